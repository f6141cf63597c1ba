"""Training the demo model: a tiny Moondream on the shapes world.

What makes a few CPU hours enough (SHAPES.md: a plain run learned nothing in 40 minutes):
  * few image tokens: 112 px crops of 14 px patches -> an 8 x 8 grid, P = 65;
  * all tasks of an image packed after one shared prefix (examples.py), so the image is
    encoded once per ~7 task segments;
  * auxiliary per-patch heads on the image tokens (kind, colour, centre offset, size of the
    shape under the patch), so "where" is learned from the first steps;
  * coordinate / size bins trained with Gaussian-smoothed cross-entropy plus a regression
    loss on the expected value;
  * position-aware initialization (2-D sin-cos position embeddings, spread Fourier
    frequencies); a curriculum from one shape up; a flat learning rate until the last 15%.
The architecture and the inference path are unchanged: aux heads are dropped at export.
Data is a pure function of (seed, step), so a resumed run sees exactly the batches it would
have seen; checkpoints are written atomically.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..models.moondream.config import MoondreamConfig
from ..models.moondream.model import MoondreamModel
from ..models.moondream.preprocess import Preprocessor
from .examples import COORD_BINS, SIZE_BINS, make_batch
from .objective import WEIGHTS, AuxHeads, losses
from .settings import TrainSettings, lr_at, sigma_at
from .vocab import TEMPLATES, build_tokenizer

DEMO_CONFIG = {
    "text": {"dim": 128, "ff_dim": 512, "n_layers": 4, "vocab_size": 384, "max_context": 512,
             "n_heads": 4, "n_kv_heads": 4, "prefix_attn": 65},
    "vision": {"enc_dim": 128, "enc_patch_size": 14, "enc_n_layers": 4, "enc_ff_dim": 512, "enc_n_heads": 4,
               "proj_out_dim": 128, "crop_size": 112, "in_channels": 3, "max_crops": 1, "overlap_margin": 1,
               "proj_inner_dim": 256},
    "region": {"dim": 128, "coord_feat_dim": 64, "coord_out_dim": COORD_BINS, "size_feat_dim": 64,
               "size_out_dim": 2 * SIZE_BINS, "inner_dim": 256},
    "tokenizer": {"templates": TEMPLATES},
}


def init_demo_model(config: MoondreamConfig, seed: int) -> MoondreamModel:
    torch.manual_seed(seed)
    model = MoondreamModel(config)
    g, d = config.vision.grid, config.vision.enc_dim
    with torch.no_grad():
        # 2-D sin-cos position embeddings: half the channels for rows, half for columns.
        ys, xs = torch.meshgrid(torch.arange(g, dtype=torch.float32), torch.arange(g, dtype=torch.float32), indexing="ij")
        freqs = 1.0 / (100.0 ** (torch.arange(d // 4) / (d // 4)))
        parts = [f(c.reshape(-1, 1) * freqs) for c in (ys, xs) for f in (torch.sin, torch.cos)]
        model.vision.pos_emb.copy_(torch.cat(parts, dim=-1)[None])
        model.text.wte.normal_(0, 0.02)
        r = config.region
        n = r.coord_feat_dim // 2
        model.region.coord_features.copy_((2.0 ** torch.linspace(-1, 5, n))[None])
        m = r.size_feat_dim // 4
        sizes = torch.zeros(2, r.size_feat_dim // 2)
        sizes[0, :m] = 2.0 ** torch.linspace(-1, 5, m)
        sizes[1, m:] = 2.0 ** torch.linspace(-1, 5, m)
        model.region.size_features.copy_(sizes)
    return model


# ---------------------------------------------------------------- loop, checkpoints, export


class Trainer:
    def __init__(self, out_dir: Path, settings: TrainSettings, device: torch.device):
        self.out = out_dir
        self.s = settings
        self.device = device
        self.config = MoondreamConfig.from_dict(DEMO_CONFIG)
        self.tokenizer = build_tokenizer()
        self.encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False).ids
        self.pre = Preprocessor(self.config.vision, 1)
        self.model = init_demo_model(self.config, settings.seed).to(device)
        self.aux = AuxHeads(self.config.vision.proj_out_dim).to(device)
        params = list(self.model.parameters()) + list(self.aux.parameters())
        self.opt = torch.optim.AdamW(params, lr=settings.lr, betas=(0.9, 0.98), weight_decay=0.01)
        self.step = 0
        self.history: list[dict] = []
        self.elapsed = 0.0
        ckpt = self.out / "checkpoint.pt"
        if ckpt.exists():
            self._restore(ckpt)

    def _restore(self, path: Path) -> None:
        # Our own checkpoint, written by _save below: plain tensors and numbers only.
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.model.load_state_dict(state["model"])
        self.aux.load_state_dict(state["aux"])
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])
        self.elapsed = float(state["elapsed"])
        self.history = json.loads((self.out / "history.json").read_text()) if (self.out / "history.json").exists() else []

    def _save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save({"model": self.model.state_dict(), "aux": self.aux.state_dict(), "opt": self.opt.state_dict(),
                    "step": self.step, "elapsed": self.elapsed}, tmp)
        os.replace(tmp, self.out / "checkpoint.pt")
        (self.out / "history.json").write_text(json.dumps(self.history))

    def train_step(self) -> dict[str, float]:
        batch = make_batch(self.step, self.s, self.pre, self.encode, self.config.prefix_len).to(self.device)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step, self.s)
        self.model.train()
        parts = losses(self.model, self.aux, batch, sigma_at(self.step, self.s))
        total = sum(WEIGHTS[k] * v for k, v in parts.items())
        self.opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(list(self.model.parameters()) + list(self.aux.parameters()), 1.0)
        self.opt.step()
        self.step += 1
        return {k: float(v.detach()) for k, v in parts.items()} | {"total": float(total.detach())}

    def run(self, until: int | None = None, log=print) -> None:
        until = min(until or self.s.total_steps, self.s.total_steps)
        t0, window = time.time(), []
        while self.step < until:
            window.append(self.train_step())
            if self.step % 50 == 0 or self.step == until:
                mean = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
                self.elapsed += time.time() - t0
                t0 = time.time()
                rec = {"step": self.step, "elapsed_s": round(self.elapsed, 1), **{k: round(v, 4) for k, v in mean.items()}}
                self.history.append(rec)
                log(json.dumps(rec))
                window = []
            if self.step % self.s.eval_every == 0:
                scores = self.evaluate(self.s.eval_images, seed=10_000 + self.step)
                self.history.append({"step": self.step, "eval": scores})
                log(json.dumps({"step": self.step, "eval": scores}))
            if self.step % self.s.ckpt_every == 0 or self.step == until:
                self._save()

    @torch.inference_mode()
    def evaluate(self, n_images: int, seed: int) -> dict[str, float]:
        from .evaluate import score_model

        self.model.eval()
        return score_model(self.model, self.tokenizer_adapter(), self.pre, n_images, seed)

    def tokenizer_adapter(self):
        from ..models.base.hub import TokenizerAdapter

        return TokenizerAdapter(self.tokenizer)

    def export(self, dest: Path, dtype: torch.dtype = torch.float16) -> None:
        """Write the inference model (no aux heads) as a hub-layout folder."""
        dest.mkdir(parents=True, exist_ok=True)
        state = {f"model.{k}": v.detach().to("cpu", dtype).contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, str(dest / "model.safetensors"))
        (dest / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": DEMO_CONFIG}, indent=1))
        self.tokenizer.save(str(dest / "tokenizer.json"))


def write_card(dest: Path, trainer: Trainer, final_eval: dict[str, float], hardware: str) -> None:
    """TRAINING.md beside the exported model: how it was made and how good it is."""
    s = trainer.s
    losses = [h for h in trainer.history if "total" in h][-10:]
    mean = {k: round(sum(h[k] for h in losses) / len(losses), 4) for k in WEIGHTS} if losses else {}
    evals = [h for h in trainer.history if "eval" in h]
    lines = [
        "# The built-in demo model",
        "",
        "A tiny Moondream 2 architecture (config.json) trained from scratch on the synthetic shapes",
        "world (shared/design/SHAPES.md) by `scripts/train_demo.py`; weights stored as float16.",
        "",
        f"- steps: {trainer.step} ({s.steps} + {s.finetune_steps} fine-tuning), batch {s.batch_size} images, "
        f"{trainer.step * s.batch_size} images seen",
        f"- seed: {s.seed}; settings: `{json.dumps(asdict(s))}`",
        f"- hardware: {hardware}",
        f"- training time: {trainer.elapsed / 3600:.2f} h (wall clock of the training steps, resumed runs summed)",
        f"- parameters: {sum(p.numel() for p in trainer.model.parameters()):,}",
        f"- final losses (mean of the last {len(losses) * 50} steps): `{json.dumps(mean)}`",
        "",
        "Evaluation during training (48 fresh scenes each):",
        "",
        "| step | caption exact | query exact | detect F1@0.5 | point F1 |",
        "|---|---|---|---|---|",
    ]
    for e in evals:
        v = e["eval"]
        lines.append(f"| {e['step']} | {v['caption_exact']} | {v['query_exact']} | {v['detect_f1@0.5']} | {v['point_f1']} |")
    lines += ["", f"Final evaluation of the exported (float16) weights on 200 fresh scenes: `{json.dumps(final_eval)}`",
              "", "Reproduce: `python scripts/train_demo.py --out runs/demo --steps "
              f"{s.steps} --balanced-from {s.balanced_from} --finetune-steps {s.finetune_steps} "
              "--export batchvlm/models/demo` "
              "(re-run the same command after an interruption).", ""]
    (dest / "TRAINING.md").write_text("\n".join(lines))

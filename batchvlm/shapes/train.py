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

import io
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

from ..models.moondream.config import MoondreamConfig
from ..models.moondream.model import MoondreamModel
from ..models.moondream.preprocess import Preprocessor
from ..models.moondream.text import apply_rotary
from .examples import COORD_BINS, SIZE_BINS, Segment, segments_for
from .vocab import TEMPLATES, build_tokenizer
from .world import KINDS, COLOURS, TRAINING, Scene, draw_scene

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


@dataclass
class TrainSettings:
    steps: int = 30000
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 300
    decay_from: float = 0.85  # fraction of steps after which the LR decays (cosine to 5%)
    curriculum: int = 4000  # steps until scenes of up to 3 shapes are common
    balanced_from: int = 0  # step from which object queries are balanced (examples.object_queries)
    seed: int = 0
    ckpt_every: int = 500
    eval_every: int = 2500
    eval_images: int = 48


class AuxHeads(nn.Module):
    """Per-image-token predictions of the shape under the patch (training only)."""

    def __init__(self, dim: int):
        super().__init__()
        self.kind = nn.Linear(dim, len(KINDS) + 1)
        self.colour = nn.Linear(dim, len(COLOURS) + 1)
        self.geometry = nn.Linear(dim, 4)  # centre offset (dx, dy) in patches, log2 (w, h)


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


# ---------------------------------------------------------------- data


def patch_targets(scene: Scene, grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each patch of the global crop: kind / colour class (0 = background) and geometry."""
    kind = np.zeros(grid * grid, dtype=np.int64)
    colour = np.zeros(grid * grid, dtype=np.int64)
    geom = np.full((grid * grid, 4), np.nan, dtype=np.float32)
    for s in scene.shapes:
        x0, y0, x1, y1 = scene.norm_box(s)
        for r in range(grid):
            for c in range(grid):
                px, py = (c + 0.5) / grid, (r + 0.5) / grid
                if x0 <= px <= x1 and y0 <= py <= y1:
                    i = r * grid + c
                    kind[i] = 1 + KINDS.index(s.kind)
                    colour[i] = 1 + list(COLOURS).index(s.colour)
                    geom[i] = ((x0 + x1) / 2 * grid - (c + 0.5), (y0 + y1) / 2 * grid - (r + 0.5),
                               math.log2(x1 - x0), math.log2(y1 - y0))
    return kind, colour, geom


@dataclass
class Batch:
    crops: torch.Tensor  # uint8 [B, S, S, 3]
    kind: torch.Tensor  # [B, T] INPUT_* of segment items
    token: torch.Tensor  # [B, T]
    value: torch.Tensor  # [B, T, 2]
    pos: torch.Tensor  # [B, T] positions (segments restart at P)
    seg: torch.Tensor  # [B, T] segment id (0 = padding)
    t_token: torch.Tensor  # [B, T]
    t_coord: torch.Tensor  # [B, T]
    t_size: torch.Tensor  # [B, T, 2]
    p_kind: torch.Tensor  # [B, grid*grid]
    p_colour: torch.Tensor
    p_geom: torch.Tensor  # [B, grid*grid, 4]

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def max_shapes_at(step: int, curriculum: int) -> int:
    f = step / max(1, curriculum)
    return 1 if f < 0.15 else 2 if f < 0.4 else 3


def make_batch(step: int, settings: TrainSettings, pre: Preprocessor, encode, prefix_len: int) -> Batch:
    rng = random.Random(f"{settings.seed}/{step}")
    crops, segs_per_image, targets = [], [], []
    top = max_shapes_at(step, settings.curriculum)
    for _ in range(settings.batch_size):
        image, scene = draw_scene(rng, TRAINING, n_shapes=rng.randint(1, top))
        if rng.random() < 0.5:  # JPEG artefacts, as in real shards
            buf = io.BytesIO()
            image.save(buf, format="JPEG", quality=rng.randint(80, 95))
            image = Image.open(buf).convert("RGB")
        crops.append(pre(image).crops[0])
        segs_per_image.append(segments_for(scene, rng, encode, balanced=step >= settings.balanced_from))
        targets.append(patch_targets(scene, pre.vision.grid))
    return collate(crops, segs_per_image, targets, prefix_len)


def collate(crops, segs_per_image: list[list[Segment]], targets, prefix_len: int) -> Batch:
    B = len(crops)
    T = max(sum(len(s) for s in segs) for segs in segs_per_image)
    kind = torch.zeros(B, T, dtype=torch.long)
    token = torch.zeros(B, T, dtype=torch.long)
    value = torch.zeros(B, T, 2)
    pos = torch.full((B, T), prefix_len, dtype=torch.long)
    seg_id = torch.zeros(B, T, dtype=torch.long)
    t_token = torch.full((B, T), -100, dtype=torch.long)
    t_coord = torch.full((B, T), float("nan"))
    t_size = torch.full((B, T, 2), float("nan"))
    for b, segs in enumerate(segs_per_image):
        at = 0
        for k, s in enumerate(segs):
            n = len(s)
            sl = slice(at, at + n)
            kind[b, sl], token[b, sl] = torch.tensor(s.kind), torch.tensor(s.token)
            value[b, sl] = torch.tensor(s.value)
            pos[b, sl] = torch.arange(prefix_len, prefix_len + n)
            seg_id[b, sl] = k + 1
            t_token[b, sl], t_coord[b, sl] = torch.tensor(s.t_token), torch.tensor(s.t_coord)
            t_size[b, sl] = torch.tensor(s.t_size)
            at += n
    p_kind, p_colour, p_geom = (torch.from_numpy(np.stack(x)) for x in zip(*targets))
    return Batch(torch.from_numpy(np.stack(crops)), kind, token, value, pos, seg_id, t_token, t_coord, t_size,
                 p_kind, p_colour, p_geom)


# ---------------------------------------------------------------- forward and losses


def dense_forward(model: MoondreamModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced forward of packed examples -> (segment hidden [B, T, C], image tokens [B, P-1, C]).

    The same weights and ops as inference (vision, input_embeds, blocks); only attention is a
    dense masked SDPA over [prefix | segments] instead of the paged cache.
    """
    c = model.config.text
    B, T = batch.kind.shape
    feats = model.vision(batch.crops, [(1, 1)] * B)
    prefix = model.prefix_embeds(feats)  # [B, P, C]
    P = prefix.shape[1]
    seg = model.input_embeds(batch.kind.reshape(-1), batch.token.reshape(-1), batch.value.reshape(-1, 2))
    x = torch.cat([prefix, seg.view(B, T, -1)], dim=1)
    L = P + T
    pos = torch.cat([torch.arange(P, device=x.device).expand(B, P), batch.pos], dim=1)
    sid = torch.cat([torch.zeros(B, P, dtype=torch.long, device=x.device), batch.seg], dim=1)
    # query i sees key j: j in the prefix and (i in the prefix or i a real token), or same
    # segment and pos_j <= pos_i. Padding queries see the prefix (their outputs are unused).
    q_in_prefix = torch.arange(L, device=x.device) < P
    mask = q_in_prefix[None, None, :] | ((sid[:, :, None] == sid[:, None, :]) & (pos[:, None, :] <= pos[:, :, None]))
    mask = mask & ~(q_in_prefix[None, :, None] & ~q_in_prefix[None, None, :])
    mask = mask[:, None]
    cos_sin = model.text.rotary[pos.reshape(-1)]
    h_dim = c.head_dim
    q_dim, kv_dim = c.n_heads * h_dim, c.n_kv_heads * h_dim
    for block in model.text.blocks:
        h = block.ln(x)
        q, k, v = block.attn.qkv(h).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rotary(q.reshape(B * L, c.n_heads, h_dim), cos_sin).view(B, L, c.n_heads, h_dim)
        k = apply_rotary(k.reshape(B * L, c.n_kv_heads, h_dim), cos_sin).view(B, L, c.n_kv_heads, h_dim)
        v = v.view(B, L, c.n_kv_heads, h_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           enable_gqa=c.n_heads != c.n_kv_heads)
        x = x + block.attn.proj(o.transpose(1, 2).reshape(B, L, q_dim)) + block.mlp(h)
    return x[:, P:], feats


def soft_bin_loss(logits: torch.Tensor, target_bin: torch.Tensor, sigma: float) -> torch.Tensor:
    """Cross-entropy against a Gaussian around the (continuous) target bin, plus an L1 loss on
    the expected bin in units of 2% of the range."""
    n = logits.shape[-1]
    bins = torch.arange(n, device=logits.device, dtype=torch.float32)
    soft = torch.exp(-0.5 * ((bins - target_bin[..., None]) / sigma) ** 2)
    soft = soft / soft.sum(-1, keepdim=True)
    logp = F.log_softmax(logits.float(), dim=-1)
    ce = -(soft * logp).sum(-1)
    expected = (logp.exp() * bins).sum(-1)
    return (ce + (expected - target_bin).abs() / (n / 50)).mean()


def losses(model: MoondreamModel, aux: AuxHeads, batch: Batch, sigma: float) -> dict[str, torch.Tensor]:
    hidden, feats = dense_forward(model, batch)
    out = {}
    tok = batch.t_token >= 0
    out["token"] = F.cross_entropy(model.text.logits(hidden[tok]).float(), batch.t_token[tok])
    has_c = ~batch.t_coord.isnan()
    out["coord"] = soft_bin_loss(model.region.coord_logits(hidden[has_c]), batch.t_coord[has_c] * COORD_BINS, sigma)
    has_s = ~batch.t_size[..., 0].isnan()
    sizes = batch.t_size[has_s]
    target = torch.stack([size_bin_t(sizes[:, 0]), size_bin_t(sizes[:, 1])], dim=-1)
    out["size"] = soft_bin_loss(model.region.size_logits(hidden[has_s]), target, sigma)
    out["aux_kind"] = F.cross_entropy(aux.kind(feats).flatten(0, 1), batch.p_kind.flatten())
    out["aux_colour"] = F.cross_entropy(aux.colour(feats).flatten(0, 1), batch.p_colour.flatten())
    on = batch.p_kind.flatten() > 0
    geom = aux.geometry(feats).flatten(0, 1)[on]
    out["aux_geom"] = F.smooth_l1_loss(geom, batch.p_geom.flatten(0, 1)[on]) if on.any() else geom.sum()
    return out


def size_bin_t(s: torch.Tensor) -> torch.Tensor:
    return (torch.log2(s.clamp_min(2**-10)) + 10.0) / 10.0 * (SIZE_BINS - 1)


WEIGHTS = {"token": 1.0, "coord": 1.0, "size": 0.5, "aux_kind": 0.5, "aux_colour": 0.5, "aux_geom": 0.5}


# ---------------------------------------------------------------- loop, checkpoints, export


def lr_at(step: int, s: TrainSettings) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    start = int(s.decay_from * s.steps)
    if step < start:
        return s.lr
    f = (step - start) / max(1, s.steps - start)
    return s.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * f)))


def sigma_at(step: int, s: TrainSettings) -> float:
    """Width of the soft bin targets: wide early (any gradient toward the right place), sharp late."""
    return max(3.0, 40.0 * (1 - step / (0.5 * s.steps)))


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
        until = min(until or self.s.steps, self.s.steps)
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
        from ..models.moondream.family import TokenizerAdapter

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
        f"- steps: {trainer.step}, batch {s.batch_size} images, {trainer.step * s.batch_size} images seen",
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
              f"{s.steps} --balanced-from {s.balanced_from} --export batchvlm/models/demo` "
              "(re-run the same command after an interruption).", ""]
    (dest / "TRAINING.md").write_text("\n".join(lines))

"""Duplicate visual-token pruning on the native Qwen3-VL (model.prune_duplicates, issue 43 part 2).

Off: nothing changes (the parity tests of tests/models/qwen3_vl run with it off, untouched; the
label fingerprint of a job without it is what it was). On: whole 2x2 merge groups equal to a kept
neighbour are dropped; the engine's greedy tokens equal transformers' Qwen3-VL modules run on the
same pruned inputs (its vision tower on the kept patches with their own position embeddings and
rotary positions, attention among them; its text model on the pruned prefix with the kept tokens'
M-RoPE positions and DeepStack rows), and are identical across batch sizes and modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from support.qwen3vl_fixture import IDS, write_checkpoint
from support.qwen_vl import MAX_NEW, PROMPTS, TASKS
from support.siglip_fixture import siglip_checkpoint

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec, parse_job
from batchvlm.models.base.errors import ModelLoadError
from batchvlm.models.qwen_vl.positions import prefix_positions
from batchvlm.models.base.prune import kept_groups
from batchvlm.models.registry import open_family

transformers = pytest.importorskip("transformers")


def flat_images() -> list[Image.Image]:
    """Flat backgrounds with a few shapes (most merge groups repeat), one noise image (none do)."""
    rng = np.random.default_rng(5)
    out = []
    for i, (w, h) in enumerate([(160, 128), (96, 224), (256, 64), (128, 128)]):
        a = np.full((h, w, 3), (230 - 40 * i, 220, 200 + 10 * i), dtype=np.uint8)
        for _ in range(2):
            x, y = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
            a[y : y + 37, x : x + 41] = rng.integers(0, 256, 3, dtype=np.uint8)
        out.append(Image.fromarray(a))
    out.append(Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)))
    return out


def test_kept_groups():
    flat = np.full((64, 96, 3), 7, dtype=np.uint8)
    assert kept_groups(flat, 32, 0.0).tolist() == [0]  # every other group equals a kept neighbour
    noise = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    assert kept_groups(noise, 32, 0.0) is None
    ramp = np.repeat(np.repeat(np.arange(3, dtype=np.uint8) * 2, 32)[None, :, None], 32, 0).repeat(3, 2)
    assert kept_groups(ramp, 32, 0.0) is None
    # within 2/255 of the left neighbour each step, but the third is 4 off the kept first: kept
    assert kept_groups(ramp, 32, 2.5 / 255).tolist() == [0, 2]


def test_kept_tokens_keep_their_positions():
    full = prefix_positions(3, (2, 3))
    keep = torch.tensor([0, 4, 5])
    pruned = prefix_positions(3, (2, 3), keep=keep)
    assert torch.equal(pruned[:, 3:6], full[:, 3 + keep]) and torch.equal(pruned[:, -1], full[:, -1])


def test_off_leaves_the_fingerprint_and_a_family_that_cannot_prune_refuses(tmp_path):
    base = {"name": "j", "input": {"shards": "x.tar"}, "tasks": [{"caption": {}}], "output": {"dir": "o"}}
    off = parse_job(base, tmp_path)
    assert "prune_duplicates" not in off.label_settings()["model"]
    on = parse_job(base | {"model": {"name": "demo", "prune_duplicates": 0.0}}, tmp_path)
    assert on.label_settings()["model"]["prune_duplicates"] == 0.0 and on.label_fingerprint() != off.label_fingerprint()
    siglip = siglip_checkpoint(tmp_path / "siglip")  # Moondream prunes too now (its own tests)
    with pytest.raises(ModelLoadError, match="model.prune_duplicates: siglip"):
        open_family(ModelSpec(name=str(siglip), prune_duplicates=0.0))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("qwen3vl-prune"), seed=2, likely_stops=True)
    family = open_family(ModelSpec(name=str(folder), prune_duplicates=0.0))
    model = family.load("float32", "cpu")
    pre = family.preprocessor()
    prepared = [pre(im) for im in flat_images()]
    return dict(folder=folder, family=family, model=model, prepared=prepared,
                seqs=family.sequences(TASKS, EngineSpec(max_new_tokens=MAX_NEW)))


def run_engine(setup, batch: int, pipelined: bool) -> list[list[list[int]]]:
    engine = Engine(setup["model"], setup["seqs"], EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch,
                                                              pipelined=pipelined), setup["family"].max_prefix_len())
    done = {r.sample.index: [s.output.tokens for s in r.seqs]
            for r in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(setup["prepared"]))}
    assert engine.scheduler.blocks.used == 0
    return [done[i] for i in range(len(setup["prepared"]))]


def test_a_flat_background_loses_most_of_its_tokens(setup):
    shares = [1 - p.tokens / (p.grid[0] * p.grid[1]) for p in setup["prepared"]]
    assert all(s > 0.2 for s in shares[:4]) and shares[4] == 0.0, shares
    assert setup["prepared"][4].keep is None


def hf_pruned_greedy(hf, tok, processor, im: Image.Image, keep: torch.Tensor | None, prompt: str) -> list[int]:
    """transformers' modules on the pruned inputs: the vision tower on the kept patches (hooks cut
    its rows, rotary tables and attention span to them), the text model on the pruned prefix with
    the kept tokens' M-RoPE positions and DeepStack rows, greedy without a cache."""
    pix = processor(images=[im], return_tensors="pt")
    _, gh, gw = (int(v) for v in pix["image_grid_thw"][0])
    gh, gw = gh // 2, gw // 2
    keep = torch.arange(gh * gw) if keep is None else keep
    rows = (keep[:, None] * 4 + torch.arange(4)).reshape(-1)
    visual = hf.model.visual

    def cut(module, args, kwargs):
        pe = kwargs["position_embeddings"]
        kwargs |= {"position_embeddings": tuple(t[rows] for t in pe),
                   "cu_seqlens": torch.tensor([0, len(rows)], dtype=torch.int32, device=rows.device),
                   "max_seqlen": len(rows)}
        hidden = args[0] if args else kwargs.pop("hidden_states")
        if module is visual.blocks[0]:
            hidden = hidden[rows]
        return (hidden, *args[1:]), kwargs

    hooks = [b.register_forward_pre_hook(cut, with_kwargs=True) for b in visual.blocks]
    try:
        with torch.inference_mode():
            out = visual(pix["pixel_values"], grid_thw=pix["image_grid_thw"])
    finally:
        for h in hooks:
            h.remove()
    feats, deep = out.pooler_output, list(out.deepstack_features)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * len(keep)))["input_ids"]
    s = ids.index(IDS["<|image_pad|>"])
    image_pos = torch.stack([torch.zeros_like(keep), keep // gw, keep % gw]) + s
    after = s + max(gh, gw) + torch.arange(len(ids) - s - len(keep))
    pos = torch.cat([torch.arange(s).expand(3, s), image_pos, after.expand(3, -1)], 1)
    lm = hf.model.language_model
    stops = {IDS["<|im_end|>"], IDS["<|endoftext|>"]}
    gen: list[int] = []
    with torch.inference_mode():
        for _ in range(MAX_NEW):
            all_ids = torch.tensor([ids + gen])
            embeds = lm.embed_tokens(all_ids)
            mask = all_ids == IDS["<|image_pad|>"]
            embeds[mask] = feats.to(embeds.dtype)
            p = torch.cat([pos, (pos[:, -1:] + 1 + torch.arange(len(gen)))], 1) if gen else pos
            h = lm(inputs_embeds=embeds, position_ids=p[:, None], visual_pos_masks=mask,
                   deepstack_visual_embeds=deep).last_hidden_state
            t = int(hf.lm_head(h[0, -1]).argmax())
            if t in stops:
                break
            gen.append(t)
    return gen


@pytest.fixture(scope="module")
def reference(setup):
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = Qwen3VLForConditionalGeneration.from_pretrained(setup["folder"]).eval()
    tok = AutoTokenizer.from_pretrained(setup["folder"])
    processor = Qwen2VLImageProcessorPil.from_pretrained(setup["folder"])
    return [[hf_pruned_greedy(hf, tok, processor, im, p.keep, prompt) for prompt in PROMPTS]
            for im, p in zip(flat_images(), setup["prepared"])]


def test_pruned_tokens_equal_transformers_on_the_same_pruned_inputs(setup, reference):
    assert run_engine(setup, 7, False) == reference


@pytest.mark.parametrize("batch,pipelined", [(1, False), (1, True), (7, True), (64, True), (64, False)])
def test_pruned_labels_are_the_same_across_batch_sizes_and_modes(setup, reference, batch, pipelined):
    assert run_engine(setup, batch, pipelined) == reference

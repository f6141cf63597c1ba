"""Duplicate visual-token pruning on the native Florence-2 (model.prune_duplicates, issue 43):
after DaViT, the image tokens of last-stage cells whose stem footprint (the pixels the strided
convs read for them) equals a kept neighbour's are left out of the encoder, the kept ones at
their own positions (BART's learned positions with gaps).

Off: nothing changes (tests/models/florence2/test_florence2.py runs with it off, untouched). On:
the engine's greedy tokens equal transformers' Florence-2 on the same pruned inputs (its image
features' kept rows, its encoder on them and the prompt with a hook giving its learned positions
the gaps, `generate` from that encoder output), identical across batch sizes 1 / 7 / 64,
pipelined and synchronous; the prefixes (the encoder's rows and the cross-attention K/V) are as
long as the kept tokens."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from support.florence2 import NEW_TOKENS, TASKS, Reference, flat_images, tasks_of, tf
from support.tiny_vlms import florence2

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.florence2.config import VisionConfig
from batchvlm.models.florence2.preprocess import Footprint
from batchvlm.models.registry import open_family

TEXTS = ["<CAPTION>", "What is it?", "<OPEN_VOCABULARY_DETECTION>car", "<OPEN_VOCABULARY_DETECTION>dog", "<OCR>",
         "<DENSE_REGION_CAPTION>"]  # what the processor gets for each sequence of TASKS


def test_the_released_models_footprint():
    v = VisionConfig(depths=(1, 1, 9, 1), patch_size=(7, 3, 3, 3), patch_stride=(4, 2, 2, 2),
                     patch_padding=(3, 1, 1, 1), patch_prenorm=(False, True, True, True), dims=(1, 1, 1, 1),
                     heads=(1, 1, 1, 1), groups=(1, 1, 1, 1), window=12, mlp_ratio=4.0, qkv_bias=True,
                     projection_dim=1, max_positions=50, max_temporal=100)
    assert Footprint.of(v, 768, 768) == Footprint((24, 24), 32, 63, 31)  # 576 cells: 577 image tokens


CHECKPOINTS = {  # (vision overrides, side): (a) two stages, the footprint inside the image but at the top /
    # left; (b) three stages on 88 px, last footprints reaching past the bottom / right
    "a": ({}, 64),
    "b": (dict(depths=[1, 1, 1], patch_size=[7, 3, 3], patch_stride=[4, 2, 2], patch_padding=[3, 1, 1],
               patch_prenorm=[False, True, True], embed_dim=[16, 24, 32], num_heads=[1, 2, 2], num_groups=[1, 2, 4],
               window_size=3), 88),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tf()
    root = tmp_path_factory.mktemp("florence2-prune")
    b_vision, b_side = CHECKPOINTS["b"]
    b = florence2(root / "b", seed=1, side=b_side, vision=b_vision,
                  text=dict(d_model=48, encoder_attention_heads=4, decoder_attention_heads=4, decoder_layers=3,
                            encoder_ffn_dim=96, decoder_ffn_dim=96, scale_embedding=True),
                  generation=dict(no_repeat_ngram_size=3, forced_bos_token_id=256))
    return {"a": florence2(root / "a", seed=4), "b": b}


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_cell_reads_its_footprint_only(checkpoints, name):
    """The stem (DaViT's strided convs and their norms, without the blocks) of the real module tree:
    a cell's output changes with a pixel inside its footprint, not with any outside it."""
    family = open_family(ModelSpec(name=str(checkpoints[name]), prune_duplicates=0.0))
    fp, side = family.preprocessor().footprint, CHECKPOINTS[name][1]
    convs = family.load("float32", "cpu").model.model.vision_tower.convs
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, side, side, generator=gen)

    def stem(x):
        for conv in convs:
            x = conv(x)
        return x[0]

    with torch.inference_mode():
        base = stem(x)
        assert tuple(base.shape[1:]) == fp.grid
        r, c = fp.grid[0] - 1, fp.grid[1] // 2
        top, left = r * fp.stride - fp.pad, c * fp.stride - fp.pad
        for y, xx, inside in [(top, left, True), (min(side - 1, top + fp.size - 1), left + fp.size - 1, True),
                              (top - 1, left, False), (top, left - 1, False), (top, left + fp.size, False)]:
            if not (0 <= y < side and 0 <= xx < side):
                continue
            moved = x.clone()
            moved[0, :, y, xx] += 5.0
            changed = not torch.equal(stem(moved)[:, r, c], base[:, r, c])
            assert changed == inside, (y, xx)


@pytest.fixture(scope="module")
def setup(checkpoints):
    out = {}
    for name, folder in checkpoints.items():
        family = open_family(ModelSpec(name=str(folder), prune_duplicates=0.0))
        images = flat_images(CHECKPOINTS[name][1])
        pre = family.preprocessor()
        out[name] = family, family.load("float32", "cpu"), images, [pre(im) for im in images]
    return out


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_flat_background_loses_most_of_its_tokens(setup, name):
    family, _, _, prepared = setup[name]
    cells = family.image_tokens - 1
    shares = [1 - (p.prefix_len - 1) / cells for p in prepared]
    assert all(s > 0.3 for s in shares[:4]) and shares[4] == 0.0, shares
    assert prepared[4].keep is None and prepared[4].prefix_len == family.image_tokens
    off = open_family(ModelSpec(name=str(family.folder))).preprocessor()(setup[name][2][0])
    assert off.keep is None and off.prefix_len == family.image_tokens and torch.equal(off.pixels, prepared[0].pixels)


@torch.inference_mode()
def hf_pruned_greedy(ref: Reference, image_tokens: int, im: Image.Image, keep: torch.Tensor | None,
                     text: str) -> tuple[int, ...]:
    """transformers' Florence-2 on the pruned inputs: its image features' kept rows (the pooled
    token, then the kept cells) and the prompt's embeddings into its BART encoder, whose learned
    positions a hook takes at the kept tokens' own places; then `generate` from that encoder output."""
    enc = ref.inputs(im, text)
    model = ref.model.model
    feats = model.get_image_features(enc["pixel_values"]).pooler_output
    rows = torch.arange(image_tokens) if keep is None else torch.cat([torch.zeros(1, dtype=torch.long), keep + 1])
    prompt = enc["input_ids"][:, image_tokens:]
    embeds = torch.cat([feats[:, rows], model.get_input_embeddings()(prompt)], dim=1)
    positions = torch.cat([rows, image_tokens + torch.arange(prompt.shape[1])])
    encoder = model.language_model.encoder
    table = encoder.embed_positions

    def gaps(module, args, output):
        return table.weight[positions + table.offset][None].to(output.dtype)

    hook = table.register_forward_hook(gaps)
    try:
        out = encoder(inputs_embeds=embeds)
    finally:
        hook.remove()
    ids = ref.model.generate(encoder_outputs=out, do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS)[0, 1:]
    ids = ids.tolist()
    return tuple(ids[: ids.index(ref.eos)] if ref.eos in ids else ids)


@pytest.fixture(scope="module")
def reference(checkpoints, setup):
    out = {}
    for name, folder in checkpoints.items():
        ref = Reference(folder)
        family, _, images, prepared = setup[name]
        out[name] = [[hf_pruned_greedy(ref, family.image_tokens, im, p.keep, t) for t in TEXTS]
                     for im, p in zip(images, prepared)]
        # the unpruned noise image: what plain generate writes (the hook's positions are 0, 1, ...)
        assert out[name][4] == [ref.generate([images[4]], t)[0] for t in TEXTS]
    return out


def run_engine(setup, name: str, batch: int, pipelined: bool) -> tuple[list[list[tuple[int, ...]]], list[int]]:
    family, model, _, prepared = setup[name]
    settings = EngineSpec(max_new_tokens=NEW_TOKENS, max_batch_size=batch, pipelined=pipelined)
    engine = Engine(model, family.sequences(tasks_of(TASKS), settings), settings, family.max_prefix_len())
    lens: list[int] = []
    launch = engine.runner.launch

    def spied(plan):
        lens.extend(plan.prefix_lens.tolist())
        return launch(plan)

    engine.runner.launch = spied
    got = {im.sample.index: [tuple(s.output.tokens) for s in im.seqs]
           for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared))}
    assert engine.scheduler.blocks.used == 0
    return [got[i] for i in range(len(prepared))], lens


@pytest.mark.parametrize("name", ["a", "b"])
def test_pruned_tokens_equal_transformers_on_the_same_pruned_inputs(setup, reference, name):
    got, lens = run_engine(setup, name, 7, False)
    assert got == reference[name]
    assert len({w for ws in reference[name] for w in ws}) > len(TEXTS)  # answers differ by image
    # every prefix the engine prefilled (the encoder's rows, the cross K/V's) is the kept tokens and a prompt
    family, _, _, prepared = setup[name]
    prompts = {len(s.spec.prefix_prompt) for s in family.sequences(tasks_of(TASKS), EngineSpec())}
    allowed = {p.prefix_len + n for p in prepared for n in prompts}
    assert set(lens) <= allowed and min(lens) < min(prompts) + family.image_tokens


@pytest.mark.parametrize("batch,pipelined", [(1, False), (7, True), (64, True), (64, False)])
def test_pruned_labels_are_the_same_across_batch_sizes_and_modes(setup, reference, batch, pipelined):
    for name in ("a", "b"):
        assert run_engine(setup, name, batch, pipelined)[0] == reference[name]

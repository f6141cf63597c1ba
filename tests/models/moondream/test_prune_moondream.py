"""Duplicate visual-token pruning on the native Moondream (model.prune_duplicates, issue 43 part 2;
vision.py forward_kept, device.py).

Off: nothing changes (the parity tests of this folder and the demo's label print run untouched;
the preprocessor ships no keep). On: a token whose global-crop patch repeats a kept neighbour is
dropped from the prefix; the global crop's tower runs on the kept patches, the local crops' on
all of theirs (stitched and pooled, then the kept rows taken); kept tokens keep their positions.
The engine's labels equal the static-batch generation's (generate.py, the in-repo reference:
upstream Moondream has no pruned path to compare with) on the same pruned inputs, and are
identical across batch sizes 1 / 7 / 64, pipelined and synchronous."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from support.moondream import (TINY, LoadedMoondream, hub_folder, id_tokenizer, random_state, run_engine,
                               run_engine_outputs)

from batchvlm.job import ModelSpec
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.generate import generate
from batchvlm.models.moondream.preprocess import Preprocessor
from batchvlm.models.registry import open_family
from batchvlm.shapes.world import COUNT_QUESTION, NUMBERS, SPEC, draw_scene
from batchvlm.tasks import CaptionTask, ClassifyTask, DetectTask, PointTask, QueryTask

DEMO_TASKS = [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": COUNT_QUESTION}),
              DetectTask(detect={"objects": ["circle", "square"]}), PointTask(point={"objects": ["red circle"]})]


def flat_images(sizes) -> list[Image.Image]:
    """Flat backgrounds with a few noise rectangles: most patches repeat, some do not."""
    rng = np.random.default_rng(3)
    out = []
    for i, (w, h) in enumerate(sizes):
        a = np.full((h, w, 3), (200 - 30 * i, 210, 190 + 10 * i), dtype=np.uint8)
        for _ in range(2):
            x, y = int(rng.integers(0, w - w // 3)), int(rng.integers(0, h - h // 3))
            a[y : y + h // 4, x : x + w // 4] = rng.integers(0, 256, (h // 4, w // 4, 3), dtype=np.uint8)
        out.append(Image.fromarray(a))
    return out


def test_off_ships_no_keep_and_the_full_prefix():
    md = LoadedMoondream("demo")
    image = draw_scene(random.Random(1), SPEC)[0]
    off = md.preprocessor(image)
    assert off.keep is None and off.prefix_len == off.next_pos == md.P
    on = Preprocessor(md.config.vision, md.family.max_crops, 0.0)(image)
    assert torch.equal(on.crops, off.crops) and on.next_pos == md.P
    assert 0 < on.keep.numel() < md.P - 1 and on.prefix_len == 1 + on.keep.numel()
    assert open_family(ModelSpec(name="demo", prune_duplicates=0.0)).preprocessor().prune == 0.0


def test_every_token_kept_equals_the_unpruned_tower(tmp_path):
    """forward_kept with nothing dropped is forward (the stitched local grid included), to float
    rounding: the kept path indexes the same patches, positions and pooled rows."""
    config = MoondreamConfig.from_dict(TINY)
    md = LoadedMoondream(str(hub_folder(tmp_path / "m", TINY, random_state(config), id_tokenizer(64))))
    pre = md.preprocessor
    prepared = [pre(im) for im in flat_images([(40, 40), (150, 110), (70, 160)])]
    assert {p.tiling for p in prepared} != {(1, 1)}  # local crops: the stitched path
    crops = torch.cat([p.crops for p in prepared])
    tilings = [p.tiling for p in prepared]
    full = md.model.vision(crops, tilings)
    every = [torch.arange(config.vision.n_image_tokens)] * len(prepared)
    kept = md.model.vision.forward_kept(crops, tilings, every)
    torch.testing.assert_close(torch.stack(kept), full, rtol=1e-4, atol=1e-5)
    some = [torch.tensor([0, 3, 5, 15]), torch.tensor([0, 1]), torch.arange(16)]
    pruned = md.model.vision.forward_kept(crops, tilings, some)
    assert [f.shape[0] for f in pruned] == [4, 2, 16]


def test_kept_tokens_keep_their_positions():
    md = LoadedMoondream("demo")
    on = Preprocessor(md.config.vision, md.family.max_crops, 0.0)(draw_scene(random.Random(2), SPEC)[0])
    feats = md.engine.encode([on])
    prompt = torch.tensor([1, 11, 2])
    inputs = md.engine.prefix_inputs(feats, [prompt])
    n = on.keep.numel()
    assert inputs.embeds_NC.shape[0] == 1 + n + 3
    assert torch.equal(inputs.positions, torch.cat([torch.zeros(1, dtype=torch.long), 1 + on.keep,
                                                    md.P + torch.arange(3)]))
    assert md.engine.prefix_layout(on, (1, 11, 2)) == (1 + n + 3, md.P + 3)


def test_pruned_labels_equal_the_reference_across_batch_sizes_and_modes():
    md = LoadedMoondream("demo")
    pre = Preprocessor(md.config.vision, md.family.max_crops, 0.0)
    seqs = md.sequences(DEMO_TASKS, 24, 6)
    rng = random.Random(43)
    prepared = [pre(draw_scene(rng, SPEC)[0]) for _ in range(24)]
    assert len({p.prefix_len for p in prepared}) > 1  # prefixes of different lengths in one batch
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]
    alone = [[(o.tokens, o.objects) for o in generate(md.model, [p], [s.spec for s in seqs])[0]] for p in prepared[:4]]
    assert alone == reference[:4]
    for batch in (1, 7, 64):
        n = 6 if batch < 2 * len(seqs) else len(prepared)  # small batches: a few images' paths
        for pipelined in (False, True):
            got = run_engine(md, prepared[:n], seqs, max_batch_size=batch, pipelined=pipelined)
            assert got == reference[:n], (batch, pipelined)


def test_pruned_classify_and_local_crops_are_batch_invariant(tmp_path):
    """A prefix prompt after the kept tokens (classify), and images with local crops (the tiny
    random model, crops of 56 px): the same labels at every batch size and mode."""
    md = LoadedMoondream("demo")
    pre = Preprocessor(md.config.vision, md.family.max_crops, 0.0)
    tasks = [ClassifyTask(classify={"question": COUNT_QUESTION, "choices": list(NUMBERS)}), DEMO_TASKS[1]]
    seqs = md.sequences(tasks, 8, 4)
    rng = random.Random(5)
    prepared = [pre(draw_scene(rng, SPEC)[0]) for _ in range(10)]

    def labels(batch: int, pipelined: bool) -> list[dict]:
        raws = run_engine_outputs(md, prepared, seqs, max_batch_size=batch, pipelined=pipelined)
        return [md.family.columns(tasks, seqs, r) for r in raws]

    first = labels(64, True)
    for batch, pipelined in ((7, True), (64, False), (256, True)):
        got = labels(batch, pipelined)
        # the choice and the answer exactly; a choice's probability to float rounding (as
        # test_classify_moondream: the scoring rows' batch changes the last bits)
        assert [(r["classify"], r["query"]) for r in got] == [(r["classify"], r["query"]) for r in first]
        assert [c["prob"] for r in got for c in r["classify_scores"]] == pytest.approx(
            [c["prob"] for r in first for c in r["classify_scores"]], abs=1e-5, rel=0)
    config = MoondreamConfig.from_dict(TINY)
    tiny = LoadedMoondream(str(hub_folder(tmp_path / "m", TINY, random_state(config), id_tokenizer(64))))
    tiny_pre = Preprocessor(config.vision, 4, 0.02)
    images = [tiny_pre(im) for im in flat_images([(150, 110), (40, 40), (70, 160), (120, 120)])]
    assert any(p.tiling != (1, 1) for p in images) and any(p.prefix_len < tiny.P for p in images)
    tiny_seqs = tiny.sequences([CaptionTask(caption={"length": "short"}), PointTask(point={"objects": ["23"]})], 12, 3)
    reference = [[(o.tokens, o.objects) for o in img]
                 for img in generate(tiny.model, images, [s.spec for s in tiny_seqs])]
    for batch in (1, 64):
        assert run_engine(tiny, images, tiny_seqs, max_batch_size=batch) == reference

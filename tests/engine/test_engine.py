"""The engine labels exactly like the simple batched generation and the upstream reference,
pipelined or not, at any batch size; sampling draws do not depend on the batch."""

import json

import numpy as np
import pytest
import torch
from support.moondream import (TASKS, TINY, LoadedMoondream, hub_folder, id_tokenizer, random_state, run_engine,
                               run_engine_outputs)
from PIL import Image

from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
from batchvlm.models.base.decoding import sequence_seed
from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.generate import generate


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = hub_folder(tmp_path_factory.mktemp("tiny"), TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder))
    g = torch.Generator().manual_seed(1)
    images = [Image.fromarray(torch.randint(0, 256, (40 + 37 * (i % 5), 60 + 29 * (i % 7), 3), generator=g,
                                            dtype=torch.uint8).numpy()) for i in range(11)]
    return md, [md.preprocessor(im) for im in images]


@pytest.fixture(scope="module")
def simple(tiny):
    """The simple generation of TASKS on every image: (sequences, (tokens, objects) per image)."""
    md, prepared = tiny
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    return seqs, [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]


@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_engine_equals_simple_generation(tiny, simple, batch):
    md, prepared = tiny
    seqs, reference = simple
    if batch < len(seqs) * 2:  # rows of at most two images at once: 5 images (more than the 4 in
        prepared, reference = prepared[:5], reference[:5]  # flight) take every path these batches take
    for pipelined in (False, True):
        got = run_engine(md, prepared, seqs, max_batch_size=batch, pipelined=pipelined, max_images_in_flight=4)
        assert got == reference, (batch, pipelined)
    got = run_engine(md, prepared, seqs, fixed_shape_decode=True, max_batch_size=batch, pipelined=True)
    assert got == reference, (batch, "fixed-shape decode")


def test_sampling_is_batch_invariant(tiny):
    md, prepared = tiny
    seqs = md.sequences(TASKS[:2], max_new_tokens=9, max_objects=3, temperature=1.0, top_p=0.9)
    runs = [run_engine(md, prepared, seqs, max_batch_size=b, pipelined=p, seed=0) for b, p in ((2, False), (64, True))]
    assert runs[0] == runs[1]
    seeds = [[sequence_seed(0, f"key{i}", j) for j in range(len(seqs))] for i in range(len(prepared))]
    static = generate(md.model, prepared, [s.spec for s in seqs], seeds)
    assert runs[0] == [[(o.tokens, o.objects) for o in img] for img in static]
    greedy = run_engine(md, prepared, md.sequences(TASKS[:2], max_new_tokens=9, max_objects=3), max_batch_size=64)
    assert greedy != runs[0]  # the draws do change something


def test_engine_matches_the_upstream_reference(fixtures_dir, tmp_path):
    from support.moondream import id_tokenizer as idt
    from support.moondream import upstream_tasks, wanted_more

    root = fixtures_dir / "moondream-tiny"
    config = json.loads((root / "config.json").read_text())
    folder = hub_folder(tmp_path / "m", config, root / "weights.safetensors", idt(config["text"]["vocab_size"]))
    md = LoadedMoondream(str(folder))
    expected = json.loads((root / "expected.json").read_text())
    prepared = [md.preprocessor(Image.open(root / "images" / e["file"])) for e in expected["images"]]
    seqs = md.sequences(upstream_tasks(expected), max_new_tokens=20, max_objects=5)
    got = run_engine_outputs(md, prepared, seqs, max_batch_size=7, pipelined=True)
    for e, (cap, query, det, pt) in zip(expected["images"], got):
        assert cap.tokens == e["caption_normal"]["token_ids"] and query.tokens == e["query"]["token_ids"]
        boxes = [(o["x_min"], o["y_min"], o["x_max"], o["y_max"]) for o in e["detect"]["objects"]]
        assert len(det.objects) == len(boxes)
        assert np.allclose(np.array(det.objects).reshape(-1, 4), np.array(boxes).reshape(-1, 4), atol=1e-6)
        assert pt.objects == [(p["x"], p["y"]) for p in e["point"]["points"]]
        # truncated: the reference's decision after the 5th object was another object, not EOS
        assert [det.more, pt.more] == [wanted_more(e, k, 5, md.config.tokenizer.eos_id) for k in ("detect", "point")]


def test_tightest_limits(tiny):
    """One token, one object: text sequences finish at their first decision, spatial ones at the
    decision after their object (did the model want another?), never planned again."""
    md, prepared = tiny
    seqs = md.sequences(TASKS, max_new_tokens=1, max_objects=1)
    reference = [[(o.tokens, o.objects, o.more) for o in img]
                 for img in generate(md.model, prepared, [s.spec for s in seqs])]
    assert all(len(o[0]) <= 1 and len(o[1]) <= 1 for img in reference for o in img)
    for pipelined in (False, True):
        got = run_engine_outputs(md, prepared, seqs, max_batch_size=5, pipelined=pipelined)
        assert [[(o.tokens, o.objects, o.more) for o in img] for img in got] == reference


def test_auto_pipelining_follows_the_device(tiny):
    md, _ = tiny
    seqs = md.sequences(TASKS, 8, 3)
    assert not Engine(md.engine, seqs, EngineSpec(), md.P).pipelined  # CPU: nothing to overlap
    assert Engine(md.engine, seqs, EngineSpec(pipelined=True), md.P).pipelined

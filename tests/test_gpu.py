"""CUDA paths: streams, events, pinned staging, CUDA graphs, bf16. Skipped without CUDA."""

import json

import numpy as np
import pytest
import torch
from helpers import LoadedMoondream, hub_folder, id_tokenizer, random_state
from PIL import Image
from test_engine import TASKS, run_engine
from test_moondream_loading import TINY

from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.generate import generate

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    folder = hub_folder(tmp_path_factory.mktemp("tiny"), TINY, random_state(MoondreamConfig.from_dict(TINY), seed=5),
                        id_tokenizer(64))
    md = LoadedMoondream(str(folder), device="cuda", dtype="float32")
    g = torch.Generator().manual_seed(2)
    images = [Image.fromarray(torch.randint(0, 256, (50 + 31 * (i % 5), 70 + 23 * (i % 7), 3), generator=g,
                                            dtype=torch.uint8).numpy()) for i in range(24)]
    return md, [md.preprocessor(im) for im in images]


def test_graphs_pipelining_and_eager_agree_on_cuda(tiny_cuda):
    md, prepared = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]
    for graphs in (False, True):
        for pipelined in (False, True):
            for batch in (7, 64):
                got = run_engine(md, prepared, seqs, max_batch_size=batch, pipelined=pipelined, cuda_graphs=graphs)
                assert got == reference, (graphs, pipelined, batch)


def test_upstream_parity_on_cuda_float32(fixtures_dir, tmp_path):
    from test_moondream_parity import _tasks

    root = fixtures_dir / "moondream-tiny"
    config = json.loads((root / "config.json").read_text())
    folder = hub_folder(tmp_path / "m", config, root / "weights.safetensors", id_tokenizer(config["text"]["vocab_size"]))
    md = LoadedMoondream(str(folder), device="cuda", dtype="float32")
    expected = json.loads((root / "expected.json").read_text())
    prepared = [md.preprocessor(Image.open(root / "images" / e["file"])) for e in expected["images"]]
    seqs = md.sequences(_tasks(expected), max_new_tokens=20, max_objects=5)
    got = run_engine(md, prepared, seqs, max_batch_size=64, pipelined=True, cuda_graphs=True)
    for e, (cap, query, det, pt) in zip(expected["images"], got):
        assert cap[0] == e["caption_normal"]["token_ids"] and query[0] == e["query"]["token_ids"]
        boxes = [(o["x_min"], o["y_min"], o["x_max"], o["y_max"]) for o in e["detect"]["objects"]]
        assert np.allclose(np.array(det[1]).reshape(-1, 4), np.array(boxes).reshape(-1, 4), atol=1e-5)


def test_demo_model_in_bfloat16_still_labels_right():
    from batchvlm.shapes.evaluate import score_model

    md = LoadedMoondream("demo", device="cuda", dtype="bfloat16")
    scores = score_model(md.model, md.family.tokenizer, md.preprocessor, 48, seed=4242)
    assert min(scores.values()) >= 0.85, scores


def test_kv_cache_is_sized_from_free_memory(tiny_cuda):
    from batchvlm.engine.engine import Engine
    from batchvlm.job import EngineSpec

    md, _ = tiny_cuda
    seqs = md.sequences(TASKS, max_new_tokens=9, max_objects=3)
    small = Engine(md.engine, seqs, EngineSpec(max_batch_size=8, kv_memory_fraction=0.01), md.P)
    large = Engine(md.engine, seqs, EngineSpec(max_batch_size=8, kv_memory_fraction=0.5), md.P)
    assert small.stats["kv_blocks"] <= large.stats["kv_blocks"]


def test_compiled_fused_attention_equals_the_reference_on_cuda():
    """The compiled flex kernels (the CUDA default) on the random paged batches of the CPU test."""
    from test_fused_attention import random_batch, run

    from batchvlm.models.attention import ReferenceAttention, backend_for
    from batchvlm.models.fused_attention import FusedAttention

    assert isinstance(backend_for(torch.device("cuda")), FusedAttention)
    for seed, causal in ((0, False), (1, True)):
        batch, N = random_batch(seed, causal, n_pad_rows=3, device="cuda")
        want, _ = run(ReferenceAttention(), batch, N, seed, device="cuda")
        got, _ = run(FusedAttention(compile=True), batch, N, seed, device="cuda")
        real = batch.write_slots != 0
        torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=2e-5)

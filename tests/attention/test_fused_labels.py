"""With the fused attention forced on (eager flex_attention on CPU), the engine labels exactly as
the reference: the upstream parity fixtures and the demo job, float32. The fused path reads the
paged cache in place: no K/V gather into dense tensors (the reference's gathers are seen by the
same check, so it can fail)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from support.moondream import LoadedMoondream, hub_folder, id_tokenizer, run_engine, upstream_tasks
from PIL import Image
from support.paged_batches import random_batch, run
from support.paths import DATA, REPO

from batchvlm.job import load_job
from batchvlm.output.layout import Layout
from batchvlm.attention import dispatch as attention
from batchvlm.attention import ReferenceAttention
from batchvlm.attention.fused import FusedAttention
from batchvlm.run import run_job

LIMIT = 12  # demo-job images labelled with the fused path
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def fused(monkeypatch):
    """Every KV cache allocated from here on attends through the fused backend."""
    monkeypatch.setattr(attention, "backend_for", lambda device: FusedAttention(compile=False))


def test_upstream_parity_with_the_fused_path(fixtures_dir, tmp_path, fused):
    root = fixtures_dir / "moondream-tiny"
    config = json.loads((root / "config.json").read_text())
    folder = hub_folder(tmp_path / "m", config, root / "weights.safetensors", id_tokenizer(config["text"]["vocab_size"]))
    md = LoadedMoondream(str(folder), dtype="float32")
    expected = json.loads((root / "expected.json").read_text())
    prepared = [md.preprocessor(Image.open(root / "images" / e["file"])) for e in expected["images"]]
    seqs = md.sequences(upstream_tasks(expected), max_new_tokens=20, max_objects=5)
    # caches pick their backend on first use, through backend_for: the fused one here
    assert isinstance(attention.backend_for(torch.device("cpu")), FusedAttention)
    # Prefill steps run eagerly; decode-only steps run the CUDA-graph body (uncaptured): padding
    # rows, the scratch row and the null block, as on CUDA.
    got = run_engine(md, prepared, seqs, fixed_shape_decode=True, max_batch_size=7, pipelined=True)
    for e, (cap, query, det, pt) in zip(expected["images"], got):
        assert cap[0] == e["caption_normal"]["token_ids"] and query[0] == e["query"]["token_ids"]
        boxes = [(o["x_min"], o["y_min"], o["x_max"], o["y_max"]) for o in e["detect"]["objects"]]
        assert len(det[1]) == len(boxes)
        assert np.allclose(np.array(det[1]).reshape(-1, 4), np.array(boxes).reshape(-1, 4), atol=1e-6)
        assert pt[1] == [(p["x"], p["y"]) for p in e["point"]["points"]]


def test_demo_job_labels_are_unchanged_with_the_fused_path(tmp_path, fused):
    shutil.copytree(REPO / "jobs" / "data", tmp_path / "data")
    job = yaml.safe_load((REPO / "jobs" / "demo.yaml").read_text())
    job["engine"]["max_batch_size"] = 32  # labels do not depend on it; a smaller cache keeps eager flex quick
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(job))
    run_job(load_job(tmp_path / "demo.yaml"), limit=LIMIT, progress=False)  # eager flex is slow: the first images
    import pyarrow.dataset as ds

    # --limit cuts shards short: they wait under __batchvlm__/partial/ until a run redoes them
    out = Layout(tmp_path / "out" / "shapes-demo")
    table = ds.dataset(sorted(out.partial_dir.glob("*.parquet.partial")), format="parquet").to_table()
    got = sorted(({"shard": Path(r["source"]).name} | {k: r[k] for k in ("key", "caption", "n_shapes", "detect", "point")}
                  for r in table.to_pylist()), key=lambda r: (r["shard"], r["key"]))
    before = [json.loads(line) for line in (DATA / "demo-labels-before-family-boundary.jsonl").open()]
    assert len(got) >= LIMIT
    assert got == [r for r in before if (r["shard"], r["key"]) in {(g["shard"], g["key"]) for g in got}]


def _cache_reads(backend) -> list[str]:
    """Profiled ops of one attention call that take the whole layer cache [S, Hkv, D] as an input
    and make a new tensor from it (index / index_select / copies) rather than a view."""
    batch, N = random_batch(6, False, n_pad_rows=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        run(backend, batch, N, 6)
    cache_shape = [96 * 4, 2, 8]  # N_BLOCKS * BS slots, HKV, D (tests/support/paged_batches.py)
    views = {"aten::select", "aten::unsqueeze", "aten::transpose", "aten::as_strided", "aten::view",
             "aten::expand", "aten::index_copy_", "aten::randn", "aten::to", "aten::_to_copy", "aten::copy_",
             "aten::empty_strided", "aten::lift_fresh", "aten::detach", "aten::alias"}
    return [e.name for e in prof.events() if e.name not in views and any(list(s) == cache_shape for s in e.input_shapes)]


def test_no_kv_gather_on_the_fused_path():
    gathers = _cache_reads(ReferenceAttention())
    assert "aten::index" in gathers  # the reference gathers K/V into dense tensors: the check sees it
    backend = FusedAttention(compile=False)
    flex, storages = backend._flex, []

    def spy(q, k, v, **kwargs):
        storages.append((k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr()))
        return flex(q, k, v, **kwargs)

    backend._flex = spy
    assert _cache_reads(backend) == []
    # Every flex call got the cache itself (a view of its storage), in the cache dtype. What eager
    # flex does inside (it expands GQA heads) is the CPU fallback's business; the compiled
    # kernel reads the view in place.
    batch, N = random_batch(6, False, n_pad_rows=2)
    storages.clear()
    _, cache = run(backend, batch, N, 6)
    assert storages == [(cache.k.untyped_storage().data_ptr(), cache.v.untyped_storage().data_ptr())] * 4

"""json tasks and output.constrain on the native engine, with a tiny random Qwen3-VL (whose free
answers are garbage): every answer the token limit did not cut validates against its schema (the
five of structured_cases.py) or parses as the grounding JSON; labels are the same at any batch size,
pipelined or not; and a CPU trace of the pipelined engine shows no launch waiting for a mask."""

from __future__ import annotations


import pytest
from support.mask_trace import MaskTrace
from support.qwen3vl_fixture import write_checkpoint
from support.structured_cases import SCHEMAS, assert_finished_answers_validate

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.qwen_vl.labels import parses_cleanly
from batchvlm.models.registry import open_family
from batchvlm.tasks import DetectTask, JsonTask, PointTask

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

MAX_NEW = 60
TASKS = [DetectTask(detect={"objects": ["cat"]}), PointTask(point={"objects": ["dog"]})]
TASKS += [JsonTask(json={"prompt": "Describe it.", "schema": schema, "name": name})
          for name, (schema, _, _) in SCHEMAS.items()]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from support.qwen_vl import images

    from batchvlm.data.decode import decode
    from support.inputs import encode_image

    folder = write_checkpoint(tmp_path_factory.mktemp("qwen3vl"), seed=2)
    family = open_family(ModelSpec(name=str(folder)))
    # Sampled (counter-based, so batch-invariant too): greedy, this model writes `[]` for every
    # object; sampled, some answers list objects.
    seqs = family.sequences(TASKS, EngineSpec(max_new_tokens=MAX_NEW, temperature=1.0), constrain=True)
    pre = family.preprocessor()
    prepared = [pre(d.image, d.width, d.height) for d in (decode(encode_image(im, "PNG"), 10**8) for im in images()[:3])]
    return dict(family=family, seqs=seqs, model=family.load("float32", "cpu"), prepared=prepared)


def engine_for(setup, batch: int, pipelined: bool) -> Engine:
    return Engine(setup["model"], setup["seqs"], EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch,
                                                            pipelined=pipelined), setup["family"].max_prefix_len())


def columns(setup, engine: Engine) -> list[dict]:
    done = {im.sample.index: im for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(setup["prepared"]))}
    assert engine.scheduler.blocks.used == 0
    return [setup["family"].columns(TASKS, setup["seqs"], [s.output for s in done[i].seqs]) for i in sorted(done)]


@pytest.fixture(scope="module")
def traced(setup) -> tuple[list[dict], MaskTrace]:
    """The pipelined engine's labels, and a trace of its host-side events (mask_trace.py)."""
    engine = engine_for(setup, 64, True)
    trace = MaskTrace.attach(engine)
    return columns(setup, engine), trace


def test_answers_validate_and_do_not_depend_on_batch_or_pipelining(setup, traced):
    first = traced[0]
    assert columns(setup, engine_for(setup, 7, False)) == first
    assert_finished_answers_validate(first)
    found = 0
    for kind, key, n in (("detect", "bbox_2d", 4), ("point", "point_2d", 2)):
        for c in first:
            if not c[f"{kind}_truncated"]:
                assert all(parses_cleanly(r["text"], key, n) for r in c[f"{kind}_raw"]), c[f"{kind}_raw"]
            found += len(c[kind])
    assert found > 0  # not only empty lists


def test_no_launch_waits_for_a_mask(traced):
    traced[1].assert_no_launch_waits_for_a_mask()

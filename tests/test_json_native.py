"""json tasks and output.constrain on the native engine, with a tiny random Qwen3-VL (whose free
answers are garbage): every answer the token limit did not cut validates against its schema (the
five of structured_cases.py) or parses as the grounding JSON; labels are the same at any batch size,
pipelined or not; and a CPU trace of the pipelined engine shows no launch waiting for a mask."""

from __future__ import annotations


import pytest
from qwen3vl_fixture import write_checkpoint
from structured_cases import SCHEMAS, assert_finished_answers_validate

from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.family import WorkItem
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
    from test_qwen3vl_engine import images

    from batchvlm.data.decode import decode
    from helpers import encode_image

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
    done = {im.ticket: im for im in engine.run(WorkItem(i, p, f"k{i}") for i, p in enumerate(setup["prepared"]))}
    assert engine.scheduler.blocks.used == 0
    return [setup["family"].columns(TASKS, setup["seqs"], [s.output for s in done[i].seqs]) for i in sorted(done)]


@pytest.fixture(scope="module")
def traced(setup):
    """The pipelined engine's labels, and a trace of its host-side events: launches, collects (the
    host's only wait for the device), mask computations (each in the schedule of a step), and
    the schedules that found nothing to run. -> (columns, events, rows of each step, masked rows
    of each step)."""
    engine = engine_for(setup, 64, True)
    runner, sched = engine.runner, engine.scheduler
    events: list[tuple[str, int]] = []
    rows: dict[int, set[int]] = {}
    masked: dict[int, set[int]] = {}

    def launch(plan, launch=runner.launch):
        events.append(("launch", plan.step))
        rows[plan.step] = set(plan.new_rows.tolist()) | set(plan.decode_rows.tolist())
        masked[plan.step] = set(plan.mask_rows.tolist())
        return launch(plan)

    def collect(inflight, collect=runner.collect):
        events.append(("collect", inflight.plan.step))
        return collect(inflight)

    def fill_masks(answers, out, fill=sched.fill_masks):
        events.append(("mask", sched.step))
        fill(answers, out)

    def schedule(schedule=sched.schedule):
        plan = schedule()
        if plan is None and sched.running:
            assert all(s.inflight > 0 for s in sched.running if s.state.name == "RUNNING")
            events.append(("nothing to run", sched.step))
        return plan

    runner.launch, runner.collect, sched.fill_masks, sched.schedule = launch, collect, fill_masks, schedule
    return columns(setup, engine), events, rows, masked


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
    """Pipelined: the masks of step t are computed after step t-1 was launched and before it is
    collected, from tokens of committed steps only; the device waits for the host only when
    nothing at all could run (every running sequence's last step in flight)."""
    _, events, rows, masked = traced
    overlapped = 0
    for k, (what, t) in enumerate(events):
        if what != "mask" or t == 0:
            continue
        assert [e for e in events[:k] if e[0] == "launch"][-1] == ("launch", t - 1)
        if ("collect", t - 1) in events[:k]:  # the device ran dry: nothing else was runnable
            assert ("nothing to run", t) in events[events.index(("launch", t - 1)):k]
        else:  # computed while step t-1 runs: for rows not in it, whose tokens are all committed
            overlapped += 1
            assert not masked[t] & rows[t - 1]
    waits = sum(e[0] == "nothing to run" for e in events)
    steps = sum(e[0] == "launch" for e in events)
    # Constrained rows take turns in two cohorts: the device runs dry only at the start (every
    # sequence admitted at once) and in the tail (one answer left, nothing to overlap it with).
    assert overlapped > waits and overlapped > steps // 2, (overlapped, waits, steps)

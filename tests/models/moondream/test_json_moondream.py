"""json tasks on the native Moondream engine (the demo model, sampled so that answers vary): the
grammar compiled over Moondream's tokenizer holds every answer the token limit did not cut to its
schema (the five of structured_cases.py), the prompt asked as a query; labels are the same at any
batch size, pipelined or not (the mask machinery itself is traced in test_json_native.py)."""

from __future__ import annotations

import random

import pytest
from support.moondream import LoadedMoondream
from support.structured_cases import SCHEMAS, assert_finished_answers_validate

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
from batchvlm.shapes.world import SPEC, draw_scene
from batchvlm.tasks import JsonTask

pytest.importorskip("xgrammar")

MAX_NEW = 48
TASKS = [JsonTask(json={"prompt": "Describe it.", "schema": schema, "name": name})
         for name, (schema, _, _) in SCHEMAS.items()]


@pytest.fixture(scope="module")
def setup():
    md = LoadedMoondream("demo", dtype="float32")
    rng = random.Random(5)
    # Sampled (counter-based, so batch-invariant too): the demo model's greedy answers repeat.
    seqs = md.sequences(TASKS, max_new_tokens=MAX_NEW, temperature=1.0)
    return dict(md=md, seqs=seqs, prepared=[md.preprocessor(draw_scene(rng, SPEC)[0]) for _ in range(3)])


def columns(setup, batch: int, pipelined: bool) -> list[dict]:
    md, seqs = setup["md"], setup["seqs"]
    engine = Engine(md.engine, seqs, EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch, pipelined=pipelined),
                    md.P)
    done = {im.sample.index: im for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(setup["prepared"]))}
    assert engine.scheduler.blocks.used == 0
    return [md.family.columns(TASKS, seqs, [s.output for s in done[i].seqs]) for i in sorted(done)]


def test_answers_validate_and_do_not_depend_on_batch_or_pipelining(setup):
    answer = setup["md"].config.tokenizer.answer_id
    assert all(s.spec.grammar is not None and s.spec.prompt[-2:] == (answer, answer)
               for s in setup["seqs"])  # the query-style prompt
    first = columns(setup, 64, True)
    assert columns(setup, 4, False) == first
    assert_finished_answers_validate(first)


def test_a_json_answer_whole_at_exactly_max_new_tokens_is_not_truncated(tmp_path):
    """The grammar decides: an answer that became whole with the last token allowed was cut by nothing."""
    import pyarrow.parquet as pq
    from support.cli import cli
    from support.inputs import good_png, write_job, write_tar

    write_tar(tmp_path / "s.tar", [("a.png", good_png())])
    schema = {"type": "object", "properties": {"shape": {"enum": ["circle", "square"]}}, "required": ["shape"],
              "additionalProperties": False}

    def answer(limit: int) -> dict:
        job = write_job(tmp_path / f"job{limit}.yaml", "s.tar", out=f"out{limit}", engine={"max_new_tokens": limit},
                        tasks=[{"json": {"prompt": "Which shape?", "schema": schema}}])
        cli("run", job)
        return pq.read_table(tmp_path / f"out{limit}" / "s.parquet").to_pylist()[0]

    free = answer(40)
    assert not free["json_truncated"], free
    whole = free["json_tokens"]["generated"] - 1  # its tokens, the stop token not counted
    exact = answer(whole)
    assert (exact["json"], exact["json_truncated"], exact["json_tokens"]["generated"]) == (free["json"], False, whole)
    assert answer(whole - 1)["json_truncated"]

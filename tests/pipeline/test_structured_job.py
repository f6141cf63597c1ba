"""classify and json tasks in the job file: one-line errors naming the field, and their columns."""

from pathlib import Path

import pyarrow as pa
import pytest
from support.structured_cases import SCHEMAS

from batchvlm.job import JobError, parse_job
from batchvlm.output.writer import schema
from batchvlm.tasks import choice_values

BASE = {"name": "j", "input": {"shards": "x.tar"}, "output": {"dir": "out"}}


def _job(*tasks):
    return parse_job(BASE | {"tasks": list(tasks)}, Path("/tmp"))


def _json(schema_):
    return {"json": {"prompt": "Describe it.", "schema": schema_}}


def _props(**props):
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("tasks, message", [
    ([{"classify": {"question": "q", "choices": []}}], "tasks.0.classify.choices: List should have at least 1 item"),
    ([{"classify": {"question": "q", "choices": ["a", "  "]}}], "tasks.0.classify.choices: choice 1 is empty"),
    ([{"classify": {"question": "q", "choices": ["yes", "no", "yes "]}}],
     "tasks.0.classify.choices: choice 'yes' is given twice"),
    ([{"classify": {"question": "q", "choices": ["a"], "max_new_tokens": 3}}],
     "tasks.0.classify.max_new_tokens: unknown key"),
    ([{"caption": {}}, {"classify": {"question": "", "choices": ["a"]}}], "tasks.1.classify.question: String should"),
    ([{"classify": {"question": "q", "choices": ["a"], "name": "a"}}, {"caption": {"name": "a_scores"}}],
     "tasks.1: its column 'a_scores' is also the scores column of tasks.0"),
    ([_json(_props(d={"type": "string", "format": "date"}))],
     "tasks.0.json.schema: properties.d.format: keyword 'format' cannot be enforced while decoding (use pattern)"),
    ([_json(_props(a={"oneOf": [{"type": "string"}, {"type": "null"}]}))],
     "tasks.0.json.schema: properties.a.oneOf: keyword 'oneOf' cannot be enforced"),
    ([_json(_props(a={"type": "array", "items": {"type": "integer", "multipleOf": 2}}))],
     "tasks.0.json.schema: properties.a.items.multipleOf: keyword 'multipleOf' cannot be enforced"),
    ([_json(_props(a={"$ref": "https://example.com/a.json"}))],
     "tasks.0.json.schema: properties.a.$ref: only local references into $defs are supported"),
    ([_json(_props(**{"a b": {"type": "integer", "minimum": "0"}}))],
     "tasks.0.json.schema: properties.\"a b\".minimum: not valid JSON Schema: '0' is not of type 'number'"),
    ([_json({"type": "objekt"})], "tasks.0.json.schema: type: not valid JSON Schema"),
    ([{"json": {"prompt": "p"}}], "tasks.0.json.schema: Field required"),
    ([{"json": {"prompt": "p", "schema": _props(), "temperature": 1}}], "tasks.0.json.temperature: unknown key"),
])
def test_bad_structured_tasks_are_named_in_one_line(tasks, message):
    with pytest.raises(JobError) as err:
        _job(*tasks)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_every_test_schema_is_accepted_and_choices_are_stripped():
    job = _job({"classify": {"question": "Where?", "choices": [" indoor", "outdoor "], "name": "scene"}},
               *(_json(s) | {"json": _json(s)["json"] | {"name": n}} for n, (s, _, _) in SCHEMAS.items()))
    assert job.tasks[0].classify.choices == ["indoor", "outdoor"]
    assert job.tasks[1].json_.json_schema == SCHEMAS["nested"][0]
    # the job record names the field as the user wrote it
    assert "schema" in job.label_settings()["tasks"][1]["json"]


def test_columns_of_classify_and_json():
    job = _job({"classify": {"question": "Where?", "choices": ["in", "out"], "name": "scene"}},
               _json(SCHEMAS["enums"][0]))
    s = schema(job.tasks, {})
    assert s.names[6:] == ["scene", "scene_scores", "json", "json_truncated", "scene_tokens",
                           "json_tokens"]  # no scene_truncated
    assert s.field("scene").type == pa.string() and s.field("json").type == pa.string()
    assert s.field("scene_scores").type == pa.list_(pa.struct([("label", pa.string()), ("prob", pa.float32())]))


def test_choice_values_are_a_softmax_in_choice_order():
    label, cell = choice_values(["a", "b", "c"], [-1.0, -0.5, -0.5])
    assert label == "b"  # the first of equal scores
    assert [c["label"] for c in cell] == ["a", "b", "c"]
    assert sum(c["prob"] for c in cell) == pytest.approx(1.0, abs=1e-12)
    assert cell[1]["prob"] == cell[2]["prob"] and cell[0]["prob"] < cell[1]["prob"]
    assert choice_values(["only"], [-300.0]) == ("only", [{"label": "only", "prob": 1.0}])


def test_moondream_builds_classify_and_json_sequences():
    from batchvlm.models.base.decoding import MODE_SCORE
    from batchvlm.models.registry import open_family

    job = _job({"caption": {}}, {"classify": {"question": "How many shapes are there?", "choices": ["one", "two"]}})
    seqs = open_family(job.model, weights=False).sequences(job.tasks, job.engine)
    assert [s.label for s in seqs if s.spec.mode == MODE_SCORE] == ["one", "two"]
    pytest.importorskip("xgrammar")
    job = _job({"caption": {}}, {"json": {"prompt": "Describe it.", "schema": {"type": "object"}}})
    seqs = open_family(job.model, weights=False).sequences(job.tasks, job.engine)
    assert [s.spec.grammar is not None for s in seqs] == [False, True]


def test_shapes_scores_classify_labels_against_the_scene():
    from batchvlm.shapes.metrics import Scores
    from batchvlm.shapes.world import COUNT_QUESTION, Scene, Shape

    scene = Scene(200, 200, [Shape("circle", "red", (20, 20, 60, 60)), Shape("square", "blue", (100, 100, 160, 160))])
    scores = Scores()
    assert "classify_exact" not in scores.table()  # only once a classify label was scored
    scores.add_classify(scene, COUNT_QUESTION, "two")
    scores.add_classify(scene, COUNT_QUESTION, "three")
    scores.add_classify(scene, "what color is the triangle?", "red")  # not asked by the spec: not scored
    assert scores.table()["classify_exact"] == 0.5

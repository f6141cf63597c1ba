"""Job files built from the job models with wrong types, out-of-range values and unknown keys:
validation never raises anything but a one-line JobError, and that line names the field
that was broken (or a field above it)."""

import datetime
import json
import re
import subprocess
import sys
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from batchvlm.job import Job, JobError, parse_job

BASE = {"name": "j", "input": {"shards": "x.tar"}, "tasks": [{"caption": {}}, {"detect": {"objects": ["a"]}}],
        "output": {"dir": "out"}}


def _paths(model: type[BaseModel], prefix: tuple = ()) -> list[tuple]:
    """Every field path of the job, nested models included (tasks through the base's tasks)."""
    out = []
    for name, f in model.model_fields.items():
        path = prefix + (name,)
        out.append(path)
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _paths(ann, path)
    return out


PATHS = _paths(Job) + [("tasks", 0, "caption", k) for k in ("length", "name", "max_new_tokens")] + [
    ("tasks", 1, "detect", k) for k in ("objects", "name", "max_objects")]

WRONG = st.one_of(
    st.booleans(), st.none(), st.integers(-10**30, 10**30), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.dates(), st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
    st.sampled_from([0, -1, 1e20, 2**63, 10**9, "", " ", "auto", "all", True, [], {}, [1, 1], ".inf"]))


@st.composite
def broken_jobs(draw) -> tuple[dict[str, Any], str]:
    """(a job with one thing wrong, the dotted path of what was broken)."""
    import copy

    job = copy.deepcopy(BASE)
    path = draw(st.sampled_from(PATHS))
    node = job
    for part in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(part, {})
        else:
            node = node[part]
    if draw(st.booleans()) and isinstance(node.get(path[-1], {}), dict):  # an unknown key inside
        node = node.setdefault(path[-1], {})
        key = draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in node))
        node[key] = draw(WRONG)
        path = path + (key,)
    else:
        node[path[-1]] = draw(WRONG)
    return job, ".".join(map(_part, path))


def _part(x) -> str:
    """A path part as messages write it: odd keys quoted."""
    s = str(x)
    return s if s.isprintable() and s.strip() == s and not any(c in s for c in ".: ") else json.dumps(s)


def _named_field(message: str) -> str:
    """The field a message starts with: parts joined by `.`, each a JSON string (a quoted key may
    hold `": "`, which also ends the field) or plain (no `.`, `:` or space, as _part writes it)."""
    s, i = message.removeprefix("job: "), 0
    while True:
        end = None
        if s.startswith('"', i):
            try:
                end = json.JSONDecoder().raw_decode(s, i)[1]
            except ValueError:
                pass  # a plain key that starts with a quote
        if end is None:
            end = re.compile(r'[^.: ]*').match(s, i + s.startswith('"', i)).end()
        if not s.startswith(".", end):
            return s[:end]
        i = end + 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(broken_jobs())
def test_broken_jobs_are_one_line_naming_the_field(tmp_path_factory, case):
    data, broken = case
    try:
        parse_job(data, tmp_path_factory.getbasetemp())
    except JobError as e:
        message = str(e)
        assert "\n" not in message
        field = _named_field(message)
        # the broken field, a field above it (a model-level check), or a part of its value
        assert field == "<root>" or _related(field, broken), (message, broken)


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@pytest.mark.slow
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(broken_jobs())
def test_validate_never_prints_a_traceback(tmp_path, case):
    data, broken = case
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "validate", str(path)], capture_output=True,
                       text=True, timeout=120)
    assert "Traceback" not in r.stderr and r.returncode in (0, 2), r.stderr
    if r.returncode == 2:
        lines = r.stderr.strip().splitlines()
        # a job file error names the file; a check of what the job points at (inputs, output
        # folder) names only the field: a valid job whose x.tar does not exist gets that
        assert len(lines) == 1 and lines[0].startswith("batchvlm: error: "), r.stderr
        field = lines[0].removeprefix("batchvlm: error: ").removeprefix(f"{path}: ").split(": ", 1)[0]
        # validate goes on to the inputs (x.tar does not exist here): then the field is input.*
        assert _related(field, broken) or field.startswith("input") or field == "<root>", (lines[0], broken)


def test_dates_in_the_job_are_named_not_crashed(tmp_path):
    with pytest.raises(JobError, match=r"^job: name: Input should be a valid string \(YAML read 2025-01-02 as a date"):
        parse_job(BASE | {"name": datetime.date(2025, 1, 2)}, tmp_path)


# Names that collide with the row's columns, each other's derived columns, or input.keep columns
CLASHING_NAMES = st.one_of(
    st.sampled_from(["x", "x_truncated", "x_raw", "caption", "caption_truncated", "detect", "detect_raw", "point_raw",
                     "key", "source", "status", "error", "width", "url", "url_truncated"]),
    st.text(min_size=1, max_size=5))


@st.composite
def named_jobs(draw) -> dict[str, Any]:
    tasks = []
    for kind in draw(st.lists(st.sampled_from(["caption", "query", "detect", "point"]), min_size=1, max_size=4)):
        args: dict[str, Any] = {"question": "q?"} if kind == "query" else {} if kind == "caption" else {"objects": ["a"]}
        if draw(st.booleans()):
            args["name"] = draw(CLASHING_NAMES)
        tasks.append({kind: args})
    keep = draw(st.lists(st.sampled_from(["url", "json", "caption", "x_truncated", "detect_raw"]), max_size=2,
                         unique=True))
    return BASE | {"input": {"shards": "x.tar", "keep": keep}, "tasks": tasks,
                   "output": {"dir": "out", "raw_text": draw(st.booleans())}}


def _columns(data: dict[str, Any]) -> list[str]:
    """The columns a row of this job would have, by the README's rules (not by job.py)."""
    named = [(kind, args.get("name") or kind) for t in data["tasks"] for kind, args in t.items()]
    raw = [f"{n}_raw" for kind, n in named if kind in ("detect", "point")] if data["output"]["raw_text"] else []
    return (["key", "source", "width", "height", "status", "error"] + [n for _, n in named] + raw
            + [f"{n}_truncated" for _, n in named] + [f"{n}_tokens" for _, n in named] + data["input"]["keep"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(named_jobs())
def test_task_names_either_give_distinct_columns_or_are_refused(tmp_path_factory, data):
    """Validation refuses exactly the jobs whose columns would clash (they crashed after the
    whole run, writing nothing), naming the task or input.keep; what it lets through writes."""
    import pyarrow as pa

    from batchvlm.output.writer import schema

    columns = _columns(data)
    try:
        job = parse_job(data, tmp_path_factory.getbasetemp())
    except JobError as e:
        message = str(e)
        assert "\n" not in message and len(set(columns)) < len(columns), message
        assert re.match(r"job: (tasks\.\d+|input\.keep): ", message), message
        return
    assert len(set(columns)) == len(columns)
    sch = schema(job.tasks, {}, [pa.field(k, pa.string()) for k in job.input.keep], job.output.raw_text)
    assert sorted(sch.names) == sorted(columns)  # each column once: the writer can fill every row

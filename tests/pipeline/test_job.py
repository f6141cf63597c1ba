"""The job file: typed validation with one-line errors naming the field; schemas stay fresh."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.paths import REPO

from batchvlm.job import JobError, load_job

GOOD = {"name": "j", "input": {"shards": "data/x-{0..2}.tar"}, "tasks": [{"caption": {}}], "output": {"dir": "out"}}


def _write(tmp_path, data) -> Path:
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return p


def test_relative_paths_resolve_against_the_job_folder(tmp_path):
    job = load_job(_write(tmp_path, GOOD))
    assert job.input.shards == [str(tmp_path / "data/x-{0..2}.tar")]
    assert job.output.dir == str(tmp_path / "out")
    assert job.model.name == "demo" and job.engine.temperature == 0.0


@pytest.mark.parametrize("change, message", [
    ({"engine": {"max_batch_size": 0}}, "engine.max_batch_size: Input should be greater than or equal to 1"),
    ({"tasks": [{"caption": {"length": "huge"}}]}, "tasks.0.caption.length: Input should be 'short', 'normal' or 'long'"),
    ({"tasks": [{"caption": {"lenght": "short"}}]}, "tasks.0.caption.lenght: unknown key"),
    ({"tasks": [{"describe": {}}]}, "tasks.0: a task is one of caption, query, detect, point"),
    ({"tasks": [{"detect": {"objects": []}}]}, "tasks.0.detect.objects: List should have at least 1 item"),
    ({"tasks": [{"caption": {}}, {"caption": {"length": "long"}}]}, "tasks.1: its column 'caption' is also the column of tasks.0"),
    ({"outptu": {"dir": "x"}}, "outptu: unknown key"),
    ({"input": {"shards": "a.tar", "folder": "b"}}, "input: give exactly one of shards, folder, parquet"),
    ({"model": {"dtype": "int8"}}, "model.dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
    ({"model": {"device": "tpu"}}, "model.device: String should match pattern"),
    ({"runtime": {"gpus": 0}}, "runtime.gpus: a count of GPUs must be at least 1"),
    ({"runtime": {"gpus": [1, 1]}}, "runtime.gpus: GPU ids must be distinct"),
    ({"tasks": [{"point": {"objects": ["a"]}}, {"caption": {"name": "point_raw"}}], "output": {"dir": "o", "raw_text": True}},
     "job.yaml: tasks.1: its column 'point_raw' is also the raw text column (output.raw_text) of tasks.0"),
    # senseless values YAML happily produces
    ({"engine": {"temperature": float("inf")}}, "engine.temperature: Input should be a finite number"),
    ({"engine": {"temperature": float("nan")}}, "engine.temperature: Input should be a finite number"),
    ({"engine": {"max_batch_size": True}}, "engine.max_batch_size: Input should be a valid integer (YAML read true"),
    ({"engine": {"max_batch_size": 1e20}}, "engine.max_batch_size: Input should be a valid integer (YAML read 1.0e+20"),  # as the file has it
    ({"engine": {"max_batch_size": 1000000}}, "engine.max_batch_size: Input should be less than or equal to"),
    ({"input": {"shards": "a.tar", "image_keys": []}}, "input.image_keys: List should have at least 1 item"),
    ({"output": {"dir": ""}}, "output.dir: String should have at least 1 character"),
    ({"output": {"dir": "  "}}, "output.dir: String should match pattern"),
    ({"runtime": {"gpus": True}}, "runtime.gpus: Input should be 'all'"),
    ({"name": 2025}, "name: Input should be a valid string (YAML read 2025 as a number; quote it: '2025')"),
    ({"loader": {"workers": 1e9}}, "loader.workers: Input should be a valid integer"),
])
def test_bad_fields_are_named(tmp_path, change, message):
    with pytest.raises(JobError) as err:
        load_job(_write(tmp_path, GOOD | change))
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_yaml_syntax_error_names_the_line(tmp_path):
    with pytest.raises(JobError, match=r"line 2 invalid YAML"):
        load_job(_write(tmp_path, "name: x\ntasks: [caption: {]\n"))


def test_cli_rejects_a_bad_job_before_loading_any_model(tmp_path):
    # The model named here does not exist: had it been loaded first, its error would show.
    bad = _write(tmp_path, GOOD | {"engine": {"top_p": 3}, "model": {"name": "nobody/nothing"}})
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"batchvlm: error: {bad}: engine.top_p: Input should be less than or equal to 1"]


def test_checked_in_schemas_are_fresh():
    from gen_schemas import render  # scripts/: on the path by pyproject.toml

    for name, text in render().items():
        assert (REPO / "schemas" / name).read_text() == text, f"schemas/{name} is stale: run scripts/gen_schemas.py"


def test_a_job_file_that_is_not_text_or_not_a_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"name: t\xff\xfe\n")
    with pytest.raises(JobError, match="not UTF-8 text"):
        load_job(bad)
    with pytest.raises(JobError, match="cannot read"):
        load_job(tmp_path)


def test_a_date_revision_is_the_tag_it_looks_like(tmp_path):
    # exactly as the README writes it: YAML reads 2025-06-21 as a date
    path = _write(tmp_path, yaml.safe_dump(GOOD) + "model: {name: vikhyatk/moondream2, revision: 2025-06-21}\n")
    assert load_job(path).model.revision == "2025-06-21"


def test_a_key_given_twice_is_an_error(tmp_path):
    text = "name: j\ninput: {shards: x.tar}\ntasks: [caption: {}]\noutput: {dir: out}\nengine:\n" \
           "  max_batch_size: 8\n  max_new_tokens: 4\n  max_batch_size: 16\n"
    with pytest.raises(JobError, match=r"engine\.max_batch_size: key given twice \(lines 6 and 8\)"):
        load_job(_write(tmp_path, text))


def test_relative_inputs_are_normalised(tmp_path):
    (tmp_path / "jobs").mkdir()
    job = load_job(_write(tmp_path / "jobs", GOOD | {"input": {"shards": "../data/./x.tar"}}))
    assert job.input.shards == [str(tmp_path / "data" / "x.tar")]

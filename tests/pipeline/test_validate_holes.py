"""What `validate` (preflight, the one check before a run) refuses that a run would otherwise get
wrong after the work: through the real CLI, each exit 2 with one line naming the cause (issue 40)."""

import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from support.cli import cli_app
from support.inputs import write_job

from batchvlm.exits import EXIT_JOB_ERROR
from batchvlm.shapes.shards import write_shards


def parquet_job(path, **inp):
    """A job of Parquet input (write_job's input is tar shards)."""
    job = yaml.safe_load(write_job(path, "unused").read_text())
    job["input"] = {"parquet": "t.parquet"} | inp
    path.write_text(yaml.safe_dump(job))
    return path


def refused(root, *args) -> str:
    r = cli_app(root, *args)
    assert r.returncode == EXIT_JOB_ERROR, r.stdout
    errors = [line for line in r.stdout.splitlines() if line.startswith("batchvlm: error: ")]
    assert len(errors) == 1, r.stdout
    return errors[0]


def test_an_img2dataset_folder_as_output_keeps_its_parquet(tmp_path):
    """img2dataset writes 00000.tar, 00000.parquet (urls, captions) and 00000_stats.json side by
    side: labels for 00000.tar would replace its 00000.parquet."""
    data = tmp_path / "data"
    write_shards(data, 1, 2, seed=1)
    (data / "shapes-000000.tar").rename(data / "00000.tar")
    theirs = pa.table({"url": ["http://a", "http://b"], "caption": ["a", "b"]})
    pq.write_table(theirs, data / "00000.parquet")
    (data / "00000_stats.json").write_text("{}")
    job = write_job(tmp_path / "job.yaml", "data/00000.tar", out="data")
    for args in (("validate", job), ("run", job), ("run", job, "--overwrite")):
        assert "00000.parquet was not written by this output" in refused(tmp_path, *args)
        assert pq.read_table(data / "00000.parquet").equals(theirs)


def test_a_users_own_parquet_in_the_output_folder_is_not_replaced(tmp_path):
    write_shards(tmp_path / "data", 2, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", tasks=[{"caption": {}}])
    cli_app(tmp_path, "run", job, "--limit", "2", check=True)  # shapes-000000 done: ours
    mine = pa.table({"x": [1]})
    pq.write_table(mine, tmp_path / "out" / "shapes-000001.parquet")
    line = refused(tmp_path, "validate", job)
    assert "shapes-000001.parquet was not written by this output" in line
    refused(tmp_path, "run", job)
    assert pq.read_table(tmp_path / "out" / "shapes-000001.parquet").equals(mine)
    (tmp_path / "out" / "shapes-000001.parquet").unlink()
    cli_app(tmp_path, "run", job, check=True)  # its own files are no obstacle
    cli_app(tmp_path, "run", job, "--overwrite", check=True)


def test_a_url_output_is_refused_before_any_folder_is_made(tmp_path, monkeypatch):
    """Other schemes than s3:// are refused; an s3:// store that cannot be reached is refused in
    one line naming it (tests/output/test_object_store.py has the stores that answer)."""
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out="gs://bucket/labels")
    for cmd in ("validate", "run"):
        assert "output.dir: gs://bucket/labels: an output URL is s3://bucket/prefix" in refused(tmp_path, cmd, job)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out="s3://bucket/labels")
    for cmd in ("validate", "run"):
        assert "cannot reach the store of s3://bucket/labels" in refused(tmp_path, cmd, job)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "job.yaml"]


def test_a_model_folder_without_safetensors_is_refused_by_validate(tmp_path):
    from batchvlm.models.registry import DEMO_DIR

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((DEMO_DIR / name).read_bytes())
    (model / "pytorch_model.bin").write_bytes(b"a pickle batchvlm never opens")
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", model={"name": str(model)})
    for args in (("validate", job), ("run", job, "--dry-run"), ("run", job)):
        assert "no model.safetensors" in refused(tmp_path, *args)
    assert not (tmp_path / "out").exists()


def missing_backend() -> str:
    """A protocol whose fsspec backend this environment lacks (s3fs is no dependency)."""
    import fsspec

    for protocol in ("s3", "gs", "abfs"):
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError:
            return protocol
    pytest.skip("every object-store backend is installed")


def test_a_missing_fsspec_backend_is_refused_at_validate(tmp_path):
    protocol = missing_backend()
    job = write_job(tmp_path / "job.yaml", f"{protocol}://bucket/x-{{000..001}}.tar")
    for args in (("validate", job), ("run", job)):
        assert f"input.shards: {protocol}://bucket/x-{{000..001}}.tar needs fsspec's {protocol!r} backend" in refused(tmp_path, *args)
    glob = write_job(tmp_path / "glob.yaml", f"{protocol}://bucket/*.tar")
    assert "backend" in refused(tmp_path, "validate", glob)
    unknown = write_job(tmp_path / "unknown.yaml", "nosuch://bucket/x.tar")
    assert "fsspec knows no protocol 'nosuch'" in refused(tmp_path, "validate", unknown)
    pq.write_table(pa.table({"image": [f"{protocol}://bucket/a.jpg", "local.jpg"]}), tmp_path / "t.parquet")
    paths = parquet_job(tmp_path / "paths.yaml")
    assert f"needs fsspec's {protocol!r} backend" in refused(tmp_path, "validate", paths)


def test_keep_columns_whose_types_clash_across_parquet_files_are_refused_at_validate(tmp_path):
    from support.inputs import good_png

    png = good_png(64, 48)
    pq.write_table(pa.table({"image": [png], "n": pa.array([1], pa.int32()), "tag": ["a"]}), tmp_path / "t-0.parquet")
    pq.write_table(pa.table({"image": [png], "n": pa.array([2], pa.int64()), "tag": pa.array([7])}),
                   tmp_path / "t-1.parquet")
    clash = parquet_job(tmp_path / "clash.yaml", parquet="t-*.parquet", keep=["n", "tag"])
    for args in (("validate", clash), ("run", clash)):
        line = refused(tmp_path, *args)
        assert "input.keep: column 'tag' is string in" in line and "t-0.parquet but int64 in" in line
    assert not (tmp_path / "out").exists()
    widened = parquet_job(tmp_path / "widened.yaml", parquet="t-*.parquet", keep=["n"])  # int32 + int64 unify
    cli_app(tmp_path, "run", widened, check=True)
    table = pq.read_table(tmp_path / "out")
    assert table.schema.field("n").type == pa.int64() and sorted(table.column("n").to_pylist()) == [1, 2]


def laughs(levels: int) -> str:
    """The "billion laughs": each level an alias of nine of the one below (9**levels values)."""
    lines = ["l0: &l0 [ha, ha, ha, ha, ha, ha, ha, ha, ha]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def test_job_files_that_cost_minutes_to_check_are_refused_in_seconds(tmp_path):
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    body = job.read_text()
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(laughs(10) + body.replace("name: test-job", "name: test-job\nx: *l10"))
    start = time.monotonic()
    assert "YAML aliases expand to more than 1,000,000 values" in refused(tmp_path, "validate", bomb)
    loop = tmp_path / "loop.yaml"
    loop.write_text(body + "x: &x [1, *x]\n")
    assert "a YAML alias refers to a value that holds it" in refused(tmp_path, "validate", loop)
    big = tmp_path / "big.yaml"
    with open(big, "w") as f:
        f.write(body)
        f.truncate(50 << 20)  # sparse: 50 MB that cost nothing to write
    assert "big.yaml: 50 MB; a job file is at most 4 MB" in refused(tmp_path, "validate", big)
    assert time.monotonic() - start < 20
    aliased = tmp_path / "aliased.yaml"  # aliases that stay small are fine
    aliased.write_text(body.replace("max_new_tokens: 12", "max_new_tokens: &n 12\n  max_objects: *n")
                       .replace("  max_objects: 3\n", ""))
    cli_app(tmp_path, "validate", aliased, check=True)


def test_sixty_thousand_detect_objects_validate_in_seconds(tmp_path):
    write_shards(tmp_path / "data", 1, 2, seed=1)
    objects = [f"object {i}" for i in range(60_000)]
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", tasks=[{"detect": {"objects": objects}}])
    start = time.monotonic()
    cli_app(tmp_path, "validate", job, check=True)
    assert time.monotonic() - start < 30  # 49 s before: a quadratic duplicate check, YAML in pure Python
    twice = write_job(tmp_path / "twice.yaml", "data/shapes-*.tar", tasks=[{"detect": {"objects": objects + ["object 7"]}}])
    assert "object 7" in refused(tmp_path, "validate", twice)


def test_a_misspelt_key_is_named_with_what_it_likely_meant(tmp_path):
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    job.write_text(job.read_text().replace("tasks:", "taks:"))
    assert refused(tmp_path, "validate", job).endswith("taks: unknown key; did you mean tasks?")
    job.write_text(job.read_text().replace("taks:", "tasks:").replace("max_new_tokens", "max_new_tokns"))
    assert "engine.max_new_tokns: unknown key; did you mean max_new_tokens?" in refused(tmp_path, "validate", job)


def test_a_folder_keep_that_no_file_has_is_refused(tmp_path):
    from support.inputs import good_png

    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(good_png(64, 48))
    (tmp_path / "images" / "a.json").write_text("{}")
    job = yaml.safe_load(write_job(tmp_path / "job.yaml", "unused").read_text())
    job["input"] = {"folder": "images", "keep": ["json", "path", "nonexistent"]}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert "input.keep: no file beside the images of" in refused(tmp_path, "validate", tmp_path / "job.yaml")
    job["input"]["keep"] = ["json", "path"]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cli_app(tmp_path, "validate", tmp_path / "job.yaml", check=True)


def test_a_preview_inside_the_output_folder_is_refused(tmp_path):
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", tasks=[{"caption": {}}])
    cli_app(tmp_path, "run", job, check=True)
    for inside in ("out/preview.html", "out/sub/p.html"):
        assert "is inside the output folder" in refused(tmp_path, "preview", "out", "-o", inside)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["__batchvlm__", "shapes-000000.parquet"]
    cli_app(tmp_path, "preview", "out", "-o", "preview.html", check=True)
    assert pq.read_table(tmp_path / "out").num_rows == 2  # the folder still reads as labels

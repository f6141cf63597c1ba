"""No silent loss at the edges (issue 28): every input file is labelled, an error row, or counted
as skipped; a changed image relabels its shard; a refused run changes nothing; readers see done
shards only; exports never merge or overwrite silently.

One folder dataset is labelled once (after a `--limit` run, for what an unfinished shard leaves
visible) and copied where a test changes it; one tar dataset for shard names. Commands that load
no model, refused runs and the tar dataset's run go through the real CLI app in this process; the
other runs are subprocesses."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from support.inputs import encode_image, write_tar
from support.cli import inproc
from support.paths import REPO
from PIL import Image


DEMO = REPO / "batchvlm" / "models" / "demo"


def cli(*args, cwd: Path):
    return subprocess.run([sys.executable, "-m", "batchvlm.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd)


def png(colour, size=(24, 16)) -> bytes:
    return encode_image(Image.new("RGB", size, colour), "PNG")


def job_file(root: Path, name: str, folder: str, out: str, **changes) -> Path:
    job = {"name": "edges", "input": {"folder": folder, "shard_size": 2}, "model": {"name": "./model"},
           "tasks": [{"caption": {"max_new_tokens": 2}}, {"detect": {"objects": ["circle"]}}],
           "engine": {"max_new_tokens": 2, "max_objects": 2}, "loader": {"workers": 0}, "output": {"dir": out}}
    for section, value in changes.items():
        job[section] = value if not isinstance(value, dict) else job.get(section, {}) | value
    path = root / name
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.fixture(scope="module")
def labelled(tmp_path_factory):
    """root/img: a.jpg + a.png (one stem), b.jfif, ._c.jpg (macOS), d.heic, sub/f.png, and
    linked -> ../elsewhere (e.png); labelled by a local copy of the demo model, after a
    `--limit 1` run whose state is kept for the test of unfinished shards."""
    root = tmp_path_factory.mktemp("edges")
    shutil.copytree(DEMO, root / "model")
    img = root / "img"
    (img / "sub").mkdir(parents=True)
    (root / "elsewhere").mkdir()
    (img / "a.jpg").write_bytes(encode_image(Image.new("RGB", (24, 16), (200, 30, 30)), "JPEG"))
    (img / "a.png").write_bytes(png((30, 200, 30)))
    (img / "b.jfif").write_bytes(encode_image(Image.new("RGB", (20, 20), (30, 30, 200)), "JPEG"))
    (img / "._c.jpg").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (img / "d.heic").write_bytes(b"\x00\x00\x00\x18ftypheic")
    (img / "sub" / "f.png").write_bytes(png((90, 90, 90)))
    (root / "elsewhere" / "e.png").write_bytes(png((250, 250, 0)))
    (img / "linked").symlink_to("../elsewhere")
    job = job_file(root, "job.yaml", "img", "out")
    first = cli("run", job, "--limit", "1", cwd=root)
    assert first.returncode == 0, first.stderr
    after_limit = {"top": sorted(p.name for p in (root / "out").glob("*.parquet")),
                   "status": inproc(root, "status", job)}
    r = cli("run", job, cwd=root)
    assert r.returncode == 0, r.stderr
    return {"root": root, "job": job, "summary": r.stderr.strip().splitlines()[-1], "after_limit": after_limit,
            "rows": pq.read_table(root / "out").to_pylist()}


def copy_of(labelled, name: str) -> tuple[Path, Path]:
    """A copy of the input folder and its output (stats and mtimes kept), with its job file."""
    root = labelled["root"]
    shutil.copytree(root / "img", root / f"img-{name}", symlinks=True)
    shutil.copytree(root / "out", root / f"out-{name}", symlinks=True)
    return root / f"img-{name}", job_file(root, f"{name}.yaml", f"img-{name}", f"out-{name}")


def test_1_yolo_export_keeps_both_images_of_a_stem_and_never_merges(labelled):
    root = labelled["root"]
    code, out = inproc(root, "export", "yolo", "out", "yolo")
    assert code == 0, out
    labels = root / "yolo" / "labels"  # flat, as YOLO tools read it
    assert sorted(p.name for p in labels.iterdir()) == ["a+2.txt", "a.txt", "b.txt", "e.txt", "f.txt"]  # a.jpg, a.png
    names = [json.loads(line)["file_name"] for line in (root / "yolo" / "captions.jsonl").read_text().splitlines()]
    assert "a.jpg" in names and "a+2.png" in names
    code, out = inproc(root, "export", "yolo", "out", "yolo")
    assert code == 2 and "DEST" in out and "not empty" in out and "--overwrite" in out
    code, out = inproc(root, "export", "coco", "out", "yolo", "--overwrite")
    assert code == 0, out
    assert not (root / "yolo" / "labels").exists() and (root / "yolo" / "annotations.json").exists()
    code, out = inproc(root, "export", "coco", "out", "img/export")
    assert code == 2 and "inside input.folder" in out and not (root / "img" / "export").exists()


def test_2_symlinked_subfolders_are_followed(labelled):
    keys = {(r["source"].rsplit("/", 1)[-1], r["key"]) for r in labelled["rows"]}
    assert ("linked", "e.png") in keys
    assert (labelled["root"] / "out" / "linked-00000.parquet").exists()


def test_3_an_image_replaced_in_place_relabels_its_shard(labelled):
    img, job = copy_of(labelled, "replaced")
    root = labelled["root"]
    code, out = inproc(root, "status", job)
    assert code == 0 and "4/4 shards done" in out and "0 pending" in out, out
    (img / "b.jfif").write_bytes(encode_image(Image.new("RGB", (20, 20), (0, 0, 0)), "JPEG"))  # same name
    code, out = inproc(root, "status", job)
    # its rows stay on disk until the next run relabels it: "done, input changed", not pending (issue 40 item 18)
    assert code == 0 and "3/4 shards done" in out and "0 pending" in out and "1 changed" in out, out


def test_4_every_file_is_labelled_or_counted_as_skipped(labelled):
    by_key = {r["key"]: r for r in labelled["rows"]}
    assert by_key["b.jfif"]["status"] == "ok"  # .jfif / .jpe are JPEG
    assert "._c.jpg" not in by_key and "d.heic" not in by_key
    for text in (labelled["summary"], inproc(labelled["root"], "status", labelled["job"])[1],
                 inproc(labelled["root"], "validate", labelled["job"])[1]):
        assert "2 file(s) skipped" in text and "macOS ._ metadata" in text and "HEIC" in text, text


def test_6_an_unfinished_shard_is_never_visible_to_readers(labelled):
    after = labelled["after_limit"]
    assert after["top"] == []  # the --limit run's partial shard stayed in __batchvlm__/partial/
    code, out = after["status"]
    assert code == 0 and "1 partial" in out and "0/4 shards done" in out, out
    assert len(labelled["rows"]) == 5 and not (labelled["root"] / "out" / "__batchvlm__" / "partial" /
                                               "root-00000.parquet").exists()


def test_7_a_run_refused_for_other_weights_changes_nothing(labelled):
    from safetensors.torch import load_file, save_file

    img, job = copy_of(labelled, "weights")
    (img / "new.png").write_bytes(png((1, 2, 3)))
    out = labelled["root"] / "out-weights"
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.endswith(".lock")}
    weights = labelled["root"] / "model" / "model.safetensors"
    original = weights.read_bytes()
    tensors = load_file(weights)
    first = sorted(tensors)[0]
    tensors[first] = tensors[first] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    try:
        code, text = inproc(labelled["root"], "run", job)
    finally:
        weights.write_bytes(original)
    assert code == 2 and "other model weights" in text, text
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and not p.name.endswith(".lock")}
    assert after == before  # new.png was not frozen into shards.json


def test_8_task_columns_that_clash_are_refused_before_any_work(labelled):
    job = job_file(labelled["root"], "clash.yaml", "img", "out-clash",
                   tasks=[{"caption": {"name": "x"}}, {"detect": {"objects": ["circle"], "name": "x_truncated"}}])
    code, out = inproc(labelled["root"], "validate", job)
    assert code == 2 and "tasks.0: its truncation flag 'x_truncated' is also the column of tasks.1" in out, out


def test_9_run_checks_the_parquet_image_column_before_loading_the_model(tmp_path):
    pq.write_table(pa.table({"image": pa.array([1, 2], pa.int64())}), tmp_path / "p.parquet")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "p", "input": {"parquet": "p.parquet"}, "tasks": [{"caption": {}}],
                                   "loader": {"workers": 0}, "output": {"dir": "out"}}))
    code, out = inproc(tmp_path, "run", job)
    assert code == 2 and "input.image_column" in out and "int64" in out, out
    assert "loaded" not in out and not (tmp_path / "out").exists()  # nothing left behind either


def test_10_the_batch_size_is_capped_by_the_device_and_validate_says_so(labelled):
    job = job_file(labelled["root"], "wide.yaml", "img", "out-wide", engine={"max_batch_size": 16384})
    code, out = inproc(labelled["root"], "validate", job)
    assert code == 0 and "engine.max_batch_size: 16384 is more than CPU runs; it runs 1024" in out, out


def test_11_a_users_own_stats_file_is_not_an_old_layout(labelled):
    out = labelled["root"] / "out-mine"
    out.mkdir()
    (out / "mine.stats.json").write_text(json.dumps({"accuracy": 0.9}))
    job = job_file(labelled["root"], "mine.yaml", "img", "out-mine")
    code, text = inproc(labelled["root"], "status", job)
    assert code == 0 and "0/4 shards done" in text, text
    code, text = inproc(labelled["root"], "validate", job)
    assert code == 0, text


@pytest.fixture(scope="module")
def tars(tmp_path_factory):
    """d1/x.tar, d2/x.tar, _a.tar, .b.tar: one image each, labelled once."""
    root = tmp_path_factory.mktemp("tars")
    for i, name in enumerate(["d1/x.tar", "d2/x.tar", "_a.tar", ".b.tar"]):
        (root / name).parent.mkdir(exist_ok=True)
        write_tar(root / name, [(f"k{i}.png", png((60 * i, 0, 0)))])
    job = root / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "t", "input": {"shards": ["d1/x.tar", "d2/x.tar", "_a.tar", ".b.tar"]},
                                   "tasks": [{"caption": {"max_new_tokens": 2}}], "engine": {"max_new_tokens": 2},
                                   "loader": {"workers": 0}, "output": {"dir": "out"}}))
    code, out = inproc(root, "run", job)
    assert code == 0, out
    return root


def test_5_files_named_with_a_leading_underscore_or_dot_are_read_by_readers(tars, tmp_path):
    from batchvlm.job import parse_job
    from batchvlm.output.shardlist import plan

    out = tars / "out"
    assert {"a.parquet", "b.parquet"} <= {p.name for p in out.glob("*.parquet")}
    assert len(pq.read_table(out).to_pylist()) == 4  # pyarrow skips _ and . files: none is left out
    pq.write_table(pa.table({"image": [b"x"]}), tmp_path / "_part.parquet")
    job = parse_job({"name": "p", "input": {"parquet": "_part.parquet"}, "tasks": [{"caption": {}}],
                     "output": {"dir": "o"}}, tmp_path)
    assert [s.stem for s in plan(job.input)] == ["part"]


def test_12_two_files_of_one_name_get_distinct_shards(tars):
    sources = {Path(r["source"]).relative_to(tars).as_posix(): name
               for name in ("x", "x+2") for r in pq.read_table(tars / "out" / f"{name}.parquet").to_pylist()}
    assert sources == {"d1/x.tar": "x", "d2/x.tar": "x+2"}


def test_13_yaml_hints_quote_what_was_written(labelled, tmp_path):
    from batchvlm.job import JobError, load_job

    def message(model: str = "", engine: str = "") -> str:
        path = tmp_path / "j.yaml"
        path.write_text(f"name: j\ninput: {{shards: x.tar}}\nmodel: {{{model}}}\nengine: {{{engine}}}\n"
                        "tasks: [caption: {}]\noutput: {dir: o}\n")
        with pytest.raises(JobError) as e:
            load_job(path)
        return str(e.value)

    path = tmp_path / "rev.yaml"
    path.write_text("name: j\ninput: {folder: img}\nmodel: {name: demo, revision: 0123}\ntasks: [caption: {}]\n"
                    "output: {dir: o}\n")
    code, out = inproc(tmp_path, "validate", path)
    assert code == 2 and "YAML read 0123 as a number; quote it: '0123'" in out, out
    assert "YAML read no as a boolean; quote it: 'no'" in message(model="revision: no")
    assert "YAML read 1e-3 as text; write 0.001" in message(engine="temperature: 1e-3")


def test_14_equivalent_settings_are_not_a_change(labelled):
    root = labelled["root"]
    job = job_file(root, "same.yaml", "img", "out", model={"name": str(root / "model"), "backend": "native"})
    code, out = inproc(root, "validate", job)
    assert code == 0, out  # auto resolved to native; ./model is this folder


def test_15_validate_counts_the_shards_a_run_would_have(labelled):
    img, job = copy_of(labelled, "gone")
    shutil.rmtree(img / "sub")  # its frozen shard stays in the list
    code, out = inproc(labelled["root"], "validate", job)
    assert code == 0 and "(4 shard(s), 5 image(s)" in out, out
    code, out = inproc(labelled["root"], "status", job)
    assert "/4 shards done" in out, out


def test_15_after_sigterm_the_summary_counts_the_rows_kept(tmp_path):
    """A stop after the small shard a-00000 was written: the b images in flight are labelled but
    dropped with their unfinished shard; the summary's images are the rows kept, and it names the
    dropped ones, so summary and progress agree."""
    for name in ["a/0.png", "a/1.png", *(f"b/{i:02d}.png" for i in range(60))]:
        (tmp_path / "img" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "img" / name).write_bytes(png((len(name), 1, 1)))
    (tmp_path / "model").symlink_to(DEMO)
    job = job_file(tmp_path, "job.yaml", "img", "out", input={"shard_size": 60}, engine={"max_batch_size": 2},
                   tasks=[{"caption": {"max_new_tokens": 2}}])
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | {"BATCHVLM_PROGRESS": "json"})
    done = tmp_path / "out" / "__batchvlm__" / "a-00000.stats.json"
    deadline = time.time() + 120
    while time.time() < deadline and not done.exists():
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    summary = stderr.strip().splitlines()[-1]
    counted = sum(json.loads(line).get("images", 0) for line in stdout.splitlines())
    assert p.returncode == 75 and "stopped by signal" in summary, stderr
    assert len(pq.read_table(tmp_path / "out").to_pylist()) == 2 and " 2 images, " in summary, summary
    assert counted > 2 and f" {counted - 2} more labelled in unfinished or failed shards" in summary, (counted, summary)


def unprivileged(path: Path) -> list[str]:
    """A command prefix under which permissions stop a process from reading `path` (chmod 000):
    none for a plain user; for root, its file capabilities dropped (setpriv). Skips where neither works."""
    prefix = []
    if os.geteuid() == 0 and shutil.which("setpriv"):
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    if subprocess.run([*prefix, "ls", str(path)], capture_output=True).returncode == 0:
        pytest.skip("permissions do not stop this user (root without setpriv) from reading a folder")
    return prefix


def test_15_an_unreadable_folder_fails_validate_and_the_run_counts_what_it_kept(tmp_path):
    img = tmp_path / "img"
    (img / "locked").mkdir(parents=True)
    (img / "ok").mkdir()
    for name in ("locked/x.png", "ok/a.png", "ok/b.png", "c.png", "noread.png"):
        (img / name).write_bytes(png((len(name), 1, 1)))
    (tmp_path / "model").symlink_to(DEMO)
    job = job_file(tmp_path, "job.yaml", "img", "out", tasks=[{"caption": {"max_new_tokens": 2}}])
    (img / "locked").chmod(0)
    (img / "noread.png").chmod(0)
    try:
        prefix = unprivileged(img / "locked")
        bvlm = [*prefix, sys.executable, "-m", "batchvlm.cli"]
        r = subprocess.run([*bvlm, "validate", job], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 2 and "input.folder: cannot read" in r.stderr and "locked" in r.stderr, r.stderr
        r = subprocess.run([*bvlm, "run", job], capture_output=True, text=True, cwd=tmp_path,
                           env=os.environ | {"BATCHVLM_PROGRESS": "json"})
    finally:
        (img / "locked").chmod(0o755)
        (img / "noread.png").chmod(0o644)
    # root-00000 (c.png, noread.png) and locked-00000 fail; c.png was labelled, then dropped with its shard
    summary = r.stderr.strip().splitlines()[-1]
    counted = sum(json.loads(line).get("images", 0) for line in r.stdout.splitlines())
    assert r.returncode == 1 and "2 FAILED" in summary, r.stderr
    assert counted == 3 and " 2 images, 1 more labelled in unfinished or failed shards" in summary, summary
    assert sorted(row["key"] for row in pq.read_table(tmp_path / "out").to_pylist()) == ["a.png", "b.png"]
    code, out = inproc(tmp_path, "status", job)
    assert "2 failed" in out and "2 rows" in out, out


def test_16_small_things_validation_lets_through(labelled, tmp_path):
    from batchvlm.data.sources import Encoded, read_shard
    from batchvlm.job import JobError, parse_job

    root = labelled["root"]
    base = {"name": "j", "input": {"shards": "x.tar"}, "output": {"dir": "o"}}
    with pytest.raises(JobError, match=r"tasks.0.detect.objects: 'cat' is named twice"):
        parse_job(base | {"tasks": [{"detect": {"objects": ["cat", "dog", "cat"]}}]}, tmp_path)
    code, out = inproc(root, "validate", job_file(root, "px.yaml", "img", "out-px", model={"max_pixels": 4096}))
    assert code == 2 and "model.max_pixels: a Qwen3-VL setting" in out, out
    added = {"caption": {"length": "short", "name": "short"}}
    job = job_file(root, "added.yaml", "img", "out", tasks=[{"caption": {"max_new_tokens": 2}},
                                                            {"detect": {"objects": ["circle"]}}, added])
    code, out = inproc(root, "validate", job)  # a task appended: the done shards gain its columns (issue 40 item 16)
    assert code == 0, out
    job = job_file(root, "inserted.yaml", "img", "out", tasks=[added, {"caption": {"max_new_tokens": 2}},
                                                               {"detect": {"objects": ["circle"]}}])
    code, out = inproc(root, "validate", job)  # one before them changes what tasks.0 is
    assert code == 2 and "tasks.0.caption.length was \"normal\", is now \"short\"" in out and "circle" not in out, out
    pq.write_table(pa.table({"image": [png((1, 1, 1))] * 3, "id": ["k", None, ""]}), tmp_path / "keys.parquet")
    keyed = parse_job({"name": "k", "input": {"parquet": "keys.parquet", "key_column": "id"},
                       "tasks": [{"caption": {}}], "output": {"dir": "o"}}, tmp_path)
    from batchvlm.output.shardlist import plan

    encs = [e for e in read_shard(plan(keyed.input)[0], keyed.input) if isinstance(e, Encoded)]
    assert [(e.key, e.error) for e in encs] == [
        ("k", None), ("row 1", "key: null in input.key_column 'id'"), ("row 2", "key: empty in input.key_column 'id'")]


def test_readme_agrees_with_the_package():
    readme = (REPO / "README.md").read_text()
    torch_pin = re.search(r'"torch>=([\d.]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert f"torch >= {torch_pin}" in readme and "torch >= " + torch_pin in (REPO / "Makefile").read_text()
    links = re.findall(r"\]\(((?!https?:|#)[^)]+)\)", readme)
    links = [link.partition("#")[0] for link in links]  # a page's heading: the page must exist
    assert links and all((REPO / link).resolve().is_relative_to(REPO) and (REPO / link).exists() for link in links)
    assert (REPO / "docs/output.md").read_text().count("_job.json") == 1  # the first layout's file, named where that layout is described

"""What a new (or hostile) user meets first, through the real CLI: every mistake is one line
naming the cause before any work starts, runs on one folder never do the work twice, and
progress and the final summary tell the truth."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from support.cli import cli_app as app
from support.inputs import encode_image, write_job, write_tar
from PIL import Image


def cli(*args, check=False, **kw):
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stderr}")
    return r


def one_line_error(r, *fragments, code=2) -> str:
    """The run failed with exactly one line on stderr, naming every fragment; no traceback."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert lines and lines[-1].startswith("batchvlm: error: "), r.stderr
    assert [line for line in lines if "error:" in line or "Error" in line] == lines[-1:], r.stderr
    for f in fragments:
        assert f in lines[-1], r.stderr
    return lines[-1]


def png(w=96, h=64, colour=(200, 30, 30), fmt="PNG") -> bytes:
    im = Image.new("RGB", (w, h), (240, 240, 240))
    im.paste(colour, (10, 10, 50, 40))
    return encode_image(im, fmt)


CHEAP = {"tasks": [{"caption": {"length": "short"}}], "engine": {"max_new_tokens": 4}}  # labels are not the point


def tar_job(root: Path, n_shards=1, per=2, **sections) -> Path:
    for s in range(n_shards):
        write_tar(root / f"in-{s}.tar", [(f"s{s}_{i}.png", png()) for i in range(per)])
    return write_job(root / "job.yaml", "in-*.tar", **(CHEAP | sections))


@pytest.fixture
def mounted(tmp_path):
    """mount(8) as root where the sandbox allows it; the test skips where it does not."""
    mounts = []

    def mount(*args: str) -> None:
        r = subprocess.run(["mount", *args], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount here: {r.stderr.strip()}")
        mounts.append(args[-1])

    yield mount
    for m in reversed(mounts):
        subprocess.run(["umount", "-l", m], capture_output=True)


def test_a_read_only_output_folder_is_refused_before_any_work(tmp_path, mounted):
    job = tar_job(tmp_path, output={"dir": "ro/out"})
    (tmp_path / "ro").mkdir()
    mounted("--bind", str(tmp_path / "ro"), str(tmp_path / "ro"))
    mounted("-o", "remount,ro,bind", str(tmp_path / "ro"))
    for r in (app(tmp_path, "validate", job), app(tmp_path, "run", job, "--dry-run"), cli("run", job)):
        one_line_error(r, "output.dir", "read-only")
        assert "loaded" not in r.stderr  # refused before the model


def test_a_full_disk_is_one_line_and_leaves_no_temporaries(tmp_path, mounted):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk))
    job = tar_job(tmp_path, n_shards=2, per=12, output={"dir": "disk/out"})
    (disk / "filler").write_bytes(b"\1" * (256 * 1024 - 5 * 4096))  # the job record fits, the shards do not
    r = cli("run", job)
    one_line_error(r, "no space left", "output.dir", code=1)
    assert not list((disk / "out").glob("*.tmp-*"))


def test_the_output_folder_must_be_a_folder_apart_from_the_inputs(tmp_path):
    job = tar_job(tmp_path, output={"dir": "taken"})
    (tmp_path / "taken").write_text("a file")
    one_line_error(app(tmp_path, "validate", job), "output.dir", "is a file")
    # an image folder holding the output folder: exported images would become inputs
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png())
    job = write_job(tmp_path / "f.yaml", "unused", input={"folder": "imgs", "shards": None},
                    output={"dir": "imgs/labels"})
    one_line_error(app(tmp_path, "run", job, "--dry-run"), "output.dir", "inside input.folder")


def test_a_parquet_column_of_the_wrong_type_is_named_by_validate(tmp_path):
    pq.write_table(pa.table({"image": [1, 2, 3]}), tmp_path / "t.parquet")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "t.parquet", "shards": None})
    one_line_error(app(tmp_path, "validate", job), "input.image_column", "int64", "image bytes")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a machine without CUDA")
def test_no_cuda_is_found_by_validate(tmp_path):
    job = tar_job(tmp_path, model={"name": "demo", "device": "cuda"})
    one_line_error(app(tmp_path, "validate", job), "model.device", "no CUDA")
    assert not (tmp_path / "out").exists()


def test_two_runs_of_one_job_do_not_both_label(tmp_path):
    job = tar_job(tmp_path, n_shards=2, per=2, engine={"max_new_tokens": 8, "max_batch_size": 2})
    first = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stderr=subprocess.PIPE,
                             text=True)
    try:
        for line in first.stderr:  # the first run holds the lock once it says what it labels
            if "shard(s) to label" in line:
                break
        # paused (the lock stays held) so that it cannot finish before the second one starts
        os.kill(first.pid, signal.SIGSTOP)
        try:
            second = cli("run", job)
        finally:
            os.kill(first.pid, signal.SIGCONT)
        # 75, not 2: nothing is wrong with the job (a scheduler retries it, Kubernetes included)
        one_line_error(second, "another batchvlm run", f"pid {first.pid}", "rank 0 of 1", code=75)
    finally:
        first.stderr.read()
        assert first.wait(timeout=300) == 0
    assert "0 shard(s) written, 2 already done" in app(tmp_path, "run", job, check=True).stderr


def test_auto_dtype_is_the_devices_precision_a_mismatch_names_it_and_overwrite_spares_foreign_stats(tmp_path):
    job = tar_job(tmp_path)
    cli("run", job, check=True)  # dtype auto on this CPU: float32
    # the same inputs (rewriting them would change their mtime: issue 14 relabels changed inputs)
    same = write_job(tmp_path / "job.yaml", "in-*.tar", **(CHEAP | {"model": {"name": "demo", "dtype": "float32"}}))
    assert "1 already done" in app(tmp_path, "run", same, check=True).stderr
    other = write_job(tmp_path / "job.yaml", "in-*.tar", **(CHEAP | {"model": {"name": "demo", "dtype": "bfloat16"}}))
    one_line_error(app(tmp_path, "run", other, "--dry-run"), 'model.dtype was "float32", is now "bfloat16"', "--overwrite")
    mine = tmp_path / "out" / "my-notes.stats.json"
    mine.write_text('{"accuracy": 0.9}')
    app(tmp_path, "run", other, "--overwrite", check=True)
    assert mine.read_text() == '{"accuracy": 0.9}'


def moved_project(tmp_path) -> Path:
    """A labelled project moved elsewhere as a whole (the job record keeps absolute paths)."""
    root = tmp_path / "before"
    root.mkdir()
    job = tar_job(root, n_shards=2, per=2)
    cli("run", job, check=True)
    shutil.move(root, tmp_path / "after")
    return tmp_path / "after"


def test_status_preview_export_after_the_project_moved_or_lost_its_inputs(tmp_path):
    root = moved_project(tmp_path)
    out = root / "out"
    report = json.loads(app(tmp_path, "status", out, "--json", check=True).stdout)
    assert (report["done"], report["pending"], report["rows"]) == (2, 0, 4)
    app(tmp_path, "preview", out, "-o", tmp_path / "p.html", check=True)
    assert (tmp_path / "p.html").read_text().count("data:image/jpeg;base64,") == 4  # images found again
    app(tmp_path, "export", "coco", out, tmp_path / "coco", "--with-images", check=True)
    assert (tmp_path / "coco" / "images" / "in-0" / "s0_0.png").read_bytes() == png()
    for tar in root.glob("in-*.tar"):
        tar.unlink()
    r = app(tmp_path, "status", out, check=True)
    assert "2/? shards done" in r.stdout and "inputs not found" in r.stdout
    assert app(tmp_path, "preview", out, "-o", tmp_path / "q.html", check=True).stdout.endswith(": 4 rows\n")
    assert "no images: input" in (tmp_path / "q.html").read_text()
    app(tmp_path, "export", "yolo", out, tmp_path / "yolo", check=True)  # needs no image
    assert len(list((tmp_path / "yolo" / "labels").rglob("*.txt"))) == 4
    one_line_error(app(tmp_path, "export", "coco", out, tmp_path / "c2", "--with-images"), "cannot read its input")


def test_progress_has_a_total_and_an_output_folder_matched_by_its_own_input_pattern_is_named(tmp_path):
    (tmp_path / "data").mkdir()
    for i in range(3):
        pq.write_table(pa.table({"image": [png()] * 3}), tmp_path / "data" / f"p-{i}.parquet")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "*/*.parquet", "shards": None},
                    output={"dir": "out"}, **CHEAP)
    r = cli("run", job, check=True)
    frames = r.stderr.replace("\r", "\n").splitlines()
    bars = [f for f in frames if f.startswith("test-job:") and "img" in f]
    assert any("/9 [" in f for f in bars), bars  # a total from the Parquet footers: rate and ETA
    assert "9/9" in bars[-1] and "shards=3/3" in bars[-1], bars[-1]
    assert "batch 64" in r.stderr  # the CPU default batch size
    # the next run's input pattern now matches the labels: named before any work
    one_line_error(app(tmp_path, "validate", job), "input.parquet", "batchvlm's own output", "Narrow the pattern")


def test_tar_metadata_members_are_no_samples_and_error_kinds_are_whole(tmp_path):
    """A tar's two images of one key (c.jpg, c.png) kept one and dropped the other without a trace,
    and many-dotted names (img.v1.png) were `no image` rows under webdataset's first-dot key: each
    image is now its own row, keyed back to its member name (docs/job.md, Tar members). Members that name no
    sample (no extension, dotfiles such as macOS ._ resource forks, links, devices) were dropped
    without a count: now counted by reason in the summary, the shard's stats and `status`, as a
    folder's skipped files are; directories are no files. A tar output's preview needs no torch."""
    import tarfile

    def special(name, kind, **kw):
        info = tarfile.TarInfo(name)
        info.type = kind
        for k, v in kw.items():
            setattr(info, k, v)
        return info

    write_tar(tmp_path / "m-0.tar", [("__meta__.json", b"{}"), ("a.png", png()), ("b.txt", b"caption only"),
                                     ("c.jpg", png(fmt="JPEG")), ("c.png", png()), ("img.v1.png", png()),
                                     ("img.v2.png", png()), ("photo.2024.01.png", png()), ("README", b"read me"),
                                     ("._a.png", png()), (".DS_Store", b"\0"), special("d", tarfile.DIRTYPE),
                                     ("d/._c.jpg", png(fmt="JPEG")), special("e.png", tarfile.SYMTYPE, linkname="a.png"),
                                     special("f.png", tarfile.CHRTYPE, devmajor=1, devminor=3)])
    job = write_job(tmp_path / "job.yaml", "m-0.tar", **(CHEAP | {"engine": {"max_new_tokens": 4, "max_batch_size": 8}}))
    r = cli("run", job, check=True)
    assert "batch 8" in r.stderr  # the job's own value is kept
    rows = pq.read_table(tmp_path / "out" / "m-0.parquet").select(["key", "status"]).to_pylist()
    assert [(row["key"], row["status"]) for row in rows] == [
        ("a", "ok"), ("b", "error"), ("c.jpg", "ok"), ("c.png", "ok"), ("img.v1", "ok"), ("img.v2", "ok"),
        ("photo.2024.01", "ok")]
    stats = json.loads((tmp_path / "out" / "__batchvlm__" / "m-0.stats.json").read_text())
    assert stats["error_kinds"] == {"no image in sample": 1}
    skipped = {"macOS ._ metadata": 2, "not a regular file (link, device)": 2, "no extension": 1,
               "hidden file (name starts with a dot)": 1}
    assert stats["skipped"] == skipped
    note = ("6 file(s) skipped (2 macOS ._ metadata, 2 not a regular file (link, device), 1 no extension, "
            "1 hidden file (name starts with a dot))")
    assert r.stderr.strip().splitlines()[-1].endswith(f"{note} -> {tmp_path / 'out'}"), r.stderr
    report = json.loads(app(tmp_path, "status", tmp_path / "out", "--json", check=True).stdout)
    assert (report["skipped"], report["skipped_files"]) == (note, skipped)
    assert note in app(tmp_path, "run", job, check=True).stderr  # a run with nothing left to label says it too
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "batchvlm.cli", "preview", tmp_path / "out",
                        "-o", tmp_path / "p.html"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "p.html").exists(), r.stderr
    assert not re.search(r"\| +torch$", r.stderr, re.M)


def test_help_version_and_unexpected_errors(tmp_path):
    r = cli("run", "--help", check=True)
    assert "<bool>" not in r.stdout and "--dry-run" in r.stdout
    from batchvlm import __version__

    assert cli("--version", check=True).stdout.strip() == f"batchvlm {__version__}"
    # an output folder whose job record is not what batchvlm wrote: not a crash
    (tmp_path / "out" / "__batchvlm__").mkdir(parents=True)
    (tmp_path / "out" / "__batchvlm__" / "job.json").write_text('{"job_spec": {"name": 3}}')
    one_line_error(cli("status", tmp_path / "out"), "not a batchvlm output folder")
    # commands that load no model start without torch (most of a run's start-up), a refused job file too
    bad_job = tmp_path / "bad.yaml"
    bad_job.write_text("name: x\n")
    for args in (["--version"], ["run", "--help"], ["status", tmp_path / "out"], ["run", bad_job]):
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "batchvlm.cli", *map(str, args)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode in (0, 2) and "Traceback" not in r.stderr, r.stderr
        assert not re.search(r"\| +torch$", r.stderr, re.M), args


def test_export_names_follow_the_inputs(tmp_path):
    (tmp_path / "imgs").mkdir()
    files = {"img_000.jpg": png(fmt="JPEG"), "b.webp": png(fmt="WEBP"), "c.gif": png(fmt="GIF")}
    for name, data in files.items():
        (tmp_path / "imgs" / name).write_bytes(data)
    job = write_job(tmp_path / "job.yaml", "unused", input={"folder": "imgs", "shards": None}, **CHEAP)
    cli("run", job, check=True)
    app(tmp_path, "export", "coco", tmp_path / "out", tmp_path / "coco", "--with-images", check=True)
    coco = json.loads((tmp_path / "coco" / "annotations.json").read_text())
    assert sorted(i["file_name"] for i in coco["images"]) == ["root-00000/b.webp", "root-00000/c.gif", "root-00000/img_000.jpg"]
    for name, data in files.items():
        assert (tmp_path / "coco" / "images" / "root-00000" / name).read_bytes() == data
    app(tmp_path, "export", "yolo", tmp_path / "out", tmp_path / "yolo", check=True)
    data = yaml.safe_load((tmp_path / "yolo" / "data.yaml").read_text())
    assert "train" not in data and not (tmp_path / "yolo" / "images").exists()
    assert (tmp_path / "yolo" / "labels" / "img_000.txt").exists()  # flat, as YOLO tools read it


def test_model_mistakes_are_found_by_validate_and_dry_run(tmp_path):
    long = tar_job(tmp_path, tasks=[{"query": {"question": "what is this " * 200}}])
    for args in (("validate", long), ("run", long, "--dry-run")):
        one_line_error(app(tmp_path, *args), "tasks.0", "context")
    unknown = tar_job(tmp_path, model={"name": "nobody/nothing"})  # offline (conftest): not in the cache
    one_line_error(app(tmp_path, "validate", unknown), "model.name", "nobody/nothing")
    assert not (tmp_path / "out").exists()  # nothing was created for a job that cannot run

"""A new user's messy data, through the real CLI and readers (piece nu): file names that are not
UTF-8, files that hold something else than their extension says, an input with no rows, and a
run stopped by Ctrl-C twice. Each is labelled, an error row that names what the file is, or one
clear line and exit code; never a crashed job or a silent gap."""

from __future__ import annotations

import io
import json
import os
import queue
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from support.inputs import encode_image, png_header_only, write_tar
from support.cli import inproc
from support.paths import REPO
from PIL import Image, features

from batchvlm.data.sources import read_shard
from batchvlm.job import InputSpec
from batchvlm.output.shardlist import plan

DEMO = REPO / "batchvlm" / "models" / "demo"
HEIC = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic"  # the first bytes of an iPhone photo
LFS = b"version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 12345\n"


def cli(*args, cwd: Path, **kw):
    return subprocess.run([sys.executable, "-m", "batchvlm.cli", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=300, **kw)


def png(colour=(200, 30, 30), size=(24, 16)) -> bytes:
    return encode_image(Image.new("RGB", size, colour), "PNG")


def job_file(root: Path, inp: dict, **changes) -> Path:
    job = {"name": "messy", "input": inp, "model": {"name": str(DEMO)}, "tasks": [{"caption": {"length": "short"}}],
           "engine": {"max_new_tokens": 2}, "loader": {"workers": 0}, "output": {"dir": "out"}} | changes
    (root / "job.yaml").write_text(yaml.safe_dump(job))
    return root / "job.yaml"


def test_a_folder_of_messy_names_and_impostor_files(tmp_path):
    """Names whose bytes are not UTF-8 (a file and a directory) crashed the whole run before any
    image was labelled; now each is labelled, its key / path / source / shard name showing the
    bytes as \\xNN, and a resumed run finds them done. Files whose extension lies are error rows
    that name what they hold, a too large one names the setting; AVIF is labelled where this
    Pillow reads it."""
    img = tmp_path / "img"
    img.mkdir()
    try:
        (img / os.fsdecode(b"d\xe9j\xe0")).mkdir()
        (img / os.fsdecode(b"caf\xe9.png")).write_bytes(png())
    except (OSError, UnicodeError):
        pytest.skip("this filesystem takes only UTF-8 names")
    (img / os.fsdecode(b"d\xe9j\xe0") / "x.png").write_bytes(png((30, 200, 30)))
    (img / "a.png").write_bytes(png((30, 30, 200)))
    (img / "iphone.jpg").write_bytes(HEIC)  # HEIC bytes under a JPEG name
    (img / "lfs.png").write_bytes(LFS)  # a dataset cloned without `git lfs pull`
    (img / "page.jpg").write_bytes(b"<!DOCTYPE html><html><body>403 Forbidden</body></html>")
    (img / "huge.png").write_bytes(png_header_only(20000, 20000))  # 400 megapixels: over the limit
    if features.check("avif"):
        (img / "photo.avif").write_bytes(encode_image(Image.new("RGB", (20, 20), (90, 90, 90)), "AVIF"))
    job = job_file(tmp_path, {"folder": "img", "keep": ["path"]})

    r = cli("run", job, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "skipped" not in r.stderr.splitlines()[-1], r.stderr  # every file is an image to label here
    rows = {row["key"]: row for row in pq.read_table(tmp_path / "out").to_pylist()}
    assert rows["caf\\xe9.png"]["status"] == "ok" and rows["caf\\xe9.png"]["path"] == "caf\\xe9.png"
    assert rows["x.png"]["status"] == "ok" and rows["x.png"]["path"] == "d\\xe9j\\xe0/x.png"
    assert rows["x.png"]["source"] == str(img.resolve() / "d\\xe9j\\xe0")
    assert (tmp_path / "out" / "d\\xe9j\\xe0-00000.parquet").is_file()
    assert rows["iphone.jpg"]["error"].startswith("decode: HEIC image")
    assert "git lfs pull" in rows["lfs.png"]["error"] and "HTML page" in rows["page.jpg"]["error"]
    assert "photo.avif" not in rows or rows["photo.avif"]["status"] == "ok"
    assert rows["huge.png"]["error"] == "too large: 20000x20000 pixels (loader.max_image_pixels: 100000000)"
    assert len(rows) == 7 + features.check("avif")

    code, out = inproc(tmp_path, "run", job, "--dry-run")  # the frozen shard list and done markers read back
    assert code == 0 and "2 shard(s), 2 done, 0 to label" in out, out


def test_a_tar_of_latin1_names_gives_utf8_keys_and_says_which_image_keys_it_read(tmp_path):
    """GNU tar on a Latin-1 system stores names as raw bytes: the keys (which seed sampling and
    land in a Parquet string column) are valid UTF-8. A sample with no member of
    input.image_keys says which extensions were looked for."""
    with tarfile.open(tmp_path / "x.tar", "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        for name, data in [("caf\u00e9.jpg", encode_image(Image.new("RGB", (8, 8)), "JPEG")), ("b.gif", png())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    inp = InputSpec(shards=str(tmp_path / "x.tar"))
    samples = list(read_shard(plan(inp)[0], inp))
    assert [s.key for s in samples] == ["caf\\xe9", "b"]
    assert samples[0].data and samples[0].key.encode("utf-8")
    assert samples[1].error == "no image in sample (has: gif; input.image_keys: jpg, jpeg, png, webp)"


def test_a_parquet_path_not_found_says_where_it_was_looked_for(tmp_path):
    """Paths written relative to the project, not to the Parquet file: each row says where it looked."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    (tmp_path / "tables").mkdir()
    pq.write_table(pa.table({"image": ["img/a.png"]}), tmp_path / "tables" / "t.parquet")
    inp = InputSpec(parquet=str(tmp_path / "tables" / "t.parquet"))
    [sample] = read_shard(plan(inp)[0], inp)
    assert sample.error == (f"read img/a.png: file not found at {tmp_path}/tables/img/a.png (a relative path is "
                            "read from the Parquet file's folder)")


def test_an_input_with_no_rows_is_one_line_not_an_empty_success(tmp_path):
    """Parquet files of no rows were labelled into an empty folder with exit 0; now they are one
    line, exit 2, as an empty image folder is. Tars are read to know: each that holds no image
    (empty, or text members only) is named in the run's summary, and where none holds one the run
    and `status` say that nothing was labelled, exit 2, where they said `0 errors` and exit 0."""
    pq.write_table(pa.table({"image": pa.array([], pa.binary())}), tmp_path / "empty.parquet")
    job = job_file(tmp_path, {"parquet": "empty.parquet"})
    code, out = inproc(tmp_path, "validate", job)
    assert code == 2 and out.strip() == f"batchvlm: error: input.parquet: no rows in {tmp_path}/empty.parquet", out
    tarfile.open(tmp_path / "empty.tar", "w").close()
    write_tar(tmp_path / "text.tar", [("a.txt", b"a caption"), ("b.json", b"{}")])
    r = cli("run", job_file(tmp_path, {"shards": "{empty,text}.tar"}), cwd=tmp_path)
    *_, summary, last = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "2 shard(s) written" in summary and "2 with no images (empty, text)" in summary, r.stderr
    no_images = ("input.shards: none of the 2 tar(s) holds an image (a member whose extension is one of "
                 "input.image_keys: jpg, jpeg, png, webp); nothing was labelled")
    assert last == f"batchvlm: error: {no_images}", r.stderr
    code, status = inproc(tmp_path, "status", "out")  # and on every later look, until the inputs change
    assert code == 0 and status.splitlines()[1:] == [f"  {no_images}"], status


def test_ctrl_c_twice_writes_the_finished_shards_and_says_what_is_kept(tmp_path):
    """The first Ctrl-C says at once that the run is stopping; the second stops it (exit 130) with a
    line saying what was kept, where before it ended silently. It dropped the finished shards the
    writer still held (the one put() waited to hand over, the one queued, the one being written);
    now those are written first. Heavy sidecars keep the writer behind the labelling, as a slow
    disk does: every image the progress counted (one image per shard) is in the output."""
    img = tmp_path / "img"
    img.mkdir()
    for i in range(40):
        (img / f"{i:03d}.png").write_bytes(png((i, 1, 1), (8, 8)))
        (img / f"{i:03d}.txt").write_text(os.urandom(100_000).hex())
    job = job_file(tmp_path, {"folder": "img", "shard_size": 1, "keep": ["txt"]},
                   engine={"max_new_tokens": 2, "max_batch_size": 4, "max_images_in_flight": 4})
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], cwd=tmp_path, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=os.environ | {"BATCHVLM_PROGRESS": "json"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in p.stderr], daemon=True).start()
    progress: list[dict] = []
    reader = threading.Thread(target=lambda: [progress.append(json.loads(line)) for line in p.stdout], daemon=True)
    reader.start()
    while not list((tmp_path / "out" / "__batchvlm__").glob("*.stats.json")):  # the first shard is written
        assert p.poll() is None
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    seen = []
    while not any("SIGINT: stopping after the images in flight" in line for line in seen):
        seen.append(lines.get(timeout=60))
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=120) == 130, seen
    reader.join(timeout=10)
    time.sleep(0.1)
    while not lines.empty():
        seen.append(lines.get())
    assert seen[-1].startswith("batchvlm: interrupted: the shards written so far are kept"), seen
    labelled = sum(m.get("images", 0) for m in progress)
    rows = pq.read_table(tmp_path / "out").num_rows
    assert 0 < labelled == rows < 40, (labelled, rows, seen)
    code, status = inproc(tmp_path, "status", "out")
    assert code == 0 and status.startswith(f"messy: {rows}/40 shards done, 0 partial, 0 failed, {40 - rows} pending"), status


def test_a_full_dev_shm_stops_the_run_with_one_line_instead_of_hanging(tmp_path):
    """Docker and Kubernetes give a container 64 MB of /dev/shm unless told otherwise. A loader
    worker's tensor that did not fit there was lost in the queue's feeder thread and the run
    waited for it forever; now it ends at once with one line naming the fix, exit 1, and no
    shard marked done. /dev/shm is a 64 KiB tmpfs in a mount namespace of the run alone."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    tar = tmp_path / "in.tar"
    with tarfile.open(tar, "w") as t:
        for i in range(4):
            info = tarfile.TarInfo(f"s{i}.png")
            info.size = len(data := png((i * 40, 0, 0), (64, 48)))
            t.addfile(info, io.BytesIO(data))
    job = job_file(tmp_path, {"shards": "in.tar"}, loader={"workers": 1})
    run = f"mount -t tmpfs -o size=64k tmpfs /dev/shm && exec {sys.executable} -m batchvlm.cli run {job}"
    r = subprocess.run(["unshare", "-m", "sh", "-c", run], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and lines[-1].startswith("batchvlm: error: loader: /dev/shm is full ("), r.stderr
    assert "--shm-size" in lines[-1] and "loader.workers: 0" in lines[-1] and "Traceback" not in r.stderr
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_folder_sidecars_named_after_the_whole_file_and_a_jpeg_named_heic(tmp_path):
    """`img.jpg.txt` (gallery-dl's and many exporters' sidecar name) is read like `img.txt`, the
    image's own first; sidecars the job keeps are no skipped files; a real JPEG named .heic is
    labelled (its bytes say what it is), a real HEIC still skipped and counted."""
    img = tmp_path / "img"
    img.mkdir()
    (img / "a.jpg").write_bytes(encode_image(Image.new("RGB", (24, 16), (200, 30, 30)), "JPEG"))
    (img / "a.jpg.txt").write_text("own caption")
    (img / "a.txt").write_text("stem caption")  # the image's own wins
    (img / "b.png").write_bytes(png())
    (img / "b.txt").write_text("b caption")
    (img / "c.heic").write_bytes(encode_image(Image.new("RGB", (20, 20), (30, 200, 30)), "JPEG"))
    (img / "d.heic").write_bytes(HEIC)
    (img / "notes.md").write_text("not a sidecar")
    job = job_file(tmp_path, {"folder": "img", "keep": ["txt"]})

    code, out = inproc(tmp_path, "run", job)
    assert code == 0, out
    rows = {row["key"]: row for row in pq.read_table(tmp_path / "out").to_pylist()}
    assert {k: (r["status"], r["txt"]) for k, r in rows.items()} == {
        "a.jpg": ("ok", "own caption"), "b.png": ("ok", "b caption"), "c.heic": ("ok", None)}
    last = out.strip().splitlines()[-1]
    assert "2 file(s) skipped (1 HEIC (unreadable: convert to JPEG or PNG), 1 not an image)" in last, out

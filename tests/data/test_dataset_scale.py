"""Inputs at dataset scale, through the real CLI and real readers: bounded, stable shards; an
output folder that pandas, pyarrow.dataset, DuckDB and `datasets` open as it is; metadata kept
beside the labels; damaged, unreadable and changed inputs reported or relabelled."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from support.cli import cli_app
from support.inputs import encode_image, write_job, write_tar
from PIL import Image

from batchvlm.job import InputSpec, Job, load_job
from batchvlm.output.layout import OutputConflict
from batchvlm.output.reader import Output, OutputError
from batchvlm.status import collect

FAST = {"tasks": [{"caption": {"length": "short"}}], "engine": {"max_new_tokens": 2, "max_batch_size": 256}}


def cli(*args, check=True, env=None, **kw):
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", *map(str, args)], capture_output=True, text=True,
                       env=os.environ | (env or {}), **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stderr}")
    return r


def tiny(fmt: str, colour=(200, 30, 30)) -> bytes:
    return encode_image(Image.new("RGB", (8, 8), colour), fmt)


def fill(folder: Path, n: int, start: int = 0, real_every: int = 1) -> list[str]:
    """n tiny images of mixed types in `folder`, of which every `real_every`-th is a real one and
    the others empty files (error rows: every stage but the model sees them, so a thousand images
    fit the test budget on 2 CPU cores); -> their file names."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"png": tiny("PNG"), "jpg": tiny("JPEG"), "webp": tiny("WEBP")}
    names = []
    for i in range(start, start + n):
        ext = ("png", "jpg", "webp")[i % 3]
        (folder / f"img{i:05d}.{ext}").write_bytes(data[ext] if i % real_every == 0 else b"")
        names.append(f"img{i:05d}.{ext}")
    return names


def read_back(out: Path) -> dict[str, list[str]]:
    """The `path` column as each reader sees the output folder itself."""
    import duckdb
    import pandas as pd

    got = {"pandas": pd.read_parquet(out)["path"].tolist(),
           "pyarrow.dataset": ds.dataset(out, format="parquet").to_table(columns=["path"]).column("path").to_pylist(),
           "pq.read_table": pq.read_table(out, columns=["path"]).column("path").to_pylist(),
           "duckdb": [r[0] for r in duckdb.sql(f"SELECT path FROM read_parquet('{out}/*.parquet')").fetchall()]}
    try:
        import datasets
    except ImportError:
        pass
    else:
        got["datasets"] = datasets.load_dataset("parquet", data_dir=str(out), split="train")["path"]
    return got


def _done(out: Path) -> int:
    n = 0
    for p in (out / "__batchvlm__").glob("*.stats.json"):
        try:
            n += bool(json.loads(p.read_text()).get("complete"))
        except ValueError:
            pass
    return n


def test_a_folder_in_bounded_stable_shards_that_every_reader_opens(tmp_path):
    images = tmp_path / "images"
    want = fill(images, 340, 0, 8) + [f"sub/{n}" for n in fill(images / "sub", 360, 340, 8)] \
        + [f".hidden/{n}" for n in fill(images / ".hidden", 300, 700, 8)]
    (images / "notes.txt").write_text("not an image")
    job = write_job(tmp_path / "job.yaml", "unused", output={"dir": "out"}, loader={"workers": 2, "prefetch": 4},
                    input={"folder": "images", "shards": None, "shard_size": 100, "keep": ["path"]},
                    **(FAST | {"engine": {"max_new_tokens": 2, "max_batch_size": 8}}))  # shards end one by one
    out = tmp_path / "out"
    # kill -9 at a random moment after the first shards are down, then run again
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and _done(out) < 2:
        time.sleep(0.02)
    time.sleep(random.Random(7).uniform(0.0, 0.5))
    killed = p.poll() is None
    if killed:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    before = {f.name: f.stat().st_mtime_ns for f in out.glob("*.parquet")
              if json.loads((out / "__batchvlm__" / f"{f.stem}.stats.json").read_text())["complete"]}
    assert killed and 2 <= len(before) < 11
    cli("run", job)
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".parquet")) == ["__batchvlm__"]
    names = sorted(f.stem for f in out.glob("*.parquet"))
    assert names == [f"hidden-{i:05d}" for i in range(3)] + [f"root-{i:05d}" for i in range(4)] \
        + [f"sub-{i:05d}" for i in range(4)]
    assert max(pq.read_metadata(f).num_rows for f in out.glob("*.parquet")) == 100
    for reader, paths in read_back(out).items():
        assert sorted(paths) == sorted(want), reader  # every image exactly once
    assert all(f.stat().st_mtime_ns == before[f.name] for f in out.glob("*.parquet") if f.name in before)

    # 140 more images: new shards for them alone, no existing Parquet file rewritten
    mtimes = {f.name: f.stat().st_mtime_ns for f in out.glob("*.parquet")}
    want += fill(images, 60, 1800, 8) + [f"sub/{n}" for n in fill(images / "sub", 80, 1860, 8)]
    r = cli("run", job)
    assert "2 shard(s) written, 11 already done, 140 images" in r.stderr
    assert {f.name: f.stat().st_mtime_ns for f in out.glob("*.parquet") if f.name in mtimes} == mtimes
    assert sorted(set(f.name for f in out.glob("*.parquet")) - set(mtimes)) == ["root-00004.parquet",
                                                                                "sub-00004.parquet"]
    for reader, paths in read_back(out).items():
        assert sorted(paths) == sorted(want), reader
    report = collect(load_job(job))
    assert (report["shards"], report["done"], report["pending"], report["rows"]) == (13, 13, 0, 1140)


def test_two_ranks_split_one_folders_shards(tmp_path):
    fill(tmp_path / "images", 48)
    job = write_job(tmp_path / "job.yaml", "unused", input={"folder": "images", "shards": None, "shard_size": 6},
                    **FAST)
    procs = [subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stderr=subprocess.PIPE,
                              text=True, env=os.environ | {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
             for r in range(2)]
    logs = [p.communicate()[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert all("4 shard(s) written" in log for log in logs)  # 8 shards: 4 each
    keys = pq.read_table(tmp_path / "out", columns=["key"]).column("key").to_pylist()
    assert sorted(keys) == [f"img{i:05d}.{('png', 'jpg', 'webp')[i % 3]}" for i in range(48)]
    frozen = json.loads((tmp_path / "out" / "__batchvlm__" / "shards.json").read_text())
    assert [s["stem"] for s in frozen["shards"]] == [f"root-{i:05d}" for i in range(8)]


def test_big_parquet_is_split_and_keeps_its_columns(tmp_path):
    n = 1200
    image = tiny("PNG")
    table = pa.table({"image": [image if i % 40 == 0 else None for i in range(n)],  # nulls: error rows, fast
                      "url": [f"https://example.com/{i}.png" for i in range(n)],
                      "caption": [f"original caption {i}" for i in range(n)],
                      "license": pa.array([i % 7 for i in range(n)], pa.int16())})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=300)
    job = write_job(tmp_path / "job.yaml", "unused", engine=FAST["engine"],
                    input={"parquet": "t.parquet", "shards": None, "shard_size": 500, "keep": ["url", "caption", "license"]},
                    tasks=[{"query": {"question": "What is it?", "name": "answer"}}])
    cli("run", job)
    out = tmp_path / "out"
    assert sorted(f.name for f in out.glob("*.parquet")) == ["t-00000.parquet", "t-00001.parquet", "t-00002.parquet"]
    assert [pq.read_metadata(out / f"t-0000{i}.parquet").num_rows for i in range(3)] == [500, 500, 200]
    got = ds.dataset(out).to_table()
    assert got.schema.field("license").type == pa.int16() and got.schema.field("url").type == pa.string()
    rows = sorted(got.to_pylist(), key=lambda r: int(r["key"]))
    assert [r["key"] for r in rows] == [str(i) for i in range(n)]
    assert all(r["url"] == f"https://example.com/{i}.png" and r["caption"] == f"original caption {i}"
               and r["license"] == i % 7 for i, r in enumerate(rows))
    assert sum(r["status"] == "ok" for r in rows) == 30 and all(r["answer"] for r in rows if r["status"] == "ok")

    # The file is rewritten smaller: labelled again as one shard; the row ranges it had are gone.
    pq.write_table(table.slice(0, 400), tmp_path / "t.parquet")
    r = cli_app(tmp_path, "run", job, check=True)
    assert "1 shard(s) written, 0 already done" in r.stderr
    assert sorted(f.name for f in out.glob("*.parquet")) == ["t.parquet"]
    assert pq.read_table(out).num_rows == 400


def test_tar_sidecars_pass_through_and_duplicate_keys_are_error_rows(tmp_path):
    png = tiny("PNG")
    write_tar(tmp_path / "s-0.tar", [("a.png", png), ("a.json", b'{"url": "http://x/a"}'), ("a.txt", b"a cat"),
                                     ("b.png", png), ("b.txt", "ünïcode".encode()),
                                     ("a.png", tiny("PNG", (0, 0, 255))), ("a.json", b'{"url": "http://x/a2"}')])
    job = write_job(tmp_path / "job.yaml", "s-0.tar", input={"keep": ["json", "txt"]}, **FAST)
    cli("run", job)
    rows = pq.read_table(tmp_path / "out" / "s-0.parquet").to_pylist()
    assert [(r["key"], r["status"], r["json"], r["txt"]) for r in rows] == [
        ("a", "ok", '{"url": "http://x/a"}', "a cat"), ("b", "ok", None, "ünïcode"),
        ("a", "error", '{"url": "http://x/a2"}', None)]
    assert rows[2]["error"].startswith("duplicate key")
    stats = json.loads((tmp_path / "out" / "__batchvlm__" / "s-0.stats.json").read_text())
    assert stats["error_kinds"] == {"duplicate key": 1}


def test_a_damaged_tar_fails_the_run_shows_in_status_and_is_relabelled_when_replaced(tmp_path):
    members = [(f"s{i}.png", encode_image(Image.new("RGB", (40, 40), (i * 50, 0, 0)), "PNG")) for i in range(4)]
    whole = write_tar(tmp_path / "whole.tar", members).read_bytes()
    member_bytes = 512 + -(-len(members[0][1]) // 512) * 512
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "cut-0.tar").write_bytes(whole[: 2 * member_bytes + 100])  # inside the third header
    (tmp_path / "data" / "junk-0.tar").write_bytes(b"<html>404 not found</html>" * 40)  # not a tar at all
    job = write_job(tmp_path / "job.yaml", "data/*.tar", **FAST)
    r = cli("run", job, check=False)
    assert r.returncode == 1 and "2 DAMAGED (cut-0: 2 sample(s) kept, junk-0: 0 sample(s) kept)" in r.stderr
    s = cli_app(tmp_path, "status", job)
    assert "2 damaged" in s.stdout and "damaged: cut-0: 2 sample(s) kept" in s.stdout
    allowed = write_job(tmp_path / "allowed.yaml", "data/*.tar", input={"allow_damaged": True}, **FAST)
    r = cli_app(tmp_path, "run", allowed, check=True)  # nothing left to label: still said on every run, but allowed to exit 0
    assert "2 already done" in r.stderr and "2 DAMAGED" in r.stderr
    # Re-downloaded whole: labelled again, the old file replaced.
    (tmp_path / "data" / "cut-0.tar").write_bytes(whole)
    (tmp_path / "data" / "junk-0.tar").unlink()
    r = cli("run", job)
    assert "1 shard(s) written" in r.stderr and "DAMAGED" not in r.stderr
    assert pq.read_table(tmp_path / "out" / "cut-0.parquet").column("key").to_pylist() == ["s0", "s1", "s2", "s3"]
    report = collect(load_job(job))
    assert (report["done"], report["damaged"], report["rows"]) == (1, 0, 4)


def test_an_unreadable_directory_leaves_its_shard_unfinished(tmp_path):
    fill(tmp_path / "images" / "ok", 3)
    fill(tmp_path / "images" / "locked", 3)
    (tmp_path / "images" / "locked").chmod(0)
    try:
        os.listdir(tmp_path / "images" / "locked")
    except PermissionError:
        pass
    else:  # root reads chmod 000 (and the interpreter lives where an unprivileged user cannot run it)
        (tmp_path / "images" / "locked").chmod(0o755)
        pytest.skip("this user can read a chmod 000 directory")
    job = write_job(tmp_path / "job.yaml", "unused", input={"folder": "images", "shards": None}, **FAST)
    r = cli("run", job, check=False)
    assert r.returncode == 1 and "1 FAILED (locked-00000)" in r.stderr, r.stderr
    report = json.loads(cli_app(tmp_path, "status", job, "--json").stdout)
    assert (report["done"], report["failed"]) == (1, 1) and "Permission denied" in report["failed_shards"][0]
    (tmp_path / "images" / "locked").chmod(0o755)
    r = cli_app(tmp_path, "run", job, check=True)
    assert "1 shard(s) written, 1 already done, 3 images" in r.stderr


def test_a_file_that_cannot_be_read_fails_its_shard_but_a_missing_one_is_an_error_row(tmp_path):
    from batchvlm.output.shardlist import plan
    from batchvlm.data.sources import read_shard

    fill(tmp_path, 3)
    inp = InputSpec(folder=str(tmp_path))
    (shard,) = plan(inp)
    (tmp_path / "img00001.jpg").unlink()
    (tmp_path / "img00001.jpg").mkdir()  # listed as a file, now unreadable as one (EISDIR)
    with pytest.raises(IsADirectoryError):
        list(read_shard(shard, inp))
    (tmp_path / "img00001.jpg").rmdir()  # gone since it was listed: an error row
    got = [(e.key, e.error) for e in read_shard(shard, inp)]
    assert got == [("img00000.png", None), ("img00001.jpg", "read: file not found"), ("img00002.webp", None)]


@pytest.mark.parametrize("change", [{"image_column": "img"}, {"key_column": "id"}, {"shard_size": 5},
                                    {"keep": ["url"]}])
def test_what_a_row_holds_is_in_the_fingerprint(change):
    base = {"name": "j", "input": {"parquet": "x.parquet"}, "tasks": [{"caption": {}}], "output": {"dir": "o"}}
    changed = base | {"input": base["input"] | change}
    assert Job.model_validate(base).label_fingerprint() != Job.model_validate(changed).label_fingerprint()


def test_an_old_layout_folder_is_refused_with_how_to_migrate(tmp_path):
    write_tar(tmp_path / "s-0.tar", [("a.png", tiny("PNG"))])
    job = write_job(tmp_path / "job.yaml", "s-0.tar", **FAST)
    out = tmp_path / "out"
    out.mkdir()
    (out / "_job.json").write_text("{}")
    (out / "s-0.stats.json").write_text(json.dumps({"shard": "s-0", "complete": True}))
    pq.write_table(pa.table({"x": [1]}), out / "mine.parquet")  # not ours: stays
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 2 and "older batchvlm" in r.stderr and "--overwrite" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(OutputConflict, match="older batchvlm"):  # status
        collect(load_job(job))
    with pytest.raises(OutputError, match="older batchvlm"):  # preview, export
        Output.open(out)
    cli("run", job, "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["__batchvlm__", "mine.parquet", "s-0.parquet"]
    assert pq.read_table(out / "s-0.parquet").column("key").to_pylist() == ["a"]


def test_keep_names_are_checked_before_any_work(tmp_path):
    pq.write_table(pa.table({"image": [tiny("PNG")]}), tmp_path / "t.parquet")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "t.parquet", "shards": None, "keep": ["url"]})
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 2 and "input.keep" in r.stderr and "'url'" in r.stderr


def test_a_run_reads_each_parquet_footer_once_for_the_keep_columns(tmp_path, monkeypatch):
    """input.keep's types are unified over every file's footer: by the pre-run check, and the
    writer's schema takes them from it (a run over thousands of remote files read them twice)."""
    for i, ints in enumerate([pa.int32(), pa.int64()]):  # unified: int64
        pq.write_table(pa.table({"image": [tiny("PNG")], "n": pa.array([i], ints)}), tmp_path / f"t{i}.parquet")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "t*.parquet", "shards": None, "keep": ["n"]},
                    **FAST)
    reads = []
    real = pq.read_schema
    monkeypatch.setattr(pq, "read_schema", lambda f, *a, **kw: reads.append(getattr(f, "path", f)) or real(f, *a, **kw))
    cli_app(tmp_path, "run", job, check=True)
    assert sorted(Path(r).name for r in reads) == ["t0.parquet", "t1.parquet"], reads
    assert pq.read_schema(tmp_path / "out" / "t0.parquet").field("n").type == pa.int64()


def test_keep_columns_may_not_clash_with_label_columns(tmp_path):
    from batchvlm.job import JobError, parse_job

    base = {"name": "j", "input": {"folder": "x"}, "tasks": [{"caption": {}}], "output": {"dir": "o"}}
    for keep, message in [(["caption"], "input.keep: column 'caption' is also the column of tasks.0"),
                          (["caption_truncated"], "input.keep: column 'caption_truncated' is also the truncation flag of tasks.0"),
                          (["error"], "input.keep: 'error' is a reserved output column"),
                          (["json", "json"], "input.keep: a column is named twice")]:
        with pytest.raises(JobError, match=message):
            parse_job(base | {"input": {"folder": "x", "keep": keep}}, tmp_path)

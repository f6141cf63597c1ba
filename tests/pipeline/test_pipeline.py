"""End to end through the real CLI: shards in, one Parquet per shard out, bad inputs as rows,
resume, settings changes, --limit, and other sources."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from support.cli import cli, cli_app
from support.inputs import broken_shard, good_png, write_job, write_tar

from batchvlm.output.rows import LabelRow


def test_broken_images_become_rows(tmp_path):
    expected = broken_shard(tmp_path / "mixed-000.tar")
    job = write_job(tmp_path / "job.yaml", "mixed-{000..000}.tar", loader={"workers": 2})
    r = cli("run", job)
    assert "1 shard(s) written" in r.stderr and "5 errors" in r.stderr
    rows = pq.read_table(tmp_path / "out" / "mixed-000.parquet").to_pylist()
    assert [r["key"] for r in rows] == list(expected)  # one row per sample, in shard order
    for row in rows:
        status, w, h, err = expected[row["key"]]
        assert (row["status"], row["width"], row["height"]) == (status, w, h), row
        if err:
            assert err in row["error"] and row["caption"] is None and row["detect"] is None
        else:
            assert row["error"] is None and isinstance(row["caption"], str)
        LabelRow.model_validate(row)
    stats = json.loads((tmp_path / "out" / "__batchvlm__" / "mixed-000.stats.json").read_text())
    assert stats["complete"] and (stats["rows"], stats["errors"]) == (11, 5)


def shapes_shards(tmp_path: Path, n: int, per: int) -> None:
    from batchvlm.shapes.shards import write_shards

    write_shards(tmp_path / "data", n, per, seed=7)


def keys_of(path: Path) -> list[str]:
    return pq.read_table(path, columns=["key"]).column("key").to_pylist()


def test_resume_skips_done_shards_and_labels_new_ones(tmp_path):
    shapes_shards(tmp_path, 2, 3)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    cli("run", job)
    out = tmp_path / "out"
    first = {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet")}
    assert len(first) == 2
    # A scheduled re-run after a new shard arrived labels only that shard.
    from batchvlm.shapes.shards import write_shards

    write_shards(tmp_path / "new", 1, 3, seed=99, prefix="shapes-late")
    (tmp_path / "new" / "shapes-late-000000.tar").rename(tmp_path / "data" / "shapes-late-000000.tar")
    r = cli("run", job)
    assert "1 shard(s) written, 2 already done" in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.parquet") if p.name in first} == first
    s = cli_app(tmp_path, "status", job, "--json")
    report = json.loads(s.stdout)
    assert (report["done"], report["pending"], report["rows"]) == (3, 0, 9)


def test_changed_settings_are_refused_unless_overwrite(tmp_path):
    shapes_shards(tmp_path, 1, 2)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    cli("run", job)
    changed = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", tasks=[{"caption": {"length": "short"}}])
    r = cli_app(tmp_path, "run", changed)
    assert r.returncode == 2 and "other settings" in r.stderr
    cli_app(tmp_path, "run", changed, "--overwrite", check=True)
    cols = pq.read_table(tmp_path / "out" / "shapes-000000.parquet").column_names
    assert "detect" not in cols and "caption" in cols
    cli_app(tmp_path, "run", changed, check=True)  # the new settings are now the folder's


def test_limit_leaves_partial_shards_for_the_next_run(tmp_path):
    shapes_shards(tmp_path, 2, 4)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    r = cli("run", job, "--limit", "5")
    assert "1 shard(s) written" in r.stderr and "1 partial (cut short by --limit" in r.stderr and "5 images" in r.stderr
    report = json.loads(cli_app(tmp_path, "status", job, "--json").stdout)
    assert report["done"] + report["partial"] == 2 and report["partial"] >= 1
    assert cli_app(tmp_path, "preview", tmp_path / "out", "-o", tmp_path / "look.html").stdout.endswith(": 5 rows\n")
    cli("run", job)
    report = json.loads(cli_app(tmp_path, "status", job, "--json").stdout)
    assert (report["done"], report["rows"]) == (2, 8)
    for p in (tmp_path / "out").glob("*.parquet"):
        assert len(keys_of(p)) == len(set(keys_of(p))) == 4


def test_folder_and_parquet_sources(tmp_path):
    (tmp_path / "imgs" / "b").mkdir(parents=True)
    (tmp_path / "imgs" / "top.png").write_bytes(good_png())
    (tmp_path / "imgs" / "b" / "x.png").write_bytes(good_png(120, 90))
    (tmp_path / "imgs" / "b" / "y.jpg").write_bytes(b"broken")
    job = write_job(tmp_path / "f.yaml", "unused", input={"folder": "imgs", "shards": None}, output={"dir": "out-f"})
    cli("run", job)
    assert keys_of(tmp_path / "out-f" / "root-00000.parquet") == ["top.png"]
    rows = pq.read_table(tmp_path / "out-f" / "b-00000.parquet").to_pylist()
    assert [(r["key"], r["status"], r["width"]) for r in rows] == [("x.png", "ok", 120), ("y.jpg", "error", None)]

    pq.write_table(pa.table({"id": ["p1", "p2", "p3"], "image": [good_png(), None, b"junk"]}),
                   tmp_path / "bytes.parquet")
    pq.write_table(pa.table({"img": ["imgs/top.png", "imgs/missing.png"]}), tmp_path / "paths.parquet")
    job = write_job(tmp_path / "p.yaml", "unused", input={"parquet": "bytes.parquet", "shards": None,
                                                          "key_column": "id"}, output={"dir": "out-p"})
    cli_app(tmp_path, "run", job, check=True)
    rows = pq.read_table(tmp_path / "out-p" / "bytes.parquet").to_pylist()
    assert [(r["key"], r["status"]) for r in rows] == [("p1", "ok"), ("p2", "error"), ("p3", "error")]
    job = write_job(tmp_path / "q.yaml", "unused", input={"parquet": "paths.parquet", "shards": None,
                                                          "image_column": "img"}, output={"dir": "out-q"})
    cli_app(tmp_path, "run", job, check=True)
    rows = pq.read_table(tmp_path / "out-q" / "paths.parquet").to_pylist()
    assert [(r["key"], r["status"], r["width"]) for r in rows] == [("0", "ok", 200), ("1", "error", None)]


def test_missing_inputs_and_workers_cover_every_sample_once(tmp_path):
    job = write_job(tmp_path / "job.yaml", "data/none-{0..3}.tar")
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 2 and "not found" in r.stderr
    shapes_shards(tmp_path, 5, 3)
    job = write_job(tmp_path / "job.yaml", "data/shapes-{000000..000004}.tar", loader={"workers": 3, "prefetch": 2})
    cli("run", job)
    for i in range(5):
        assert keys_of(tmp_path / "out" / f"shapes-{i:06d}.parquet") == [f"{i:06d}_{k:04d}" for k in range(3)]


def test_damaged_tar_keeps_what_was_readable(tmp_path):
    members = [(f"s{i}.png", good_png()) for i in range(4)]
    path = write_tar(tmp_path / "broken-0.tar", members)
    member_bytes = 512 + -(-len(members[0][1]) // 512) * 512
    path.write_bytes(path.read_bytes()[: 2 * member_bytes + 700])  # cut inside the third image
    job = write_job(tmp_path / "job.yaml", "broken-0.tar")
    r = cli("run", job, check=False)
    assert r.returncode == 1 and "1 DAMAGED (broken-0: 2 sample(s) kept)" in r.stderr
    stats = json.loads((tmp_path / "out" / "__batchvlm__" / "broken-0.stats.json").read_text())
    assert stats["complete"] and stats["damaged"] and stats["rows"] == 2  # the two whole images


def test_unreadable_shard_is_reported_failed_and_retried(tmp_path):
    shapes_shards(tmp_path, 1, 2)
    gone = f"file://{tmp_path}/vanished.tar"  # a URL: listed, then unreadable
    job = write_job(tmp_path / "job.yaml", "unused", input={"shards": [str(tmp_path / "data/shapes-000000.tar"), gone]})
    r = cli("run", job, check=False)
    assert r.returncode == 1 and "1 FAILED (vanished)" in r.stderr
    report = json.loads(cli_app(tmp_path, "status", tmp_path / "out", "--json").stdout)
    assert (report["done"], report["failed"]) == (1, 1) and "vanished" in report["failed_shards"][0]
    from batchvlm.shapes.shards import write_shards

    write_shards(tmp_path / "late", 1, 2, seed=3, prefix="vanished")
    (tmp_path / "late" / "vanished-000000.tar").rename(tmp_path / "vanished.tar")
    cli_app(tmp_path, "run", job, check=True)
    report = json.loads(cli_app(tmp_path, "status", job, "--json").stdout)
    assert (report["done"], report["failed"], report["rows"]) == (2, 0, 4)


def test_a_shard_that_breaks_the_reader_fails_alone(tmp_path):
    """Not an I/O error (a corrupt Parquet file): that shard fails, the others are labelled,
    and the run ends (loader workers ignore SIGTERM; a failure must not hang the exit)."""
    im = good_png()
    pq.write_table(pa.table({"image": [im, im]}), tmp_path / "good.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"not a parquet file")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "*.parquet", "shards": None}, output={"dir": "labels"},
                    loader={"workers": 2})
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(job)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "1 FAILED (bad)" in r.stderr and "ArrowInvalid" in r.stderr
    assert keys_of(tmp_path / "labels" / "good.parquet") == ["0", "1"]
    # A model folder without weights: one line, after the workers started.
    import shutil

    from batchvlm.models.registry import DEMO_DIR

    shutil.copytree(DEMO_DIR, tmp_path / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    for i in range(2):  # enough samples that the workers are still busy (blocked on a full queue)
        pq.write_table(pa.table({"image": [im] * 64}), tmp_path / f"many-{i}.parquet")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "many-*.parquet", "shards": None},
                    output={"dir": "labels2"}, loader={"workers": 2, "prefetch": 1},
                    model={"name": str(tmp_path / "model")})
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(job)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("batchvlm: error:")
    # An unexpected error (a fault injected into model loading) while the workers are busy: the
    # traceback keeps the loader alive into interpreter exit, which must not wait on the workers.
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "many-*.parquet", "shards": None},
                    output={"dir": "labels3"}, loader={"workers": 2, "prefetch": 1})
    script = ("import sys\nfrom batchvlm.job import load_job\nfrom batchvlm.models.moondream.host import Moondream\n"
              "from batchvlm.run import run_job\n"
              "def broken(*args): raise RuntimeError('injected fault')\n"
              "Moondream.load = broken\nrun_job(load_job(sys.argv[1]), progress=False)\n")
    r = subprocess.run([sys.executable, "-c", script, str(job)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "RuntimeError: injected fault" in r.stderr


def test_overwrite_spares_foreign_files_and_inputs_are_never_outputs(tmp_path):
    im = good_png()
    pq.write_table(pa.table({"image": [im]}), tmp_path / "t.parquet")
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "t.parquet", "shards": None}, output={"dir": "."})
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 2 and "output.dir" in r.stderr and "holds the input" in r.stderr
    assert pq.read_table(tmp_path / "t.parquet").column_names == ["image"]
    job = write_job(tmp_path / "job.yaml", "unused", input={"parquet": "t.parquet", "shards": None}, output={"dir": "out"})
    (tmp_path / "out").mkdir()
    pq.write_table(pa.table({"x": [1]}), tmp_path / "out" / "precious.parquet")
    cli("run", job)
    cli_app(tmp_path, "run", job, "--overwrite", check=True)
    assert (tmp_path / "out" / "precious.parquet").exists() and keys_of(tmp_path / "out" / "t.parquet") == ["0"]


def test_a_prompt_longer_than_the_context_is_one_line(tmp_path):
    shapes_shards(tmp_path, 1, 1)
    job = write_job(tmp_path / "job.yaml", "data/*.tar", tasks=[{"query": {"question": "what is this " * 200}}])
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "batchvlm: error: tasks.0: a ") and "context" in r.stderr


def test_a_sample_keeps_no_pixels_once_encoded():
    """A sample keeps what its row needs (and the size the model saw, for columns) when the engine
    drops its prepared image after encoding: nothing else keeps the pixels alive."""
    import gc
    import weakref

    import torch

    from batchvlm.data.loader import Sample
    from batchvlm.models.qwen_vl.preprocess import PreparedImage

    prepared = PreparedImage(torch.zeros(28, 56, 3, dtype=torch.uint8), (1, 2), 3)
    pixels = weakref.ref(prepared.pixels)
    sample = Sample(0, 5, "k", prepared, 640, 480, meta={"id": 1})
    del prepared
    sample.prepared = None  # what the engine does once the image is encoded (tests/engine checks it does)
    gc.collect()
    assert pixels() is None
    assert (sample.shard, sample.index, sample.key, sample.width, sample.height, sample.error, sample.meta,
            sample.seen) == (0, 5, "k", 640, 480, None, {"id": 1}, (56, 28))

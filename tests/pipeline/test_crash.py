"""kill -9 at set points of a run (read from the output folder, never a timer), then re-run: every sample
exactly once, nothing finished redone."""

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
from support.inputs import write_job

from batchvlm.shapes.shards import write_shards


def _complete(out) -> int:
    n = 0
    for stats in (out / "__batchvlm__").glob("*.stats.json"):
        try:
            n += json.loads(stats.read_text())["complete"]
        except ValueError:
            pass
    return n


def _finished(out) -> dict[str, int]:
    """stem -> mtime of the shards done: a complete marker naming the Parquet file beside it."""
    done = {}
    for stats in (out / "__batchvlm__").glob("*.stats.json"):
        d = json.loads(stats.read_text())
        parquet = out / f"{d['shard']}.parquet"
        # the marker is written before the rename: a kill between them leaves it naming no file
        if d["complete"] and parquet.exists() and parquet.stat().st_size == d["output"]["size"]:
            done[d["shard"]] = parquet.stat().st_mtime_ns
    return done


# Where each run is killed, by what the folder shows (polled every few ms), never by a timer: one
# shard more done (the next is being labelled), a Parquet file being written, a done marker
# written (its rename may not be), one shard more done. Each comes while shards are left, however
# slow the machine, so every run is killed mid-run.
KILL_POINTS = [
    lambda out, before: len(_finished(out)) > before["finished"],
    lambda out, before: (any((out / "__batchvlm__").glob("*.parquet.tmp-*"))
                         or len(_finished(out)) > before["finished"] + 1),
    lambda out, before: _complete(out) > before["complete"],
    lambda out, before: len(_finished(out)) > before["finished"],
]


def test_kill_9_then_rerun(tmp_path):
    n_shards, per_shard = 16, 6
    write_shards(tmp_path / "data", n_shards, per_shard, seed=11)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", loader={"workers": 2, "prefetch": 2},
                    engine={"max_batch_size": 8})  # small batches: shards finish one by one
    out = tmp_path / "out"
    finished: dict[str, int] = {}
    cmd = [sys.executable, "-m", "batchvlm.cli", "run", str(job)]
    for attempt, kill_point in enumerate(KILL_POINTS):
        log = tmp_path / f"run-{attempt}.log"
        before = {"finished": len(finished), "complete": _complete(out) if out.exists() else 0}
        with log.open("w") as f:
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True)
        deadline = time.time() + 600  # a failure, not a kill point: the run is stuck
        while p.poll() is None and not (out.exists() and kill_point(out, before)):
            assert time.time() < deadline, log.read_text()
            time.sleep(0.002)
        assert p.poll() is None, f"run {attempt} ended before its kill point\n{log.read_text()}"
        os.killpg(p.pid, signal.SIGKILL)  # the run and its loader workers
        p.wait()
        for stem, mtime in finished.items():  # what was done stays untouched
            assert (out / f"{stem}.parquet").stat().st_mtime_ns == mtime
        for stem, mtime in _finished(out).items():
            finished.setdefault(stem, mtime)
    assert 0 < len(finished) < n_shards
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for stem, mtime in finished.items():
        assert (out / f"{stem}.parquet").stat().st_mtime_ns == mtime
    assert not list(out.glob("*.tmp-*")) and not list((out / "__batchvlm__").glob("*.tmp-*"))
    for s in range(n_shards):
        keys = pq.read_table(out / f"shapes-{s:06d}.parquet", columns=["key"]).column("key").to_pylist()
        assert keys == [f"{s:06d}_{i:04d}" for i in range(per_shard)]
        assert json.loads((out / "__batchvlm__" / f"shapes-{s:06d}.stats.json").read_text())["complete"]


def test_sweep_spares_other_live_writers(tmp_path):
    import socket

    from batchvlm.output.layout import Layout
    from batchvlm.output.manifest import sweep_temporaries

    host = socket.gethostname()
    dead = subprocess.Popen(["true"])
    dead.wait()
    layout = Layout(tmp_path)
    layout.meta.mkdir()
    live_here = layout.meta / f"a.parquet.tmp-{host}-{os.getpid()}"
    dead_here = layout.meta / f"b.parquet.tmp-{host}-{dead.pid}"
    other_host = layout.meta / "c.parquet.tmp-node17-123"  # maybe writing right now on another node
    stale = layout.meta / "d.parquet.tmp-node17-456"
    for p in (live_here, dead_here, other_host, stale):
        p.write_text("partial")
    os.utime(stale, (time.time() - 7200,) * 2)
    assert sorted(sweep_temporaries(layout)) == sorted([dead_here.name, stale.name])
    assert live_here.exists() and other_host.exists()


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def test_kill_9_of_the_run_alone_frees_its_lock_and_ends_its_loader_workers(tmp_path):
    """Only the main process is killed (an OOM killer, a node agent): its loader workers die with
    it and the lock goes with it, so a rerun at once is not refused naming a dead pid."""
    write_shards(tmp_path / "data", 12, 6, seed=13)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", loader={"workers": 2, "prefetch": 2},
                    engine={"max_batch_size": 8})
    cmd = [sys.executable, "-m", "batchvlm.cli", "run", str(job)]
    p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None and _complete(tmp_path / "out") < 1:
        time.sleep(0.02)  # labelling: the workers are up and decoding the next shards
    workers = _children(p.pid)
    assert p.poll() is None and workers, "the run ended before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "another batchvlm run" not in r.stderr
    for w in workers:  # gone (a zombie of the dead parent is reaped by init)
        assert not os.path.exists(f"/proc/{w}") or "Z" in open(f"/proc/{w}/stat").read().split()[2]

"""Scale-out on CPU: Slurm arrays, local worker processes, work stealing, SIGTERM mid-shard."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.cli import cli_app
from support.inputs import write_job
from support.paths import REPO

from batchvlm.dist import Rank, my_shards, resolve_rank
from batchvlm.shapes.shards import write_shards

N_SHARDS, PER_SHARD = 7, 3


def test_rank_resolution():
    assert resolve_rank({}) == Rank(0, 1, 0)
    assert resolve_rank({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "3"}) == Rank(2, 3, 0)
    assert resolve_rank({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "4"}) \
        == Rank(1, 3, 0)
    assert resolve_rank({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == Rank(3, 8, 3, launched=True)
    srun = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    assert resolve_rank(srun) == Rank(5, 8, 1, launched=True)
    # array task 1 of 2, spawning 4 local GPU workers itself: worker 2 is global rank 6 of 8
    env = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_NTASKS": "1", "SLURM_PROCID": "0",
           "BATCHVLM_LOCAL_RANK": "2", "BATCHVLM_LOCAL_WORLD": "4"}
    assert resolve_rank(env) == Rank(6, 8, 2, launched=True)
    # a local worker of a plain `batchvlm run` (launch.py)
    assert resolve_rank({"BATCHVLM_LOCAL_RANK": "1", "BATCHVLM_LOCAL_WORLD": "2"}) == Rank(1, 2, 1, launched=True)
    with pytest.raises(ValueError):
        resolve_rank({"RANK": "4", "WORLD_SIZE": "2"})
    # Kubernetes Indexed Job: a pod is an array task (it starts its node's workers)
    assert resolve_rank({"JOB_COMPLETION_INDEX": "2", "BATCHVLM_WORLD": "3"}) == Rank(2, 3, 0)
    pod = {"JOB_COMPLETION_INDEX": "1", "BATCHVLM_WORLD": "2", "BATCHVLM_LOCAL_RANK": "3", "BATCHVLM_LOCAL_WORLD": "4"}
    assert resolve_rank(pod) == Rank(7, 8, 3, launched=True)
    for bad, says in [({"JOB_COMPLETION_INDEX": "0"}, "only JOB_COMPLETION_INDEX"),
                      ({"JOB_COMPLETION_INDEX": "3", "BATCHVLM_WORLD": "3"}, "spec.completions"),
                      ({"JOB_COMPLETION_INDEX": "0", "BATCHVLM_WORLD": "x"}, "BATCHVLM_WORLD='x'"),
                      ({"JOB_COMPLETION_INDEX": "0", "BATCHVLM_WORLD": "2", "SLURM_ARRAY_TASK_ID": "0"}, "one launcher")]:
        with pytest.raises(ValueError, match=says):
            resolve_rank(bad)


def test_partition_is_disjoint_and_complete():
    shards = [object() for _ in range(10)]
    parts = [my_shards(shards, Rank(r, 3, 0)) for r in range(3)]
    assert sorted(id(s) for p in parts for s in p) == sorted(id(s) for s in shards)


def cli(job, env=None, check=True, **kw):
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(job)], capture_output=True, text=True,
                       env=os.environ | (env or {}), **kw)
    if check and r.returncode != 0:
        raise AssertionError(r.stderr)
    return r


def tables(out: Path) -> dict[str, list[dict]]:
    return {p.stem: pq.read_table(p).to_pylist() for p in sorted(out.glob("*.parquet"))}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("scale")
    write_shards(root / "data", N_SHARDS, PER_SHARD, seed=5)
    job = write_job(root / "single.yaml", "data/shapes-*.tar", out="out-single")
    cli_app(root, "run", job, check=True)  # the reference labels: in this process
    return root, tables(root / "out-single")


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for stem in want:
        strip = lambda rows: [{k: v for k, v in r.items() if k != "source"} for r in rows]  # noqa: E731
        assert strip(got[stem]) == strip(want[stem]), stem


def test_array_tasks_sequential_and_concurrent_equal_single_run(data):
    root, single = data
    # Each array task starts its node's workers (one per GPU; here per_node CPU workers): the
    # launcher's local workers, one aggregated progress bar over them, are checked here too.
    job = write_job(root / "arr.yaml", "data/shapes-*.tar", out="out-array-seq", runtime={"workers_per_node": 2})
    for task in range(2):  # ranks 0-3 of 4 over 7 shards (three concurrent tasks follow)
        r = cli(job, {"SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_TASK_COUNT": "2"})
        assert "x2" in r.stderr
    assert json.loads((root / "out-array-seq" / "__batchvlm__" / "job.json").read_text())["world_size"] == 4
    _same(tables(root / "out-array-seq"), single)

    job = write_job(root / "arr2.yaml", "data/shapes-*.tar", out="out-array-par")
    procs = [subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stderr=subprocess.PIPE,
                              env=os.environ | {"SLURM_ARRAY_TASK_ID": str(t), "SLURM_ARRAY_TASK_COUNT": "3"})
             for t in range(3)]
    assert [p.wait() for p in procs] == [0, 0, 0]
    _same(tables(root / "out-array-par"), single)


def test_work_stealing_ranks_take_each_shard_once(data):
    root, single = data
    job = write_job(root / "steal.yaml", "data/shapes-*.tar", out="out-steal", runtime={"work_stealing": True})
    procs = [subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stderr=subprocess.PIPE,
                              env=os.environ | {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
             for r in range(2)]
    assert [p.wait() for p in procs] == [0, 0]
    _same(tables(root / "out-steal"), single)
    assert not list((root / "out-steal" / "__batchvlm__").glob("*.claim"))


def test_sigterm_mid_shard_then_rerun(tmp_path):
    write_shards(tmp_path / "data", 12, 6, seed=9)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", loader={"workers": 2, "prefetch": 2},
                    engine={"max_batch_size": 16})
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "__batchvlm__").glob("*.stats.json"))) < 2:
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stderr = p.communicate(timeout=120)[1]
    assert p.returncode == 75, stderr  # "stopped: run again", for Slurm requeue
    assert "stopped by signal" in stderr
    done_first = {s.name for s in (out / "__batchvlm__").glob("*.stats.json")}
    assert 2 <= len(done_first) < 12
    for stats in (out / "__batchvlm__").glob("*.stats.json"):
        assert json.loads(stats.read_text())["complete"]
    assert not list(out.glob("*.tmp-*")) and not list((out / "__batchvlm__").glob("*.tmp-*"))
    cli(job)
    for s in range(12):
        keys = pq.read_table(out / f"shapes-{s:06d}.parquet", columns=["key"]).column("key").to_pylist()
        assert keys == [f"{s:06d}_{i:04d}" for i in range(6)]


def test_sbatch_template_is_valid_bash():
    scripts = sorted((REPO / "scripts" / "slurm").glob("*.sbatch"))
    assert [s.name for s in scripts] == ["batchvlm-array.sbatch"]  # the template the README names: found, and alone
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)


def test_only_one_rank_takes_over_a_dead_holders_claim(tmp_path):
    from batchvlm.output.claims import Claims

    a, b = Claims(tmp_path, lease_s=60), Claims(tmp_path, lease_s=60)
    assert a.take("s0") and not b.take("s0")  # live lease
    old = time.time() - 120
    os.utime(a.path("s0"), (old, old))  # its holder died
    seen_by_b = a.path("s0").stat().st_mtime_ns  # b saw it stale too, at the same moment
    assert a.take("s0")
    assert not b._take_over("s0", seen_by_b)  # b lost the race for this stale generation
    assert not b.take("s0")  # and the lease is live again
    # A taker that died between its token and the claim: its token expires with the lease.
    older = old - 10
    os.utime(a.path("s0"), (older, older))
    token = tmp_path / f"s0.claim.takeover-{a.path('s0').stat().st_mtime_ns}"
    token.touch()
    os.utime(token, (older, older))
    assert b.take("s0")
    a.release("s0")
    assert not list(tmp_path.iterdir())
    # A holder on this host that was killed: its claim is free at once, lease or not.
    import socket

    dead = subprocess.Popen(["true"])
    dead.wait()
    a.path("s1").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    assert b.take("s1")
    a.path("s2").write_text(json.dumps({"host": "node17", "pid": dead.pid}))  # elsewhere: wait for the lease
    assert not b.take("s2")
    # Same host name, another machine (containers given one fixed host name): its boot id differs
    a.path("s3").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "boot": "another-kernel"}))
    assert not b.take("s3")


def test_a_launcher_frees_the_claims_of_its_ended_ranks_only(tmp_path, monkeypatch):
    from batchvlm.output.claims import LAUNCH_ENV, Claims, release_launch

    for stem, launch in [("a", "L1"), ("b", "L2"), ("c", None)]:
        if launch:
            monkeypatch.setenv(LAUNCH_ENV, launch)
        else:
            monkeypatch.delenv(LAUNCH_ENV)
        assert Claims(tmp_path).take(stem)  # a live holder (this process): no lease has run out
    assert release_launch(tmp_path, "L1") == ["a"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.claim", "c.claim"]


def test_work_stealing_exits_0_only_once_every_shard_is_done(tmp_path):
    """A rank whose pass is over waits for the shards other ranks hold; one whose holder dies
    (here a process on this host, killed) it takes and labels: its exit 0 means the job is done."""
    import socket

    write_shards(tmp_path / "data", 4, 2, seed=14)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", runtime={"work_stealing": True})
    meta = tmp_path / "out" / "__batchvlm__"
    meta.mkdir(parents=True)
    holder = subprocess.Popen(["sleep", "600"])  # a live rank that holds shapes-000003
    (meta / "shapes-000003.claim").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid}))
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], cwd=tmp_path,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and p.poll() is None and len(list(meta.glob("*.stats.json"))) < 3:
            time.sleep(0.05)
    finally:
        holder.kill()  # the holder dies (and is reaped: its pid is free, not a zombie)
        holder.wait()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    for s in range(4):
        assert pq.read_table(tmp_path / "out" / f"shapes-{s:06d}.parquet").num_rows == 2, err
    assert not list(meta.glob("*.claim*"))

"""Ray: `batchvlm run --ray` on a local cluster this module starts (CPU actors, demo model), with
an actor killed mid-run, and the Ray Data `Labeler` against `batchvlm run`'s labels."""

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.inputs import write_job
from support.s3server import bucket, s3, store_env, written  # noqa: F401 - the fixtures

from batchvlm.shapes.shards import write_shards

ray = pytest.importorskip("ray")

N_SHARDS, PER = 20, 2
ACTORS = 2


@pytest.fixture(scope="module")
def cluster(s3):
    """One local cluster for the module (start-up is slow); its workers inherit this environment
    (PYTHONPATH, HF_HUB_OFFLINE, and the test store's: AWS_ENDPOINT_URL and a key, for as long as
    the cluster lives)."""
    with pytest.MonkeyPatch.context() as env:
        for k, v in store_env(s3[1]).items():
            env.setenv(k, v)
        ray.init(address="local", num_cpus=ACTORS, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            yield ray.get_runtime_context().gcs_address
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def labelled(cluster, tmp_path_factory):
    """`--ray` over 20 shards, one actor killed with -9 mid-run, and a shard claimed by a rank of
    this launch that died on another host (its lease still runs): (root, job file, exit code,
    stderr, actor pids seen, the killed pid, shards done when it was killed)."""
    root = tmp_path_factory.mktemp("ray")
    write_shards(root / "data", N_SHARDS, PER, seed=21)
    job = write_job(root / "job.yaml", "data/shapes-*.tar", engine={"max_new_tokens": 6, "max_batch_size": 2},
                    tasks=[{"caption": {}}, {"detect": {"objects": ["circle"]}}])
    meta = root / "out" / "__batchvlm__"
    meta.mkdir(parents=True)
    (meta / f"shapes-{N_SHARDS - 1:06d}.claim").write_text(json.dumps({"host": "node17", "pid": 1, "launch": "L-0"}))
    p = subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job), "--ray", cluster],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=os.environ | {"BATCHVLM_LAUNCH": "L"})
    seen: set[int] = set()
    killed, done_at_kill = None, None
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline:
        seen |= _actor_pids()
        done = len(list(meta.glob("*.stats.json"))) if meta.is_dir() else 0
        if killed is None and done >= 2 and seen:
            killed, done_at_kill = max(seen), done
            os.kill(killed, signal.SIGKILL)  # the rank's process, mid-run
        time.sleep(0.05)
    out, err = p.communicate(timeout=60)
    return root, job, p.returncode, err, seen, killed, done_at_kill


def _actor_pids() -> set[int]:
    """Processes of RankWorker actors on this machine (Ray names them by their class)."""
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "cmdline").read_bytes().startswith(b"ray::RankWorker"):
                    pids.add(int(d.name))
            except OSError:
                pass
    return pids


def test_ray_ranks_label_every_shard_once_though_an_actor_was_killed(labelled):
    root, job, code, err, seen, killed, done_at_kill = labelled
    assert code == 0, err
    assert killed is not None and done_at_kill < N_SHARDS  # killed mid-run
    assert len(seen) > ACTORS  # Ray restarted the killed actor (a new RankWorker process)
    assert f"ray: {ACTORS} rank(s)" in err and f"{N_SHARDS} shard(s) written" in err
    assert "1 shard(s) were held by ranks that died on another node; one more round" in err
    out = root / "out"
    for s in range(N_SHARDS):
        keys = pq.read_table(out / f"shapes-{s:06d}.parquet", columns=["key"]).column("key").to_pylist()
        assert keys == [f"{s:06d}_{i:04d}" for i in range(PER)]
        assert json.loads((out / "__batchvlm__" / f"shapes-{s:06d}.stats.json").read_text())["complete"]
    assert not list((out / "__batchvlm__").glob("*.claim*"))


def test_labeler_in_map_batches_gives_the_labels_of_batchvlm_run(labelled, tmp_path):
    from batchvlm.integrations.ray_data import Labeler

    root, job, code, *_ = labelled
    assert code == 0
    rows, want = [], {}
    for s in range(3):
        with tarfile.open(root / "data" / f"shapes-{s:06d}.tar") as tar:
            for m in tar.getmembers():
                if not m.name.endswith(".json"):
                    image = {"bytes": tar.extractfile(m).read(), "path": None}  # the datasets library's struct
                    rows.append({"name": m.name.split(".")[0], "image": image})
        for r in pq.read_table(root / "out" / f"shapes-{s:06d}.parquet").to_pylist():
            want[r["key"]] = {k: v for k, v in r.items() if k not in ("key", "source")}
    on_disk = tmp_path / "one.png"
    on_disk.write_bytes(rows[0]["image"]["bytes"])
    rows.append({"name": "by-path", "image": {"bytes": None, "path": str(on_disk)}})  # a path instead of bytes
    want["by-path"] = want[rows[0]["name"]]
    rows.append({"name": "broken", "image": {"bytes": b"not an image", "path": None}})
    ds = ray.data.from_items(rows).map_batches(Labeler, fn_constructor_kwargs={"job": str(job)}, batch_size=4,
                                               concurrency=1)
    got = {r.pop("name"): r for r in ds.take_all()}
    broken = got.pop("broken")
    assert broken["status"] == "error" and broken["error"] == "decode: not an image" and broken["caption"] is None
    assert sorted(got) == sorted(want)
    for name, r in got.items():
        r.pop("image")
        assert r == want[name], name


def test_ray_ranks_write_every_shard_once_into_a_store(cluster, bucket, tmp_path):
    """`--ray` with output.dir in an object store (moto): the actors claim and commit through it."""
    name, client = bucket
    write_shards(tmp_path / "data", 4, 1, seed=23)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels",
                    tasks=[{"caption": {}}], engine={"max_new_tokens": 4})
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(job), "--ray", cluster],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"ray: {ACTORS} rank(s)" in r.stderr and "4 shard(s) written" in r.stderr, r.stderr
    stems = [f"shapes-{s:06d}" for s in range(4)]
    assert written(client, name, "labels") == {
        "top": [f"{s}.parquet" for s in stems], "markers": [f"__batchvlm__/{s}.stats.json" for s in stems],
        "claims": [], "images": [f"{s:06d}_0000" for s in range(4)]}

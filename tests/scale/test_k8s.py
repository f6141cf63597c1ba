"""Kubernetes Indexed Jobs: JOB_COMPLETION_INDEX ranks (real processes), kill -9 and SIGTERM, the
exit codes podFailurePolicy acts on, and the shipped manifest against the API's own schema."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from support.inputs import write_job
from support.paths import REPO

from batchvlm.exits import EXIT_JOB_ERROR, EXIT_STOPPED
from batchvlm.job import parse_job
from batchvlm.shapes.shards import write_shards

MANIFEST = REPO / "scripts" / "k8s" / "batchvlm-indexed-job.yaml"
CMD = [sys.executable, "-m", "batchvlm.cli", "run"]


def _done(out: Path) -> set[str]:
    """Shards that are done: a marker and its renamed file (the marker is written first, so a kill
    between the two leaves a marker naming a file that is not there: not done, output/writer.py)."""
    stems = (p.name.removesuffix(".stats.json") for p in (out / "__batchvlm__").glob("*.stats.json"))
    return {s for s in stems if (out / f"{s}.parquet").exists()}


def _pod(job: Path, index: int, world: int) -> subprocess.Popen:
    env = os.environ | {"JOB_COMPLETION_INDEX": str(index), "BATCHVLM_WORLD": str(world),
                        "OMP_NUM_THREADS": "1"}  # two pods share the test machine's cores
    return subprocess.Popen(CMD + [str(job)], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)


def test_indexed_pods_killed_and_drained_then_recreated_label_every_image_once(tmp_path):
    world, n_shards, per = 2, 12, 2  # index i owns shards i, i+2, ..., i+10
    write_shards(tmp_path / "data", n_shards, per, seed=3)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", engine={"max_new_tokens": 6, "max_batch_size": 2},
                    tasks=[{"caption": {}}])
    out = tmp_path / "out"
    pods = [_pod(job, i, world) for i in range(world)]
    mine = lambda i: {f"shapes-{s:06d}" for s in range(i, n_shards, world)}  # noqa: E731
    # Each pod is stopped right after its own first shard: pod 0 by kill -9 (its node died), pod 1
    # by SIGTERM (drained: finish what is in flight, keep finished shards).
    deadline, killed, t_term = time.time() + 240, False, None
    while time.time() < deadline and not (killed and t_term):
        done = _done(out)
        if not killed and mine(0) & done:
            os.killpg(pods[0].pid, signal.SIGKILL)
            killed = True
        if not t_term and mine(1) & done:
            pods[1].send_signal(signal.SIGTERM)
            t_term = time.time()
        time.sleep(0.02)
    assert pods[1].wait(timeout=120) == EXIT_STOPPED, pods[1].stderr.read()
    drain_s = time.time() - t_term
    assert "stopped by signal" in pods[1].stderr.read()
    assert pods[0].wait() == -signal.SIGKILL
    left = {i: mine(i) - _done(out) for i in range(world)}
    # Work was left. (A drained pod may finish all its shards: their rows can be labelled before
    # the first one is written, and a drain writes them.)
    assert left[0] or left[1], left
    kept = {s: (out / f"{s}.parquet").stat().st_mtime_ns for s in _done(out)}
    # The Job recreates the pods with the same indices: they take the same shards, skip the done ones.
    again = [_pod(job, i, world) for i in range(world)]
    for i, p in enumerate(again):
        stderr = p.communicate(timeout=240)[1]
        assert p.returncode == 0, stderr
        assert f"{len(mine(i)) - len(left[i])} already done" in stderr
    for s, mtime in kept.items():
        assert (out / f"{s}.parquet").stat().st_mtime_ns == mtime  # finished shards never redone
    for s in range(n_shards):
        keys = pq.read_table(out / f"shapes-{s:06d}.parquet", columns=["key"]).column("key").to_pylist()
        assert keys == [f"{s:06d}_{i:04d}" for i in range(per)]
        assert json.loads((out / "__batchvlm__" / f"shapes-{s:06d}.stats.json").read_text())["complete"]
    assert drain_s < 60  # well inside the manifest's terminationGracePeriodSeconds


def test_a_bad_job_file_exits_with_the_do_not_retry_code(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("name: x\ninput: {shards: 'a.tar'}\ntasks: [{caption: {lenght: short}}]\noutput: {dir: out}\n")
    r = subprocess.run(CMD + [str(bad)], capture_output=True, text=True,
                       env=os.environ | {"JOB_COMPLETION_INDEX": "0", "BATCHVLM_WORLD": "2"})
    assert r.returncode == EXIT_JOB_ERROR, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("batchvlm: error: ") and "lenght" in r.stderr


def test_a_model_missing_from_an_offline_cache_is_final_not_a_hub_hiccup():
    from batchvlm.models.base.errors import ModelFetchError, ModelLoadError
    from batchvlm.models.base.hub import resolve_dir

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest
    with pytest.raises(ModelLoadError, match="cannot fetch") as e:
        resolve_dir("nobody-here/no-such-model", None)
    assert not isinstance(e.value, ModelFetchError)  # exit 2 (FailIndex), not 1 (retry)


def test_the_indexed_job_manifest_is_valid_and_matches_the_exit_codes(tmp_path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    for doc in docs:  # the API's own OpenAPI schemas, shipped in the wheel: offline, strict (no unknown fields)
        kubernetes_validate.validate(doc, "1.33.0", strict=True)
    broken = json.loads(json.dumps(docs[1]))
    broken["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, "1.33.0", strict=True)

    config, job = docs
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert spec["completionMode"] == "Indexed" and int(env["BATCHVLM_WORLD"]) == spec["completions"]
    assert pod["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] >= 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    rules = {(r["action"], tuple(r["onExitCodes"]["values"])) for r in spec["podFailurePolicy"]["rules"]
             if "onExitCodes" in r}
    assert rules == {("FailIndex", (EXIT_JOB_ERROR,)), ("Ignore", (EXIT_STOPPED,))}
    assert all(r["onExitCodes"]["containerName"] == container["name"]
               for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r)
    # the job file it mounts is a valid batchvlm job, at the path the command names
    mount = next(m for m in container["volumeMounts"] if m["name"] == "job")
    (name, text), = config["data"].items()
    assert container["command"][-1] == f"{mount['mountPath']}/{name}"
    parse_job(yaml.safe_load(text), tmp_path, name)

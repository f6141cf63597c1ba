"""scripts/gpu_check.sh, the script a lent GPU runs, on CPU: the plan's two calls (the first returns
the headline bench before anything else), a step the call's time cannot cover is skipped and
recorded and fails the call, a named step runs alone, bench_engine's JSON survives a runner that
crashes (the dry run of every step: test_gpu_check_dry_run.py)."""

import json
import re
import subprocess
import sys
import tarfile

from support.gpu_check import RUNNERS, SCRIPT, gpu_check, planned
from support.paths import REPO

FIRST_CALL = ["environment", "bench_engine", "flex_smoke_cut", "gpu_tests_new"]


def test_the_first_call_returns_the_headline_bench_first_and_fits_its_380_s(tmp_path):
    run, _ = gpu_check(tmp_path, "--plan")
    assert run.returncode == 0, run.stderr
    calls = planned(run.stdout)
    assert sorted(calls) == [1, 2]
    assert [s for s, _ in calls[1]] == FIRST_CALL  # the environment, then the numbers, then correctness
    assert 15 + sum(b for _, b in calls[1]) <= 380
    assert "a cold start" in run.stdout  # call 2 has its own set-up
    body = SCRIPT.read_text()
    for name, _ in calls[1] + calls[2]:
        assert re.search(rf"^{name}\(\) {{", body, flags=re.M), name
    assert len({s for s, _ in calls[1] + calls[2]}) == len(calls[1]) + len(calls[2])  # no step twice
    assert "no step" in gpu_check(tmp_path, "nope")[0].stderr


def test_a_step_the_call_cannot_cover_is_skipped_and_fails_the_call(tmp_path):
    run, summary = gpu_check(tmp_path, "--dry-run", "environment", "gpu_tests", CALL_BUDGET_S="60")
    # 240 s on a CPU (4x): the environment step (40 s) fits, gpu_tests (at least 480 s) does not
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^environment: ok in \d+s/", summary, flags=re.M), summary
    assert re.search(r"^gpu_tests: skipped: needs 480 s", summary, flags=re.M), summary
    assert "FAILED: gpu_tests (skipped)" in summary and "flex_smoke" not in summary


def test_named_steps_run_alone_and_pass(tmp_path):
    """And what comes back from a device call is a few files (the tool brings back 8 at most): the
    summary and every step's log in one archive (and bench.json, when bench_engine ran)."""
    run, summary = gpu_check(tmp_path, "--dry-run", "environment")
    assert run.returncode == 0, run.stdout + run.stderr
    assert summary.splitlines()[0].startswith("environment: ok") and "every step ok" in summary.splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        env = tar.extractfile("./env.txt").read().decode()
    assert "torch" in env and "dry run on CPU" in env


def test_bench_engine_writes_its_json_after_every_runner(tmp_path):
    """A runner that crashes mid-row leaves the runners before it in the JSON."""
    out = tmp_path / "bench.json"
    code = f"""
import sys
sys.path.insert(0, {str(REPO / "scripts")!r})
import bench_engine

def crash(*args, **kwargs):
    raise RuntimeError("the static batch crashed")

bench_engine.run_static = crash
sys.argv = ["bench_engine.py", "--model", "demo", "--device", "cpu", "--images", "2", "--repeat", "1",
            "--max-new-tokens", "3", "--max-objects", "1", "--rows", "caption/4", "mixed/4", "--kv-blocks", "300",
            "--runners", "engine pipelined", "engine sync", "static batch", "--json", {str(out)!r}]
bench_engine.main()
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert run.returncode != 0 and "the static batch crashed" in run.stderr, run.stdout + run.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["workload"] for r in results] == ["caption"]
    assert [k for k in results[0] if k in RUNNERS] == ["engine pipelined", "engine sync"]
    assert results[0]["engine sync"]["images"] == 2

"""scripts/gpu_check.sh, the script a lent GPU runs, on CPU: every planned step is a step it can
run, a step the call's time cannot cover is skipped and recorded and fails the call, and a named
step runs alone. (`--dry-run` walks every step at tiny sizes: 1-2 minutes, so run by hand
before a device call, not here.)"""

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

from support.paths import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "shared" / "fixtures" / "moondream-tiny").mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "LOG_DIR": str(tmp_path / "logs"),
           "BATCHVLM_SHARED": str(tmp_path / "shared"), **env}
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=240, env=env)
    summary = out / "summary.txt"
    return run, summary.read_text() if summary.exists() else ""


def test_the_plan_names_only_steps_the_script_defines(tmp_path):
    run, _ = gpu_check(tmp_path, "--plan")
    assert run.returncode == 0, run.stderr
    steps = re.findall(r"^  (\w+)\s+(\d+)\s+\(starts", run.stdout, flags=re.M)
    assert [s for s, _ in steps][:3] == ["environment", "flex_smoke", "gpu_tests"]  # correctness first
    body = SCRIPT.read_text()
    for name, _ in steps:
        assert re.search(rf"^{name}\(\) {{", body, flags=re.M), name
    # the whole plan fits one call up to the headline bench
    budgets = dict((s, int(b)) for s, b in steps)
    assert 15 + sum(budgets[s] for s in ("environment", "flex_smoke", "gpu_tests", "bench_engine")) <= 420
    assert "no step" in gpu_check(tmp_path, "nope")[0].stderr


def test_a_step_the_call_cannot_cover_is_skipped_and_fails_the_call(tmp_path):
    run, summary = gpu_check(tmp_path, "--dry-run", "environment", "gpu_tests", CALL_BUDGET_S="60")
    # 240 s on a CPU (4x): the environment step (40 s) fits, gpu_tests (at least 600 s) does not
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^environment: ok in \d+s/", summary, flags=re.M), summary
    assert re.search(r"^gpu_tests: skipped: needs 600 s", summary, flags=re.M), summary
    assert "FAILED: gpu_tests (skipped)" in summary and "flex_smoke" not in summary


def test_named_steps_run_alone_and_pass(tmp_path):
    """And what comes back from a device call is two files (the tool brings back 8 at most): the
    summary and every step's log in one archive."""
    run, summary = gpu_check(tmp_path, "--dry-run", "environment")
    assert run.returncode == 0, run.stdout + run.stderr
    assert summary.splitlines()[0].startswith("environment: ok") and "every step ok" in summary.splitlines()[-1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "summary.txt"]
    with tarfile.open(tmp_path / "out" / "logs.tar.gz") as tar:
        env = tar.extractfile("./env.txt").read().decode()
    assert "torch" in env and "dry run on CPU" in env

"""scripts/gpu_check.sh as its tests drive it (tests/gpu/test_gpu_check*.py): a run in a
temporary folder (its own $OUT, logs and an empty fixtures folder), and the plan it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from support.paths import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"
RUNNERS = ["engine pipelined", "engine sync", "static batch", "one-at-a-time"]


def gpu_check(tmp_path: Path, *args: str, timeout: int = 240, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    (tmp_path / "shared" / "fixtures" / "moondream-tiny").mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "LOG_DIR": str(tmp_path / "logs"),
           "BATCHVLM_SHARED": str(tmp_path / "shared"), **env}
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)
    summary = out / "summary.txt"
    return run, summary.read_text() if summary.exists() else ""


def planned(stdout: str) -> dict[int, list[tuple[str, int]]]:
    """call -> [(step, budget)] as --plan prints them."""
    calls, call = {}, 0
    for line in stdout.splitlines():
        if m := re.match(r"^call (\d) \((\d+) s", line):
            call = int(m.group(1))
            calls[call] = []
        elif m := re.match(r"^  (\w+)\s+(\d+)\s+\(starts", line):
            calls[call].append((m.group(1), int(m.group(2))))
    return calls

"""The CLI as tests drive it: in this process (inproc, cli_app) or as a fresh process (cli), and
what a fresh process imports while it loads a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def cli(*args, cwd=None, check=True):
    """`batchvlm ARGS` in a fresh process; a nonzero exit raises with its stderr unless check=False."""
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", *map(str, args)], capture_output=True, text=True, cwd=cwd)
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\n{r.stderr}")
    return r


LOAD_AND_LIST = """import sys
from batchvlm.job import ModelSpec
from batchvlm.models.registry import open_family
open_family(ModelSpec(name=sys.argv[1])).load("float32", "cpu")
print(",".join(m for m in ("torch._dynamo", "sympy") if m in sys.modules))"""


def heavy_imports_of_loading(folder: Path) -> str:
    """Which of torch._dynamo / sympy (most of a second of start-up together) a fresh process
    imports while it opens and loads the checkpoint `folder` on the CPU: "" for none."""
    r = subprocess.run([sys.executable, "-c", LOAD_AND_LIST, str(folder)], capture_output=True, text=True, check=True)
    return r.stdout.strip()


def inproc(cwd: Path, *args) -> tuple[int, str]:
    """The CLI app in this process: (exit code, stdout + stderr). For commands that load no model,
    and runs that are not about the process (its signals, start-up, loader workers: those are
    subprocesses); the signal handlers a run installs are put back."""
    import signal

    from typer.testing import CliRunner

    from batchvlm.cli import app

    old, handlers = os.getcwd(), {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(app, [str(a) for a in args])
    finally:
        os.chdir(old)
        for s, h in handlers.items():
            signal.signal(s, h)
    return r.exit_code, r.output


def cli_app(cwd: Path, *args, check: bool = False) -> subprocess.CompletedProcess:
    """inproc as a finished process: its exit code, and its output as both streams."""
    code, out = inproc(cwd, *args)
    if check and code != 0:
        raise AssertionError(f"exit {code}\n{out}")
    return subprocess.CompletedProcess(args, code, out, out)

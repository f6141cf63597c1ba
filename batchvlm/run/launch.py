"""`batchvlm run` on one node: this process is the one worker, or it starts one worker process per
GPU (or `runtime.workers_per_node` on a CPU) and draws one progress bar.

Workers are plain `batchvlm run` processes with BATCHVLM_LOCAL_RANK / _WORLD set (dist.py) and
CUDA_VISIBLE_DEVICES narrowed to their GPU. They report progress as JSON lines on stdout;
their stderr passes through. SIGTERM / SIGUSR1 / SIGINT are forwarded, so a preempted node
stops every worker cleanly. Under torchrun, accelerate or a multi-task srun the launcher is
not used: each of those processes is already one worker.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
from pathlib import Path

from ..dist import LOCAL_RANK_ENV, LOCAL_WORLD_ENV, Rank, resolve_rank
from ..exits import EXIT_STOPPED
from ..job import Job
from ..output import manifest
from ..progress import PROGRESS_ENV
from .preflight import clears, preflight
from .stop import StopFlag
from .worker import run_job


def run_here(job_file: Path, job: Job, limit: int | None, overwrite: bool) -> int:
    """Run `job` on this node; -> the exit code (exits.py)."""
    rank = resolve_rank()
    envs = worker_envs(job, rank)
    clear = clears(job, overwrite)
    if envs:  # one worker process per GPU of this node; they start after the clearing
        pre = preflight(job, clear, rank)  # a refused job clears nothing
        if clear:
            manifest.clear_outputs(pre.layout)
        return spawn(job_file, envs, limit, job.name)
    if LOCAL_RANK_ENV in os.environ:  # a worker of the above: the launcher cleared already
        clear = False
        job = job.model_copy(update={"output": job.output.model_copy(update={"mode": "resume"})})
    stop = StopFlag()
    stop.install()
    return run_job(job, limit=limit, overwrite=clear, rank=rank, stop=stop).end(job)


def worker_envs(job: Job, rank: Rank) -> list[dict[str, str]]:
    """Environments of the local workers to start; empty = run in this process."""
    if rank.launched:
        return []
    import torch

    if torch.cuda.is_available():
        visible = list(range(torch.cuda.device_count()))
        gpus = job.runtime.gpus
        ids = visible if gpus == "all" else visible[:gpus] if isinstance(gpus, int) else list(gpus)
        if missing := [g for g in ids if g not in visible]:
            raise ValueError(f"runtime.gpus: GPU {missing[0]} is not visible ({len(visible)} visible)")
        physical = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = physical.split(",") if physical else [str(i) for i in visible]
        if ids == visible[:1]:
            return []  # one worker on the first GPU: this process
        return [{"CUDA_VISIBLE_DEVICES": names[g], LOCAL_RANK_ENV: str(i), LOCAL_WORLD_ENV: str(len(ids))}
                for i, g in enumerate(ids)]
    n = job.runtime.workers_per_node
    if n <= 1:
        return []
    threads = str(max(1, (os.cpu_count() or n) // n))
    return [{LOCAL_RANK_ENV: str(i), LOCAL_WORLD_ENV: str(n), "OMP_NUM_THREADS": threads} for i in range(n)]


def spawn(job_file: Path, envs: list[dict[str, str]], limit: int | None, name: str) -> int:
    """Run the workers to completion; -> the exit code for the whole node."""
    from tqdm import tqdm

    args = [sys.executable, "-m", "batchvlm.cli", "run", str(job_file)]

    def share(i: int) -> list[str]:  # --limit N over n workers: N in all (at least one each)
        return ["--limit", str(max(1, limit // len(envs) + (i < limit % len(envs))))] if limit else []

    procs = [subprocess.Popen(args + share(i), env=os.environ | env | {PROGRESS_ENV: "json"},
                              stdout=subprocess.PIPE, text=True, bufsize=1) for i, env in enumerate(envs)]

    def forward(signum, frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    bar = tqdm(unit="img", desc=f"{name} x{len(procs)}", dynamic_ncols=True, file=sys.stderr)
    errors = 0
    totals: dict[int, int] = {}  # worker's stdout fd -> its images to label, once it knows
    try:
        sel = selectors.DefaultSelector()
        for p in procs:
            sel.register(p.stdout, selectors.EVENT_READ)
        open_streams = len(procs)
        while open_streams:
            for key, _ in sel.select(timeout=1.0):
                line = key.fileobj.readline()
                if not line:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    sys.stdout.write(line)
                    continue
                if msg.get("total") is not None:
                    totals[key.fileobj.fileno()] = msg["total"]
                    if len(totals) == len(procs):
                        bar.total = sum(totals.values())
                bar.update(msg.get("images", 0))
                errors += msg.get("errors", 0)
                bar.set_postfix(errors=errors, refresh=False)
        codes = [p.wait() for p in procs]
    finally:
        bar.close()
        for s, h in previous.items():
            signal.signal(s, h)
    if any(c not in (0, EXIT_STOPPED) for c in codes):
        return max(c if c > 0 else 1 for c in codes if c not in (0, EXIT_STOPPED))
    return EXIT_STOPPED if EXIT_STOPPED in codes else 0

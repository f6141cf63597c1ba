"""`batchvlm run job.yaml --ray ADDRESS`: the ranks of a run as Ray actors across a cluster.

One actor per GPU of the cluster (or, without GPUs, per CPU slot: 1 + loader.workers CPUs),
each the usual run loop (worker.py) as one rank with work stealing over the shared output
folder, so ranks that start late or run slow simply take fewer shards. The first actor checks
the job before anything starts (preflight, where the ranks run: the driver may have neither
their GPUs nor their mounts); a refused job clears nothing. An actor that dies is restarted by
Ray, which retries its run: the new process takes over its predecessor's claims (same host: at
once; another host: when this launch's ranks have all ended, `release_launch` frees them and one
more round labels what is left). The driver draws one progress bar and exits with the usual
codes (exits.py). Ray is imported only here, only when asked; the cluster's nodes need
batchvlm installed and the job's paths (inputs, output folder) mounted at the same place.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..dist import Rank
from ..errors import error_line, run_failure
from ..exits import EXIT_FAILED, EXIT_JOB_ERROR, EXIT_OK, EXIT_STOPPED
from ..job import Job
from ..output import manifest
from ..output.claims import LAUNCH_ENV, release_launch
from ..output.layout import Layout
from ..output.shardlist import plan
from ..progress import PROGRESS_ENV
from .log import log
from .preflight import clears, preflight
from .stop import StopFlag
from .summary import RunSummary
from .worker import run_job

INSTALL = "pip install 'batchvlm[ray]'"
MAX_RESTARTS = 3  # per actor: a rank that keeps dying (the same poison input) ends the run with 1
MAX_ROUNDS = 3  # rounds after the first only take shards whose holder died on another host
POLL_S = 0.5


class _ProgressTap:
    """The actor's stdout: counts the run loop's JSON progress lines (progress.py's protocol),
    passes anything else through."""

    def __init__(self, through):
        self.through, self.images, self.errors, self._line = through, 0, 0, ""

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno: the real stream's
        return getattr(self.through, name)

    def write(self, s: str) -> int:
        self._line += s
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            try:
                msg = json.loads(line)
                self.images += msg.get("images", 0)
                self.errors += msg.get("errors", 0)
            except (ValueError, AttributeError):
                self.through.write(line + "\n")
        return len(s)

    def flush(self) -> None:
        self.through.flush()


class RankWorker:
    """One rank (a Ray actor): built once per process, restarted by Ray after a crash."""

    def __init__(self, job: Job, rank: int, world: int):
        os.environ[PROGRESS_ENV] = "json"
        self.job, self.rank = job, Rank(rank, world, 0, launched=True)
        self.stop = StopFlag()  # set by the driver (request_stop), never by a signal here
        self.tap = _ProgressTap(sys.stdout)
        sys.stdout = self.tap

    def progress(self) -> tuple[str, int, int]:
        return f"{socket.gethostname()}:{os.getpid()}", self.tap.images, self.tap.errors

    def request_stop(self) -> None:
        self.stop.event.set()

    def check(self, clear: bool) -> None:
        preflight(self.job, clear, self.rank)

    def clear(self) -> None:
        manifest.clear_outputs(Layout.at(self.job.output.dir))

    def run(self, limit: int | None, launch: str) -> dict[str, Any]:
        os.environ[LAUNCH_ENV] = launch  # in this rank's claims
        try:
            summary = run_job(self.job, limit=limit, rank=self.rank, progress=True, stop=self.stop,
                              await_held=False)  # _drive frees a dead round's claims and runs another
        except Exception as e:
            if (failure := run_failure(e, self.job.output.dir)) is None:
                raise  # a bug: Ray carries it to the driver
            code, message = failure
            return {"error": message, "code": code}
        return {"summary": summary, "who": self.progress()}

    def shards(self, ended: str | None = None) -> tuple[list[str], list[str], list[str]]:
        """(claims freed, shards not done, shards done). `ended`: a launch whose ranks have all
        ended; its claims are freed first."""
        layout = Layout.at(self.job.output.dir)
        freed = release_launch(layout.meta, ended) if ended and layout.meta.is_dir() else []
        with layout.listed():
            done = {s.stem: manifest.is_done(layout, s) for s in plan(self.job.input, layout)}
        return freed, [s for s, d in done.items() if not d], [s for s, d in done.items() if d]


@dataclass
class _Bar:
    """The cluster's progress: per actor process, its latest counts (a restarted actor starts at 0)."""

    name: str
    world: int

    def __post_init__(self):
        from tqdm import tqdm

        self.counts: dict[tuple[int, str], tuple[int, int]] = {}
        self.bar = tqdm(unit="img", desc=f"{self.name} ray x{self.world}", dynamic_ncols=True, file=sys.stderr)

    def update(self, rank: int, who: str, images: int, errors: int) -> bool:
        """-> whether this is a new process for `rank` after an earlier one (a restart)."""
        restarted = (rank, who) not in self.counts and any(r == rank for r, _ in self.counts)
        before = self.counts.get((rank, who), (0, 0))
        self.counts[(rank, who)] = (images, errors)
        if (images, errors) != before:
            self.bar.set_postfix(errors=sum(e for _, e in self.counts.values()), refresh=False)
            self.bar.update(images - before[0])
        return restarted


def _slots(ray, job: Job) -> tuple[int, dict[str, float]]:
    """(actors, resources of each): a GPU each where the cluster has GPUs and the job may use them."""
    free = ray.available_resources()
    gpus = int(free.get("GPU", 0) or ray.cluster_resources().get("GPU", 0))
    if gpus and job.model.device != "cpu":
        return gpus, {"num_gpus": 1, "num_cpus": 1}
    per = 1 + job.loader.workers
    return max(1, int(free.get("CPU", 0) or ray.cluster_resources().get("CPU", 1)) // per), {"num_cpus": per}


def run_on_ray(job: Job, address: str, limit: int | None, overwrite: bool) -> int:
    """-> the launch's exit code (exits.py)."""
    try:
        import ray
        from ray.exceptions import RayActorError, RayError
    except ImportError:
        log(error_line(f"--ray: Ray is not installed; {INSTALL}"))
        return EXIT_JOB_ERROR
    t0 = time.time()
    try:
        ray.init(address=address, logging_level="WARNING", log_to_driver=True,
                 runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k == "BATCHVLM_DEBUG"}})
    except (ConnectionError, ValueError, RuntimeError) as e:
        log(error_line(f"--ray {address}: cannot reach a Ray cluster: {str(e).strip().splitlines()[0]}"))
        return EXIT_FAILED
    try:
        world, resources = _slots(ray, job)
        clear = clears(job, overwrite)
        job = job.model_copy(update={"runtime": job.runtime.model_copy(update={"work_stealing": True}),
                                     "output": job.output.model_copy(update={"mode": "resume"})})
        actor = ray.remote(max_restarts=MAX_RESTARTS, max_task_retries=MAX_RESTARTS, max_concurrency=3,
                           **resources)(RankWorker)
        actors = [actor.remote(job, r, world) for r in range(world)]
        _get(ray, actors[0].check.remote(clear))  # a refused job: its one line, from the CLI
        if clear:  # once, before any rank starts (a rank must not clear another's work)
            ray.get(actors[0].clear.remote())
        each = ", ".join(f"{n:g} {k.removeprefix('num_').upper()}" for k, n in resources.items())
        log(f"batchvlm: ray: {world} rank(s) of {each} on {len(ray.nodes())} node(s)")
        return _drive(ray, (RayActorError, RayError), job, actors, limit, t0)
    finally:
        ray.shutdown()


def _drive(ray, errors: tuple[type[Exception], ...], job: Job, actors: list, limit: int | None, t0: float) -> int:
    world = len(actors)
    stop = {"asked": False}

    def on_signal(signum, frame) -> None:
        if stop["asked"] and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop["asked"] = True

    total = RunSummary(0, 0)
    code = EXIT_OK
    base = os.environ.get(LAUNCH_ENV) or uuid.uuid4().hex[:12]  # round r's ranks claim as "<base>-<r>"
    # Counted from the output folder, not from the ranks' summaries: a rank that died took its
    # count of the shards it had written with it.
    _, _, before = _get(ray, actors[0].shards.remote())
    total.shards_done_before = len(before)
    bar = _Bar(job.name, world)
    busy = world  # ranks to run this round: later rounds need one per freed shard at most
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        for round_ in range(MAX_ROUNDS):
            launch = f"{base}-{round_}"
            shares = [max(1, limit // world + (i < limit % world)) if limit else None for i in range(world)]
            runs = {a.run.remote(shares[i], launch): i for i, a in enumerate(actors[:busy])}
            results = _wait(ray, errors, actors, runs, stop, bar)
            code = _merge(results, total, code)
            if code != EXIT_OK or total.stopped_by_signal or limit is not None:
                break
            freed, left, done = _get(ray, actors[0].shards.remote(launch))
            total.shards_written = sorted(set(done) - set(before))
            left = [s for s in left if s not in total.shards_failed]
            if not left:
                break
            if not freed or round_ == MAX_ROUNDS - 1:
                log(f"batchvlm: ray: {len(left)} shard(s) are not done and held by another run "
                    f"({', '.join(left[:3])}); run again once it ends")
                code = EXIT_STOPPED  # nothing failed: as when another run holds a rank's lock
                break
            log(f"batchvlm: ray: {len(freed)} shard(s) were held by ranks that died on another node; "
                "one more round labels them")
            busy = min(world, len(freed))
    finally:
        bar.bar.close()
        for s, h in previous.items():
            signal.signal(s, h)
    total.seconds = time.time() - t0
    verdict = total.end(job)  # the summary line, always
    return code if code != EXIT_OK else verdict


def _wait(ray, errors: tuple[type[Exception], ...], actors: list, runs: dict[Any, int], stop: dict[str, bool],
          bar: _Bar) -> dict[int, dict[str, Any]]:
    """Wait for one round's runs (`runs`: each call -> its rank), drawing the ranks' progress and
    passing on a stop; -> each rank's result."""
    actor_error, ray_error = errors
    results: dict[int, dict[str, Any]] = {}
    polls: dict[Any, int] = {}  # progress calls in flight (one per rank; a dead rank's waits for its restart)
    while runs:
        if stop["asked"]:  # again on every pass: a rank Ray restarted since starts unstopped
            for a in actors:
                a.request_stop.remote()
        ready, _ = ray.wait(list(runs), num_returns=len(runs), timeout=POLL_S)
        for ref in ready:
            i = runs.pop(ref)
            try:
                results[i] = ray.get(ref)
                if "who" in results[i]:  # its last counts: a poll may have come before them
                    bar.update(i, *results[i]["who"])
            except actor_error as e:  # restarted MAX_RESTARTS times and died again
                results[i] = {"error": f"rank {i} died ({type(e).__name__}) and was restarted "
                                       f"{MAX_RESTARTS} times", "code": EXIT_FAILED}
            except ray_error as e:  # a bug in the rank: one line, like the CLI
                first = str(e).strip().splitlines()
                results[i] = {"error": f"rank {i}: {first[-1] if first else type(e).__name__}",
                              "code": EXIT_FAILED}
        polled = set(polls.values())
        polls |= {a.progress.remote(): i for i, a in enumerate(actors) if i in runs.values() and i not in polled}
        done, _ = ray.wait(list(polls), num_returns=len(polls), timeout=POLL_S) if polls else ([], [])
        for ref in done:
            i = polls.pop(ref)
            try:
                who, images, errs = ray.get(ref)
            except ray_error:
                continue  # died for good: its run's result says so
            if bar.update(i, who, images, errs):
                log(f"batchvlm: ray: rank {i} was restarted by Ray ({who}); it resumes its shards")
    return results


def _get(ray, ref) -> Any:
    """ray.get, raising a task's own exception (a SourceError, say: one line from the CLI)."""
    from ray.exceptions import RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        raise (e.cause if isinstance(e.cause, Exception) else e) from None


def _merge(results: dict[int, dict[str, Any]], total: RunSummary, code: int) -> int:
    """Add one round's rank results to `total`; -> the exit code so far (an error's, the worst)."""
    for message in dict.fromkeys(r["error"] for r in results.values() if "error" in r):  # all ranks, one line
        log(error_line(message))
    for i in sorted(results):
        if "error" in results[i]:
            code = max(code, results[i]["code"])
        else:
            total.add(results[i]["summary"])
    return code

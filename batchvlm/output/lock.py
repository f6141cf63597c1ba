"""One run per rank on an output folder: a second `batchvlm run` of the same job is refused.

Ranks of one launch (Slurm array tasks, torchrun processes, local GPU workers) label disjoint
shards, so each takes the lock of its own (rank, world); two processes with the same rank and
world would label the same shards, twice the work. The lock is an flock(2) on a file in the
output folder: the kernel (or the NFS lock manager) drops it when its holder dies, however it
dies, so a killed run never leaves a stale lock. The file lives in the metadata folder
(`__batchvlm__/run-<rank>-of-<world>.lock`): nothing but Parquet files sits at the top level. The file holds who took it, for the message.
Work stealing needs no lock: its claims already keep ranks apart.

The lock follows the process that took it: a forked child (a loader worker) closes its copy of
the file at once, so the kernel drops the lock when the run itself dies, whatever its children
still do. (An flock belongs to the open file, which a fork shares.)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
from pathlib import Path

from .layout import Layout
from .manifest import OutputConflict, lock_path, pid_alive


_HELD: set[int] = set()  # the fds of the run locks this process holds


def _close_in_child() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


class RunLockHeld(OutputConflict):
    """Another live run labels this rank: nothing is wrong with the job, try again later."""


class RunLock:
    def __init__(self, out_dir: Path | Layout, rank: int, world: int):
        self.layout = out_dir if isinstance(out_dir, Layout) else Layout(Path(out_dir))
        self.path = lock_path(self.layout, rank, world)
        self.rank, self.world = rank, world
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(fd)
            os.close(fd)
            raise RunLockHeld(
                f"output.dir: another batchvlm run ({holder}) is labelling {self.layout.dir} as rank {self.rank} "
                f"of {self.world}; wait for it to finish, or set runtime.work_stealing: true to share the "
                "shards between runs") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        self._fd = fd
        _HELD.add(fd)

    @staticmethod
    def _holder(fd: int) -> str:
        try:
            d = json.loads(os.pread(fd, 4096, 0))
            return f"host {d['host']}, pid {d['pid']}, since {d['since']}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is not None:
            _HELD.discard(self._fd)
            os.close(self._fd)  # closing drops the flock; the file stays (unlinking would race)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def held_ranks(layout: Layout) -> list[tuple[int, int]]:
    """(rank, world) of the run locks a live process holds now (`status`: their shards are running).
    Asked of the kernel with a shared lock taken and dropped at once, only where the holder the file
    names may be alive (on this host: its pid), so a run starting in that instant is hardly ever
    refused as if another held the lock (it would say so)."""
    held = []
    for path in layout.meta.glob("run-*-of-*.lock"):
        if not (m := re.fullmatch(r"run-(\d+)-of-(\d+)\.lock", path.name)):
            continue
        try:
            holder = json.loads(path.read_bytes())
            here = holder["host"] == socket.gethostname()
        except (OSError, ValueError, KeyError, TypeError):
            continue  # never taken, or being written by a run that takes it now
        if (not here or pid_alive(int(holder["pid"]))) and _locked(path):
            held.append((int(m.group(1)), int(m.group(2))))
    return held


def _locked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)

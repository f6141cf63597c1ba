"""Parallel decode + preprocess: shards in, prepared samples out, in CPU worker processes.

Worker w of W reads pending shards w, w+W, w+2W, ... in full, so every sample is produced by
exactly one worker (no duplicates, no gaps) and each shard's samples arrive in shard order,
followed by one `ShardEnd`. With work stealing, every worker walks all shards (from its own
offset) and reads those it manages to claim instead. A key seen before in the same shard makes
an error row (`duplicate key`): no two rows of a shard share a key, and nothing is dropped
silently. Crops travel as uint8 tensors (shared memory), never floats; a worker moves them there
itself, so a full /dev/shm stops the run with one line instead of losing the sample in the
queue's feeder thread (where the main process would wait for it forever). Workers ignore SIGTERM /
SIGINT: the main process decides when to stop; they die with it (kill -9 too).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..job import InputSpec, LoaderSpec
from ..models.base.contract import Prepared, Preprocessor
from .decode import decode
from .sources import Encoded, ShardRef, TarSkipped, read_shard


@dataclass
class Sample:
    """One image on its whole way from the loader to its row: decoded and preprocessed in a
    worker, labelled (models/base/contract.py SampleLike: what a labeler reads), then its row."""

    shard: int  # index into the loader's shard list
    index: int  # position in the shard
    key: str
    # The family's preprocessed image (tensors travel in shared memory); None for an error
    # sample, and set to None by the engine once the pixels are on the device.
    prepared: Prepared | None
    width: int = 0  # 0: not known (the image could not be read)
    height: int = 0
    error: str | None = None
    meta: dict[str, Any] | None = None  # the `input.keep` values, passed through to the row
    # Prepared.seen, kept when the pixels are dropped: the family's columns read it.
    seen: tuple[int, int] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.prepared is not None:
            self.seen = self.prepared.seen


@dataclass
class ShardEnd:
    shard: int
    n_samples: int
    damaged: str | None = None  # the container broke; the samples before it were delivered
    failed: str | None = None  # unreadable (I/O error, broken container): must not be marked done
    skipped: dict[str, int] | None = None  # a tar's members that are no sample's: reason -> count


@dataclass
class Halt:
    """A worker cannot hand samples over at all (shared memory is full): the run stops."""

    error: str


class SharedMemoryFull(RuntimeError):
    """Raised in the main process for a worker's Halt."""


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _shm_note() -> str:
    """` (12 KiB free of 64 MiB)` for /dev/shm, or ''."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return ""
    return f" ({_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)})"


def _to_shared(obj: Any, depth: int = 0) -> None:
    """Move the tensors of a prepared image (a dataclass, or dicts / lists of them) into shared
    memory, as pickling them for the main process would."""
    if isinstance(obj, torch.Tensor):
        obj.share_memory_()
    elif depth < 4:
        values = (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple))
                  else [getattr(obj, f.name) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else [])
        for v in values:
            _to_shared(v, depth + 1)


def prepare(enc: Encoded, pre: Preprocessor, spec: LoaderSpec, shard: int, index: int) -> Sample:
    if enc.error is not None:
        return Sample(shard, index, enc.key, None, error=enc.error)
    d = decode(enc.data, spec.max_image_pixels, pre.largest_size if spec.jpeg_draft else None)
    if d.error is not None:
        return Sample(shard, index, enc.key, None, d.width, d.height, d.error)
    try:
        p = pre(d.image, d.width, d.height)
    except (OSError, ValueError) as e:
        return Sample(shard, index, enc.key, None, d.width, d.height, f"preprocess: {e}")
    return Sample(shard, index, enc.key, p, d.width, d.height)


@dataclass(frozen=True)
class Stealing:
    take: Callable[[ShardRef], bool]  # claims a shard that is not done yet (output/claims.py)
    offset: int  # where this rank starts walking the shard list


class ShardStream(IterableDataset):
    def __init__(self, shards: list[ShardRef], inp: InputSpec, spec: LoaderSpec, pre: Preprocessor,
                 stealing: Stealing | None = None):
        self.shards, self.inp, self.spec, self.pre, self.stealing = shards, inp, spec, pre, stealing

    def __iter__(self) -> Iterator[Sample | ShardEnd]:
        info = get_worker_info()
        wid, n = (info.id, info.num_workers) if info else (0, 1)
        if self.stealing is None:
            for i in range(wid, len(self.shards), n):
                yield from self._shard(i)
            return
        st, total = self.stealing, len(self.shards)
        start = st.offset + wid * max(1, total // n)
        for k in range(total):
            i = (start + k) % total
            if st.take(self.shards[i]):
                yield from self._shard(i)

    def _shard(self, i: int) -> Iterator[Sample | ShardEnd | Halt]:
        count, seen, skipped = 0, set(), None  # keys of this shard so far: bounded by the shard size
        in_worker = get_worker_info() is not None
        try:
            for enc in read_shard(self.shards[i], self.inp):
                if isinstance(enc, TarSkipped):
                    skipped = enc.counts
                    continue
                if not isinstance(enc, Encoded):
                    yield ShardEnd(i, count, damaged=enc.error, skipped=skipped)
                    return
                if enc.key in seen:
                    enc = Encoded(enc.key, None, "duplicate key: an earlier sample of this shard has it", enc.meta)
                seen.add(enc.key)
                sample = prepare(enc, self.pre, self.spec, i, count)
                sample.meta = enc.meta
                if in_worker:
                    try:
                        _to_shared(sample.prepared)
                    except RuntimeError as e:
                        if "shared memory" not in str(e):
                            raise
                        yield Halt(f"loader: /dev/shm is full{_shm_note()}: loader workers hand images to the "
                                   "model through shared memory; give the machine or container more (docker run "
                                   "--shm-size=8g, or a Kubernetes emptyDir of medium Memory at /dev/shm), or set "
                                   "loader.workers: 0")
                        return
                yield sample
                count += 1
        except Exception as e:  # noqa: BLE001 - whatever breaks a shard fails that shard, never the job
            yield ShardEnd(i, count, failed=f"{type(e).__name__}: {e}")
            return
        yield ShardEnd(i, count, skipped=skipped)


def _quiet_worker(parent: int, _: int) -> None:
    """A worker ignores stop signals, and dies with the run: killed (SIGKILL) the moment its
    parent dies, however it dies (kill -9 too), where Linux can say so (PR_SET_PDEATHSIG)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before that took effect
            os._exit(1)


@dataclass
class Stream:
    """The loader's samples, and the worker processes that make them."""

    items: Iterator[Sample | ShardEnd | Halt]
    workers: list[multiprocessing.process.BaseProcess]

    def __iter__(self) -> Iterator[Sample | ShardEnd]:
        for item in self.items:
            if isinstance(item, Halt):
                raise SharedMemoryFull(item.error)
            yield item

    def close(self) -> None:
        """Kill the workers. They ignore SIGTERM, and the multiprocessing exit hook terminates
        and then joins them: after an error it would wait forever. Meanwhile SIGCHLD is not
        torch's: its DataLoader handler would take these kills for workers that failed and raise
        that in place of the error being reported (the run's own, e.g. /dev/shm being full)."""
        handler = signal.getsignal(signal.SIGCHLD)  # None: not set from Python, so left alone
        # only the main thread may set handlers
        if handler is None or not self.workers or threading.current_thread() is not threading.main_thread():
            handler = None
        else:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            for p in self.workers:
                p.kill()
                p.join()
        finally:
            if handler is not None:
                signal.signal(signal.SIGCHLD, handler)


def load(shards: list[ShardRef], inp: InputSpec, spec: LoaderSpec, pre: Preprocessor,
         stealing: Stealing | None = None) -> Stream:
    stream = ShardStream(shards, inp, spec, pre, stealing)
    workers = min(spec.workers, len(shards))
    if workers == 0:
        return Stream(iter(stream), [])
    before = set(multiprocessing.active_children())
    items = iter(DataLoader(stream, batch_size=None, num_workers=workers, prefetch_factor=spec.prefetch,
                            multiprocessing_context="fork", persistent_workers=False,
                            worker_init_fn=partial(_quiet_worker, os.getpid())))
    return Stream(items, [p for p in multiprocessing.active_children() if p not in before])  # started by iter()

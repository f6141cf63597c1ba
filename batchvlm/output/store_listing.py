"""One listing of an output's levels in a store standing in for a request per shard
(S3Store.listed): which shards are done is read from it, not asked key by key.

S3 lists 1000 keys a request, so an output of 100,000 shards is some 300 LIST requests (its
Parquet objects, `__batchvlm__/`, `partial/`); without it a run's start and `status` asked for
every shard's marker and Parquet object (four to five requests a shard). The markers that do
exist are still read (their rows, their input's stat), READ_AHEAD at a time, in the listing's
order, by THREADS threads: the shards are read in that order, so a run waits for one round trip
per READ_AHEAD markers, not one per marker.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .store import ObjectInfo

READ_AHEAD = 64
THREADS = 16
MARKER = ".stats.json"


@dataclass
class Snapshot:
    pid: int  # a forked process (a loader worker) does not use its parent's
    prefixes: set[str]  # each ends in "/" ("" for the bucket's top)
    suffixes: tuple[str, ...]  # the keys it answers for end in one of these
    objects: dict[str, ObjectInfo]
    bodies: dict[str, tuple[bytes, str] | None] = field(default_factory=dict)  # read ahead, not yet asked for
    markers: list[str] = field(init=False)  # the listed markers, sorted

    def __post_init__(self) -> None:
        self.markers = sorted(k for k in self.objects if k.endswith(MARKER))

    def answers(self, key: str) -> bool:
        if self.pid != os.getpid() or not key.endswith(self.suffixes):
            return False
        parent = key.rpartition("/")[0]
        return (f"{parent}/" if parent else "") in self.prefixes

    def body(self, key: str, get: Callable[[str], tuple[bytes, str] | None]) -> tuple[bytes, str] | None:
        """A listed marker's (bytes, ETag), with the next READ_AHEAD markers read meanwhile;
        None where it is gone since the listing."""
        if key not in self.bodies:
            if len(self.bodies) > 4 * READ_AHEAD:  # read ahead, never asked for: not kept
                self.bodies.clear()
            i = bisect.bisect_left(self.markers, key)
            batch = [key] + [k for k in self.markers[i : i + READ_AHEAD] if k != key and k not in self.bodies]
            with ThreadPoolExecutor(min(THREADS, len(batch))) as pool:
                self.bodies |= dict(zip(batch, pool.map(get, batch)))
        return self.bodies.pop(key)

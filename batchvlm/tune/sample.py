"""The images `tune` labels: N drawn reproducibly from the job's inputs, whatever the shard order.

An image is drawn when its sha256(seed, key) is among the N smallest: the same seed gives the
same images however the shards are listed or read, and reading is one streaming pass holding N
encoded images. Unreadable members (an Encoded error) are never drawn. Without --sample, N is
DEFAULT_SAMPLE, or every image where the inputs hold fewer; an --sample the inputs cannot fill is
refused.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass

from ..data.sources import Encoded, ShardRef, SourceError, count_samples, read_shard
from ..errors import UsageError
from ..job import InputSpec

DEFAULT_SAMPLE = 200


@dataclass(frozen=True)
class Drawn:
    images: list[Encoded]  # in draw order (by hash), the same for a seed
    population: int  # readable images in the inputs


def _rank(seed: int, key: str, shard: str) -> bytes:
    return hashlib.sha256(f"{seed}\0{shard}\0{key}".encode()).digest()


def check_size(shards: list[ShardRef], n: int) -> None:
    """Refuse, before anything is read, `n` above a count the containers state (tar shards state
    none: `draw` refuses then, still before the model loads)."""
    sizes = [count_samples(s) for s in shards]
    if None not in sizes and n > (total := sum(sizes)):
        raise UsageError(f"--sample: {n} is more than the {total} image(s) of the job's inputs; lower it")


def draw(shards: list[ShardRef], inp: InputSpec, n: int, seed: int, exact: bool = True) -> Drawn:
    """-> the n images of smallest rank; `exact` (--sample given): fewer readable images is an
    error, else all of them are drawn."""
    heap: list[tuple[bytes, int, Encoded]] = []  # max-heap by rank (negated), the n smallest kept
    population = 0
    for s in shards:
        for item in read_shard(s, inp):
            if not isinstance(item, Encoded) or item.error is not None:
                continue
            population += 1
            r = bytes(255 - b for b in _rank(seed, item.key, s.stem))  # negate: heapq is a min-heap
            entry = (r, population, item)
            if len(heap) < n:
                heapq.heappush(heap, entry)
            elif r > heap[0][0]:
                heapq.heapreplace(heap, entry)
    if population == 0:
        raise SourceError("tune: the job's inputs hold no readable image")
    if exact and population < n:
        raise UsageError(f"--sample: {n} is more than the {population} readable image(s) of the job's inputs; "
                         "lower it")
    return Drawn([e[2] for e in sorted(heap, reverse=True)], population)

"""The contract between the run loop and whatever labels images: a stream of work items in,
a stream of finished images out (in any order)."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, Protocol

from ..models.moondream.decoding import RawOutput
from ..models.moondream.family import Moondream, Sequence
from ..models.moondream.generate import generate
from ..models.moondream.preprocess import PreparedImage


@dataclass
class WorkItem:
    ticket: Any  # the caller's handle, returned with the result
    image: PreparedImage
    key: str  # sample key: with the job seed it seeds sampling, whatever the batch


def sequence_seed(job_seed: int, key: str, seq: int) -> int:
    return zlib.crc32(f"{job_seed}/{key}/{seq}".encode())


class Labeler(Protocol):
    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]: ...


class StaticBatchLabeler:
    """Fixed batches through the simple batched generation: each batch runs until its slowest
    sequence ends. The baseline the engine is measured against."""

    def __init__(self, md: Moondream, seqs: list[Sequence], max_batch_size: int, seed: int):
        self.md, self.seqs, self.seed = md, seqs, seed
        self.images_per_batch = max(1, max_batch_size // len(seqs))

    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]:
        it = iter(items)
        while batch := list(islice(it, self.images_per_batch)):
            seeds = [[sequence_seed(self.seed, w.key, j) for j in range(len(self.seqs))] for w in batch]
            outs = generate(self.md.model, [w.image for w in batch], [s.spec for s in self.seqs], seeds)
            yield from zip((w.ticket for w in batch), outs)

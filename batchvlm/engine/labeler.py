"""What the run loop hands the engine: one image to label, with a handle to get it back."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

from ..models.family import Prepared


@dataclass
class WorkItem:
    ticket: Any  # the caller's handle, returned with the result
    image: Prepared
    key: str  # sample key: with the job seed it seeds sampling, whatever the batch


def sequence_seed(job_seed: int, key: str, seq: int) -> int:
    """Sampling seed of one sequence: a function of the job seed, sample key and task alone."""
    return zlib.crc32(f"{job_seed}/{key}/{seq}".encode())

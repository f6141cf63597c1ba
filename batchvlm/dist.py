"""Who am I in a multi-process run, and which shards are mine."""

from __future__ import annotations

from dataclasses import dataclass

from .data.sources import ShardRef


@dataclass(frozen=True)
class Rank:
    rank: int  # global rank
    world: int  # number of ranks
    local: int  # index on this node (selects the GPU)


def my_shards(shards: list[ShardRef], rank: Rank) -> list[ShardRef]:
    """Round-robin over the sorted shard list: deterministic, disjoint, and the union is all."""
    return shards[rank.rank :: rank.world]


def resolve_rank() -> Rank:
    """Single process for now; launchers (torchrun, Slurm) are read by the scale-out layer."""
    return Rank(0, 1, 0)

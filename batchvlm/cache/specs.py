"""What state a model's layers keep per sequence: the kinds the engine sizes and accounts.

vLLM v1's `KVCacheSpec` family is the reference point. A model declares a list of specs, each
covering a group of its layers; the engine allocates one tensor set per spec (tensors.py):

  PagedKV      full attention: K/V per token slot, paged in refcounted blocks. Prefix tokens
               (shared by the sequences on a prefix) and own tokens both have slots.
  CrossKV      read-only K/V of a prefix segment (an encoder-decoder's cross-attention): written
               once, when the prefix is prefilled, from whatever the family computes there (an
               encoder's output); read by own tokens; never written by them. Same slot space as
               PagedKV (one block table per prefix), so it is paged the same way.
  Recurrent    a fixed-size state per sequence (linear attention / SSM: a conv state and a
               recurrent matrix per layer), held in state rows, not blocks. A prefix's state at its
               end is a snapshot that each sequence on it forks from by copy when its prompt is
               prefilled; decode steps update a row in place.

Memory: paged kinds cost `bytes_per_slot` for every slot of every block (a CrossKV kind that
`shares` a PagedKV kind's tensors costs nothing of its own); a recurrent kind costs
`bytes_per_state` for every row (plus a scratch row) and every snapshot slot. On the reference
attention backend a CrossKV kind also costs its PrefixView, outside the cache:
`prefix_view_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PagedKV:
    name: str  # the key of its tensors in EngineCache.paged
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_slot(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True)
class CrossKV(PagedKV):
    # A PagedKV kind of the same shape whose tensors also hold this kind's blocks (None: its own).
    # Sound only when that kind writes and reads own blocks alone (an encoder-decoder's decoder
    # self-attention, Reads.OWN): this kind writes and reads prefix blocks alone, and a block is a
    # prefix's or a sequence's own, never both at once, so the two never meet in a slot. One
    # allocation then serves both, and a slot costs once.
    shares: str | None = None

    @property
    def bytes_per_slot(self) -> int:
        return 0 if self.shares else super().bytes_per_slot

    @property
    def view_bytes_per_slot(self) -> int:
        """Its K/V of one slot, however they are stored (what a PrefixView copies)."""
        return super().bytes_per_slot


@dataclass(frozen=True)
class Recurrent:
    name: str  # the key of its tensors in EngineCache.recurrent
    shapes: dict[str, tuple[int, ...]] = field(hash=False)  # per sequence, e.g. {"conv": (layers, C, K-1)}
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_state(self) -> int:
        return sum(math.prod(s) for s in self.shapes.values()) * self.dtype.itemsize


StateSpec = PagedKV | CrossKV | Recurrent


def bytes_per_slot(specs: list[StateSpec]) -> int:
    return sum(s.bytes_per_slot for s in specs if isinstance(s, PagedKV))


def bytes_per_state(specs: list[StateSpec]) -> int:
    return sum(s.bytes_per_state for s in specs if isinstance(s, Recurrent))


def has_recurrent(specs: list[StateSpec]) -> bool:
    return any(isinstance(s, Recurrent) for s in specs)


def prefix_view_bytes(specs: list[StateSpec], n_prefixes: int, prefix_len: int) -> int:
    """What a decode group's PrefixView (attention/layout.py) holds when it reads n_prefixes
    prefixes of at most prefix_len tokens: every layer's K and V of each CrossKV kind, densely,
    in the cache's dtype, i.e. their slots' bytes. Only CrossKV kinds are viewed (attention/dispatch.py
    `attend`), and only on the reference backend (the fused kernels read the cache in place)."""
    return n_prefixes * prefix_len * sum(s.view_bytes_per_slot for s in specs if isinstance(s, CrossKV))

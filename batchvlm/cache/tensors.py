"""The tensors that hold sequences' state, one set per declared spec (specs.py).

Paged kinds share one slot space: slot = block * block_size + index, block 0 the null block
(padding writes land there, padded keys read from there). Recurrent kinds share one state
index space: rows 0..n_rows-1 are the device-state rows of running sequences, n_rows is the
scratch row padding reads and writes, and n_rows + 1 + s is snapshot slot s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .specs import CrossKV, PagedKV, Recurrent, StateSpec


@dataclass
class KVCache:
    """All layers' keys and values of one paged kind: one allocation, per-layer views by dim 0."""

    k: torch.Tensor  # [n_layers, n_blocks * block_size, n_kv_heads, head_dim]
    v: torch.Tensor
    block_size: int
    backend: Any = None  # attention/backend.py's AttentionBackend; None: picked by device on first use
    prefix_views: bool = False  # a CrossKV kind: decode groups may read its prefixes through a PrefixView

    @classmethod
    def allocate(cls, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, backend: Any = None,
                 prefix_views: bool = False) -> KVCache:
        shape = (n_layers, n_blocks * block_size, n_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), block_size, backend, prefix_views)

    @property
    def n_blocks(self) -> int:
        return self.k.shape[1] // self.block_size


@dataclass
class EngineCache:
    """Everything the engine allocated for a model, by spec name."""

    paged: dict[str, KVCache]
    recurrent: dict[str, dict[str, torch.Tensor]]  # name -> {part: [n_rows + 1 + n_snapshots, *shape]}
    block_size: int
    n_rows: int
    n_blocks: int

    def snapshot_index(self, s: int) -> int:
        return self.n_rows + 1 + s

    @classmethod
    def allocate(cls, specs: list[StateSpec], n_blocks: int, block_size: int, n_rows: int, n_snapshots: int,
                 device: torch.device) -> EngineCache:
        paged = {s.name: KVCache.allocate(s.layers, n_blocks, block_size, s.kv_heads, s.head_dim, s.dtype, device,
                                          prefix_views=isinstance(s, CrossKV))
                 for s in specs if isinstance(s, PagedKV) and not (isinstance(s, CrossKV) and s.shares)}
        for s in specs:
            if isinstance(s, CrossKV) and s.shares:
                paged[s.name] = _shared(s, paged, specs, block_size)
        n = n_rows + 1 + n_snapshots
        recurrent = {s.name: {part: torch.zeros(n, *shape, dtype=s.dtype, device=device)
                              for part, shape in s.shapes.items()}
                     for s in specs if isinstance(s, Recurrent)}
        return cls(paged, recurrent, block_size, n_rows, n_blocks)


def _shared(spec: CrossKV, paged: dict[str, KVCache], specs: list[StateSpec], block_size: int) -> KVCache:
    """A CrossKV kind's KVCache on the tensors of the PagedKV kind it shares (specs.py CrossKV.shares)."""
    host = next((s for s in specs if s.name == spec.shares and type(s) is PagedKV), None)
    if host is None or (host.layers, host.kv_heads, host.head_dim, host.dtype) != (
            spec.layers, spec.kv_heads, spec.head_dim, spec.dtype):
        raise ValueError(f"CrossKV {spec.name!r} shares {spec.shares!r}, which is no PagedKV kind of its shape")
    own = paged[host.name]
    return KVCache(own.k, own.v, block_size, prefix_views=True)

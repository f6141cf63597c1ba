"""Which backend attends, and the two calls a family makes: `plan_groups` once per forward (per
paged kind), `attend` per layer, whatever the backend.

The backend is picked once per device (`KVCache.backend`, set on first use when the allocator
left it None): the fused, compiled kernels on CUDA (attention/fused.py), the reference elsewhere
(attention/reference.py). `backend_for` is the one place that choice is made: the engine's
start-up and `plan_groups` both read it from here (tests force the fused path anywhere by
patching it, or by setting `cache.backend`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.tensors import KVCache
from .backend import AttentionBackend, MaskBounds
from .layout import AttentionBatch, Reads
from .reference import ReferenceAttention


@functools.cache
def backend_for(device: torch.device) -> AttentionBackend:
    """The one attention path of a device: fused, compiled kernels on CUDA; the reference elsewhere."""
    if device.type == "cuda":
        from .fused import FusedAttention

        return FusedAttention(compile=True)
    return ReferenceAttention()


def fix_shapes(caches: Iterable[KVCache], bounds: MaskBounds) -> None:
    """Pick each paged cache's backend now (else on first use) and give it the engine's maxima."""
    for kv in caches:
        if kv.backend is None:
            kv.backend = backend_for(kv.k.device)
        kv.backend.fix_shapes(bounds)


@dataclass
class Plans:
    backend: AttentionBackend
    groups: Any  # the backend's per-group plans
    prefix_views: bool = False  # the kind's KVCache.prefix_views: `attend` may read through a PrefixView


def plan_groups(batch: AttentionBatch, kv: KVCache) -> Plans:
    """Once per forward (per paged kind): what every layer's `attend` shares."""
    if kv.backend is None:
        kv.backend = backend_for(kv.k.device)
    return Plans(kv.backend, kv.backend.plan(batch, kv.k.shape[1]), kv.prefix_views)


def attend(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, batch: AttentionBatch, plans: Plans,
           reads: Reads = Reads.PREFIX_AND_OWN, layer: int | None = None) -> torch.Tensor:
    """Write this step's keys/values into their slots, then attend every group. -> [N, H, D].
    `layer`: this call's layer index, which lets a decode group's prefix reads reuse its
    PrefixView on a CrossKV kind (None, or another kind: always gather; the engine sizes memory
    for views of CrossKV kinds only)."""
    if layer is not None and plans.prefix_views:
        return plans.backend.attend(q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans.groups, reads, layer)
    if reads is Reads.PREFIX_AND_OWN:  # keeps backends that predate `reads` working
        return plans.backend.attend(q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans.groups)
    return plans.backend.attend(q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans.groups, reads)

"""Attention over a flat batch of tokens from many sequences: the batch layout a step hands the
model (layout.py), the plain reference (reference.py, CPU and tests) and the fused flex kernels
(fused.py, CUDA, with their paged block masks: paged_mask.py), one picked per device (dispatch.py)
behind one interface (backend.py). Below both the engine and the models: the engine builds an
AttentionBatch, a family's layers call `attend`."""

from ..cache.tensors import KVCache
from .backend import AttentionBackend
from .dispatch import attend, backend_for, plan_groups
from .layout import (PAD, AttentionBatch, PrefixGroup, PrefixView, Reads, SharedPrefix, TaskGroup, bucket, slot_of,
                     write_kv)
from .reference import ReferenceAttention, prefix_self_attention

__all__ = ["PAD", "AttentionBackend", "AttentionBatch", "KVCache", "PrefixGroup", "PrefixView", "Reads",
           "ReferenceAttention", "SharedPrefix", "TaskGroup", "attend", "backend_for", "bucket", "plan_groups",
           "prefix_self_attention", "slot_of", "write_kv"]

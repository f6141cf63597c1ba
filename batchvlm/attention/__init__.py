"""Attention over a flat batch of tokens from many sequences: the batch layout a step hands the
model, the plain reference (CPU, tests) and the fused flex kernels (CUDA). Below both the engine
and the models: the engine builds an AttentionBatch, a family's layers call `attend`."""

from .reference import (PAD, AttentionBackend, AttentionBatch, KVCache, PrefixGroup, PrefixView, Reads,
                        ReferenceAttention, SharedPrefix, TaskGroup, attend, backend_for, bucket, plan_groups,
                        prefix_self_attention, slot_of, write_kv)

__all__ = ["PAD", "AttentionBackend", "AttentionBatch", "KVCache", "PrefixGroup", "PrefixView", "Reads",
           "ReferenceAttention", "SharedPrefix", "TaskGroup", "attend", "backend_for", "bucket", "plan_groups",
           "prefix_self_attention", "slot_of", "write_kv"]

"""Fused attention over the paged KV cache: every kernel reads the cache in place.

The same groups and visibility as the reference (models/attention.py), computed by PyTorch's
fused kernels instead of gathering K/V into dense float32 copies:

  PrefixGroup  the prefix attends to this step's own K/V (the rows it has just computed, not
               the cache): causal prefixes through SDPA with `is_causal` (flash-eligible: right
               padding sits after every real query, so the causal mask already hides it),
               bidirectional ones through SDPA with a key-length mask (memory-efficient kernel).
  TaskGroup    two flex_attention calls over the whole layer cache viewed as one sequence of
               slots, `[1, n_kv_heads, n_slots, head_dim]` (a view: no copy), each with a paged
               block mask. The prefix part has one batch entry per image, the own part one per
               sequence; both return their log-sum-exps (float32, from inside the kernel) and
               merge as in the reference.

Paged block mask. The block mask's KV block size is the cache block size, so a batch entry's
block table *is* its list of KV blocks (`kv_indices`), and `kv_num_blocks` = ceil(len / bs)
stops the kernel after the entry's last used block (the null-block padding of a table is never
visited). Inside a visited block the mask_mod decides per slot. For that it needs the logical
index of a slot: `owner[blk]` is the batch entry whose table holds physical block `blk` and
`logical[blk]` its position in that table, so slot `kv` is entry `owner[kv // bs]`'s token
`logical[kv // bs] * bs + kv % bs`. Within one group every non-null block belongs to exactly one
entry (own blocks to one sequence; prefix blocks to one image, and images are the entries of
the prefix part); the null block is owned by nobody, so padding entries see no key at all
(flex then returns output 0 and LSE -inf, and the merge keeps them finite). The mask_mod is the
whole truth on every slot, so the eager flex fallback (which evaluates it on every slot of the
cache) and the compiled kernel (which evaluates it on visited blocks only) agree.

Compiled shapes. Batch entries, queries per entry and table widths are padded up to powers of
two (padding entries have `kv_num_blocks` 0), so a long run compiles a bounded number of
kernels: O(log rows * log prompt * log blocks) per group kind. KV stays in the model dtype;
softmax and LSE accumulate in float32 inside the kernel.

CUDA graphs: every step here is device tensor work with shapes that follow the input shapes
(no host sync, no data-dependent shapes), so the fixed-shape decode body (engine/graphs.py)
captures it; the compiled kernels are built during its warm-up runs, before capture.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from .attention import AttentionBatch, PrefixGroup, Reads, TaskGroup, bucket, write_kv

log = logging.getLogger(__name__)

Q_BLOCK = 128  # flex's query tile; a decode step (one query per entry) uses one


@dataclass
class PagedMask:
    """A paged block mask for one flex_attention call, and the padded batch it applies to."""

    block_mask: BlockMask
    q_rows: torch.Tensor  # [Bp, Tqp] long: flat query rows; padding -> row N (a zero query)
    n_real: tuple[int, int]  # (B, Tq): entries and queries per entry before the padding


@dataclass
class FusedPlan:
    """Per-forward derived tensors of a group, shared by all layers."""

    group: PrefixGroup | TaskGroup
    key_mask: torch.Tensor | None = None  # [I, 1, 1, L] bool: bidirectional prefix groups
    own: PagedMask | None = None  # task groups: each sequence's own tokens
    prefix: PagedMask | None = None  # task groups: each image's prefix, once per image


def _pad2(t: torch.Tensor, rows: int, cols: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]), value=value)


def paged_mask(q_rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, n_slots: int, block_size: int,
               n_rows: int, q_own: torch.Tensor | None = None) -> PagedMask:
    """Block mask for entries b with queries `q_rows` [B, Tq] reading the `lens` [B] first tokens of
    their blocks `table` [B, nb] in a cache of `n_slots` slots. With `q_own` [B, Tq] (own
    indices), query t of entry b sees its tokens o <= q_own[b, t] only (causal own part)."""
    dev = table.device
    B, Tq = q_rows.shape
    Bp, Tqp, nbp = bucket(B), bucket(Tq), bucket(table.shape[1])
    n_blocks = n_slots // block_size
    table_p = _pad2(table, Bp, nbp, 0)  # [Bp, nbp]
    lens_p = F.pad(lens, (0, Bp - B), value=0)  # [Bp]
    used = (lens_p + block_size - 1) // block_size  # [Bp] blocks holding tokens
    j = torch.arange(nbp, device=dev)
    # owner / logical of every physical block; the last element is a dump for unused table
    # entries and the null block, which stays unowned (-1).
    live = (j[None] < used[:, None]) & (table_p != 0)
    dest = torch.where(live, table_p, n_blocks).reshape(-1)
    owner = torch.full((n_blocks + 1,), -1, dtype=torch.int32, device=dev)
    logical = torch.zeros(n_blocks + 1, dtype=torch.int32, device=dev)
    owner.scatter_(0, dest, torch.arange(Bp, dtype=torch.int32, device=dev).repeat_interleave(nbp))
    logical.scatter_(0, dest, j.to(torch.int32).repeat(Bp))
    owner[n_blocks] = -1
    lens32 = lens_p.to(torch.int32)

    if q_own is None:
        def mask_mod(b, h, q, kv):
            blk = kv // block_size
            return (owner[blk] == b) & (logical[blk] * block_size + kv % block_size < lens32[b])
    else:
        own32 = _pad2(q_own, Bp, Tqp, 0).to(torch.int32)  # [Bp, Tqp]; PAD = 2**30 fits

        def mask_mod(b, h, q, kv):
            blk = kv // block_size
            o = logical[blk] * block_size + kv % block_size
            return (owner[blk] == b) & (o < lens32[b]) & (o <= own32[b, q])

    n_q_blocks = -(-Tqp // Q_BLOCK)
    kv_num_blocks = used.to(torch.int32)[:, None, None].expand(Bp, 1, n_q_blocks).contiguous()
    kv_indices = table_p.to(torch.int32)[:, None, None, :].expand(Bp, 1, n_q_blocks, nbp).contiguous()
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=(Q_BLOCK, block_size),
                                          mask_mod=mask_mod, seq_lengths=(Tqp, n_slots), compute_q_blocks=False)
    return PagedMask(block_mask, _pad2(q_rows, Bp, Tqp, n_rows), (B, Tq))


class FusedAttention:
    """The attention backend of CUDA devices (and of tests that force it on CPU).

    `compile=True` runs flex_attention through torch.compile (the fused kernel; what CUDA uses);
    `compile=False` runs flex's eager implementation, which materializes scores over the whole
    cache: slow, but it evaluates the same block masks and mask_mods, so CPU tests check them."""

    def __init__(self, compile: bool):
        self.compile = compile
        self._flex: Callable = torch.compile(flex_attention, dynamic=False) if compile else flex_attention
        self._seen: set[tuple] = set()
        self.compile_s = 0.0  # time spent in calls that compiled a new kernel (logged separately)

    def plan(self, batch: AttentionBatch, n_slots: int) -> list[FusedPlan]:
        bs = batch.block_size
        n_rows = batch.write_slots.shape[0]
        plans = []
        for g in batch.groups:
            if isinstance(g, PrefixGroup):
                key_mask = None
                if not g.causal:
                    j = torch.arange(g.q_rows.shape[1], device=g.lens.device)
                    key_mask = (j[None, :] < g.lens[:, None])[:, None, None, :]
                plans.append(FusedPlan(g, key_mask=key_mask))
                continue
            p = g.prefix
            plans.append(FusedPlan(
                g, own=paged_mask(g.q_rows, g.table, g.own_len, n_slots, bs, n_rows, g.q_own),
                prefix=paged_mask(p.q_rows, p.tables, p.lens, n_slots, bs, n_rows)))
        return plans

    def _paged(self, q_pad: torch.Tensor, k_1HSD: torch.Tensor, v_1HSD: torch.Tensor,
               m: PagedMask) -> tuple[torch.Tensor, torch.Tensor]:
        """-> output [B, Tq, H, D] (query dtype), LSE [B, Tq, H] float32 (natural log)."""
        q_BHTD = q_pad[m.q_rows].transpose(1, 2)
        gqa = k_1HSD.shape[1] != q_BHTD.shape[1]
        key = (tuple(q_BHTD.shape), tuple(m.block_mask.kv_indices.shape), tuple(k_1HSD.shape), q_BHTD.dtype)
        new = self.compile and key not in self._seen
        t0 = time.perf_counter() if new else 0.0
        o, aux = self._flex(q_BHTD, k_1HSD, v_1HSD, block_mask=m.block_mask, enable_gqa=gqa,
                            return_aux=AuxRequest(lse=True))
        if new:
            self._seen.add(key)
            dt = time.perf_counter() - t0
            self.compile_s += dt
            log.info("flex_attention compiled for %s in %.1f s", key, dt)
        B, Tq = m.n_real
        return o[:B, :, :Tq].transpose(1, 2), aux.lse[:B, :, :Tq].transpose(1, 2)

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, batch: AttentionBatch, plans: list[FusedPlan],
               reads: Reads = Reads.PREFIX_AND_OWN) -> torch.Tensor:
        write_kv(k_NHD, v_NHD, k_cache, v_cache, batch, reads)
        N, H, D = q_NHD.shape
        Hkv = k_NHD.shape[1]
        q_pad = torch.cat([q_NHD, q_NHD.new_zeros(1, H, D)])
        out = q_NHD.new_zeros(N + 1, H, D)
        # The whole layer cache as one sequence of slots: [S, Hkv, D] -> [1, Hkv, S, D], a view.
        k_1HSD, v_1HSD = k_cache[None].transpose(1, 2), v_cache[None].transpose(1, 2)
        for plan in plans:
            g = plan.group
            if isinstance(g, PrefixGroup) and reads is not Reads.PREFIX_AND_OWN:
                continue  # prefix rows are queried by prefix+own layers only
            if isinstance(g, PrefixGroup):
                # This step's own K/V rows of the prefix (just computed; not read back from the cache).
                k_pad = torch.cat([k_NHD, k_NHD.new_zeros(1, Hkv, D)])
                v_pad = torch.cat([v_NHD, v_NHD.new_zeros(1, Hkv, D)])
                q_BHLD = q_pad[g.q_rows].transpose(1, 2)
                k_BHLD, v_BHLD = k_pad[g.q_rows].transpose(1, 2), v_pad[g.q_rows].transpose(1, 2)
                o_BHLD = F.scaled_dot_product_attention(q_BHLD, k_BHLD, v_BHLD, attn_mask=plan.key_mask,
                                                        is_causal=g.causal, enable_gqa=Hkv != H)
                out[g.q_rows] = o_BHLD.transpose(1, 2)
                continue
            o1, l1 = self._paged(q_pad, k_1HSD, v_1HSD, plan.own) if reads is not Reads.PREFIX else (None, None)
            if reads is Reads.OWN:
                out[g.q_rows] = o1.to(out.dtype)
                continue
            pre, pre_lse = self._paged(q_pad, k_1HSD, v_1HSD, plan.prefix)  # [I, M, H, D], [I, M, H]
            # Per-image results to the group's [B, Tq] layout (padding reads an appended zero slot).
            p = g.prefix
            I, M = p.q_rows.shape
            pre_flat = torch.cat([pre.reshape(I * M, H, D), pre.new_zeros(1, H, D)])
            lse_flat = torch.cat([pre_lse.reshape(I * M, H), pre_lse.new_zeros(1, H)])
            o2, l2 = pre_flat[p.q_slot], lse_flat[p.q_slot]  # [B, Tq, H, D], [B, Tq, H]
            if reads is Reads.PREFIX:
                out[g.q_rows] = o2.to(out.dtype)
                continue
            # A query that sees no key in one part has LSE -inf there: weight 0. Padding queries
            # may see none at all; the clamps keep them finite (their outputs are discarded).
            m = torch.maximum(l1, l2).clamp(min=torch.finfo(torch.float32).min)
            w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
            merged = (o1.float() * w1 + o2.float() * w2) / (w1 + w2).clamp(min=1e-30)
            out[g.q_rows] = merged.to(out.dtype)
        return out[:N]

"""The paged block mask of one flex_attention call: a batch entry's block table is its list of
KV blocks, and a mask_mod that says, slot by slot, which keys an entry's queries see.

The block mask's KV block size is the cache block size, so a batch entry's
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

Kernel tiles. Inductor picks flex's decode kernel when a call has < 128 queries per entry and the
query heads per KV head are a power of two; else the main kernel. The block mask's KV block is the
cache block, and both kernels need their BLOCK_N to divide it (the main kernel's sm_90 defaults
are 32-128 wide, more than a 16-token block), so `flex_tiles` passes `kernel_options` with a
BLOCK_N that divides every supported block size (16, 32, 64, 128). The decode kernel's query tile
holds queries x group heads (next power of two, >= 16) and must divide the mask's query block:
the query block grows with it (e.g. 64 queries x 4 heads -> 256). No tile is larger than
inductor's own sm_90 default for the dtype and head dim (64 x 32 at Qwen3.5's head dim 256, where
128 x 64 would not fit in shared memory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from .layout import bucket

Q_BLOCK = 128  # the mask's query block for the main kernel (its BLOCK_M, <= 128, divides it)


# num_stages / num_warps for inductor's flex decode kernel (the calls with < 128 queries per entry);
# empty: inductor's choice (torch 2.11 on sm_90: 1 stage, 2 warps, as a later branch of its
# heuristics overwrites the sm_90 one). Unchanged until a device measures better:
# scripts/bench_attention.py --decode-sweep times the candidates.
DECODE_OPTIONS: dict[str, int] = {}


def flex_tiles(block_size: int, dtype: torch.dtype, head_dim: int, n_queries: int, group: int
               ) -> tuple[int, dict[str, int | bool]]:
    """-> (the mask's query block, kernel_options) of one flex call with `n_queries` (padded)
    queries per entry and `group` query heads per KV head. Tiles never exceed inductor's sm_90
    defaults (so they fit in shared memory) and BLOCK_N divides the KV block size."""
    pow2_group = group & (group - 1) == 0
    if n_queries < 128 and pow2_group:  # inductor's decode kernel
        return max(Q_BLOCK, bucket(n_queries * group)), {"BLOCK_N": min(block_size, 64), **DECODE_OPTIONS}
    wide = dtype == torch.float32
    big = head_dim > 128  # Qwen3.5's 256: inductor's own sm_90 tiles are 64 x 32 there (shared memory)
    options: dict[str, int | bool] = {"BLOCK_M": 32 if wide and head_dim > 64 else 64 if big else 128,
                                      "BLOCK_N": min(block_size, 32 if wide or big else 64)}
    if not pow2_group:  # torch < 2.10 would still try the decode kernel, which needs a power of two
        options["FORCE_USE_FLEX_ATTENTION"] = True
    return Q_BLOCK, options


@dataclass
class PagedMask:
    """A paged block mask for one flex_attention call, and the padded batch it applies to. The
    BlockMask itself is made on the first layer's call, when the query heads are known (its query
    block depends on them); later layers reuse it."""

    kv_num_blocks: torch.Tensor  # [Bp, 1, n_q_blocks] int32
    kv_indices: torch.Tensor  # [Bp, 1, n_q_blocks, nbp] int32
    mask_mod: Callable
    seq_lengths: tuple[int, int]  # (Tqp, n_slots)
    block_size: int
    q_rows: torch.Tensor  # [Bp, Tqp] long: flat query rows; padding -> row N (a zero query)
    n_real: tuple[int, int]  # (B, Tq): entries and queries per entry before the padding
    _made: tuple | None = None  # (group, dtype, head dim, BlockMask, kernel options)

    def for_heads(self, group: int, dtype: torch.dtype, head_dim: int) -> tuple[BlockMask, dict]:
        key = (group, dtype, head_dim)
        if self._made is None or self._made[:3] != key:
            q_block, options = flex_tiles(self.block_size, dtype, head_dim, self.seq_lengths[0], group)
            mask = BlockMask.from_kv_blocks(self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=(q_block, self.block_size),
                                            mask_mod=self.mask_mod, seq_lengths=self.seq_lengths,
                                            compute_q_blocks=False)
            self._made = (*key, mask, options)
        return self._made[3], self._made[4]


def _pad2(t: torch.Tensor, rows: int, cols: int, value: int) -> torch.Tensor:
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]), value=value)


def paged_mask(q_rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, n_slots: int, block_size: int,
               n_rows: int, padded: tuple[int, int, int], q_own: torch.Tensor | None = None) -> PagedMask:
    """Block mask for entries b with queries `q_rows` [B, Tq] reading the `lens` [B] first tokens of
    their blocks `table` [B, nb] in a cache of `n_slots` slots, padded to `padded` (Bp, Tqp, nbp).
    With `q_own` [B, Tq] (own indices), query t of entry b sees its tokens o <= q_own[b, t] only
    (causal own part)."""
    dev = table.device
    B, Tq = q_rows.shape
    Bp, Tqp, nbp = padded
    if B > Bp or Tq > Tqp or table.shape[1] > nbp:
        raise ValueError(f"a step of {B} entries x {Tq} queries x {table.shape[1]} blocks exceeds the mask "
                         f"bounds {padded}")
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

    # ceil(Tqp / Q_BLOCK) query blocks: the main kernel's; the decode kernel (Tqp < 128) has one
    # either way, whatever query block for_heads picks.
    n_q_blocks = -(-Tqp // Q_BLOCK)
    kv_num_blocks = used.to(torch.int32)[:, None, None].expand(Bp, 1, n_q_blocks).contiguous()
    kv_indices = table_p.to(torch.int32)[:, None, None, :].expand(Bp, 1, n_q_blocks, nbp).contiguous()
    return PagedMask(kv_num_blocks, kv_indices, mask_mod, (Tqp, n_slots), block_size, _pad2(q_rows, Bp, Tqp, n_rows),
                     (B, Tq))

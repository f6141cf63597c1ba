"""Fused attention over the paged KV cache: every kernel reads the cache in place.

The same groups and visibility as the reference (attention/layout.py), computed by PyTorch's
fused kernels instead of gathering K/V into dense float32 copies:

  PrefixGroup  the prefix attends to this step's own K/V (the rows it has just computed, not
               the cache): causal prefixes through SDPA with `is_causal` (flash-eligible: right
               padding sits after every real query, so the causal mask already hides it),
               bidirectional ones through SDPA with a key-length mask (memory-efficient kernel), a
               bidirectional image part before a causal prefix prompt with a full [L, L] mask.
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

Compiled shapes. dynamo keeps at most `recompile_limit` compiled entries per code object (8 by
default; every flex_attention call of the process shares one), and past it flex runs unfused:
the whole layer cache in float32 and dense scores, ~50x slower. So the engine gives the backend
fixed maxima (`MaskBounds`: rows, prompt length, own and prefix blocks, sequences per image) and
every mask is padded to them: entries to the row count, queries to 1 (decode) or the longest
prompt, tables to the widest table. Padding entries have `kv_num_blocks` 0, so the kernel skips
them and the padding costs almost nothing. One engine configuration then compiles 2 shapes per
group kind (own / prefix part, decode / prompt) per KV cache size, 8 with the warm-up's scratch
cache. The limit is raised deliberately and hitting it is an error (`fail_on_recompile_limit_hit`,
`fullgraph`): a fallback must never be silent. Without bounds (tests of random batches) and in
eager flex (which compiles nothing), sizes are padded up to powers of two. KV stays in the model
dtype; softmax and LSE accumulate in float32 inside the kernel.

Kernel tiles. Inductor picks flex's decode kernel when a call has < 128 queries per entry and the
query heads per KV head are a power of two; else the main kernel. The block mask's KV block is the
cache block, and both kernels need their BLOCK_N to divide it (the main kernel's sm_90 defaults
are 32-128 wide, more than a 16-token block), so `flex_tiles` passes `kernel_options` with a
BLOCK_N that divides every supported block size (16, 32, 64, 128). The decode kernel's query tile
holds queries x group heads (next power of two, >= 16) and must divide the mask's query block:
the query block grows with it (e.g. 64 queries x 4 heads -> 256). No tile is larger than
inductor's own sm_90 default for the dtype and head dim (64 x 32 at Qwen3.5's head dim 256, where
128 x 64 would not fit in shared memory).

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

from .backend import COMPILED, MaskBounds
from .layout import AttentionBatch, PrefixGroup, Reads, TaskGroup, bucket, write_kv

log = logging.getLogger(__name__)

Q_BLOCK = 128  # the mask's query block for the main kernel (its BLOCK_M, <= 128, divides it)
RECOMPILE_LIMIT = 64  # compiled flex entries per process: a few engine configurations, 8 each


def flex_tiles(block_size: int, dtype: torch.dtype, head_dim: int, n_queries: int, group: int
               ) -> tuple[int, dict[str, int | bool]]:
    """-> (the mask's query block, kernel_options) of one flex call with `n_queries` (padded)
    queries per entry and `group` query heads per KV head. Tiles never exceed inductor's sm_90
    defaults (so they fit in shared memory) and BLOCK_N divides the KV block size."""
    pow2_group = group & (group - 1) == 0
    if n_queries < 128 and pow2_group:  # inductor's decode kernel
        return max(Q_BLOCK, bucket(n_queries * group)), {"BLOCK_N": min(block_size, 64)}
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


@dataclass
class FusedPlan:
    """Per-forward derived tensors of a group, shared by all layers."""

    group: PrefixGroup | TaskGroup
    key_mask: torch.Tensor | None = None  # [I, 1, 1, L] bool: bidirectional prefixes of unequal lengths;
    # [I, 1, L, L]: a bidirectional part before a causal prefix prompt (PrefixGroup.bidir_lens)
    own: PagedMask | None = None  # task groups: each sequence's own tokens
    prefix: PagedMask | None = None  # task groups: each image's prefix, once per image


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


_compiled_flex: dict[str, Callable] = {}


def compiled_flex(backend: str = "inductor") -> Callable:
    """flex_attention through torch.compile, one wrapper per backend for the whole process (the
    dynamo cache is per code object anyway). The recompile limit is raised once and hitting it
    raises. "eager" runs the traced graph without inductor: CPU tests count entries with it."""
    if backend not in _compiled_flex:
        inner = torch._dynamo.lookup_backend(backend)

        def counting(gm, example_inputs):
            COMPILED.shapes += 1
            return inner(gm, example_inputs)

        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        cfg.fail_on_recompile_limit_hit = True
        _compiled_flex[backend] = torch.compile(flex_attention, backend=counting, dynamic=False, fullgraph=True)
    return _compiled_flex[backend]


class FusedAttention:
    """The attention backend of CUDA devices (and of tests that force it on CPU).

    `compile=True` runs flex_attention through torch.compile (the fused kernel; what CUDA uses);
    `compile=False` runs flex's eager implementation, which materializes scores over the whole
    cache: slow, but it evaluates the same block masks and mask_mods, so CPU tests check them.
    `bounds` (set by the engine before its first step) fixes the padded shapes; see the module docstring."""

    reads_in_place = True

    def __init__(self, compile: bool, backend: str = "inductor", bounds: MaskBounds | None = None):
        self.compile = compile
        self._flex: Callable = compiled_flex(backend) if compile else flex_attention
        self.bounds = bounds
        self.compile_s = 0.0  # time spent in this backend's calls that compiled a new kernel
        self.compiled_shapes = 0

    def fix_shapes(self, bounds: MaskBounds) -> None:
        self.bounds = bounds

    def _padded(self, kind: str, B: int, Tq: int, nb: int) -> tuple[int, int, int]:
        # Eager flex compiles nothing, and its dense scores grow with every padding entry.
        if self.bounds is None or not self.compile:
            return bucket(B), bucket(Tq), bucket(nb)
        return self.bounds.own(Tq) if kind == "own" else self.bounds.prefix(Tq)

    def plan(self, batch: AttentionBatch, n_slots: int) -> list[FusedPlan]:
        bs = batch.block_size
        n_rows = batch.write_slots.shape[0]
        plans = []
        for g in batch.groups:
            if isinstance(g, PrefixGroup):
                key_mask = None
                j = torch.arange(g.q_rows.shape[1], device=g.lens.device)
                if g.bidir_lens is not None:  # causal after a bidirectional part: a full [L, L] mask
                    seen = (j[None, :] <= j[:, None])[None] | (j[None, None, :] < g.bidir_lens[:, None, None])
                    key_mask = (seen & (j[None, None, :] < g.lens[:, None, None]))[:, None]
                elif not g.causal and not g.all_full:
                    key_mask = (j[None, :] < g.lens[:, None])[:, None, None, :]
                plans.append(FusedPlan(g, key_mask=key_mask))
                continue
            p = g.prefix
            own_pad = self._padded("own", *g.q_rows.shape, g.table.shape[1])
            pre_pad = self._padded("prefix", *p.q_rows.shape, p.tables.shape[1])
            plans.append(FusedPlan(
                g, own=paged_mask(g.q_rows, g.table, g.own_len, n_slots, bs, n_rows, own_pad, g.q_own),
                prefix=paged_mask(p.q_rows, p.tables, p.lens, n_slots, bs, n_rows, pre_pad)))
        return plans

    def _paged(self, q_pad: torch.Tensor, k_1HSD: torch.Tensor, v_1HSD: torch.Tensor,
               m: PagedMask) -> tuple[torch.Tensor, torch.Tensor]:
        """-> output [B, Tq, H, D] (query dtype), LSE [B, Tq, H] float32 (natural log)."""
        q_BHTD = q_pad[m.q_rows].transpose(1, 2)
        H, Hkv = q_BHTD.shape[1], k_1HSD.shape[1]
        block_mask, options = m.for_heads(H // Hkv, q_BHTD.dtype, q_BHTD.shape[-1])
        before, t0 = COMPILED.shapes, time.perf_counter()
        o, aux = self._flex(q_BHTD, k_1HSD, v_1HSD, block_mask=block_mask, enable_gqa=H != Hkv,
                            return_aux=AuxRequest(lse=True), kernel_options=options)
        if COMPILED.shapes != before:
            dt = time.perf_counter() - t0
            self.compile_s += dt
            self.compiled_shapes += COMPILED.shapes - before
            COMPILED.seconds += dt
            log.info("flex_attention compiled for q %s, kv blocks %s, cache %s, %s in %.1f s", tuple(q_BHTD.shape),
                     tuple(m.kv_indices.shape), tuple(k_1HSD.shape), q_BHTD.dtype, dt)
        B, Tq = m.n_real
        return o[:B, :, :Tq].transpose(1, 2), aux.lse[:B, :, :Tq].transpose(1, 2)

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, batch: AttentionBatch, plans: list[FusedPlan],
               reads: Reads = Reads.PREFIX_AND_OWN, layer: int | None = None) -> torch.Tensor:
        """`layer` is not needed: the kernels read the cache in place (no PrefixView)."""
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
                                                        is_causal=g.causal and plan.key_mask is None,
                                                        enable_gqa=Hkv != H)
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

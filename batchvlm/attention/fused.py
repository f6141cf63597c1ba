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
               merge as in the reference. Their masks are attention/paged_mask.py's.

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
from torch.nn.attention.flex_attention import AuxRequest, flex_attention

from .backend import COMPILED, MaskBounds
from .layout import AttentionBatch, PrefixGroup, Reads, TaskGroup, bucket, write_kv
from .paged_mask import PagedMask, paged_mask

log = logging.getLogger(__name__)

RECOMPILE_LIMIT = 64  # compiled flex entries per process: a few engine configurations, 8 each


@dataclass
class FusedPlan:
    """Per-forward derived tensors of a group, shared by all layers."""

    group: PrefixGroup | TaskGroup
    key_mask: torch.Tensor | None = None  # [I, 1, 1, L] bool: bidirectional prefixes of unequal lengths;
    # [I, 1, L, L]: a bidirectional part before a causal prefix prompt (PrefixGroup.bidir_lens)
    own: PagedMask | None = None  # task groups: each sequence's own tokens
    prefix: PagedMask | None = None  # task groups: each image's prefix, once per image


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

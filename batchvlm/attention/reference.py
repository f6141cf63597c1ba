"""Attention over a paged KV cache, for a flat batch of tokens from many sequences.

The KV cache is one tensor of slots: `[n_layers, n_blocks * block_size, n_kv_heads, head_dim]`.
Block 0 is the null block: padding tokens write there and padded keys read from there.

Every sequence is a prefix segment (an image prefix, shared by all tasks on that image; or an
(image, prompt) encoding) then the task's own tokens (its prompt, then what it generates). The
two live in separate blocks: a prefix's blocks hold its L prefix tokens (index j < L, the tail
of the last block unused) and a sequence's own blocks hold own token o at index o. So prefix
blocks are shared copy-free by every sequence on the prefix (cache/blocks.py refcounts them),
and L may differ per prefix (it may be 0).

Visibility:
  prefix token j   sees prefix keys j' < L: all of them (bidirectional prefix), j' <= j (causal), or
                   (a bidirectional image part of B tokens before a causal prefix prompt) j' < B or
                   j' <= j
  own token o      sees every prefix key of its image, and own keys o' <= o

Two kinds of group:
  PrefixGroup  image prefixes being prefilled, one padded row per image.
  TaskGroup    own tokens of sequences (prompts, or one decode token each). The image prefix is
               read once per *image*, not once per sequence: every image's queries attend
               together to its prefix, each sequence to its own tokens, and the two partial
               softmaxes are merged exactly by their log-sum-exps (cascade attention). With
               several tasks per image this divides the dominant memory traffic by their number.
Rotary positions are applied before attention and play no part here.

What a call reads and writes (`reads`, a family's choice per layer):
  PREFIX_AND_OWN  decoder-only layers: prefix and own keys in one softmax (cascade), every row of
                  the step writes its K/V (prefix rows into the prefix's blocks).
  OWN             an encoder-decoder's decoder self-attention: own keys only; own rows write.
                  Prefix groups are not queried (their rows come back as zeros).
  PREFIX          cross-attention: prefix keys only, read-only for own tokens. `k`/`v` hold the
                  step's prefix rows only ([n_prefix, ...], what the family computed from its
                  encoder output); they are written into the prefix's blocks.

Backends. This file is the plain reference (gathers, float32 softmax): CPU and tests. A decode
group's prefix K/V, read-only while it decodes, are gathered once into a PrefixView that later
steps on the same prefixes reuse (the engine decides when; see PrefixView). CUDA uses the fused
kernels of attention/fused.py, which read the cache in place. The backend is
picked once per device (`KVCache.backend`, set on first use when the allocator left it None); a
family calls `plan_groups(batch, kv)` once per forward and `attend(...)` per layer, whatever the
backend.
Tests force the fused path anywhere by setting `cache.backend`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ..cache.spans import StateSpans
from ..cache.tensors import KVCache

__all__ = ["KVCache", "StateSpans"]  # re-exported: families and tests build batches from here

PAD = 2**30  # own index of a padding query: later than any real token


def bucket(n: int) -> int:
    """Smallest power of two >= n (>= 1): the padded sizes of compiled kernels and CUDA graphs."""
    return 1 << max(n - 1, 0).bit_length()


class Reads(Enum):
    PREFIX_AND_OWN = "prefix+own"
    OWN = "own"
    PREFIX = "prefix"


@dataclass
class PrefixGroup:
    q_rows: torch.Tensor  # [I, L] long: flat rows of each image's prefix tokens; padding -> row N
    table: torch.Tensor  # [I, n_prefix_blocks] long: prefix blocks; padding -> 0 (null block)
    lens: torch.Tensor  # [I] long: prefix length L of each image
    causal: bool
    all_full: bool = False  # known on the host: every prefix is L long (a bidirectional one needs no key mask)
    # With `causal`: [I] long, keys j' < bidir_lens[i] are seen by every query of prefix i (Moondream's
    # bidirectional image part before a causal prefix prompt); None: plain causal.
    bidir_lens: torch.Tensor | None = None


@dataclass
class SharedPrefix:
    tables: torch.Tensor  # [I, n_prefix_blocks] long: each image's prefix blocks
    lens: torch.Tensor  # [I] long: each image's prefix length
    q_rows: torch.Tensor  # [I, M] long: flat query rows on each image; padding -> row N
    q_slot: torch.Tensor  # [B, Tq] long: where each group query sits in [I * M]; padding -> I * M
    # Known on the host, where the caller has it: the longest prefix (keys past it are never
    # read) and whether every image's prefix is that long (then no mask is needed at all).
    max_len: int | None = None
    all_full: bool = False
    # Dense copies of these prefixes' K/V that later steps may reuse (PrefixView); None: gather.
    view: PrefixView | None = None


class PrefixView:
    """Dense copies of a decode group's prefix K/V, [I, H, Lp, D] per (reads, layer), made on the
    first read of a layer and reused by later steps that decode against the same prefixes, so a
    read-only prefix (cross-attention K/V above all) is not gathered from its blocks every step.

    Correct by construction, not by lookup: the engine (engine/runner.py) owns the view and hands
    a step the previous step's view only when no prefix has been written since the view was made
    and the step's prefix tables and lengths (host arrays of its plan) are the previous step's.
    Prefix K/V are written only when a prefix is prefilled, so the copies are then exactly what
    a gather would read. Keyed by (reads, layer): only CrossKV kinds are viewed (`attend`), one
    per (reads, layer). Its size is cache/specs.py `prefix_view_bytes`, which the engine's
    memory sizing reserves. The fused backend reads the cache in place and never fills a view."""

    def __init__(self) -> None:
        self._kv: dict[tuple[Reads, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for kv in self._kv.values() for t in kv)

    def read(self, key: tuple[Reads, int], gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._kv:
            self._kv[key] = gather()
        return self._kv[key]


@dataclass
class TaskGroup:
    q_rows: torch.Tensor  # [B, Tq] long: rows of the flat token batch; padding -> row N (scratch)
    q_own: torch.Tensor  # [B, Tq] long: own index of each query; padding -> PAD
    table: torch.Tensor  # [B, n_own_blocks] long: own blocks; padding -> 0 (null block)
    own_len: torch.Tensor  # [B] long: own tokens in the cache after this step's writes
    prefix: SharedPrefix


@dataclass
class AttentionBatch:
    write_slots: torch.Tensor  # [N] long: cache slot of each token's k/v; padding -> null slot
    groups: list[PrefixGroup | TaskGroup]
    block_size: int
    n_prefix: int = 0  # flat rows [0, n_prefix) are prefix tokens (host int)
    states: StateSpans | None = None  # where each sequence's tokens sit, for recurrent layers


def slot_of(table: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of the token at `index` in a sequence of blocks `table`: table [..., nb] with
    index [...] (one per row) or [..., T]."""
    if index.dim() == table.dim() - 1:
        block = table.gather(-1, (index // block_size)[..., None])[..., 0]
    else:
        block = table.gather(-1, index // block_size)
    return block * block_size + index % block_size


def _all_slots(table: torch.Tensor, block_size: int) -> torch.Tensor:
    """[..., nb] blocks -> [..., nb * block_size] slots, in index order."""
    j = torch.arange(table.shape[-1] * block_size, device=table.device)
    return table[..., j // block_size] * block_size + j % block_size


@dataclass
class GroupPlan:
    """Per-forward derived tensors of a group, shared by all layers."""

    group: PrefixGroup | TaskGroup
    k_slots: torch.Tensor  # [B, Lk] the group's keys (prefix group: the prefix; task group: own)
    mask: torch.Tensor  # [B, 1, Tq, Lk] bool
    prefix_slots: torch.Tensor | None = None  # [I, Lp] task groups: each image's prefix keys
    prefix_mask: torch.Tensor | None = None  # [I, 1, 1, Lp]; None: every key is valid


def _plan_reference(batch: AttentionBatch) -> list[GroupPlan]:
    bs = batch.block_size
    plans = []
    for g in batch.groups:
        if isinstance(g, PrefixGroup):
            k_slots = _all_slots(g.table, bs)
            j = torch.arange(k_slots.shape[1], device=k_slots.device)
            valid = j[None, None, :] < g.lens[:, None, None]  # [I, 1, Lk]
            if g.causal:
                q = torch.arange(g.q_rows.shape[1], device=j.device)
                seen = (j[None, :] <= q[:, None])[None]  # [1, L, Lk]
                if g.bidir_lens is not None:
                    seen = seen | (j[None, None, :] < g.bidir_lens[:, None, None])
                valid = valid & seen  # [I, L, Lk]
            plans.append(GroupPlan(g, k_slots, valid[:, None]))
            continue
        k_slots = _all_slots(g.table, bs)
        j = torch.arange(k_slots.shape[1], device=k_slots.device)
        mask = (j[None, None, :] < g.own_len[:, None, None]) & (j[None, None, :] <= g.q_own[:, :, None])
        p = g.prefix
        empty = p.max_len == 0  # read one masked slot: the query sees no key (output 0, LSE -inf)
        prefix_slots = _all_slots(p.tables, bs)[:, : 1 if empty else p.max_len]
        jp = torch.arange(prefix_slots.shape[1], device=k_slots.device)
        prefix_mask = None if p.all_full and not empty else (jp[None, :] < p.lens[:, None])[:, None, None, :]
        plans.append(GroupPlan(g, k_slots, mask[:, None], prefix_slots, prefix_mask))
    return plans


def _attend_lse(q_BHTD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                mask: torch.Tensor | None, may_see_none: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the scores (float32). -> [B,H,T,D], [B,H,T]
    `may_see_none`: a query may see no key (an empty or ragged prefix). Own keys never are: every
    query, padding ones included, sees its own token's key."""
    H = q_BHTD.shape[1]
    if k_BHLD.shape[1] != H:
        k_BHLD = k_BHLD.repeat_interleave(H // k_BHLD.shape[1], dim=1)
        v_BHLD = v_BHLD.repeat_interleave(H // v_BHLD.shape[1], dim=1)
    scores = (q_BHTD.float() * q_BHTD.shape[-1] ** -0.5) @ k_BHLD.float().transpose(-1, -2)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    # In place: the scores are the largest tensor here.
    m = scores.amax(dim=-1, keepdim=True)
    if may_see_none:  # a query that sees no key gets output 0 and LSE -inf: it weighs 0 in the merge
        m = m.clamp(min=torch.finfo(torch.float32).min)
    p = scores.sub_(m).exp_()
    total = p.sum(dim=-1)
    if may_see_none:
        return (p @ v_BHLD.float()) / total.clamp(min=1e-30)[..., None], m[..., 0] + total.log()
    return (p @ v_BHLD.float()) / total[..., None], m[..., 0] + total.log()


def _attend_reference(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    plans: list[GroupPlan],
    reads: Reads = Reads.PREFIX_AND_OWN,
    layer: int | None = None,
) -> torch.Tensor:
    """`layer`: the call's layer, which lets a decode group reuse its prefixes' PrefixView."""
    write_kv(k_NHD, v_NHD, k_cache, v_cache, batch, reads)
    N, H, D = q_NHD.shape
    q_pad = torch.cat([q_NHD, q_NHD.new_zeros(1, H, D)])
    out = q_NHD.new_zeros(N + 1, H, D)
    for plan in plans:
        g = plan.group
        if isinstance(g, PrefixGroup) and reads is not Reads.PREFIX_AND_OWN:
            continue
        if isinstance(g, TaskGroup) and reads is Reads.PREFIX:  # cross-attention: no own part
            out[g.q_rows] = _prefix_part(q_pad, k_cache, v_cache, plan, reads, layer, lse=False)[0].to(out.dtype)
            continue
        q_BHTD = q_pad[g.q_rows].transpose(1, 2)
        k_BHLD = k_cache[plan.k_slots].transpose(1, 2).to(q_NHD.dtype)
        v_BHLD = v_cache[plan.k_slots].transpose(1, 2).to(q_NHD.dtype)
        if isinstance(g, PrefixGroup):
            o_BHTD = F.scaled_dot_product_attention(
                q_BHTD, k_BHLD, v_BHLD, attn_mask=plan.mask, enable_gqa=k_BHLD.shape[1] != H
            )
            out[g.q_rows] = o_BHTD.transpose(1, 2)
            continue
        if reads is Reads.OWN:
            out[g.q_rows] = _attend_plain(q_BHTD, k_BHLD, v_BHLD, plan.mask).transpose(1, 2).to(out.dtype)
            continue
        own, own_lse = _attend_lse(q_BHTD, k_BHLD, v_BHLD, plan.mask)  # [B, H, Tq, D], [B, H, Tq]
        o2, l2 = _prefix_part(q_pad, k_cache, v_cache, plan, reads, layer)
        o1, l1 = own.transpose(1, 2), own_lse.transpose(1, 2)
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
        out[g.q_rows] = ((o1 * w1 + o2 * w2) / (w1 + w2)).to(out.dtype)
    return out[:N]


def _attend_plain(q_BHTD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
    """A one-part read (no merge, so no log-sum-exp): float32 SDPA; a query that sees no key
    gets 0, as in `_attend_lse`."""
    o = F.scaled_dot_product_attention(q_BHTD.float(), k_BHLD.float(), v_BHLD.float(), attn_mask=mask,
                                       enable_gqa=k_BHLD.shape[1] != q_BHTD.shape[1])
    return o.nan_to_num_(0.0)


def _prefix_part(q_pad: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: GroupPlan, reads: Reads,
                 layer: int | None, lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A task group's attention to its prefixes, each image's queries together, brought to the
    group's [B, Tq] layout (padding reads a zero slot). -> [B, Tq, H, D], LSE [B, Tq, H] (None
    without `lse`: a prefix-only read). The prefix K/V come from the group's PrefixView when it
    has one and the call names its layer, else from a gather."""
    p = plan.group.prefix
    H, D = q_pad.shape[1:]
    q_IHMD = q_pad[p.q_rows].transpose(1, 2)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        return (k_cache[plan.prefix_slots].transpose(1, 2).contiguous(),
                v_cache[plan.prefix_slots].transpose(1, 2).contiguous())

    k_IHLD, v_IHLD = gather() if p.view is None or layer is None else p.view.read((reads, layer), gather)
    if lse:
        pre, pre_lse = _attend_lse(q_IHMD, k_IHLD, v_IHLD, plan.prefix_mask, p.max_len == 0 or not p.all_full)
    else:
        pre, pre_lse = _attend_plain(q_IHMD, k_IHLD, v_IHLD, plan.prefix_mask), None
    I, _, M, _ = pre.shape
    pre_flat = torch.cat([pre.transpose(1, 2).reshape(I * M, H, D), pre.new_zeros(1, H, D)])
    if pre_lse is None:
        return pre_flat[p.q_slot], None
    lse_flat = torch.cat([pre_lse.transpose(1, 2).reshape(I * M, H), pre_lse.new_zeros(1, H)])
    return pre_flat[p.q_slot], lse_flat[p.q_slot]


class AttentionBackend(Protocol):
    def plan(self, batch: AttentionBatch, n_slots: int) -> Any:
        """Per-forward tensors shared by all layers, for a cache of n_slots slots per layer."""

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, batch: AttentionBatch, plans: Any,
               reads: Reads = Reads.PREFIX_AND_OWN, layer: int | None = None) -> torch.Tensor:
        """Write this step's keys/values into their slots, then attend every group. -> [N, H, D].
        `layer`: the call's layer, named by families whose prefix reads may use a PrefixView."""


def write_kv(k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             batch: AttentionBatch, reads: Reads) -> None:
    """The writes of one attention call (see `Reads`)."""
    slots = batch.write_slots
    if reads is Reads.OWN:
        slots, k_NHD, v_NHD = slots[batch.n_prefix:], k_NHD[batch.n_prefix:], v_NHD[batch.n_prefix:]
    elif reads is Reads.PREFIX:
        slots = slots[: batch.n_prefix]
    k_cache.index_copy_(0, slots, k_NHD.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v_NHD.to(v_cache.dtype))


class ReferenceAttention:
    def plan(self, batch: AttentionBatch, n_slots: int) -> list[GroupPlan]:
        return _plan_reference(batch)

    def attend(self, q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans,
               reads: Reads = Reads.PREFIX_AND_OWN, layer: int | None = None) -> torch.Tensor:
        return _attend_reference(q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans, reads, layer)


@functools.cache
def backend_for(device: torch.device) -> AttentionBackend:
    """The one attention path of a device: fused, compiled kernels on CUDA; the reference elsewhere."""
    if device.type == "cuda":
        from .fused import FusedAttention

        return FusedAttention(compile=True)
    return ReferenceAttention()


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


def prefix_self_attention(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, group: PrefixGroup,
                          causal: bool = False) -> torch.Tensor:
    """Dense attention among each prefix's own rows of this step, nothing cached (an encoder whose
    K/V is never stored). -> [N, H, D], zeros outside the group's rows."""
    N, H, D = q_NHD.shape
    pad = lambda x: torch.cat([x, x.new_zeros(1, *x.shape[1:])])[group.q_rows].transpose(1, 2)  # noqa: E731
    j = torch.arange(group.q_rows.shape[1], device=q_NHD.device)
    mask = (j[None, :] < group.lens[:, None])[:, None, None, :]
    if causal:
        mask = mask & (j[None, :] <= j[:, None])[None, None]
    o = F.scaled_dot_product_attention(pad(q_NHD), pad(k_NHD), pad(v_NHD), attn_mask=mask,
                                       enable_gqa=k_NHD.shape[1] != H)
    out = q_NHD.new_zeros(N + 1, H, D)
    out[group.q_rows] = o.transpose(1, 2)
    return out[:N]

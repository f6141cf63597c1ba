"""The reference attention backend: plain gathers and a float32 softmax, for CPUs and tests.

The groups and visibility are attention/layout.py's. A decode group's prefix K/V, read-only
while it decodes, are gathered once into a PrefixView that later steps on the same prefixes reuse
(the engine decides when; see PrefixView). CUDA uses the fused kernels of attention/fused.py,
which read the cache in place; attention/dispatch.py picks one per device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backend import MaskBounds
from .layout import AttentionBatch, PrefixGroup, Reads, TaskGroup, write_kv


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


class ReferenceAttention:
    """The attention backend of CPUs: gathers, float32 softmax."""

    reads_in_place = False  # a decode group may reuse its prefixes' gathered copies (PrefixView)

    def fix_shapes(self, bounds: MaskBounds) -> None:
        """Nothing is compiled: shapes follow each step."""

    def plan(self, batch: AttentionBatch, n_slots: int) -> list[GroupPlan]:
        return _plan_reference(batch)

    def attend(self, q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans,
               reads: Reads = Reads.PREFIX_AND_OWN, layer: int | None = None) -> torch.Tensor:
        return _attend_reference(q_NHD, k_NHD, v_NHD, k_cache, v_cache, batch, plans, reads, layer)


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

"""Attention over a paged KV cache, for a flat batch of tokens from many sequences.

The KV cache is one tensor of slots: `[n_layers, n_blocks * block_size, n_kv_heads, head_dim]`.
Block 0 is the null block: padding tokens write there and padded keys read from there.

Logical slot layout of every sequence (one image prefix shared by all tasks on that image):

    j in [0, P)            the image prefix (BOS + image tokens), position j
    j in [P, P_pad)        unused tail of the last prefix block (P_pad = P rounded up to a block)
    j in [P_pad, kv_len)   the task's own tokens, position P + (j - P_pad)

Because a task's own tokens start on a fresh block, the prefix blocks are shared copy-free by
every task on the image (engine/kv_cache.py refcounts them). The image prefill itself is a
sequence whose block table holds only the prefix blocks and whose kv_len is P.

Visibility: key j is seen by a query at position p iff j is valid and pos(j) <= limit(p),
where limit(p) = P - 1 for p < P (the prefix is bidirectional) and p otherwise (causal).

Shared-prefix (cascade) groups: when several sequences of a group decode on the same image,
reading that image's P prefix keys once per *sequence* multiplies the dominant memory traffic
by the number of tasks per image. A group with `shared` set attends in two parts: every
image's queries together against its prefix (read once), each sequence against its own
tokens, merged exactly by their log-sum-exp. Its block_table / kv_len then cover only the
sequence's own tokens (logical slot j = position P + j).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAD_POS = 2**30  # position of padding: later than any real token


@dataclass
class SharedPrefix:
    tables: torch.Tensor  # [I, n_prefix_blocks] long: each image's prefix blocks
    q_rows: torch.Tensor  # [I, M] long: flat query rows on each image; padding -> row N
    q_slot: torch.Tensor  # [B, Tq] long: where each group query sits in [I * M]; padding -> I * M


@dataclass
class AttentionGroup:
    """Sequences of similar query length, attended together as one padded batch."""

    q_rows: torch.Tensor  # [B, Tq] long: rows of the flat token batch; padding -> row N (scratch)
    q_pos: torch.Tensor  # [B, Tq] long: position of each query; padding -> PAD_POS
    block_table: torch.Tensor  # [B, n_blocks] long: physical blocks; padding -> 0 (null block)
    kv_len: torch.Tensor  # [B] long: logical slots in use (after this step's writes)
    shared: SharedPrefix | None = None  # queries are all past the prefix; tables hold own tokens


@dataclass
class AttentionBatch:
    write_slots: torch.Tensor  # [N] long: cache slot of each token's k/v; padding -> null slot
    groups: list[AttentionGroup]
    block_size: int
    prefix_len: int  # P


@dataclass
class GroupPlan:
    """Per-forward derived tensors of a group, shared by all layers."""

    group: AttentionGroup
    k_slots: torch.Tensor  # [B, Lk]
    mask: torch.Tensor  # [B, 1, Tq, Lk] bool
    prefix_slots: torch.Tensor | None  # [I, P] for shared groups


def _slots(table: torch.Tensor, n: int, bs: int) -> torch.Tensor:
    j = torch.arange(n, device=table.device)
    return table[:, j // bs] * bs + j % bs


def plan_groups(batch: AttentionBatch) -> list[GroupPlan]:
    bs, P = batch.block_size, batch.prefix_len
    P_pad = -(-P // bs) * bs
    plans = []
    for g in batch.groups:
        B, nb = g.block_table.shape
        j = torch.arange(nb * bs, device=g.block_table.device)  # logical slot
        k_slots = _slots(g.block_table, nb * bs, bs)
        if g.shared is None:
            k_pos = torch.where(j < P, j, P + j - P_pad)
            valid = ((j < P) | (j >= P_pad)) & (j < g.kv_len[:, None])
        else:
            k_pos, valid = P + j, j < g.kv_len[:, None]
        k_pos = torch.where(valid, k_pos, PAD_POS - 1)  # [B, Lk]
        limit = torch.where(g.q_pos < P, P - 1, g.q_pos)  # [B, Tq]
        mask = k_pos[:, None, None, :] <= limit[:, None, :, None]
        prefix_slots = None if g.shared is None else _slots(g.shared.tables, P, bs)
        plans.append(GroupPlan(g, k_slots, mask, prefix_slots))
    return plans


def _attend_lse(q_BHTD: torch.Tensor, k_BHLD: torch.Tensor, v_BHLD: torch.Tensor,
                mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the log-sum-exp of the scores (float32). -> [B,H,T,D], [B,H,T]"""
    H = q_BHTD.shape[1]
    if k_BHLD.shape[1] != H:
        k_BHLD = k_BHLD.repeat_interleave(H // k_BHLD.shape[1], dim=1)
        v_BHLD = v_BHLD.repeat_interleave(H // v_BHLD.shape[1], dim=1)
    scores = (q_BHTD.float() * q_BHTD.shape[-1] ** -0.5) @ k_BHLD.float().transpose(-1, -2)
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    # Every real query sees at least one key, so the row max is finite. In place: the scores
    # are the largest tensor here.
    m = scores.amax(dim=-1, keepdim=True)
    p = scores.sub_(m).exp_()
    total = p.sum(dim=-1)
    return (p @ v_BHLD.float()) / total[..., None], m[..., 0] + total.log()


def attend(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    plans: list[GroupPlan],
) -> torch.Tensor:
    """Write this step's keys/values into their slots, then attend every group. -> [N, H, D]."""
    k_cache.index_copy_(0, batch.write_slots, k_NHD.to(k_cache.dtype))
    v_cache.index_copy_(0, batch.write_slots, v_NHD.to(v_cache.dtype))
    N, H, D = q_NHD.shape
    q_pad = torch.cat([q_NHD, q_NHD.new_zeros(1, H, D)])
    out = q_NHD.new_zeros(N + 1, H, D)
    for plan in plans:
        g = plan.group
        q_BHTD = q_pad[g.q_rows].transpose(1, 2)
        k_BHLD = k_cache[plan.k_slots].transpose(1, 2).to(q_NHD.dtype)
        v_BHLD = v_cache[plan.k_slots].transpose(1, 2).to(q_NHD.dtype)
        if g.shared is None:
            o_BHTD = F.scaled_dot_product_attention(
                q_BHTD, k_BHLD, v_BHLD, attn_mask=plan.mask, enable_gqa=k_BHLD.shape[1] != H
            )
            out[g.q_rows] = o_BHTD.transpose(1, 2)
            continue
        own, own_lse = _attend_lse(q_BHTD, k_BHLD, v_BHLD, plan.mask)  # [B, H, Tq, D], [B, H, Tq]
        q_IHMD = q_pad[g.shared.q_rows].transpose(1, 2)
        pre, pre_lse = _attend_lse(q_IHMD, k_cache[plan.prefix_slots].transpose(1, 2),
                                   v_cache[plan.prefix_slots].transpose(1, 2), None)
        # Bring the per-image results to the group's [B, Tq] layout (padding reads a zero slot),
        # then merge the two partial softmaxes by their log-sum-exps.
        I, _, M, _ = pre.shape
        pre_flat = torch.cat([pre.transpose(1, 2).reshape(I * M, H, D), pre.new_zeros(1, H, D)])
        lse_flat = torch.cat([pre_lse.transpose(1, 2).reshape(I * M, H), pre_lse.new_zeros(1, H)])
        o2, l2 = pre_flat[g.shared.q_slot], lse_flat[g.shared.q_slot]  # [B, Tq, H, D], [B, Tq, H]
        o1, l1 = own.transpose(1, 2), own_lse.transpose(1, 2)
        m = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
        out[g.q_rows] = ((o1 * w1 + o2 * w2) / (w1 + w2)).to(out.dtype)
    return out[:N]


@dataclass
class KVCache:
    """All layers' keys and values: one allocation, per-layer views by indexing dim 0."""

    k: torch.Tensor  # [n_layers, n_blocks * block_size, n_kv_heads, head_dim]
    v: torch.Tensor
    block_size: int

    @classmethod
    def allocate(cls, n_layers: int, n_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        shape = (n_layers, n_blocks * block_size, n_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), block_size)

    @property
    def n_blocks(self) -> int:
        return self.k.shape[1] // self.block_size


def slots_of(block_table: torch.Tensor, pos: torch.Tensor, block_size: int, prefix_len: int) -> torch.Tensor:
    """Cache slot of the token at `pos` in a sequence with `block_table` ([..., n_blocks] with
    pos [...,] or [..., T]); see the logical layout in the module docstring."""
    P_pad = -(-prefix_len // block_size) * block_size
    j = torch.where(pos < prefix_len, pos, P_pad + pos - prefix_len)
    if j.dim() == block_table.dim() - 1:
        block = block_table.gather(-1, (j // block_size)[..., None])[..., 0]
    else:
        block = block_table.gather(-1, j // block_size)
    return block * block_size + j % block_size


def own_slots_of(block_table: torch.Tensor, pos: torch.Tensor, block_size: int, prefix_len: int) -> torch.Tensor:
    """Cache slot of the token at `pos` (>= P) in a table of the sequence's own blocks only."""
    j = pos - prefix_len
    if j.dim() == block_table.dim() - 1:
        block = block_table.gather(-1, (j // block_size)[..., None])[..., 0]
    else:
        block = block_table.gather(-1, j // block_size)
    return block * block_size + j % block_size


def logical_len(n_positions: int, block_size: int, prefix_len: int) -> int:
    """kv_len of a sequence holding positions [0, n_positions)."""
    if n_positions <= prefix_len:
        return n_positions
    return -(-prefix_len // block_size) * block_size + n_positions - prefix_len

"""The training objective of the demo model: a dense teacher-forced forward over packed
examples, soft-bin losses for coordinates and sizes, and auxiliary per-patch heads."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.moondream.model import MoondreamModel
from ..models.moondream.text import apply_rotary
from .examples import COORD_BINS, SIZE_BINS, Batch
from .world import COLOURS, KINDS


class AuxHeads(nn.Module):
    """Per-image-token predictions of the shape under the patch (training only)."""

    def __init__(self, dim: int):
        super().__init__()
        self.kind = nn.Linear(dim, len(KINDS) + 1)
        self.colour = nn.Linear(dim, len(COLOURS) + 1)
        self.geometry = nn.Linear(dim, 4)  # centre offset (dx, dy) in patches, log2 (w, h)


def dense_forward(model: MoondreamModel, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced forward of packed examples -> (segment hidden [B, T, C], image tokens [B, P-1, C]).

    The same weights and ops as inference (vision, input_embeds, blocks); only attention is a
    dense masked SDPA over [prefix | segments] instead of the paged cache.
    """
    c = model.config.text
    B, T = batch.kind.shape
    feats = model.vision(batch.crops, [(1, 1)] * B)
    prefix = model.prefix_embeds(feats)  # [B, P, C]
    P = prefix.shape[1]
    seg = model.input_embeds(batch.kind.reshape(-1), batch.token.reshape(-1), batch.value.reshape(-1, 2))
    x = torch.cat([prefix, seg.view(B, T, -1)], dim=1)
    L = P + T
    pos = torch.cat([torch.arange(P, device=x.device).expand(B, P), batch.pos], dim=1)
    sid = torch.cat([torch.zeros(B, P, dtype=torch.long, device=x.device), batch.seg], dim=1)
    # query i sees key j: j in the prefix and (i in the prefix or i a real token), or same
    # segment and pos_j <= pos_i. Padding queries see the prefix (their outputs are unused).
    q_in_prefix = torch.arange(L, device=x.device) < P
    mask = q_in_prefix[None, None, :] | ((sid[:, :, None] == sid[:, None, :]) & (pos[:, None, :] <= pos[:, :, None]))
    mask = mask & ~(q_in_prefix[None, :, None] & ~q_in_prefix[None, None, :])
    mask = mask[:, None]
    cos_sin = model.text.rotary[pos.reshape(-1)]
    h_dim = c.head_dim
    q_dim, kv_dim = c.n_heads * h_dim, c.n_kv_heads * h_dim
    for block in model.text.blocks:
        h = block.ln(x)
        q, k, v = block.attn.qkv(h).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rotary(q.reshape(B * L, c.n_heads, h_dim), cos_sin).view(B, L, c.n_heads, h_dim)
        k = apply_rotary(k.reshape(B * L, c.n_kv_heads, h_dim), cos_sin).view(B, L, c.n_kv_heads, h_dim)
        v = v.view(B, L, c.n_kv_heads, h_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                           enable_gqa=c.n_heads != c.n_kv_heads)
        x = x + block.attn.proj(o.transpose(1, 2).reshape(B, L, q_dim)) + block.mlp(h)
    return x[:, P:], feats


def soft_bin_loss(logits: torch.Tensor, target_bin: torch.Tensor, sigma: float) -> torch.Tensor:
    """Cross-entropy against a Gaussian around the (continuous) target bin, plus an L1 loss on
    the expected bin in units of 2% of the range."""
    n = logits.shape[-1]
    bins = torch.arange(n, device=logits.device, dtype=torch.float32)
    soft = torch.exp(-0.5 * ((bins - target_bin[..., None]) / sigma) ** 2)
    soft = soft / soft.sum(-1, keepdim=True)
    logp = F.log_softmax(logits.float(), dim=-1)
    ce = -(soft * logp).sum(-1)
    expected = (logp.exp() * bins).sum(-1)
    return (ce + (expected - target_bin).abs() / (n / 50)).mean()


def losses(model: MoondreamModel, aux: AuxHeads, batch: Batch, sigma: float) -> dict[str, torch.Tensor]:
    hidden, feats = dense_forward(model, batch)
    out = {}
    tok = batch.t_token >= 0
    out["token"] = F.cross_entropy(model.text.logits(hidden[tok]).float(), batch.t_token[tok])
    has_c = ~batch.t_coord.isnan()
    out["coord"] = soft_bin_loss(model.region.coord_logits(hidden[has_c]), batch.t_coord[has_c] * COORD_BINS, sigma)
    has_s = ~batch.t_size[..., 0].isnan()
    sizes = batch.t_size[has_s]
    target = torch.stack([size_bin_t(sizes[:, 0]), size_bin_t(sizes[:, 1])], dim=-1)
    out["size"] = soft_bin_loss(model.region.size_logits(hidden[has_s]), target, sigma)
    out["aux_kind"] = F.cross_entropy(aux.kind(feats).flatten(0, 1), batch.p_kind.flatten())
    out["aux_colour"] = F.cross_entropy(aux.colour(feats).flatten(0, 1), batch.p_colour.flatten())
    on = batch.p_kind.flatten() > 0
    geom = aux.geometry(feats).flatten(0, 1)[on]
    out["aux_geom"] = F.smooth_l1_loss(geom, batch.p_geom.flatten(0, 1)[on]) if on.any() else geom.sum()
    return out


def size_bin_t(s: torch.Tensor) -> torch.Tensor:
    return (torch.log2(s.clamp_min(2**-10)) + 10.0) / 10.0 * (SIZE_BINS - 1)


WEIGHTS = {"token": 1.0, "coord": 1.0, "size": 0.5, "aux_kind": 0.5, "aux_colour": 0.5, "aux_geom": 0.5}

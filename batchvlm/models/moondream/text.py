"""Text decoder: Phi-style blocks with a parallel residual and partial rotary embeddings."""

from __future__ import annotations

import torch
import torch.nn as nn

from ...attention import AttentionBatch, KVCache, attend, plan_groups
from .config import TextConfig
from .layers import MLP, Attention


def rotary_table(rot_dim: int, max_context: int, theta: float = 10000.0) -> torch.Tensor:
    """[max_context, rot_dim] = cos | sin of position * theta^(-2i/rot_dim), i < rot_dim/2. On the
    CPU also under a meta-device build: meta pow / arange load torch's Python decompositions
    (sympy, dynamo: a second of start-up per process)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device="cpu") / rot_dim))
    angles = torch.arange(max_context, dtype=torch.float32, device="cpu")[:, None] * inv_freq[None]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary(x_NHD: torch.Tensor, cos_sin_ND: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary on the first rot_dim dims of each head; the rest pass through.

    The reference writes each rotated (real, imag) pair interleaved; q and k share that
    permutation, so attention scores equal this form and only the cache layout differs.
    """
    half = cos_sin_ND.shape[-1] // 2
    cos, sin = cos_sin_ND[:, None, :half], cos_sin_ND[:, None, half:]
    x1, x2, rest = x_NHD[..., :half], x_NHD[..., half : 2 * half], x_NHD[..., 2 * half :]
    xf1, xf2 = x1.float(), x2.float()
    rotated = torch.cat([xf1 * cos - xf2 * sin, xf1 * sin + xf2 * cos], dim=-1).to(x_NHD.dtype)
    return torch.cat([rotated, rest], dim=-1)


class TextBlock(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.ln = nn.LayerNorm(c.dim)
        self.attn = Attention(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim)
        self.mlp = MLP(c.dim, c.ff_dim)


class TextModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Parameter(torch.empty(c.vocab_size, c.dim))
        self.blocks = nn.ModuleList(TextBlock(c) for _ in range(c.n_layers))
        self.post_ln = nn.LayerNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab_size)
        self.register_buffer("rotary", rotary_table(c.rot_dim, c.max_context), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute the rotary table in float32 (after meta construction or a dtype cast)."""
        self.rotary = rotary_table(self.config.rot_dim, self.config.max_context).to(self.wte.device)

    def forward(
        self, embeds_NC: torch.Tensor, positions_N: torch.Tensor, batch: AttentionBatch, cache: KVCache
    ) -> torch.Tensor:
        """Flat tokens of many sequences -> hidden states before post_ln [N, C]."""
        c = self.config
        N = embeds_NC.shape[0]
        plans = plan_groups(batch, cache)
        cos_sin = self.rotary[positions_N]
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        x = embeds_NC
        for i, block in enumerate(self.blocks):
            h = block.ln(x)
            q, k, v = block.attn.qkv(h).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = apply_rotary(q.view(N, c.n_heads, c.head_dim), cos_sin)
            k = apply_rotary(k.view(N, c.n_kv_heads, c.head_dim), cos_sin)
            o = attend(q, k, v.view(N, c.n_kv_heads, c.head_dim), cache.k[i], cache.v[i], batch, plans)
            x = x + block.attn.proj(o.reshape(N, q_dim)) + block.mlp(h)
        return x

    def logits(self, hidden_SC: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.post_ln(hidden_SC))

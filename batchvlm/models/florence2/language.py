"""Florence-2's language model: a BART encoder-decoder (post-norm layers, learned positions with
BART's offset of 2, LayerNorm on the embeddings). Parameter names are the checkpoint's
(`model.language_model.*`; the output head is tied to `shared`).

The encoder reads [image tokens | prompt tokens] bidirectionally. A decoder layer self-attends
over the sequence's own tokens (causal) and cross-attends to the encoder output, whose K/V are
computed once per (image, prompt) by `cross_kv` and only read afterwards. Both attentions are
callbacks, so the same layers run the dense reference path here and the engine's paged one;
q / k / v reach them as [..., heads, head_dim].
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import TextConfig

POSITION_OFFSET = 2  # BART's learned positions start at row 2

# (layer, q, k, v) -> [..., heads, head_dim]: self-attention over the sequence's own tokens
SelfAttend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (layer, q) -> [..., heads, head_dim]: attention to the layer's cross-attention K/V
CrossAttend = Callable[[int, torch.Tensor], torch.Tensor]


def _act(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return F.gelu if name == "gelu" else F.relu


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1))


class EncoderLayer(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.self_attn = Attention(c.dim, c.encoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.dim)
        self.fc1, self.fc2 = nn.Linear(c.dim, c.encoder_ff), nn.Linear(c.encoder_ff, c.dim)
        self.final_layer_norm = nn.LayerNorm(c.dim)
        self.act = _act(c.activation)

    def forward(self, x_BTC: torch.Tensor, mask_B11T: torch.Tensor | None) -> torch.Tensor:
        a = self.self_attn
        q, k, v = (a.split(p(x_BTC)).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B11T).transpose(1, 2).flatten(2)
        x_BTC = self.self_attn_layer_norm(x_BTC + a.out_proj(h))
        return self.final_layer_norm(x_BTC + self.fc2(self.act(self.fc1(x_BTC))))


class Encoder(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.embed_positions = nn.Embedding(c.max_positions + POSITION_OFFSET, c.dim)
        self.layernorm_embedding = nn.LayerNorm(c.dim)
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.encoder_layers))

    def forward(self, embeds_BTC: torch.Tensor, valid_BT: torch.Tensor | None = None,
                positions_BT: torch.Tensor | None = None) -> torch.Tensor:
        """`valid_BT`: False for padding, which no token attends to (None: no padding).
        `positions_BT`: each token's position (duplicate pruning leaves gaps); None: 0, 1, ..."""
        if positions_BT is None:
            positions_BT = torch.arange(embeds_BTC.shape[1], device=embeds_BTC.device)
        pos = self.embed_positions(positions_BT + POSITION_OFFSET)
        x = self.layernorm_embedding(embeds_BTC + pos)
        mask = None if valid_BT is None else valid_BT[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, index: int):
        super().__init__()
        self.index = index
        self.self_attn = Attention(c.dim, c.decoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.dim)
        self.encoder_attn = Attention(c.dim, c.decoder_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(c.dim)
        self.fc1, self.fc2 = nn.Linear(c.dim, c.decoder_ff), nn.Linear(c.decoder_ff, c.dim)
        self.final_layer_norm = nn.LayerNorm(c.dim)
        self.act = _act(c.activation)

    def cross_kv(self, enc_TC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.encoder_attn
        return a.split(a.k_proj(enc_TC)), a.split(a.v_proj(enc_TC))

    def forward(self, x: torch.Tensor, self_attend: SelfAttend, cross_attend: CrossAttend) -> torch.Tensor:
        a = self.self_attn
        h = self_attend(self.index, a.split(a.q_proj(x)), a.split(a.k_proj(x)), a.split(a.v_proj(x)))
        x = self.self_attn_layer_norm(x + a.out_proj(h.flatten(-2)))
        c = self.encoder_attn
        h = cross_attend(self.index, c.split(c.q_proj(x)))
        x = self.encoder_attn_layer_norm(x + c.out_proj(h.flatten(-2)))
        return self.final_layer_norm(x + self.fc2(self.act(self.fc1(x))))


class Decoder(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.embed_positions = nn.Embedding(c.max_positions + POSITION_OFFSET, c.dim)
        self.layernorm_embedding = nn.LayerNorm(c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.decoder_layers))

    def cross_kv(self, enc_TC: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the cross-attention (K, V) [T, heads, head_dim] of one encoder output."""
        return [layer.cross_kv(enc_TC) for layer in self.layers]

    def forward(self, embeds: torch.Tensor, pos: torch.Tensor, self_attend: SelfAttend,
                cross_attend: CrossAttend) -> torch.Tensor:
        """Token embeddings [..., C] at decoder positions `pos` [...] (0 = the start token)."""
        x = self.layernorm_embedding(embeds + self.embed_positions(pos + POSITION_OFFSET))
        for layer in self.layers:
            x = layer(x, self_attend, cross_attend)
        return x


class LanguageModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.config = c
        self.shared = nn.Embedding(c.vocab_size, c.dim)
        self.encoder = Encoder(c)
        self.decoder = Decoder(c)
        self.embed_scale = math.sqrt(c.dim) if c.scale_embedding else 1.0

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shared(ids) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Decoder hidden states -> float32 logits (the head is the tied embedding)."""
        return F.linear(hidden, self.shared.weight).float()

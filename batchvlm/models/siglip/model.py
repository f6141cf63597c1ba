"""The SigLIP module tree, its parameter names the checkpoint's (`vision_model.*`, `text_model.*`,
`logit_scale`, `logit_bias`): two pre-norm transformer encoders, a vision tower that pools by
attention (a learned probe attends to the patches), a text tower that takes its last token.

The vision tower reads patches as a linear map (NaFlex's `patch_embedding` is one; a fixed
checkpoint's convolution is loaded into the same linear: weights.py), so both kinds share one
tower; NaFlex resizes its position table to each image's grid (transformers' bilinear,
antialiased interpolation written as weights) and masks the padded patches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import SiglipConfig, TowerConfig


class Attention(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.heads = c.heads
        self.q_proj, self.k_proj = nn.Linear(c.hidden, c.hidden), nn.Linear(c.hidden, c.hidden)
        self.v_proj, self.out_proj = nn.Linear(c.hidden, c.hidden), nn.Linear(c.hidden, c.hidden)

    def forward(self, x_BLC: torch.Tensor, mask_B11L: torch.Tensor | None) -> torch.Tensor:
        B, L, C = x_BLC.shape
        q, k, v = (p(x_BLC).view(B, L, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B11L)
        return self.out_proj(out.transpose(1, 2).reshape(B, L, C))


class MLP(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c.hidden, c.intermediate), nn.Linear(c.intermediate, c.hidden)
        self.approximate = "tanh" if c.act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.layer_norm1, self.layer_norm2 = nn.LayerNorm(c.hidden, eps=c.eps), nn.LayerNorm(c.hidden, eps=c.eps)
        self.self_attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), mask)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, c: TowerConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.layers))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


class PoolingHead(nn.Module):
    """Multi-head attention pooling: one learned probe attends to the tokens (torch's
    MultiheadAttention parameters: `attention.in_proj_*`, `attention.out_proj`)."""

    def __init__(self, c: TowerConfig):
        super().__init__()
        self.heads = c.heads
        self.probe = nn.Parameter(torch.empty(1, 1, c.hidden))
        self.attention = nn.Module()
        self.attention.in_proj_weight = nn.Parameter(torch.empty(3 * c.hidden, c.hidden))
        self.attention.in_proj_bias = nn.Parameter(torch.empty(3 * c.hidden))
        self.attention.out_proj = nn.Linear(c.hidden, c.hidden)
        self.layernorm = nn.LayerNorm(c.hidden, eps=c.eps)
        self.mlp = MLP(c)

    def forward(self, x_BLC: torch.Tensor, mask_B11L: torch.Tensor | None) -> torch.Tensor:
        B, L, C = x_BLC.shape
        w, b = self.attention.in_proj_weight, self.attention.in_proj_bias
        q = F.linear(self.probe, w[:C], b[:C]).view(1, 1, self.heads, -1).transpose(1, 2).expand(B, -1, -1, -1)
        k, v = (F.linear(x_BLC, w[i * C:(i + 1) * C], b[i * C:(i + 1) * C]).view(B, L, self.heads, -1).transpose(1, 2)
                for i in (1, 2))
        pooled = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B11L).transpose(1, 2).reshape(B, C)
        pooled = self.attention.out_proj(pooled)
        return pooled + self.mlp(self.layernorm(pooled))


class VisionEmbeddings(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        c = config.vision
        self.patch_embedding = nn.Linear(3 * config.patch * config.patch, c.hidden)
        self.position_embedding = nn.Embedding(config.positions, c.hidden)
        self.side = round(config.positions ** 0.5)


class VisionTower(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = Encoder(config.vision)
        self.post_layernorm = nn.LayerNorm(config.vision.hidden, eps=config.vision.eps)
        self.head = PoolingHead(config.vision)

    def forward(self, pixels_BLP: torch.Tensor, positions_BLC: torch.Tensor,
                mask_B11L: torch.Tensor | None) -> torch.Tensor:
        """Normalized patches [B, L, P], their position embeddings, the key mask (None: no padding)
        -> pooled image features [B, C]."""
        x = self.embeddings.patch_embedding(pixels_BLP) + positions_BLC
        x = self.post_layernorm(self.encoder(x, mask_B11L))
        return self.head(x, mask_B11L)


class TextTower(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        c = config.text
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(config.vocab, c.hidden)
        self.embeddings.position_embedding = nn.Embedding(config.max_text, c.hidden)
        self.encoder = Encoder(c)
        self.final_layer_norm = nn.LayerNorm(c.hidden, eps=c.eps)
        self.head = nn.Linear(c.hidden, config.projection)

    def forward(self, ids_BT: torch.Tensor, mask_B11T: torch.Tensor | None) -> torch.Tensor:
        e = self.embeddings
        x = e.token_embedding(ids_BT) + e.position_embedding.weight[: ids_BT.shape[1]]
        x = self.final_layer_norm(self.encoder(x, mask_B11T))
        return self.head(x[:, -1])  # the last position, whatever the padding side (as transformers)


class SiglipModel(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.config = config
        self.vision_model = VisionTower(config)
        self.text_model = TextTower(config)
        self.logit_scale = nn.Parameter(torch.empty(1))
        self.logit_bias = nn.Parameter(torch.empty(1))

    @property
    def device(self) -> torch.device:
        return self.logit_scale.device

    @property
    def dtype(self) -> torch.dtype:
        return self.logit_scale.dtype

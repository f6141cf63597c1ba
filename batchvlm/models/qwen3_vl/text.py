"""The Qwen3 text model over a flat batch of tokens, with attention supplied by the caller.

Blocks: RMSNorm -> q/k/v (GQA) with RMSNorm per head on q and k -> interleaved multimodal
rotary -> attention -> o_proj, residual; RMSNorm -> MLP (SwiGLU, or qwen3_vl_moe's sparse
experts: qwen_vl/moe.py), residual. The attention is a
callable (layer index, q, k, v) -> output, so the same weights run under the engine's paged KV
cache or under a plain dense cache.

DeepStack: while an image prefix is prefilled, the vision tower's extra features are added to
the hidden states of the image's tokens after text layers 0, 1, ... (one feature set per
layer). Other forwards (prompts, decode steps) carry no DeepStack input.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..base.hub import embedding_table
from ..base.layers import RMSNorm
from ..qwen_vl.attend import Attend
from ..qwen_vl.moe import layer_mlp
from ..qwen_vl.rotary import TextRotary, apply_rotary
from ..qwen_vl.vision import DeepStack
from .config import TextConfig

__all__ = ["TextModel"]


class SelfAttention(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.q_proj = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps)


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, layer: int):
        super().__init__()
        self.self_attn = SelfAttention(c)
        self.mlp = layer_mlp(c, layer)
        self.input_layernorm = RMSNorm(c.dim, c.rms_eps)
        self.post_attention_layernorm = RMSNorm(c.dim, c.rms_eps)


class TextModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = embedding_table(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.rms_eps)
        self.rotary = TextRotary(c.rotary_dim, c.rope_theta, c.mrope_section)

    def forward(self, embeds_NC: torch.Tensor, positions_3N: torch.Tensor, attend: Attend,
                deepstack: DeepStack | None = None) -> torch.Tensor:
        """Flat tokens of many sequences -> final-normed hidden states [N, C]."""
        c = self.config
        N = embeds_NC.shape[0]
        cos, sin = self.rotary(positions_3N)
        x = embeds_NC
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rotary(a.q_norm(a.q_proj(h).view(N, c.n_heads, c.head_dim)), cos, sin)
            k = apply_rotary(a.k_norm(a.k_proj(h).view(N, c.n_kv_heads, c.head_dim)), cos, sin)
            v = a.v_proj(h).view(N, c.n_kv_heads, c.head_dim)
            x = x + a.o_proj(attend(i, q, k, v).reshape(N, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if deepstack is not None and i < len(deepstack.features):
                x = x.index_add(0, deepstack.rows, deepstack.features[i].to(x.dtype))
        return self.norm(x)

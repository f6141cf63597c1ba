"""The Qwen3.5 text model over a flat batch of tokens: hybrid layers, attention and per-sequence
state supplied by the caller.

Every layer: zero-centred RMSNorm -> token mixer -> residual; RMSNorm -> MLP (SwiGLU, or
qwen3_5_moe's sparse experts with a shared expert: qwen_vl/moe.py) -> residual.
The token mixer is, per `layer_types`:
  full attention  gated attention: q_proj gives each head's query and an output gate side by
                  side; q / k RMSNorm per head, interleaved multimodal rotary over the first
                  rotary_dim dims, GQA attention through the caller's `attend(kv layer, q, k,
                  v)` (kv layer: the index among the full-attention layers, which alone keep
                  K/V), output * sigmoid(gate), o_proj;
  linear          Gated DeltaNet (linear_attention.py) over the caller's LinearState.
The RMSNorms of this model scale by (1 + weight) (checkpoints store the offset from 1); the
gated norm inside Gated DeltaNet scales by weight.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..base.hub import embedding_table
from ..base.layers import RMSNorm
from ..qwen_vl.attend import Attend
from ..qwen_vl.moe import layer_mlp
from ..qwen_vl.rotary import TextRotary, apply_rotary
from .config import FULL, TextConfig
from .linear_attention import GatedDeltaNet
from .linear_state import LinearState, Segments


class GatedAttention(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.dim, 2 * c.n_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_eps, centred=True)
        self.k_norm = RMSNorm(c.head_dim, c.rms_eps, centred=True)

    def forward(self, h_NC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                kv_layer: int) -> torch.Tensor:
        c = self.c
        N = h_NC.shape[0]
        q, gate = self.q_proj(h_NC).view(N, c.n_heads, 2 * c.head_dim).chunk(2, dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(self.k_proj(h_NC).view(N, c.n_kv_heads, c.head_dim)), cos, sin)
        v = self.v_proj(h_NC).view(N, c.n_kv_heads, c.head_dim)
        o = attend(kv_layer, q, k, v).reshape(N, -1) * torch.sigmoid(gate.reshape(N, -1))
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, c: TextConfig, layer: int):
        super().__init__()
        kind = c.layer_types[layer]
        if kind == FULL:
            self.self_attn = GatedAttention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)
        self.mlp = layer_mlp(c, layer)
        self.input_layernorm = RMSNorm(c.dim, c.rms_eps, centred=True)
        self.post_attention_layernorm = RMSNorm(c.dim, c.rms_eps, centred=True)


class TextModel(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = embedding_table(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.rms_eps, centred=True)
        # per layer: its index among the full-attention layers (K/V) or among the linear ones (state)
        self.slot_of = [c.full_layers.index(i) if t == FULL else c.linear_layers.index(i)
                        for i, t in enumerate(c.layer_types)]
        self.rotary = TextRotary(c.rotary_dim, c.rope_theta, c.mrope_section)

    def forward(self, embeds_NC: torch.Tensor, positions_3N: torch.Tensor, attend: Attend, segments: Segments,
                state: LinearState) -> torch.Tensor:
        """Flat tokens of many sequences -> final-normed hidden states [N, C]."""
        cos, sin = self.rotary(positions_3N)
        x = embeds_NC
        for layer, j in zip(self.layers, self.slot_of):
            h = layer.input_layernorm(x)
            if hasattr(layer, "self_attn"):
                x = x + layer.self_attn(h, cos, sin, attend, j)
            else:
                x = x + layer.linear_attn(h, segments, state.conv[:, j], state.recurrent[:, j])
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)

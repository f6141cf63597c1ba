"""Gated DeltaNet, the linear-attention layer of Qwen3.5, over a flat batch of sequences.

x -> in_proj_qkv -> causal depthwise conv (kernel K, over each sequence's own past: the conv
state carries its last K - 1 inputs) -> SiLU -> q, k, v; q, k L2-normalised, each key head
serving lin_v_heads / lin_k_heads consecutive value heads; beta = sigmoid(in_proj_b x),
g = -exp(A_log) softplus(in_proj_a x + dt_bias) (float32); the gated delta rule
(delta_rule.py) with the recurrent state; an RMSNorm per value head gated by SiLU(in_proj_z x);
out_proj. Parameter names are the checkpoint's.

The delta rule runs in two places: `_runs` (prefill) and `_steps` (decode). On CUDA with
flash-linear-attention installed they run its kernels (fla_rule.py: chunk_gated_delta_rule over
the wave's unpadded tokens cut by StateSpans.cu_seqlens, initial states gathered by
StateSpans.read; fused_recurrent_gated_delta_rule over the rows' gathered states); elsewhere the
torch path (delta_rule.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import fla_rule
from .config import TextConfig
from .delta_rule import chunked, l2_normalize, recurrent_step_
from .linear_state import Runs, Segments


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * xf.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, c: TextConfig):
        super().__init__()
        self.c = c
        key_dim, value_dim = c.lin_k_heads * c.lin_k_dim, c.lin_v_heads * c.lin_v_dim
        self.in_proj_qkv = nn.Linear(c.dim, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(c.dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.dim, c.lin_v_heads, bias=False)
        self.in_proj_a = nn.Linear(c.dim, c.lin_v_heads, bias=False)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(c.lin_v_heads))
        self.A_log = nn.Parameter(torch.zeros(c.lin_v_heads))
        self.norm = GatedRMSNorm(c.lin_v_dim, c.rms_eps)
        self.out_proj = nn.Linear(value_dim, c.dim, bias=False)

    def _conv(self, window_BCW: torch.Tensor) -> torch.Tensor:
        """[B, C, K - 1 + L] (state, then the run's inputs) -> SiLU(conv) [B, L, C]."""
        out = F.conv1d(window_BCW.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.c.conv_dim)
        return F.silu(out).transpose(1, 2)

    def _heads(self, mixed_TC: torch.Tensor, b_TH: torch.Tensor, a_TH: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Conv outputs -> q, k (normalised, repeated to the value heads, q scaled), v, g, beta,
        all float32, heads before time: [..., H, T, D] / [..., H, T]."""
        c = self.c
        kd = c.lin_k_heads * c.lin_k_dim
        *lead, T, _ = mixed_TC.shape
        q, k, v = mixed_TC.float().split([kd, kd, c.lin_v_heads * c.lin_v_dim], dim=-1)
        rep = c.lin_v_heads // c.lin_k_heads
        q, k = (l2_normalize(x.reshape(*lead, T, c.lin_k_heads, c.lin_k_dim)).repeat_interleave(rep, dim=-2)
                for x in (q, k))
        q = q * c.lin_k_dim**-0.5
        v = v.reshape(*lead, T, c.lin_v_heads, c.lin_v_dim)
        g = -self.A_log.float().exp() * F.softplus(a_TH.float() + self.dt_bias)
        beta = b_TH.sigmoid().float()
        heads_first = (x.transpose(-3, -2) for x in (q, k, v))
        return *heads_first, g.transpose(-2, -1), beta.transpose(-2, -1)

    def forward(self, x_NC: torch.Tensor, seg: Segments, conv_state: torch.Tensor,
                recurrent_state: torch.Tensor) -> torch.Tensor:
        """`conv_state` [states, conv dim, K - 1] and `recurrent_state` [states, Hv, Dk, Dv]: this
        layer's state of every state index; read and written in place where `seg` says."""
        c = self.c
        N = x_NC.shape[0]
        mixed_NC, z_NC = self.in_proj_qkv(x_NC), self.in_proj_z(x_NC)
        b_NH, a_NH = self.in_proj_b(x_NC), self.in_proj_a(x_NC)
        o_NHV = x_NC.new_empty(N, c.lin_v_heads, c.lin_v_dim, dtype=torch.float32)
        for runs in seg.waves:
            if runs.any:
                self._runs(runs, mixed_NC, b_NH, a_NH, conv_state, recurrent_state, o_NHV)
        if len(seg.step_states):
            self._steps(seg, mixed_NC, b_NH, a_NH, conv_state, recurrent_state, o_NHV)
        o = self.norm(o_NHV.to(x_NC.dtype), z_NC.view(N, c.lin_v_heads, c.lin_v_dim))
        return self.out_proj(o.reshape(N, -1))

    def _steps(self, seg: Segments, mixed_NC: torch.Tensor, b_NH: torch.Tensor, a_NH: torch.Tensor,
               conv_state: torch.Tensor, recurrent_state: torch.Tensor, o_NHV: torch.Tensor) -> None:
        """The decode tokens: one per row, each reading and updating its row's state."""
        r, at = seg.step_rows, seg.step_states
        window = torch.cat([conv_state[at], mixed_NC[r, :, None].to(conv_state.dtype)], dim=2)  # [D, C, K]
        conv_state[at] = window[:, :, 1:]
        q, k, v, g, beta = self._heads(self._conv(window), b_NH[r, None], a_NH[r, None])
        S = recurrent_state[at]  # the rows' states gathered once, updated in place, written back once
        args = (q[:, :, 0], k[:, :, 0], v[:, :, 0], g[:, :, 0], beta[:, :, 0], S)
        if fla_rule.kernels(S.device):
            o_NHV[r], S = fla_rule.step(*args)
        else:
            o_NHV[r] = recurrent_step_(*args)
        recurrent_state[at] = S

    def _runs(self, w: Runs, mixed_NC: torch.Tensor, b_NH: torch.Tensor, a_NH: torch.Tensor,
              conv_state: torch.Tensor, recurrent_state: torch.Tensor, o_NHV: torch.Tensor) -> None:
        c = self.c
        rows, valid = w.rows_BL, w.valid_BL
        B = rows.shape[0]
        if w.fresh:
            conv0 = conv_state.new_zeros(B, *conv_state.shape[1:])
            S0 = recurrent_state.new_zeros(B, *recurrent_state.shape[1:])
        else:
            conv0, S0 = conv_state[w.read], recurrent_state[w.read]
        x_BCL = (mixed_NC[rows] * valid[..., None]).transpose(1, 2).to(conv0.dtype)
        window = torch.cat([conv0, x_BCL], dim=2)  # [B, C, K - 1 + L]
        last = w.lens_B[:, None] + torch.arange(c.conv_kernel - 1, device=rows.device)  # the run's last K - 1
        conv_state[w.write] = window.gather(2, last[:, None, :].expand(-1, c.conv_dim, -1))
        q, k, v, g, beta = self._heads(self._conv(window), b_NH[rows], a_NH[rows])
        if fla_rule.kernels(S0.device):  # the real tokens alone, time first: [T, H, ...]
            real = [x.transpose(1, 2).flatten(0, 1)[w.padded] for x in (q, k, v, g, beta)]
            o_NHV[w.rows], recurrent_state[w.write] = fla_rule.chunked_varlen(*real, S0, w.cu, w.cu_host)
            return
        keep = valid[:, None, :]  # padding writes nothing and keeps the decay at 1
        k, g, beta = k * keep[..., None], g * keep, beta * keep
        o, S = chunked(q, k, v, g, beta, S0)
        recurrent_state[w.write] = S
        o_NHV[w.rows] = o.transpose(1, 2).reshape(-1, c.lin_v_heads, c.lin_v_dim)[w.padded]

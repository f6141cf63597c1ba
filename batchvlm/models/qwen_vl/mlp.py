"""The dense text MLP of a Qwen layer, SwiGLU: down(silu(gate x) * up x). Also the shared expert
of a mixture of experts (moe.py). Parameter names are the checkpoint's."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ff_dim, bias=False)
        self.up_proj = nn.Linear(dim, ff_dim, bias=False)
        self.down_proj = nn.Linear(ff_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


"""Weight containers shared by the vision, text and region towers.

Attribute names are the checkpoint's (`attn.qkv`, `mlp.fc1`, ...): the module tree *is* the
key layout, so loading is a strict name-for-name copy.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, out or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Attention(nn.Module):
    """Fused-qkv projection weights; the attention itself lives with its caller."""

    def __init__(self, dim: int, qkv_dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, qkv_dim)
        self.proj = nn.Linear(dim, dim)

"""Module-tree pieces more than one family uses. Parameter names are the checkpoints'."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNorm(nn.Module):
    """`centred` (Qwen3.5): the checkpoint stores the weight's offset from 1 and the scaling is
    done in float32; else (Qwen3-VL) the weight scales the normalized value after its cast back to
    the input's dtype. The two round differently: each family keeps its own."""

    def __init__(self, dim: int, eps: float, centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if centred else torch.ones(dim))
        self.eps, self.centred = eps, centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.centred:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class Towers(nn.Module):
    """The checkpoint's `model.` level: the named towers (vision, projector, language model) of a
    vision-language model, registered in the order given."""

    def __init__(self, **towers: nn.Module):
        super().__init__()
        for name, tower in towers.items():
            self.add_module(name, tower)

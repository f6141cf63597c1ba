"""Region module: points and sizes in and out of the text model, as batched tensor ops.

Encoding: Fourier features [cos 2*pi*x@W, sin 2*pi*x@W] -> Linear -> text dim; the result
*replaces* the token embedding at that position.
Decoding (from the hidden state before post_ln):
    coordinate: MLP -> n bins over [0, 1]; value = bin / n (the reference's rule)
    size:       MLP -> 2 x n log-scale bins (w, h); value = 2 ** (bin / (n - 1) * 10 - 10),
                a fraction of the image width / height
A box is (cx - w/2, cy - h/2, cx + w/2, cy + h/2); nothing is clamped here.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .config import RegionConfig
from .layers import MLP


def fourier_features(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    f = 2 * math.pi * x @ w
    return torch.cat([f.cos(), f.sin()], dim=-1)


class RegionModel(nn.Module):
    def __init__(self, c: RegionConfig):
        super().__init__()
        self.config = c
        self.coord_features = nn.Parameter(torch.zeros(1, c.coord_feat_dim // 2))
        self.coord_encoder = nn.Linear(c.coord_feat_dim, c.dim)
        self.coord_decoder = MLP(c.dim, c.inner_dim, c.coord_out_dim)
        self.size_features = nn.Parameter(torch.zeros(2, c.size_feat_dim // 2))
        self.size_encoder = nn.Linear(c.size_feat_dim, c.dim)
        self.size_decoder = MLP(c.dim, c.inner_dim, c.size_out_dim)
        self.register_buffer("size_table", size_table(c.size_out_dim // 2), persistent=False)

    def reset_buffers(self) -> None:
        self.size_table = size_table(self.size_bins).to(self.coord_features.device)

    @property
    def coord_bins(self) -> int:
        return self.config.coord_out_dim

    @property
    def size_bins(self) -> int:
        return self.config.size_out_dim // 2

    def encode_coord(self, value_N: torch.Tensor) -> torch.Tensor:
        return self.coord_encoder(fourier_features(value_N[:, None].to(self.coord_features.dtype), self.coord_features))

    def encode_size(self, wh_N2: torch.Tensor) -> torch.Tensor:
        return self.size_encoder(fourier_features(wh_N2.to(self.size_features.dtype), self.size_features))

    def coord_logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        return self.coord_decoder(hidden_NC)  # [N, bins]

    def size_logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        return self.size_decoder(hidden_NC).view(-1, 2, self.size_bins)  # [N, (w, h), bins]

    def coord_value(self, bin_N: torch.Tensor) -> torch.Tensor:
        return bin_N.float() / self.coord_bins

    def size_value(self, bin_N2: torch.Tensor) -> torch.Tensor:
        return self.size_table[bin_N2]


def size_table(n_bins: int) -> torch.Tensor:
    """float32 size of every bin, each computed alone as the reference does: a vectorized pow
    over a batch can round differently in the last bit, and labels must not depend on batch.
    On the CPU also under a meta-device build (see text.rotary_table)."""
    return torch.stack([torch.pow(2.0, torch.tensor(float(b), device="cpu") / (n_bins - 1) * 10.0 - 10.0)
                        for b in range(n_bins)])

"""Rotary embeddings of both towers: rotate-half over the whole head, angles in float32.

Vision (2-D): a patch at (row, col) gets angles row * f_i in the first quarter of the head's
frequencies and col * f_i in the second, f_i = theta^(-4i / head_dim), i < head_dim / 4.

Text (interleaved multimodal): a token has three positions (t, h, w); text tokens have
t = h = w. Frequency j of the R / 2 frequencies (R: the rotated dims, the whole head or, with
Qwen3.5's partial rotary, its first part) is driven by
    h  if j % 3 == 1 and j < 3 * mrope_section[1]
    w  if j % 3 == 2 and j < 3 * mrope_section[2]
    t  otherwise,
so low and high frequencies are shared by all three axes instead of t taking the low block.
"""

from __future__ import annotations

import torch


def apply_rotary(x_NHD: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin over the first R dims of each head (R = head dim, or less
    for partial rotary: the rest passes unrotated), computed in float32, returned in x's dtype."""
    R = cos_NR.shape[-1]
    x = x_NHD[..., :R].float()
    rotated = torch.cat([-x[..., R // 2 :], x[..., : R // 2]], dim=-1)
    out = (x * cos_NR[:, None] + rotated * sin_NR[:, None]).to(x_NHD.dtype)
    return out if R == x_NHD.shape[-1] else torch.cat([out, x_NHD[..., R:]], dim=-1)


def inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
    """[dim / 2] float32 on the CPU (also inside a meta-device build, where arange would import
    torch._dynamo: hub.empty_on): theta^(-2i / dim)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))


def mrope_axes(rotary_dim: int, section: tuple[int, int, int]) -> torch.Tensor:
    """[rotary_dim / 2] long on the CPU: which of (t, h, w) drives each frequency (see the module
    docstring)."""
    j = torch.arange(rotary_dim // 2, device="cpu")
    axes = torch.zeros_like(j)
    axes[(j % 3 == 1) & (j < 3 * section[1])] = 1
    axes[(j % 3 == 2) & (j < 3 * section[2])] = 2
    return axes


def text_cos_sin(positions_3N: torch.Tensor, inv_freq: torch.Tensor, axes: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [3, N] (t, h, w) -> cos, sin [N, rotary_dim] (float32)."""
    pos_NF = positions_3N.float().t()[:, axes]  # [N, rotary_dim / 2]: each frequency's own axis
    angles = pos_NF * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def vision_cos_sin(rows_N: torch.Tensor, cols_N: torch.Tensor, inv_freq: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Patch rows / cols [N] -> cos, sin [N, head_dim] (float32); inv_freq has head_dim / 4."""
    angles = torch.cat([rows_N.float()[:, None] * inv_freq, cols_N.float()[:, None] * inv_freq], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


class TextRotary(torch.nn.Module):
    """The text model's rotary tables (float32, not in the checkpoint): the inverse frequencies of
    the first `rotary_dim` dims and the axis driving each."""

    def __init__(self, rotary_dim: int, theta: float, section: tuple[int, int, int]):
        super().__init__()
        self.rotary_dim, self.theta, self.section = rotary_dim, theta, section
        self.register_buffer("inv_freq", inverse_frequencies(rotary_dim, theta), persistent=False)
        self.register_buffer("axes", mrope_axes(rotary_dim, section), persistent=False)

    def reset(self, device: torch.device) -> None:
        """Recompute after meta construction or a dtype cast (both would spoil the tables)."""
        self.inv_freq = inverse_frequencies(self.rotary_dim, self.theta).to(device)
        self.axes = mrope_axes(self.rotary_dim, self.section).to(device)

    def forward(self, positions_3N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return text_cos_sin(positions_3N, self.inv_freq, self.axes)

"""Attention within each image of a flat patch batch, for vision towers whose images (or crops)
hold different numbers of patches: Qwen's images of any size, and any tower's images with their
duplicate patches dropped (base/prune.py). Everything but attention runs on the flat rows."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class PaddedLayout:
    """Attention within each image of a flat patch batch: images padded to the longest, one
    batched call with a key mask (padding keys are masked; padding queries are dropped). Built
    on the host from the lengths and uploaded once per batch, without waiting: every vision layer
    reuses it, and no step needs a data-dependent shape."""

    def __init__(self, lengths: list[int], device: torch.device):
        B, L = len(lengths), max(lengths)
        lens = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(lens) - lens
        j = np.arange(L)
        valid_BL = j[None] < lens[:, None]
        rows_BL = np.where(valid_BL, starts[:, None] + j[None], 0)
        packed = np.concatenate([rows_BL.reshape(-1), np.flatnonzero(valid_BL), valid_BL.reshape(-1)])
        host = torch.from_numpy(packed)
        up = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        self.rows_BL = up[: B * L].view(B, L)
        self.flat = up[B * L : B * L + int(lens.sum())]  # [n patches] rows of the real queries in [B * L]
        self.mask = None if min(lengths) == L else up[-B * L :].view(B, L).bool()[:, None, None, :]
        self.single = B == 1

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> torch.Tensor:
        if self.single:
            o = F.scaled_dot_product_attention(q_NHD.transpose(0, 1), k_NHD.transpose(0, 1), v_NHD.transpose(0, 1))
            return o.transpose(0, 1)
        q, k, v = (t[self.rows_BL].transpose(1, 2) for t in (q_NHD, k_NHD, v_NHD))  # [B, H, L, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        B, H, L, D = o.shape
        return o.transpose(1, 2).reshape(B * L, H, D).index_select(0, self.flat)

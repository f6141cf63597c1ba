"""Per-sequence state of the linear-attention layers, and how one flat forward's tokens split
into sequences for them.

A sequence keeps, per linear layer, a conv state (its last kernel - 1 conv inputs) and a
recurrent state S (float32) of a fixed size, whatever its length: one slot of `LinearState`.
A forward reads each sequence's state from its slot and writes the state after its last token
back, so a slot must hold the right starting state before: zeros for a new image prefix, a copy
of the prefix's slot for each task sequence that continues it (`fork`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import TextConfig


@dataclass
class LinearState:
    conv: torch.Tensor  # [linear layers, slots, kernel - 1, conv dim], model dtype
    recurrent: torch.Tensor  # [linear layers, slots, value heads, key dim, value dim], float32

    @classmethod
    def allocate(cls, c: TextConfig, n_slots: int, dtype: torch.dtype, device: torch.device) -> LinearState:
        n = len(c.linear_layers)
        return cls(torch.zeros(n, n_slots, c.conv_kernel - 1, c.conv_dim, dtype=dtype, device=device),
                   torch.zeros(n, n_slots, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim, dtype=torch.float32,
                               device=device))

    @staticmethod
    def bytes_per_slot(c: TextConfig, dtype: torch.dtype) -> int:
        n = len(c.linear_layers)
        return n * ((c.conv_kernel - 1) * c.conv_dim * dtype.itemsize + c.lin_v_heads * c.lin_k_dim * c.lin_v_dim * 4)

    def reset(self, slots_B: torch.Tensor) -> None:
        self.conv[:, slots_B] = 0
        self.recurrent[:, slots_B] = 0

    def fork(self, src_B: torch.Tensor, dst_B: torch.Tensor) -> None:
        """Copy the state of slots `src_B` into slots `dst_B` (a snapshot each sequence continues)."""
        self.conv[:, dst_B] = self.conv[:, src_B]
        self.recurrent[:, dst_B] = self.recurrent[:, src_B]


class Segments:
    """The sequences of a flat token batch, each a consecutive run of tokens, in flat order.
    Runs of one token (decode steps) take the recurrent step; longer runs (prefill) are padded
    to the longest and take the chunked rule. Built once per forward, shared by every linear
    layer; `lengths` are the plan's host-side counts, so building it needs no device sync."""

    def __init__(self, lengths: list[int], slots_B: torch.Tensor, device: torch.device):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        one = [i for i, n in enumerate(lengths) if n == 1]
        many = [i for i, n in enumerate(lengths) if n > 1]
        self.n_tokens = sum(lengths)
        self.step_rows = torch.tensor([starts[i] for i in one], dtype=torch.long, device=device)
        self.step_slots = slots_B[one] if one else slots_B[:0]
        self.long_slots = slots_B[many] if many else slots_B[:0]
        self.any_step, self.any_long = bool(one), bool(many)
        if many:
            L = max(lengths[i] for i in many)
            lens = torch.tensor([lengths[i] for i in many], device=device)
            j = torch.arange(L, device=device)
            self.valid_BL = j[None] < lens[:, None]
            self.rows_BL = torch.where(self.valid_BL, torch.tensor([starts[i] for i in many], device=device)[:, None]
                                       + j[None], 0)
            self.lens_B = lens

    @classmethod
    def single(cls, n_tokens: int, device: torch.device) -> Segments:
        """One sequence in slot 0 (reference forwards in tests and tools)."""
        return cls([n_tokens], torch.zeros(1, dtype=torch.long, device=device), device)

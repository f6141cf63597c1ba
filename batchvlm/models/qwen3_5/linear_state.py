"""Per-sequence state of the linear-attention layers, and how one flat forward's tokens split
into sequences for them.

A sequence keeps, per linear layer, a conv state (its last kernel - 1 conv inputs) and a
recurrent state S (float32) of a fixed size, whatever its length: one slot of `LinearState`.
A forward reads each sequence's state from its slot (or zeros, for a new image prefix) and
writes the state after its last token back. The state at the end of an image prefix stays in
the prefix's slot, a snapshot: each task sequence of the image starts from a copy of it (a fork).
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


class Wave:
    """Runs of one wave: those of one token take the recurrent step, longer ones are padded to
    the longest and take the chunked rule."""

    def __init__(self, starts: list[int], lengths: list[int], slots_B: torch.Tensor, fresh: bool,
                 device: torch.device):
        one = [i for i, n in enumerate(lengths) if n == 1]
        many = [i for i, n in enumerate(lengths) if n > 1]
        self.fresh = fresh  # start from zero state (a new prefix) instead of the slot's
        self.step_rows = torch.tensor([starts[i] for i in one], dtype=torch.long, device=device)
        self.step_slots = slots_B[one]
        self.long_slots = slots_B[many]
        self.any_step, self.any_long = bool(one), bool(many)
        if many:
            L = max(lengths[i] for i in many)
            self.lens_B = torch.tensor([lengths[i] for i in many], device=device)
            j = torch.arange(L, device=device)
            self.valid_BL = j[None] < self.lens_B[:, None]
            first = torch.tensor([starts[i] for i in many], device=device)
            self.rows_BL = torch.where(self.valid_BL, first[:, None] + j[None], 0)


class Segments:
    """The sequences of a flat token batch, each a consecutive run of tokens, in flat order, as the
    linear-attention layers see them. Each run reads its starting state from its slot and leaves
    its final state there. Two waves per layer: first the runs `[:n_fresh]`, image prefixes that
    start from zero state; then `forks` (source slots -> destination slots) are copied, the
    snapshot each task sequence of a prefix starts from; then the other runs (prompts that
    continue a prefix, decode steps). So a prefix and its sequences' prompts can share one
    forward. Built once per forward, shared by every linear layer; `lengths` are the plan's
    host-side counts, so building it needs no device sync."""

    def __init__(self, lengths: list[int], slots_B: torch.Tensor, device: torch.device, n_fresh: int = 0,
                 forks: tuple[torch.Tensor, torch.Tensor] | None = None):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        self.n_tokens = sum(lengths)
        self.forks = forks
        self.waves = [Wave(starts[:n_fresh], lengths[:n_fresh], slots_B[:n_fresh], True, device),
                      Wave(starts[n_fresh:], lengths[n_fresh:], slots_B[n_fresh:], False, device)]

    @classmethod
    def single(cls, n_tokens: int, device: torch.device, fresh: bool = False) -> Segments:
        """One sequence in slot 0 (reference forwards in tests and tools)."""
        return cls([n_tokens], torch.zeros(1, dtype=torch.long, device=device), device, n_fresh=int(fresh))

"""Per-sequence state of the linear-attention layers, and where one flat forward's sequences sit.

A sequence keeps, per linear layer, a conv state (its last kernel - 1 conv inputs) and a
recurrent state S, of a fixed size whatever its length: one state index of `LinearState`
(float32). A step's flat tokens hold
  scan runs   consecutive tokens of one sequence (an image prefix, a prompt): each starts from
              the state at `read` (ZERO: from zeros, a new prefix) and leaves its end state at
              `write`. A prefix writes its snapshot index; each task sequence's prompt reads that
              snapshot (a copy: the snapshot stays for the image's other sequences) and writes its
              own row;
  step tokens one decode token per row, reading and updating the row's state in place.
Every layer runs the runs from ZERO first (batched, padded), then the others and the steps, so a
prompt prefilled in the same forward as its prefix starts from the snapshot just written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ...cache.spans import ZERO  # `read` of a run that starts from zero state
from .config import TextConfig


@dataclass
class LinearState:
    conv: torch.Tensor  # [states, linear layers, conv dim, kernel - 1]
    recurrent: torch.Tensor  # [states, linear layers, value heads, key dim, value dim]

    @staticmethod
    def shapes(c: TextConfig) -> dict[str, tuple[int, ...]]:
        """Per sequence, all linear layers."""
        n = len(c.linear_layers)
        return {"conv": (n, c.conv_dim, c.conv_kernel - 1), "recurrent": (n, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim)}

    @classmethod
    def allocate(cls, c: TextConfig, n_states: int, device: torch.device) -> LinearState:
        s = cls.shapes(c)
        return cls(torch.zeros(n_states, *s["conv"], device=device), torch.zeros(n_states, *s["recurrent"],
                                                                                 device=device))


def _upload(device: torch.device, *columns: np.ndarray) -> list[torch.Tensor]:
    """Host int arrays -> device long tensors, in one copy that never waits for the device: from
    pageable memory the driver stages the bytes before returning, so nothing needs to stay alive
    (`torch.tensor(list, device=...)` would block until the device has run everything queued)."""
    flat = torch.from_numpy(np.concatenate(columns).astype(np.int64, copy=False))
    return list(flat.to(device, non_blocking=True).split([len(c) for c in columns]))


class Runs:
    """Runs of one wave, batched: padded to the longest for the chunked rule."""

    def __init__(self, start: list[int], length: list[int], read: list[int], write: list[int],
                 device: torch.device):
        self.any = bool(start)
        if not self.any:
            return
        self.fresh = all(r == ZERO for r in read)  # else: none is (waves are split so)
        L = max(length)
        lens = np.asarray(length, dtype=np.int64)
        b = np.repeat(np.arange(len(length)), lens)
        t = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        # the real tokens, from the host's lengths (no boolean indexing, no sync): their flat rows
        # and their places in the padded [B * L] layout
        self.read, self.write, self.lens_B, start_B, self.rows, self.padded = _upload(
            device, np.asarray(read), np.asarray(write), lens, np.asarray(start), np.asarray(start)[b] + t, b * L + t)
        j = torch.arange(L, device=device)
        self.valid_BL = j[None] < self.lens_B[:, None]
        self.rows_BL = torch.where(self.valid_BL, start_B[:, None] + j[None], 0)


class Segments:
    """Where a forward's sequences sit (see the module docstring). Host lists come from the
    plan, so building this needs no device sync; built once per forward, shared by the layers."""

    def __init__(self, scan_start: list[int], scan_len: list[int], scan_read: list[int], scan_write: list[int],
                 step_states: torch.Tensor, first_step: int, device: torch.device):
        fresh = [i for i, r in enumerate(scan_read) if r == ZERO]
        rest = [i for i, r in enumerate(scan_read) if r != ZERO]

        def runs(ix: list[int]) -> Runs:
            return Runs(*([lst[i] for i in ix] for lst in (scan_start, scan_len, scan_read, scan_write)),
                        device=device)

        self.waves = [runs(fresh), runs(rest)]
        self.step_states = step_states  # [D] long: state index of step token d (flat row first_step + d)
        self.step_rows = torch.arange(first_step, first_step + len(step_states), device=device)

    @classmethod
    def single(cls, n_tokens: int, device: torch.device, fresh: bool = False) -> Segments:
        """One sequence in state 0, from zeros or continuing (tests and tools). One token from
        state 0 is a decode step."""
        if n_tokens == 1 and not fresh:
            return cls([], [], [], [], torch.zeros(1, dtype=torch.long, device=device), 0, device)
        return cls([0], [n_tokens], [ZERO if fresh else 0], [0], torch.zeros(0, dtype=torch.long, device=device),
                   n_tokens, device)

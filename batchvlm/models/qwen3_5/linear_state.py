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

from ...cache.spans import ZERO, StateSpans  # ZERO: `read` of a run that starts from zero state
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


class Runs:
    """Spans lo..hi-1 of a step (one wave), padded to the longest for the chunked rule. Their
    state indices and bounds are slices of the step's uploaded spans (StateSpans.read / write /
    cu_seqlens, staged with the other inputs): nothing is uploaded here and nothing syncs."""

    def __init__(self, spans: StateSpans, lo: int, hi: int):
        self.any = hi > lo
        if not self.any:
            return
        self.fresh = all(r == ZERO for r in spans.scan_read[lo:hi])  # else: none is (Segments splits so)
        L = max(spans.scan_len[lo:hi])
        self.read, self.write = spans.read[lo:hi], spans.write[lo:hi]
        start_B, end_B = spans.cu_seqlens[lo:hi], spans.cu_seqlens[lo + 1 : hi + 1]
        self.lens_B = end_B - start_B
        dev = start_B.device
        j = torch.arange(L, device=dev)
        self.valid_BL = j[None] < self.lens_B[:, None]
        self.rows_BL = torch.where(self.valid_BL, start_B[:, None] + j[None], 0)
        # the real tokens (the wave's spans are consecutive flat rows): their flat rows and their
        # places b * L + t in the padded [B * L] layout
        self.rows = torch.arange(spans.scan_start[lo], spans.scan_start[hi - 1] + spans.scan_len[hi - 1], device=dev)
        b = torch.searchsorted(end_B, self.rows, right=True)
        self.padded = b * L + self.rows - start_B[b]
        # the wave's runs as one flat sequence of those tokens (fla_rule.chunked_varlen), on both sides
        self.cu = spans.cu_seqlens[lo : hi + 1] - spans.cu_seqlens[lo]
        self.cu_host = torch.from_numpy(np.concatenate([[0], np.cumsum(spans.scan_len[lo:hi], dtype=np.int64)]))


class Segments:
    """Where a forward's sequences sit (see the module docstring), from the step's StateSpans:
    host lists for the shapes, device tensors for the indices, so building this needs no device
    sync and no upload; built once per forward, shared by the layers.

    The spans tile the flat rows from row 0 in order (StateSpans.cu_seqlens), those from ZERO
    first (engine/inputs.py: prefixes, then prompts): each wave is a slice of them."""

    def __init__(self, spans: StateSpans, device: torch.device):
        reads = spans.scan_read
        n_fresh = next((i for i, r in enumerate(reads) if r != ZERO), len(reads))
        if ZERO in reads[n_fresh:]:
            raise ValueError("spans from a zero state must come before the others")
        self.waves = [Runs(spans, 0, n_fresh), Runs(spans, n_fresh, len(reads))]
        self.step_states = spans.step_rows  # [D] long: state index of step token d (flat row first_step + d)
        self.step_rows = torch.arange(spans.first_step, spans.first_step + len(spans.step_rows), device=device)

    @classmethod
    def of(cls, start: list[int], length: list[int], read: list[int], write: list[int], step_states: torch.Tensor,
           first_step: int, device: torch.device) -> Segments:
        """From host lists, uploading the indices the engine's StepInputs would carry (tests and
        tools). `start`: consecutive spans from flat row 0."""
        cu = np.concatenate([[0], np.cumsum(length, dtype=np.int64)])
        if list(start) != cu[:-1].tolist():
            raise ValueError(f"spans must tile the flat rows from 0: starts {start}, lengths {length}")
        spans = StateSpans(list(start), list(length), list(read), list(write), step_states.to(device), first_step,
                           torch.from_numpy(cu).to(device), torch.tensor(read, dtype=torch.long, device=device),
                           torch.tensor(write, dtype=torch.long, device=device))
        return cls(spans, device)

    @classmethod
    def single(cls, n_tokens: int, device: torch.device, fresh: bool = False) -> Segments:
        """One sequence in state 0, from zeros or continuing (tests and tools). One token from
        state 0 is a decode step."""
        if n_tokens == 1 and not fresh:
            return cls.of([], [], [], [], torch.zeros(1, dtype=torch.long), 0, device)
        return cls.of([0], [n_tokens], [ZERO if fresh else 0], [0], torch.zeros(0, dtype=torch.long), n_tokens, device)

"""Layers with a fixed-size state per sequence (linear attention, SSMs): where each sequence's
tokens sit in a step's flat batch, and the one loop that runs a family's scan over them.

State indices (cache/tensors.py EngineCache): the rows of running sequences, a scratch row that
padding uses, and snapshot slots holding a prefix's state at its end. A step's flat tokens are
  prefix spans   start from a zero state; their end state is written to the prefix's snapshot
  prompt spans   start from (a copy of) the snapshot of their prefix; end state -> their row
  step tokens    one decode token per row, reading and updating the row's state in place
Prefix spans come first in the flat batch and are run first in every layer, so a prompt
prefilled in the same step as its prefix forks from the snapshot just written. A zombie row (its
sequence finished, a step still in flight) only ever touches its own row, which is not reused
before that step is committed; padding rows touch only the scratch row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..cache.spans import ZERO, StateSpans

__all__ = ["ZERO", "StateSpans", "run_recurrent"]

State = dict[str, torch.Tensor]  # part -> one layer's state of some sequences [B, *shape]
Scan = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]  # ([T, C] tokens, [1, ...] state)


def run_recurrent(x_NC: torch.Tensor, spans: StateSpans, state: dict[str, torch.Tensor], layer: int,
                  scan: Scan, step: Scan) -> torch.Tensor:
    """Run one recurrent layer over a step: `scan` once per span (its tokens in order, from its
    starting state, [1, ...] states), `step` once for all step tokens ([D, ...] states, one token
    each). `state[part]` is [n_states, n_layers, *shape]; writes the end states. -> [N, C_out]."""
    parts: list[tuple[int, torch.Tensor]] = []
    for start, n, read, write in zip(spans.scan_start, spans.scan_len, spans.scan_read, spans.scan_write):
        s0 = {p: (t.new_zeros(1, *t.shape[2:]) if read == ZERO else t[read : read + 1, layer].clone())
              for p, t in state.items()}
        y, s1 = scan(x_NC[start : start + n], s0)
        for p, t in state.items():
            t[write, layer] = s1[p][0]
        parts.append((start, y))
    rows = spans.step_rows
    if rows.shape[0]:
        y, s1 = step(x_NC[spans.first_step :], {p: t[rows, layer] for p, t in state.items()})
        for p, t in state.items():
            t[rows, layer] = s1[p]
        parts.append((spans.first_step, y))
    if not parts:
        return x_NC.new_zeros(0)
    out = parts[0][1].new_empty(x_NC.shape[0], *parts[0][1].shape[1:])
    for start, y in parts:
        out[start : start + y.shape[0]] = y
    return out

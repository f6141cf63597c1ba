"""Where each sequence's tokens sit in a step's flat batch, for layers with a recurrent state
(a recurrent family runs its scan over them: models/qwen3_5/linear_state.py). Built by the engine, read by families."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ZERO = -1  # scan_read of a span that starts from a zero state


@dataclass
class StateSpans:
    scan_start: list[int]  # host: flat row of each span's first token (prefixes, then prompts)
    scan_len: list[int]  # host
    scan_read: list[int]  # host: state index each span starts from, or ZERO
    scan_write: list[int]  # host: state index each span's end state goes to
    step_rows: torch.Tensor  # [D] long: state index of each step token (flat rows first_step ...)
    first_step: int  # flat row of the first step token (host int)
    # The same spans on the device, for varlen kernels: [K + 1] cumulative lengths and [K] indices
    # (ZERO as in scan_read). Uploaded with the step's other inputs.
    cu_seqlens: torch.Tensor | None = None
    read: torch.Tensor | None = None
    write: torch.Tensor | None = None

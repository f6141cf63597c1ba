"""Grammar masks computed on a host thread one step behind, while the device runs the forward.

Step k's sampler needs the mask of each row after the tokens of step k-1, and nothing else of
step k needs it: the forward of step k reads its input tokens from device buffers (runner.py).
So the engine launches forward k without waiting, hands the emissions of step k-1 to `submit`
(a worker thread feeds them to the rows' matchers and fills step k's masks into a pinned buffer,
then copies it to the device on its own stream), and only the mask step before the sampler waits
(`mask`): on CUDA the compute stream waits on the copy's event, never the host on the device.

Two ping-pong buffers: the worker fills one while the device may still read the other. A buffer
is refilled two steps later, after its previous copy's event has completed. On CPU the same code
runs with synchronous copies; the worker still overlaps the forward (torch releases the GIL).

`trace` (optional list) records (what, step, start, end) in `time.perf_counter` seconds, so a
test can check that no forward launch waited on a mask.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..models.grammar import RowGrammars


class MaskPipeline:
    def __init__(self, grammars: RowGrammars, max_rows: int, device: torch.device,
                 trace: list[tuple[str, int, float, float]] | None = None):
        self.grammars, self.device, self.trace = grammars, device, trace
        cuda = device.type == "cuda"
        W = grammars.W
        self.host_RW = [torch.empty(max_rows, W, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self.device_RW = [torch.empty(max_rows, W, dtype=torch.int32, device=device) for _ in range(2)] \
            if cuda else self.host_RW
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.pending: list[Future | None] = [None, None]
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="masks")

    def submit(self, step: int, emitted_rows: list[int], emitted: list[int], rows: list[int]) -> None:
        """Feed the tokens step-1 emitted (`emitted[i]` by row `emitted_rows[i]`), then compute the
        masks of `rows` for `step`; returns at once."""
        slot = step % 2
        self.pending[slot] = self.worker.submit(self._work, step, slot, emitted_rows, emitted, rows)

    def _work(self, step: int, slot: int, emitted_rows: list[int], emitted: list[int], rows: list[int]) -> int:
        t0 = time.perf_counter()
        if self.copied[slot] is not None:
            self.copied[slot].synchronize()  # the copy of two steps ago has left this buffer
        self.grammars.advance(emitted_rows, emitted)
        host = self.host_RW[slot]
        self.grammars.fill(rows, host)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                self.device_RW[slot][: len(rows)].copy_(host[: len(rows)], non_blocking=True)
                self.copied[slot] = torch.cuda.Event()
                self.copied[slot].record(self.stream)
        if self.trace is not None:
            self.trace.append(("mask", step, t0, time.perf_counter()))
        return len(rows)

    def mask(self, step: int) -> torch.Tensor:
        """The device masks [B, W] of the rows `submit` named for `step`, for the mask step."""
        slot = step % 2
        n = self.pending[slot].result()  # the host waits here only (the forward is launched)
        self.pending[slot] = None
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
        return self.device_RW[slot][:n]

    def close(self) -> None:
        self.worker.shutdown(wait=True)

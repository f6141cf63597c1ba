"""CUDA graphs of decode-only steps, keyed by padded (rows, images) counts (powers of two).

Every bucket is captured at start-up, before the first step: a capture synchronizes the device,
so capturing mid-run would stall the pipeline each time a new batch size appears.

A graph reads rows, own indices, positions and block tables from static buffers. Padding rows
point at the scratch state row and the null block (they write only there); padding images
have no query rows and a one-slot prefix in the null block. Every output head is computed for
every row here (fixed shapes). Prefix tables are as wide as the widest prefix the job can have.

What a replay owns: its static inputs (filled by `run`), every intermediate, and its outputs
(the returned Decision's tensors): all in the graphs' memory pool, rewritten by the next replay
of any bucket. Whoever reads an output after launching another step must copy it first
(runner.py `emitted`). The uncaptured body (tests, on CPU) keeps that contract: it writes its
outputs into the same fixed buffers each step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..attention import bucket
from ..models.base.decoding import Decision
from .inputs import DecodeInputs, decode_shapes, pad_decode
from .plan import StepPlan
from .staging import Staging, carve

# The fixed-shape decode body a graph records: one decode-only forward and decision over the
# static input buffers (engine/runner.py `fixed_decode`). It must not sync the host or branch on
# data: capture records its device work once, replay reruns exactly that.
DecodeStep = Callable[[DecodeInputs], Decision]


@dataclass(frozen=True)
class DecodePadding:
    """The maxima every graph's static inputs are padded to."""

    rows: int  # the most rows in a step; row `rows` is the scratch row padding writes to
    prefix_blocks: int  # the widest prefix table the job can have
    own_blocks: int  # the widest own table
    seqs_per_image: int


def key_of(n_rows: int, n_images: int, max_rows: int) -> tuple[int, int]:
    return min(bucket(n_rows), max_rows), min(bucket(n_images), max_rows)


def buckets(max_rows: int) -> list[tuple[int, int]]:
    """Every key a decode step of at most max_rows rows can have (an image has >= 1 row)."""
    rows = sorted({min(2**k, max_rows) for k in range(bucket(max_rows).bit_length())})
    return [(r, i) for r in rows for i in rows if i <= r]


class DecodeGraphs:
    def __init__(self, step: DecodeStep, padding: DecodePadding, device: torch.device,
                 compute: torch.cuda.Stream | None, capture: bool = True):
        self.step = step
        self.padding = padding
        self.device, self.compute = device, compute
        self.capture = capture  # False: run the same fixed-shape body eagerly (tests it on CPU)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (graph | None, static inputs, outputs)
        # Each bucket's static inputs are views of one flat device buffer, in DecodeInputs field
        # order: a step's padded inputs, written in that layout in its pinned slot, go up in one copy.
        self.flat: dict[tuple[int, int], torch.Tensor] = {}
        self.shapes: dict[tuple[int, int], list[tuple[int, ...]]] = {}  # of each bucket's fields
        self._widths = (padding.seqs_per_image, padding.own_blocks, padding.prefix_blocks)
        self.pool = None
        t0 = time.perf_counter()
        # Under inference_mode, as the steps that replay them: flex_attention's compiled entries
        # are guarded on it, so capturing outside would compile every shape twice.
        with torch.inference_mode():
            for key in buckets(padding.rows):
                self._capture(*key)
        self.capture_s = time.perf_counter() - t0

    def _capture(self, n_rows: int, n_images: int):
        dev = self.device
        # The inputs of an all-padding step, as device buffers the graph reads (run() fills them).
        shapes = self.shapes[(n_rows, n_images)] = decode_shapes(n_rows, n_images, *self._widths)
        host = np.empty(sum(math.prod(s) for s in shapes), dtype=np.int64)
        pad_decode(None, DecodeInputs(*carve(host, shapes)), self.padding.rows)
        flat = self.flat[(n_rows, n_images)] = torch.from_numpy(host).to(dev)
        static = DecodeInputs(*carve(flat, shapes))

        def body() -> Decision:
            return self.step(static)

        if not self.capture:  # outputs held in fixed buffers as a replay's are (see run)
            self.graphs[(n_rows, n_images)] = (None, static, body())
            return
        # Warm-up and capture run the body for real: on the scratch row and the null block only.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body()
        self.pool = graph.pool()
        self.graphs[(n_rows, n_images)] = (graph, static, out)

    def run(self, plan: StepPlan, slot: Staging) -> Decision:
        key = key_of(len(plan.decode_rows), len(plan.decode_image_tables), self.padding.rows)
        graph, static, out = self.graphs[key]  # captured at start-up
        pad_decode(plan, DecodeInputs(*slot.views(self.shapes[key])), self.padding.rows)
        slot.send(self.flat[key], self.compute)  # into the static inputs, in place
        if graph is None:  # the uncaptured body, its outputs written where a replay writes them
            fresh = self.step(static)
            for f in fields(Decision):
                getattr(out, f.name).copy_(getattr(fresh, f.name))
        else:
            graph.replay()
        return out

"""CUDA graphs of decode-only steps, keyed by padded (rows, images) counts (powers of two).

Every bucket is captured at start-up, before the first step: a capture synchronizes the device,
so capturing mid-run would stall the pipeline each time a new batch size appears.

A graph reads rows, own indices, positions and block tables from static buffers. Padding rows
point at the scratch state row and the null block (they write only there); padding images
have no query rows and a one-slot prefix in the null block. Every output head is computed for
every row here (fixed shapes). Prefix tables are as wide as the widest prefix the job can have.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..models.attention import AttentionBatch
from ..models.decoding import Decision
from .plan import StepPlan
from .staging import Slot, rows_by_image

if TYPE_CHECKING:
    from .runner import Runner

FIELDS = ("rows", "own", "pos", "tables", "image_tables", "image_lens", "by_image", "slot")


def bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


def key_of(n_rows: int, n_images: int, max_rows: int) -> tuple[int, int]:
    return min(bucket(n_rows), max_rows), min(bucket(n_images), max_rows)


def buckets(max_rows: int) -> list[tuple[int, int]]:
    """Every key a decode step of at most max_rows rows can have (an image has >= 1 row)."""
    rows = sorted({min(2**k, max_rows) for k in range(bucket(max_rows).bit_length())})
    return [(r, i) for r in rows for i in rows if i <= r]


class DecodeGraphs:
    def __init__(self, runner: Runner, max_prefix_blocks: int, max_own_blocks: int, seqs_per_image: int,
                 capture: bool = True):
        self.r = runner
        self.nbp = max_prefix_blocks
        self.own = max_own_blocks
        self.per_image = seqs_per_image
        self.capture = capture  # False: run the same fixed-shape body eagerly (tests it on CPU)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (graph | None, static inputs, outputs | body)
        self.pool = None
        t0 = time.perf_counter()
        # Under inference_mode, as the steps that replay them: flex_attention's compiled entries
        # are guarded on it, so capturing outside would compile every shape twice.
        with torch.inference_mode():
            for key in buckets(runner.n_rows):
                self._capture(*key)
        self.capture_s = time.perf_counter() - t0

    def _capture(self, n_rows: int, n_images: int):
        r = self.r
        dev = r.device
        static = {"rows": torch.full((n_rows,), r.n_rows, dtype=torch.long, device=dev),
                  "own": torch.zeros(n_rows, dtype=torch.long, device=dev),
                  "pos": torch.zeros(n_rows, dtype=torch.long, device=dev),
                  "tables": torch.zeros(n_rows, self.own, dtype=torch.long, device=dev),
                  "image_tables": torch.zeros(n_images, self.nbp, dtype=torch.long, device=dev),
                  "image_lens": torch.ones(n_images, dtype=torch.long, device=dev),
                  "by_image": torch.full((n_images, self.per_image), n_rows, dtype=torch.long, device=dev),
                  "slot": torch.full((n_rows, 1), n_images * self.per_image, dtype=torch.long, device=dev)}

        def body() -> Decision:
            embeds, own_pos, groups, write_slots = [], [], [], []
            r.decode_group(*(static[k] for k in FIELDS), 0, embeds, own_pos, write_slots, groups)
            batch = AttentionBatch(write_slots[0], groups, r.bs)
            hidden = r.model.forward(embeds[0], r.model.own_positions(own_pos[0]), batch, r.cache)
            return r.decide(static["rows"], hidden, None)

        if not self.capture:
            self.graphs[(n_rows, n_images)] = (None, static, body)
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

    def run(self, plan: StepPlan, slot: Slot) -> Decision:
        r = self.r
        D, I = len(plan.decode_rows), len(plan.decode_image_tables)
        key = key_of(D, I, r.n_rows)
        graph, static, out = self.graphs[key]  # captured at start-up
        n_rows, n_images = key
        rows = np.full(n_rows, r.n_rows, dtype=np.int64)
        rows[:D] = plan.decode_rows
        own = np.zeros(n_rows, dtype=np.int64)
        own[:D] = plan.decode_own
        pos = np.zeros(n_rows, dtype=np.int64)
        pos[:D] = plan.decode_pos
        tables = np.zeros((n_rows, self.own), dtype=np.int64)
        tables[:D, : plan.decode_tables.shape[1]] = plan.decode_tables
        image_tables = np.zeros((n_images, self.nbp), dtype=np.int64)
        image_tables[:I, : plan.decode_image_tables.shape[1]] = plan.decode_image_tables
        image_lens = np.ones(n_images, dtype=np.int64)
        image_lens[:I] = plan.decode_image_lens
        grouped, slot_actual = rows_by_image(plan.decode_image, np.arange(D, dtype=np.int64)[:, None], I, n_rows)
        by_image = np.full((n_images, self.per_image), n_rows, dtype=np.int64)
        by_image[:I, : grouped.shape[1]] = grouped
        # The same slots, in the graph's fixed [n_images, per_image] layout.
        M = max(grouped.shape[1], 1)
        q_slot = np.full((n_rows, 1), n_images * self.per_image, dtype=np.int64)
        q_slot[:D, 0] = slot_actual[:, 0] // M * self.per_image + slot_actual[:, 0] % M
        uploaded, _ = slot.upload([rows, own, pos, tables, image_tables, image_lens, by_image, q_slot], [],
                                  r.device, r.compute)
        for k, v in zip(FIELDS, uploaded):
            static[k].copy_(v)
        if graph is None:
            return out()  # the uncaptured body
        graph.replay()
        return out

"""The scheduler's per-row decode state: what every step's plan reads and writes of each running
sequence, in arrays indexed by device-state row, so a step of 256 decoding rows is a few numpy
calls rather than a Python pass over its sequences per field.

A row holds one sequence from its start until it retires (scheduler.py); a retired sequence keeps
its last values (`Sequence` reads them from here while it holds a row, then from its snapshot).
"""

from __future__ import annotations

import numpy as np


class RowTable:
    def __init__(self, n_rows: int):
        self.own = np.zeros(n_rows, dtype=np.int64)  # own tokens planned into the cache so far
        self.steps = np.zeros(n_rows, dtype=np.int64)  # decode steps planned so far
        self.max_steps = np.zeros(n_rows, dtype=np.int64)  # Sequence.max_decode_steps
        self.inflight = np.zeros(n_rows, dtype=np.int64)  # planned, uncommitted steps with the row
        self.pos0 = np.zeros(n_rows, dtype=np.int64)  # rotary position of own token 0 (Prefix.next_pos)
        self.prefix = np.zeros(n_rows, dtype=np.int64)  # its prefix's PrefixTable slot
        self.order = np.zeros(n_rows, dtype=np.int64)  # start order: decode rows go oldest first
        self.live = np.zeros(n_rows, dtype=bool)  # RUNNING: decodes while steps < max_steps
        self.buffered = np.zeros(n_rows, dtype=bool)  # its emissions wait for its end (emit_buffer.py)
        # heads needed after step k: heads[row, k % period[row]] (SeqSpec.heads); grown on demand
        self.heads = np.ones((n_rows, 1), dtype=np.int64)
        self.period = np.ones(n_rows, dtype=np.int64)
        self._started = 0

    def start(self, rows: np.ndarray, max_steps: np.ndarray, pos0: np.ndarray, prefix: np.ndarray,
              heads: list[tuple[int, ...]], buffered: np.ndarray) -> None:
        """Sequences starting on `rows` (distinct): nothing planned yet."""
        self.own[rows] = self.steps[rows] = self.inflight[rows] = 0
        self.max_steps[rows], self.pos0[rows], self.prefix[rows] = max_steps, pos0, prefix
        self.order[rows] = self._started + np.arange(len(rows))
        self._started += len(rows)
        self.live[rows], self.buffered[rows] = True, buffered
        widest = max(map(len, heads), default=1)
        if widest > self.heads.shape[1]:
            grown = np.ones((self.heads.shape[0], widest), dtype=np.int64)
            grown[:, : self.heads.shape[1]] = self.heads
            self.heads = grown
        for h in set(heads):  # a job has a few head schedules
            at = rows[[x == h for x in heads]]
            self.heads[at, : len(h)] = h
            self.period[at] = len(h)

    def decoding(self) -> np.ndarray:
        """Rows of running sequences whose limit allows another decode step, oldest start first."""
        rows = np.flatnonzero(self.live & (self.steps < self.max_steps))
        return rows[np.argsort(self.order[rows], kind="stable")]

    def needs(self, rows: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Heads each row needs after its step k (Sequence.needs)."""
        return self.heads[rows, k % self.period[rows]]


class PrefixTable:
    """Admitted prefixes' block tables and lengths by slot, from admission until their image is
    done (RowTable.prefix holds a row's slot; a freed slot is reused). A step's prefix tables are
    one fancy index, padded with the null block to the widest, not a stack of per-prefix arrays."""

    def __init__(self, slots: int = 16):
        self.blocks = np.zeros((slots, 1), dtype=np.int64)  # [slot, j]: block j; 0 past the prefix's
        self.lens = np.zeros(slots, dtype=np.int64)
        self.widths = np.zeros(slots, dtype=np.int64)
        self._free: list[int] = []
        self._used = 0

    def add(self, blocks: list[int], length: int) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot, self._used = self._used, self._used + 1
        rows, cols = self.blocks.shape
        if slot >= rows or len(blocks) > cols:
            grown = np.zeros((max(rows, 2 * slot + 2), max(cols, len(blocks))), dtype=np.int64)
            grown[:rows, :cols] = self.blocks
            self.blocks = grown
            self.lens = np.concatenate([self.lens, np.zeros(grown.shape[0] - rows, dtype=np.int64)])
            self.widths = np.concatenate([self.widths, np.zeros(grown.shape[0] - rows, dtype=np.int64)])
        self.blocks[slot] = 0
        self.blocks[slot, : len(blocks)] = blocks
        self.lens[slot], self.widths[slot] = length, len(blocks)
        return slot

    def drop(self, slot: int) -> None:
        self._free.append(slot)

    def tables(self, slots: np.ndarray) -> np.ndarray:
        """[len(slots), widest] blocks of each slot's prefix (a copy)."""
        width = int(self.widths[slots].max()) if len(slots) else 0
        return self.blocks[slots, :width]

"""Buffered emissions: a running sequence's step outputs kept by row on the host until it
finishes, then handed to the family's `emit` in order, all at once.

Nothing reads a sequence's output before it finishes, except the grammar of a constrained
sequence (its next mask follows from every token it has emitted): those rows are emitted each
step, as before (scheduler.py). For every other row a commit is one vectorised write here instead
of a Python call per row per step; plain text (`emit_text`, no grammar) is flushed by numpy too.
The family sees the same calls in the same order, only later.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..models.base.decoding import EMIT_SCORE, EMIT_TOKEN, RawOutput, SeqSpec, emit_text

Emit = Callable[[RawOutput, SeqSpec, int, int, float, float], None]


class EmitBuffer:
    def __init__(self, n_rows: int, width: int = 64):
        self.count = np.zeros(n_rows, dtype=np.int64)  # emissions held per row
        self.code = np.zeros((n_rows, width), dtype=np.int64)
        self.token = np.zeros((n_rows, width), dtype=np.int64)
        self.value = np.zeros((n_rows, width, 2), dtype=np.float64)  # float32 values kept exactly

    def put(self, rows: np.ndarray, code: np.ndarray, token: np.ndarray, value: np.ndarray) -> None:
        """One emission for each of `rows` (distinct), after the ones they hold."""
        if not len(rows):
            return
        col = self.count[rows]
        if col.max() >= self.code.shape[1]:
            self._grow(2 * self.code.shape[1])
        self.code[rows, col], self.token[rows, col], self.value[rows, col] = code, token, value
        self.count[rows] += 1

    def flush(self, row: int, out: RawOutput, spec: SeqSpec, emit: Emit) -> None:
        """Hand the row's emissions to `emit`, oldest first, and empty the row."""
        n = int(self.count[row])
        if not n:
            return
        self.count[row] = 0
        codes, tokens, values = self.code[row, :n], self.token[row, :n], self.value[row, :n]
        if emit is emit_text and out.grammar is None:  # emit_text's effect, vectorised
            out.tokens.extend(tokens[codes == EMIT_TOKEN].tolist())
            out.objects.extend((v,) for v in values[codes == EMIT_SCORE, 0].tolist())
            return
        for code, token, (v0, v1) in zip(codes.tolist(), tokens.tolist(), values.tolist()):
            emit(out, spec, code, token, v0, v1)

    def _grow(self, width: int) -> None:
        for name in ("code", "token", "value"):
            old = getattr(self, name)
            new = np.zeros((old.shape[0], width, *old.shape[2:]), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

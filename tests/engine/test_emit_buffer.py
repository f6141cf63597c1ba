"""engine/emit_buffer.py: a row's held emissions reach the family's `emit` in order when it ends,
exactly as step-by-step calls would (values included), past the buffer's first width; plain text
takes the vectorised path with emit_text's effect."""

import numpy as np

from batchvlm.engine.emit_buffer import EmitBuffer
from batchvlm.models.base.decoding import EMIT_NONE, EMIT_SCORE, EMIT_TOKEN, RawOutput, emit_text


def _steps(rng, n_rows: int, n_steps: int):
    for _ in range(n_steps):
        rows = rng.permutation(n_rows)[: rng.integers(1, n_rows + 1)]
        code = rng.choice([EMIT_NONE, EMIT_TOKEN, EMIT_SCORE], size=len(rows))
        token = rng.integers(0, 1 << 40, size=len(rows))
        value = rng.standard_normal((len(rows), 2)).astype(np.float32)
        yield rows, code, token, value


def test_flush_replays_every_emission_in_order():
    rng = np.random.default_rng(0)
    buf, direct, held = EmitBuffer(5, width=2), {}, {}
    record = lambda log: lambda out, spec, *args: log.setdefault(id(out), []).append(args)  # noqa: E731
    outs = [RawOutput.empty() for _ in range(5)]
    for rows, code, token, value in _steps(rng, 5, 40):
        buf.put(rows, code, token, value)
        for r, c, t, (v0, v1) in zip(rows.tolist(), code.tolist(), token.tolist(), value.tolist()):
            record(direct)(outs[r], None, c, t, v0, v1)
    for r in range(5):
        buf.flush(r, outs[r], None, record(held))
    assert held == direct and buf.code.shape[1] >= 32 and not buf.count.any()


def test_plain_text_flush_equals_emit_text():
    rng = np.random.default_rng(1)
    buf = EmitBuffer(3)
    want, got = [RawOutput.empty() for _ in range(3)], [RawOutput.empty() for _ in range(3)]
    for rows, code, token, value in _steps(rng, 3, 100):
        buf.put(rows, code, token, value)
        for r, c, t, (v0, v1) in zip(rows.tolist(), code.tolist(), token.tolist(), value.tolist()):
            emit_text(want[r], None, c, t, v0, v1)
    for r in range(3):
        buf.flush(r, got[r], None, emit_text)
    assert [(o.tokens, o.objects) for o in got] == [(o.tokens, o.objects) for o in want]

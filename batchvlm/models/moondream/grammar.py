"""Moondream's point / detect grammar: its modes, emission codes, input kinds, head schedule,
and the host half (emissions -> points and boxes). The device half is decoding.py.

Head bits: 1 token head, 2 coordinate head, 4 size head. After the prompt and each token step a
spatial row needs the token head (another object or EOS) and, if it goes on, x (coordinate);
then y (coordinate); detect then needs (w, h) (size). After its max_objects-th object a row
reads the token head once more: EMIT_MORE if the model wanted another object (the label is cut;
nothing of that object is kept), else it ended by itself.
"""

from __future__ import annotations

from ..base.decoding import EMIT_SCORE, EMIT_TOKEN, MODE_TEXT, Decision, RawOutput, SeqSpec

MODE_POINT, MODE_DETECT = 1, 2
EMIT_X, EMIT_Y, EMIT_SIZE, EMIT_MORE = 2, 3, 4, 5
INPUT_COORD, INPUT_SIZE = 1, 2  # kinds of a step's input beside a token: a coordinate, a (w, h) size
HEAD_COORD, HEAD_SIZE = 2, 4
HEADS = {MODE_TEXT: (1,), MODE_POINT: (3, HEAD_COORD), MODE_DETECT: (3, HEAD_COORD, HEAD_SIZE)}


def spec(mode: int, prompt: tuple[int, ...], limit: int, temperature: float = 0.0, top_p: float = 1.0) -> SeqSpec:
    return SeqSpec(mode, prompt, limit, temperature, top_p, heads=HEADS[mode], decides_after_limit=mode != MODE_TEXT)


def emit(out: RawOutput, spec: SeqSpec, code: int, token: int, v0: float, v1: float) -> None:
    """Boxes are computed in float64 from the float32 centre and size, as the Moondream reference
    does, and are not clamped."""
    if code == EMIT_TOKEN:
        out.tokens.append(token)
        if out.grammar is not None:  # a json answer: its next mask follows from the token
            out.grammar.accept(token)
    elif code == EMIT_SCORE:
        out.objects.append((v0,))
    elif code == EMIT_X:
        out.pending = [v0]
    elif code == EMIT_Y:
        out.pending.append(v0)
        if spec.mode == MODE_POINT:
            out.objects.append((out.pending[0], out.pending[1]))
    elif code == EMIT_SIZE:
        x, y = out.pending
        out.objects.append((x - v0 / 2, y - v1 / 2, x + v0 / 2, y + v1 / 2))
    elif code == EMIT_MORE:
        out.more = True


def apply_decision(outputs: list[RawOutput], specs: list[SeqSpec], d: Decision) -> list[bool]:
    """Copy one step's emissions to the host outputs (one transfer); -> finished per row."""
    code, token, finished = d.code.tolist(), d.token.tolist(), d.finished.tolist()
    value: list[list[float]] = d.value.tolist()
    for out, sp, c, t, (v0, v1), f in zip(outputs, specs, code, token, value, finished):
        emit(out, sp, c, t, v0, v1)
        if f:
            out.cut = out.hit_limit(sp)
    return finished


"""Per-row decoding state shared by every family: what a sequence is, its device state, one
step's decision, counter-based sampling, and the host-side record of what a sequence emitted.

A family's `decide` turns a step's hidden states into a `Decision` on the device (no host round
trip); text families use `decide_text` below, Moondream adds its point / detect grammar
(models/moondream/decoding.py). The host reads emissions one step behind and applies them to a
`RawOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODE_TEXT, MODE_POINT, MODE_DETECT = 0, 1, 2
EMIT_NONE, EMIT_TOKEN, EMIT_X, EMIT_Y, EMIT_SIZE = 0, 1, 2, 3, 4
# Kinds of a step's input at a position: a token id, a coordinate value or a (w, h) size.
INPUT_TOKEN, INPUT_COORD, INPUT_SIZE = 0, 1, 2


@dataclass(frozen=True)
class SeqSpec:
    """One sequence to run on an image: a caption, a query, or one object of point / detect."""

    mode: int  # MODE_TEXT | MODE_POINT | MODE_DETECT
    prompt: tuple[int, ...]  # token ids after the image prefix
    limit: int  # max_new_tokens (text) or max_objects (spatial)
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def budget(self) -> int:
        """Positions the sequence may write after its prompt (an upper bound)."""
        per_step = {MODE_TEXT: 1, MODE_POINT: 2, MODE_DETECT: 3}[self.mode]
        return per_step * self.limit


@dataclass
class RowState:
    """Device state of B rows; every field is a [B] tensor."""

    mode: torch.Tensor  # long: MODE_*
    phase: torch.Tensor  # long: the family's grammar phase (0 for text)
    count: torch.Tensor  # long: tokens emitted (text) or objects completed (spatial)
    limit: torch.Tensor  # long: max_new_tokens (text) or max_objects (spatial)
    after_prompt: torch.Tensor  # bool: this forward's last token was the prompt's last
    temperature: torch.Tensor  # float: 0 = greedy
    top_p: torch.Tensor  # float
    seed: torch.Tensor  # long: per-sequence seed (counter-based sampling, batch-invariant)

    def index(self, rows: torch.Tensor) -> RowState:
        return RowState(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))


@dataclass
class Decision:
    code: torch.Tensor  # [B] long: EMIT_*
    token: torch.Tensor  # [B] long: emitted token (EMIT_TOKEN)
    value: torch.Tensor  # [B, 2] float: x, y in column 0; w, h for EMIT_SIZE
    finished: torch.Tensor  # [B] bool
    next_kind: torch.Tensor  # [B] long: INPUT_* of the next step
    next_token: torch.Tensor  # [B] long
    next_value: torch.Tensor  # [B, 2] float


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix held in int64 (products stay below 2**63)."""
    m = 0xFFFFFFFF
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & m
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & m
    return x ^ (x >> 16)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits -> float32 strictly inside (0, 1), for every input.

    The top 23 bits plus half a step: (k + 0.5) * 2^-23 for k < 2^23 is exact in float32 and
    lies in [2^-24, 1 - 2^-24]. Using more bits is wrong: (bits + 0.5) / 2^32 rounds to 1.0 for
    the top 128 values and `((bits >> 8) + 0.5) * 2^-24` ties to 1.0 for the largest, and
    u = 1 makes the Gumbel term +inf (an arbitrary token wins).
    """
    return ((bits >> 9).float() + 0.5) * 2.0**-23


def uniform(seed_B: torch.Tensor, step_B: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from (seed, step, vocab index): the same draw for a sequence
    whatever batch it runs in."""
    base = _hash32(_hash32(seed_B & 0xFFFFFFFF) ^ (step_B & 0xFFFFFFFF))
    idx = torch.arange(V, device=seed_B.device)
    return uniform_from_bits(_hash32(base[:, None] ^ idx[None, :]))


def sample_tokens(logits_BV: torch.Tensor, state: RowState, sampling: bool) -> torch.Tensor:
    greedy = logits_BV.argmax(dim=-1)
    if not sampling:
        return greedy
    # Gumbel-max over the top-p nucleus of softmax(logits / T).
    t = state.temperature.clamp_min(1e-5)[:, None]
    probs = torch.softmax(logits_BV.float() / t, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    outside = (sorted_p.cumsum(-1) - sorted_p) > state.top_p[:, None]
    keep = torch.zeros_like(outside).scatter_(1, order, ~outside)
    gumbel = -torch.log(-torch.log(uniform(state.seed, state.count, logits_BV.shape[-1])))
    scores = torch.where(keep, probs.log() + gumbel, float("-inf"))
    return torch.where(state.temperature > 0, scores.argmax(dim=-1), greedy)


def decide_text(logits_BV: torch.Tensor, state: RowState, stop_ids: torch.Tensor, sampling: bool) -> Decision:
    """One step of plain text sequences: sample a token; a stop id or the limit finishes the row.

    A row that emits its last allowed token finishes without feeding it, so limits never cost
    a forward; a stop token is not emitted. Updates `state` in place.
    """
    token = sample_tokens(logits_BV, state, sampling)
    go_on = ~torch.isin(token, stop_ids) & (state.count < state.limit)
    count = state.count + go_on.long()
    finished = ~go_on | (count >= state.limit)
    state.count = count
    state.after_prompt = torch.zeros_like(state.after_prompt)
    zeros = logits_BV.new_zeros(token.shape[0], 2, dtype=torch.float32)
    code = torch.where(go_on, EMIT_TOKEN, EMIT_NONE)
    return Decision(code, token, zeros, finished, torch.zeros_like(token), token, zeros)


@dataclass
class RawOutput:
    """What one sequence emitted, assembled on the host: token ids, or points / boxes.

    Boxes are computed in float64 from the float32 centre and size, as the Moondream reference
    does, and are not clamped.
    """

    tokens: list[int]
    objects: list[tuple[float, ...]]
    _pending: list[float]

    @classmethod
    def empty(cls) -> RawOutput:
        return cls([], [], [])

    def apply(self, mode: int, code: int, token: int, v0: float, v1: float) -> None:
        if code == EMIT_TOKEN:
            self.tokens.append(token)
        elif code == EMIT_X:
            self._pending = [v0]
        elif code == EMIT_Y:
            self._pending.append(v0)
            if mode == MODE_POINT:
                self.objects.append((self._pending[0], self._pending[1]))
        elif code == EMIT_SIZE:
            x, y = self._pending
            self.objects.append((x - v0 / 2, y - v1 / 2, x + v0 / 2, y + v1 / 2))

    def hit_limit(self, spec: SeqSpec) -> bool:
        """The sequence stopped because of its limit, not by itself: its label may be cut short.
        (A stop token is never emitted, so `limit` emitted tokens means the limit ended it.)"""
        return len(self.tokens if spec.mode == MODE_TEXT else self.objects) >= spec.limit


def apply_decision(outputs: list[RawOutput], modes: list[int], d: Decision) -> list[bool]:
    """Copy one step's emissions to the host outputs (one transfer); -> finished per row."""
    code, token, finished = d.code.tolist(), d.token.tolist(), d.finished.tolist()
    value = d.value.tolist()
    for out, mode, c, t, (v0, v1) in zip(outputs, modes, code, token, value):
        out.apply(mode, c, t, v0, v1)
    return finished

"""Per-row decoding rules for caption / query / point / detect, kept entirely on the device.

Every sequence is a row with a small integer state. After each forward, `decide` turns the
row's logits and hidden state into (a) what the row emits this step and (b) the input of its
next step, with no host round trip; the host reads the emitted values later (one step behind
in the pipelined engine) to assemble labels.

Grammar (phase after a forward -> what it decides):

    text    TOKEN : sample a token (answer id masked except right after the prompt);
                    stop on EOS or when max_new_tokens are emitted; else feed the token
    spatial TOKEN : greedy "another object or EOS" (never masked); stop on EOS or when
                    max_objects are done; else decode x from the same hidden and feed it
            Y     : decode y and feed it (point: the object is complete)
            SIZE  : detect only: decode (w, h) and feed it (the object is complete)

A row that completes its last allowed token or object stops without feeding, so length limits
never cost a forward. Outputs of a step: `code` (what was emitted), `token`, `value` (x or y in
value[:, 0], or w, h), and `finished`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import INPUT_COORD, INPUT_SIZE, INPUT_TOKEN, MoondreamModel

MODE_TEXT, MODE_POINT, MODE_DETECT = 0, 1, 2
PHASE_TOKEN, PHASE_Y, PHASE_SIZE = 0, 1, 2
EMIT_NONE, EMIT_TOKEN, EMIT_X, EMIT_Y, EMIT_SIZE = 0, 1, 2, 3, 4


@dataclass
class RowState:
    """Device state of B rows; every field is a [B] tensor."""

    mode: torch.Tensor  # long: MODE_*
    phase: torch.Tensor  # long: PHASE_*
    count: torch.Tensor  # long: tokens emitted (text) or objects completed (spatial)
    limit: torch.Tensor  # long: max_new_tokens (text) or max_objects (spatial)
    after_prompt: torch.Tensor  # bool: this forward's last token was the prompt's last
    temperature: torch.Tensor  # float: 0 = greedy
    top_p: torch.Tensor  # float
    seed: torch.Tensor  # long: per-sequence seed (counter-based sampling, batch-invariant)

    def index(self, rows: torch.Tensor) -> RowState:
        return RowState(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))

    @classmethod
    def cat(cls, states: list[RowState]) -> RowState:
        return cls(*(torch.cat([getattr(s, f) for s in states]) for f in cls.__dataclass_fields__))


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


def _uniform(seed_B: torch.Tensor, step_B: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from (seed, step, vocab index): the same draw for a sequence
    whatever batch it runs in."""
    base = _hash32(_hash32(seed_B & 0xFFFFFFFF) ^ (step_B & 0xFFFFFFFF))
    idx = torch.arange(V, device=seed_B.device)
    bits = _hash32(base[:, None] ^ idx[None, :])
    return (bits.double() + 0.5).div_(2.0**32).float()


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
    gumbel = -torch.log(-torch.log(_uniform(state.seed, state.count, logits_BV.shape[-1])))
    scores = torch.where(keep, probs.log() + gumbel, float("-inf"))
    return torch.where(state.temperature > 0, scores.argmax(dim=-1), greedy)


def decide(
    model: MoondreamModel, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> Decision:
    """Apply one step of every row's grammar; updates `state` in place.

    `heads` = (token rows, coordinate rows, size rows): the rows whose grammar phase needs that
    output head (known to the caller); other rows get zeros there, which their phase ignores.
    None computes every head for every row.
    """
    tk = model.config.tokenizer
    region = model.region
    B = hidden_BC.shape[0]
    is_text = state.mode == MODE_TEXT
    phase = state.phase
    if heads is None:
        token = _tokens(model, hidden_BC, state, sampling)
        coord = region.coord_value(region.coord_logits(hidden_BC).argmax(dim=-1))  # [B]
        size = region.size_value(region.size_logits(hidden_BC).argmax(dim=-1))  # [B, 2]
    else:
        lm, co, sz = heads
        token = hidden_BC.new_zeros(B, dtype=torch.long)
        token[lm] = _tokens(model, hidden_BC[lm], state.index(lm), sampling)
        coord = hidden_BC.new_zeros(B, dtype=torch.float32)
        coord[co] = region.coord_value(region.coord_logits(hidden_BC[co]).argmax(dim=-1))
        size = hidden_BC.new_zeros(B, 2, dtype=torch.float32)
        size[sz] = region.size_value(region.size_logits(hidden_BC[sz]).argmax(dim=-1))

    at_token = phase == PHASE_TOKEN
    go_on = at_token & (token != tk.eos_id) & (state.count < state.limit)
    completes = (is_text & go_on) | (phase == PHASE_SIZE) | ((state.mode == MODE_POINT) & (phase == PHASE_Y))
    count = state.count + completes.long()
    finished = (at_token & ~go_on) | (completes & (count >= state.limit))

    code = torch.where(
        at_token,
        torch.where(go_on, torch.where(is_text, EMIT_TOKEN, EMIT_X), EMIT_NONE),
        torch.where(phase == PHASE_Y, EMIT_Y, EMIT_SIZE),
    )
    value = torch.where((phase == PHASE_SIZE)[:, None], size, coord[:, None].expand(-1, 2))
    next_kind = torch.where(is_text, INPUT_TOKEN, torch.where(phase == PHASE_SIZE, INPUT_SIZE, INPUT_COORD))
    next_phase = torch.where(
        is_text,
        PHASE_TOKEN,
        torch.where(
            at_token,
            PHASE_Y,
            torch.where((phase == PHASE_Y) & (state.mode == MODE_DETECT), PHASE_SIZE, PHASE_TOKEN),
        ),
    )
    state.phase = next_phase
    state.count = count
    state.after_prompt = torch.zeros_like(state.after_prompt)
    return Decision(code, token, value, finished, next_kind, token, value)


def _tokens(model: MoondreamModel, hidden_BC: torch.Tensor, state: RowState, sampling: bool) -> torch.Tensor:
    """Text rows: sampled (answer id masked except right after the prompt); spatial rows: greedy."""
    answer = model.config.tokenizer.answer_id
    logits = model.text.logits(hidden_BC)
    is_text = state.mode == MODE_TEXT
    masked = logits.clone()
    masked[:, answer] = torch.where(is_text & ~state.after_prompt, float("-inf"), logits[:, answer])
    return torch.where(is_text, sample_tokens(masked, state, sampling), logits.argmax(dim=-1))


@dataclass
class RawOutput:
    """What one sequence emitted, assembled on the host: token ids, or points / boxes.

    Boxes are computed in float64 from the float32 centre and size, as the reference does,
    and are not clamped.
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


def apply_decision(outputs: list[RawOutput], modes: list[int], d: Decision) -> list[bool]:
    """Copy one step's emissions to the host outputs (one transfer); -> finished per row."""
    code, token, finished = d.code.tolist(), d.token.tolist(), d.finished.tolist()
    value = d.value.tolist()
    for out, mode, c, t, (v0, v1) in zip(outputs, modes, code, token, value):
        out.apply(mode, c, t, v0, v1)
    return finished

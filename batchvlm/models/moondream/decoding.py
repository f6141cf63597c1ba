"""Per-row decoding rules for caption / query / point / detect, kept entirely on the device.

Every sequence is a row with a small integer state. After each forward, `decide` turns the
row's logits and hidden state into (a) what the row emits this step and (b) the input of its
next step, with no host round trip; the host reads the emitted values later (one step behind
in the pipelined engine) to assemble labels.

Grammar (phase after a forward -> what it decides):

    text    TOKEN : sample a token (answer id masked except right after the prompt);
                    stop on EOS or when max_new_tokens are emitted; else feed the token
    spatial TOKEN : greedy "another object or EOS" (never masked); stop on EOS; once
                    max_objects are done, stop either way, emitting MORE if it was not EOS;
                    else decode x from the same hidden and feed it
            Y     : decode y and feed it (point: the object is complete)
            SIZE  : detect only: decode (w, h) and feed it (the object is complete)

A text row that emits its last allowed token stops without feeding it (no forward for the
limit). A spatial row feeds its last allowed object and takes one more TOKEN decision, so
`detect_truncated` means the model wanted more than max_objects, not that it found exactly that
many. Outputs of a step: `code` (what was emitted), `token`, `value` (x or y in value[:, 0], or
w, h), and `finished`.
"""

from __future__ import annotations

import torch

from ..base.decoding import EMIT_NONE, EMIT_TOKEN, INPUT_TOKEN, MODE_TEXT, Decision, RowState, sample_tokens
from ..base.grammar import apply_mask_
from .grammar import EMIT_MORE, EMIT_SIZE, EMIT_X, EMIT_Y, INPUT_COORD, INPUT_SIZE, MODE_DETECT, MODE_POINT
from .model import MoondreamModel

PHASE_TOKEN, PHASE_Y, PHASE_SIZE = 0, 1, 2


def decide(
    model: MoondreamModel, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, mask_BW: torch.Tensor | None = None,
) -> Decision:
    """Apply one step of every row's grammar; updates `state` in place.

    `heads` = (token rows, coordinate rows, size rows): the rows whose grammar phase needs that
    output head (known to the caller); other rows get zeros there, which their phase ignores.
    None computes every head for every row. `mask_BW`: json token masks (base/grammar.py), in
    jobs with json tasks; rows without a grammar allow every token.
    """
    tk = model.config.tokenizer
    region = model.region
    B = hidden_BC.shape[0]
    is_text = state.mode == MODE_TEXT
    phase = state.phase
    if heads is None:
        token = _tokens(model, hidden_BC, state, sampling, mask_BW)
        coord = region.coord_value(region.coord_logits(hidden_BC).argmax(dim=-1))  # [B]
        size = region.size_value(region.size_logits(hidden_BC).argmax(dim=-1))  # [B, 2]
    else:
        lm, co, sz = heads
        token = hidden_BC.new_zeros(B, dtype=torch.long)
        token[lm] = _tokens(model, hidden_BC[lm], state.index(lm), sampling, None if mask_BW is None else mask_BW[lm])
        coord = hidden_BC.new_zeros(B, dtype=torch.float32)
        coord[co] = region.coord_value(region.coord_logits(hidden_BC[co]).argmax(dim=-1))
        size = hidden_BC.new_zeros(B, 2, dtype=torch.float32)
        size[sz] = region.size_value(region.size_logits(hidden_BC[sz]).argmax(dim=-1))

    at_token = phase == PHASE_TOKEN
    wants = at_token & (token != tk.eos_id)
    go_on = wants & (state.count < state.limit)
    completes = (is_text & go_on) | (phase == PHASE_SIZE) | ((state.mode == MODE_POINT) & (phase == PHASE_Y))
    count = state.count + completes.long()
    finished = (at_token & ~go_on) | (is_text & completes & (count >= state.limit))

    code = torch.where(
        at_token,
        torch.where(go_on, torch.where(is_text, EMIT_TOKEN, EMIT_X), torch.where(wants, EMIT_MORE, EMIT_NONE)),
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


def _tokens(model: MoondreamModel, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
            mask_BW: torch.Tensor | None) -> torch.Tensor:
    """Text rows: sampled (answer id masked except right after the prompt; a json row's grammar
    mask first); spatial rows: greedy (their mask rows allow every token)."""
    answer = model.config.tokenizer.answer_id
    logits = model.text.logits(hidden_BC)
    if mask_BW is not None:
        logits = apply_mask_(logits, mask_BW)
    is_text = state.mode == MODE_TEXT
    masked = logits.clone()
    masked[:, answer] = torch.where(is_text & ~state.after_prompt, float("-inf"), logits[:, answer])
    return torch.where(is_text, sample_tokens(masked, state, sampling), logits.argmax(dim=-1))

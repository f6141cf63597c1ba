"""Florence-2's greedy decoding on the device, as transformers' `generate(num_beams=1)` decides it.

Three of the checkpoint's generation settings change greedy tokens (config.py GenerationSettings),
applied in transformers' order to every row's logits, without a host round trip:
  no_repeat_ngram   a token that would repeat an n-gram of the row's tokens so far (the decoder
                    start token included) is banned;
  forced_bos        the first generated token is this one, whatever the logits;
  forced_eos        the token at the last allowed position (the limit-th) is this one. When it is
                    the end token, the answer ends there unwritten and is cut (EMIT_CUT:
                    RawOutput.cut), unless the model chose the end token itself.
Otherwise as decoding.py's `decide_text`: a row that writes its limit-th token finishes (cut).

json rows (a grammar mask `mask_BW`, base/grammar.py) meet these settings so:
  forced_bos        not grammar text: it is written (EMIT_FORCED, kept in the tokens like every
                    row's) but not fed to the grammar, whose first mask holds for the next token;
  forced_eos        at the limit the answer is cut, grammar or not (`<name>_truncated`); the
                    grammar's end allows the end token, so a finished answer ends by itself;
  no_repeat_ngram   banned after the mask, unless the ban would leave the row no token the
                    grammar allows: then that row's ban is lifted for that step (the grammar wins,
                    so a row always has a token to write).
Classify choices (MODE_SCORE rows, `PromptRows`) are scored from the raw logits: no ban, no
forced token (base/device.py EngineModelBase.decide).

The n-gram ban needs each row's tokens: `History` keeps them on the device, one row per
device-state row of the engine (RowState.row), written by every decision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..base.decoding import EMIT_NONE, EMIT_SCORE, EMIT_TOKEN, Decision, RawOutput, RowState, SeqSpec, sample_tokens
from ..base.grammar import apply_mask_
from .config import GenerationSettings

# Emission code beside EMIT_NONE / EMIT_TOKEN: the forced end token cut the answer (nothing
# written). A limit-th token written ends the answer too; the scheduler sees that one itself
# (RawOutput.hit_limit).
EMIT_CUT = 2
# The forced first token (forced_bos): written like a token, but not answer text to a grammar.
EMIT_FORCED = 3


class History:
    """Tokens of every engine row: [start token, t1, t2, ...] in columns 0, 1, 2, ... Column 0 is
    never written (every sequence starts with the decoder start token); column c > 0 is written
    by the row's c-th decision. A row reused by a new sequence reads only what that one wrote
    (columns < its count + 1)."""

    def __init__(self, rows: int, width: int, start: int, device: torch.device):
        self.tokens_RW = torch.full((rows, width), start, dtype=torch.long, device=device)

    def read(self, rows_B: torch.Tensor) -> torch.Tensor:
        return self.tokens_RW[rows_B]

    def write(self, rows_B: torch.Tensor, count_B: torch.Tensor, token_B: torch.Tensor) -> None:
        """The token of each row's decision number count + 1 (zombie and padding rows write past
        their tokens, or on the scratch row)."""
        col = (count_B + 1).clamp(max=self.tokens_RW.shape[1] - 1)
        self.tokens_RW.index_put_((rows_B, col), token_B)


def ban_repeats(logits_BV: torch.Tensor, hist_BW: torch.Tensor, len_B: torch.Tensor, n: int) -> torch.Tensor:
    """Logits with -inf at each token that would complete an n-gram already in the row's first
    len_B tokens of hist_BW (transformers' NoRepeatNGramLogitsProcessor). Fixed shapes: every
    window of the history is compared, those past the row's tokens never match."""
    B, V = logits_BV.shape
    win_BKn = hist_BW.unfold(1, n, 1)  # window k = tokens k .. k + n - 1
    k = torch.arange(win_BKn.shape[1], device=hist_BW.device)
    # the row's last n - 1 tokens; a row with fewer than n tokens has no whole n-gram (no k matches)
    tail = (len_B[:, None] - n + 1 + torch.arange(n - 1, device=hist_BW.device)).clamp(min=0)
    hit_BK = (win_BKn[:, :, : n - 1] == hist_BW.gather(1, tail)[:, None, :]).all(-1) & (k[None] <= (len_B - n)[:, None])
    # banned tokens get -inf; windows that do not hit write to a spare column V, dropped after
    target = torch.where(hit_BK, win_BKn[:, :, n - 1], V)
    return F.pad(logits_BV, (0, 1)).scatter_(1, target, float("-inf"))[:, :V]


def decide(logits_BV: torch.Tensor, state: RowState, sampling: bool, g: GenerationSettings,
           history: History | None, mask_BW: torch.Tensor | None = None) -> Decision:
    """One step of every row; updates `state` (and the history) in place. `mask_BW`: json token
    masks, in jobs with json tasks (rows without a grammar allow every token)."""
    if mask_BW is not None:
        logits_BV = apply_mask_(logits_BV, mask_BW)
    if history is not None:
        banned_BV = ban_repeats(logits_BV, history.read(state.row), state.count + 1, g.no_repeat_ngram)
        if mask_BW is not None:  # never ban a row's last allowed tokens (module docstring)
            left_B1 = (banned_BV > float("-inf")).any(-1, keepdim=True)
            banned_BV = torch.where(left_B1, banned_BV, logits_BV)
        logits_BV = banned_BV
    chosen = sample_tokens(logits_BV, state, sampling)
    forced = torch.zeros_like(state.count, dtype=torch.bool)
    if g.forced_bos is not None:
        forced = state.count == 0
        chosen = torch.where(forced, g.forced_bos, chosen)
    last = state.count + 1 >= state.limit  # this decision writes the limit-th token
    token = chosen if g.forced_eos is None else torch.where(last, g.forced_eos, chosen)
    written = token != g.eos
    cut = last & ~written & (chosen != g.eos)  # the forced end in place of the model's token
    if history is not None:
        history.write(state.row, state.count, token)
    state.count = state.count + written.long()
    state.after_prompt = torch.zeros_like(state.after_prompt)
    code = torch.where(written, torch.where(forced, EMIT_FORCED, EMIT_TOKEN),
                       torch.where(cut, EMIT_CUT, EMIT_NONE))
    zeros = logits_BV.new_zeros(token.shape[0], 2, dtype=torch.float32)
    return Decision(code, token, zeros, ~written | last, torch.zeros_like(token), token, zeros)


def emit(out: RawOutput, spec: SeqSpec, code: int, token: int, v0: float, v1: float) -> None:
    """The host half: keep written tokens (feeding a json answer's grammar all but the forced
    first one), note a forced cut, keep a choice's score."""
    if code in (EMIT_TOKEN, EMIT_FORCED):
        out.tokens.append(token)
        if code == EMIT_TOKEN and out.grammar is not None:
            out.grammar.accept(token)
    elif code == EMIT_CUT:
        out.cut = True
    elif code == EMIT_SCORE:
        out.objects.append((v0,))

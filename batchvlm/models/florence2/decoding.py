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

The n-gram ban needs each row's tokens: `History` keeps them on the device, one row per
device-state row of the engine (RowState.row), written by every decision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..decoding import EMIT_NONE, EMIT_TOKEN, Decision, RawOutput, RowState, SeqSpec, sample_tokens
from .config import GenerationSettings

# Emission code beside EMIT_NONE / EMIT_TOKEN: the forced end token cut the answer (nothing
# written). A limit-th token written ends the answer too; the scheduler sees that one itself
# (RawOutput.hit_limit).
EMIT_CUT = 2


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
           history: History | None) -> Decision:
    """One step of every row; updates `state` (and the history) in place."""
    if history is not None:
        logits_BV = ban_repeats(logits_BV, history.read(state.row), state.count + 1, g.no_repeat_ngram)
    chosen = sample_tokens(logits_BV, state, sampling)
    if g.forced_bos is not None:
        chosen = torch.where(state.count == 0, g.forced_bos, chosen)
    last = state.count + 1 >= state.limit  # this decision writes the limit-th token
    token = chosen if g.forced_eos is None else torch.where(last, g.forced_eos, chosen)
    written = token != g.eos
    cut = last & ~written & (chosen != g.eos)  # the forced end in place of the model's token
    if history is not None:
        history.write(state.row, state.count, token)
    state.count = state.count + written.long()
    state.after_prompt = torch.zeros_like(state.after_prompt)
    code = torch.where(written, EMIT_TOKEN, torch.where(cut, EMIT_CUT, EMIT_NONE))
    zeros = logits_BV.new_zeros(token.shape[0], 2, dtype=torch.float32)
    return Decision(code, token, zeros, ~written | last, torch.zeros_like(token), token, zeros)


def emit(out: RawOutput, spec: SeqSpec, code: int, token: int, v0: float, v1: float) -> None:
    """The host half: keep written tokens, note a forced cut."""
    if code == EMIT_TOKEN:
        out.tokens.append(token)
    elif code == EMIT_CUT:
        out.cut = True

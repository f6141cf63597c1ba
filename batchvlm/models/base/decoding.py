"""Per-row decoding state shared by every family: what a sequence is, its device state, one
step's decision, counter-based sampling, and the host-side record of what a sequence emitted.

The grammar belongs to the family: its `decide` turns a step's hidden states into a `Decision`
on the device (no host round trip), and its `emit` applies a step's emissions to a `RawOutput`
on the host, one step behind. The engine carries modes, codes, tokens and values opaquely, and a
per-sequence head schedule (`SeqSpec.heads`). Text families use `decide_text` / `emit_text`
below; Moondream's point / detect grammar is in models/moondream/grammar.py.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

MODE_TEXT = 0  # a family's other modes are its own (values above 0)
MODE_SCORE = -1  # a classify choice: its prompt rows are scored, it finishes at its first decision
EMIT_NONE, EMIT_TOKEN = 0, 1  # a family's other emission codes are its own (values above 1)
EMIT_SCORE = -1  # value[0]: the summed log-probability of a MODE_SCORE row's scored tokens
INPUT_TOKEN = 0  # the kind of a step's input: a token id (a family may add kinds)
HEAD_TOKEN = 1  # bit 0 of a head set: the token head. A family has at most N_HEADS output heads.
N_HEADS = 3


@dataclass(frozen=True)
class SeqSpec:
    """One sequence to run on an image: a caption, a query, or one object of point / detect."""

    mode: int  # MODE_TEXT or a family's own mode (the row state's `mode`, opaque to the engine)
    prompt: tuple[int, ...]  # token ids after the image prefix
    limit: int  # max_new_tokens (text) or max_objects (spatial)
    temperature: float = 0.0
    top_p: float = 1.0
    # Tokens that belong to the sequence's prefix segment, after the image (an encoder-decoder's
    # encoder prompt; a prompt shared by several sequences): sequences of an image with equal
    # prefix prompts share one prefix. Empty for decoder-only families: the image prefix.
    prefix_prompt: tuple[int, ...] = ()
    # The output heads each step needs, as bit sets cycling with the step (0 = the prompt's last
    # token): step k needs heads[k % len(heads)]. One emitted item (a token, an object) takes one
    # cycle, so `limit` items take at most len(heads) * limit positions.
    heads: tuple[int, ...] = (HEAD_TOKEN,)
    # The sequence feeds its last allowed item and decides once more (does the model want another
    # one?), so a list of exactly `limit` items is told from a cut one: `RawOutput.more`. It then
    # writes up to `budget` positions; otherwise its last item is never fed (budget - 1).
    decides_after_limit: bool = False
    # A host-side grammar the sequence's tokens follow (base/grammar.py JsonGrammar): its
    # `answer()` starts the sequence's RawOutput.grammar, and each step the sequence runs in gets
    # a mask of `words` int32 words from it (engine/scheduler.py: one step behind). Opaque to the
    # engine but for `words`. None: unconstrained.
    grammar: Any = field(default=None, compare=False)

    @property
    def budget(self) -> int:
        """Positions the sequence may write after its prompt (an upper bound). A MODE_SCORE
        sequence's `limit` is how many of its last prompt rows are scored; it writes nothing."""
        return 1 if self.mode == MODE_SCORE else len(self.heads) * self.limit


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
    # long: the device-state row of each row (the engine's row index, padding -> its scratch row),
    # for a family that keeps per-row buffers of its own (Florence-2's token history). None
    # outside the engine.
    row: torch.Tensor | None = None

    def index(self, rows: torch.Tensor) -> RowState:
        return RowState(*(None if (x := getattr(self, f)) is None else x[rows] for f in self.__dataclass_fields__))


@dataclass
class Decision:
    code: torch.Tensor  # [B] long: EMIT_*
    token: torch.Tensor  # [B] long: emitted token (EMIT_TOKEN)
    value: torch.Tensor  # [B, 2] float: x, y in column 0; w, h for EMIT_SIZE
    finished: torch.Tensor  # [B] bool
    next_kind: torch.Tensor  # [B] long: INPUT_* of the next step
    next_token: torch.Tensor  # [B] long
    next_value: torch.Tensor  # [B, 2] float


def sequence_seed(job_seed: int, key: str, seq: int) -> int:
    """Sampling seed of one sequence: a function of the job seed, sample key and task alone."""
    return zlib.crc32(f"{job_seed}/{key}/{seq}".encode())


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix, in int32 (wrapping products, shifts made logical by a mask) or in
    int64 holding values below 2**32: the same 32 bits either way."""
    m = 0xFFFFFFFF if x.dtype == torch.int64 else -1
    x = ((x ^ ((x >> 16) & 0xFFFF)) * 0x45D9F3B) & m
    x = ((x ^ ((x >> 16) & 0xFFFF)) * 0x45D9F3B) & m
    return x ^ ((x >> 16) & 0xFFFF)


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """32 random bits (int64 below 2**32, or int32) -> float32 strictly inside (0, 1), for every input.

    The top 23 bits plus half a step: (k + 0.5) * 2^-23 for k < 2^23 is exact in float32 and
    lies in [2^-24, 1 - 2^-24]. Using more bits is wrong: (bits + 0.5) / 2^32 rounds to 1.0 for
    the top 128 values and `((bits >> 8) + 0.5) * 2^-24` ties to 1.0 for the largest, and
    u = 1 makes the Gumbel term +inf (an arbitrary token wins).
    """
    return (((bits >> 9) & 0x7FFFFF).float() + 0.5) * 2.0**-23


def uniform(seed_B: torch.Tensor, step_B: torch.Tensor, V: int) -> torch.Tensor:
    """[B, V] uniforms in (0, 1) from (seed, step, vocab index): the same draw for a sequence
    whatever batch it runs in. The [B, V] hash runs in int32 (4 bytes per token, not 8)."""
    base = _hash32(_hash32(seed_B & 0xFFFFFFFF) ^ (step_B & 0xFFFFFFFF))  # [B] in [0, 2**32)
    base = torch.where(base >= 2**31, base - 2**32, base).to(torch.int32)  # the same 32 bits
    idx = torch.arange(V, device=seed_B.device, dtype=torch.int32)
    return uniform_from_bits(_hash32(base[:, None] ^ idx[None, :]))


# Elements of the [rows, V] block sampled at a time: sampling's temporaries (softmax, sort and its
# int64 order, cumsum, the hash, the Gumbel scores: ~40 bytes per element) stay near 320 MiB
# whatever the batch; at V = 248k that is 33 rows a block, 8 blocks at 256 rows.
SAMPLE_BLOCK = 1 << 23


def sample_tokens(logits_BV: torch.Tensor, state: RowState, sampling: bool) -> torch.Tensor:
    greedy = logits_BV.argmax(dim=-1)
    if not sampling:
        return greedy
    # Each row's draw depends on its own logits and state alone (batch-invariant), so blocks of
    # rows give the samples the whole batch would; the shapes are fixed (graph-safe).
    B, V = logits_BV.shape
    rows = max(1, SAMPLE_BLOCK // V)
    sampled = torch.cat([_nucleus_gumbel(logits_BV[i : i + rows], state.temperature[i : i + rows],
                                         state.top_p[i : i + rows], state.seed[i : i + rows],
                                         state.count[i : i + rows]) for i in range(0, B, rows)])
    return torch.where(state.temperature > 0, sampled, greedy)


def _nucleus_gumbel(logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor,
                    seed_B: torch.Tensor, step_B: torch.Tensor) -> torch.Tensor:
    """Gumbel-max over the top-p nucleus of softmax(logits / T)."""
    t = temperature_B.clamp_min(1e-5)[:, None]
    probs = torch.softmax(logits_BV.float() / t, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    outside = (sorted_p.cumsum(-1) - sorted_p) > top_p_B[:, None]
    keep = torch.zeros_like(outside).scatter_(1, order, ~outside)
    gumbel = -torch.log(-torch.log(uniform(seed_B, step_B, logits_BV.shape[-1])))
    scores = torch.where(keep, probs.log() + gumbel, float("-inf"))
    return scores.argmax(dim=-1)


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


SCORE_END = -1  # PromptRows.target_N of a prompt's last row: it predicts the family's end token


@dataclass
class PromptRows:
    """The prompt rows a step's MODE_SCORE sequences score (their last `limit` rows, chosen on the
    host), on the device: what a family that scores choices needs (docs/adding-a-family.md, classify)."""

    hidden_UC: torch.Tensor  # [U, C]: one row per distinct context (scored rows that agree on theirs share it)
    pick_N: torch.Tensor  # [n_scored] the row of hidden_UC that holds each scored row's context
    target_N: torch.Tensor  # [n_scored] the token each row predicts: the next prompt token, or SCORE_END
    seq_N: torch.Tensor  # [n_scored] emitting row of each
    # Every emitting row of the step is a MODE_SCORE sequence (a host fact): there is no token to
    # decide, so a family skips its decision (and the logits of the emitting rows): `scores_only`.
    only_scores: bool = False


def choice_scores(logits_fn, prompt: PromptRows, state: RowState, end_id: int) -> torch.Tensor:
    """[B] summed float32 log-probabilities of what each MODE_SCORE row's scored prompt rows
    predict: the choice's tokens (each scored at the row before it), then `end_id` at the last row
    (the end is never fed). Other rows get 0. Logits are computed once per distinct context of
    the scored rows, and for no other row."""
    target = torch.where(prompt.target_N == SCORE_END, end_id, prompt.target_N)
    logp = torch.log_softmax(logits_fn(prompt.hidden_UC).float(), -1)[prompt.pick_N, target]
    return torch.zeros(state.mode.shape[0], dtype=torch.float32, device=logp.device).index_add_(
        0, prompt.seq_N, logp)


def scores_only(scores_B: torch.Tensor) -> Decision:
    """The decision of a step whose rows are all MODE_SCORE: each emits its score and finishes."""
    B = scores_B.shape[0]
    zeros_B = torch.zeros(B, dtype=torch.long, device=scores_B.device)
    value = torch.stack([scores_B, torch.zeros_like(scores_B)], 1)
    return Decision(torch.full_like(zeros_B, EMIT_SCORE), zeros_B, value, torch.ones(B, dtype=torch.bool,
                    device=scores_B.device), zeros_B, zeros_B, torch.zeros_like(value))


def with_scores(d: Decision, state: RowState, scores_B: torch.Tensor) -> Decision:
    """MODE_SCORE rows emit their score and finish; other rows keep their decision."""
    is_score = state.mode == MODE_SCORE
    value = d.value.clone()
    value[:, 0] = torch.where(is_score, scores_B, value[:, 0])
    return Decision(torch.where(is_score, EMIT_SCORE, d.code), d.token, value, d.finished | is_score,
                    d.next_kind, d.next_token, d.next_value)


@dataclass
class RawOutput:
    """What one sequence emitted, whatever ran it: token ids, or objects (family-defined tuples,
    e.g. points / boxes; a classify choice's summed log-probability as `(score,)`), `pending` as
    the family's scratch, and `cut`: a limit ended it, not the model (its label may be cut short).
    On the native engine the family's `emit` assembles it on the host and the scheduler sets
    `cut` when the sequence finishes (`hit_limit`). Token counts, for budgeting a job, come from
    whatever ran the sequence (never re-tokenised): `prompt_tokens` the context before its first
    generated token (the image's prefix, read by every sequence of the image, and its own prompt),
    `generated_tokens` the positions it decoded (a stop token included; 0 for a scored choice)."""

    tokens: list[int]
    objects: list[tuple[float, ...]] = field(default_factory=list)
    pending: list[float] = field(default_factory=list)
    cut: bool = False
    more: bool = False  # a decides_after_limit sequence asked for another item past its limit
    grammar: Any = None  # a constrained sequence's grammar state (SeqSpec.grammar), fed what it emits
    prompt_tokens: int = 0
    generated_tokens: int = 0

    @classmethod
    def empty(cls) -> RawOutput:
        return cls([])

    def hit_limit(self, spec: SeqSpec) -> bool:
        """The sequence stopped because of its limit, not by itself. (A stop token is never
        emitted, so `limit` emitted tokens means the limit ended it, unless its grammar says the
        answer was whole by then; a decides_after_limit sequence is cut when it asked for more.)"""
        if spec.decides_after_limit:
            return self.more
        if len(self.tokens if spec.mode == MODE_TEXT else self.objects) < spec.limit:
            return False
        return self.grammar is None or not self.grammar.complete  # whole with the last token allowed: no cut


def emit_text(out: RawOutput, spec: SeqSpec, code: int, token: int, v0: float, v1: float) -> None:
    """The host half of plain text decoding: keep emitted tokens (and a choice's score), and feed
    a constrained sequence's grammar the token (its next mask follows from it)."""
    if code == EMIT_TOKEN:
        out.tokens.append(token)
        if out.grammar is not None:
            out.grammar.accept(token)
    elif code == EMIT_SCORE:
        out.objects.append((v0,))

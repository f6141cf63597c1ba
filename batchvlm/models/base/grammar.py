"""Grammar-constrained decoding for `json` tasks (and output.constrain): a schema compiled once per
job, one answer's matcher on the host (`Answer`, fed the tokens the answer emits), masks of many
answers filled at once (`fill_masks`), and the mask step applied on the device before the
(batch-invariant) sampler (`apply_mask_`). The native engine computes masks one step behind,
never while a launch waits (engine/scheduler.py); the transformers backend inside `generate`.

The library is xgrammar (`pip install 'batchvlm[structured]'`), chosen by measurement against
llguidance 1.9.1 (scripts/bench_grammar.py, docs/benchmarks.md "Grammar engines"): on a 151,650-token
byte-level BPE, over random walks at batch 64 and 256, its masks cost 3-10x less host time per
row for four of the five test schemas (llguidance wins enums, 1.4-1.8x) and its tokenizer setup
takes 77 MiB against 269; its compile is slower (21 ms-3.1 s per schema against 1-3 ms) but
happens once per job.

A mask is a bitmask of `W = ceil(V / 32)` int32 words per row: bit `v % 32` of word `v // 32` set
= token v allowed. Rows without a grammar get all bits set (nothing masked), so one mask step
serves a batch that mixes constrained and free rows. Answers are compact JSON (no whitespace
outside strings), properties in schema order; `additionalProperties` absent allows others, as
JSON Schema says (xgrammar's strict mode would forbid them). No answer holds a special or added
token of the tokenizer; a stop token only ends one (`text_vocab`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch

from .errors import FamilyError

ALL_ALLOWED = -1  # an int32 word with every bit set


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ImportError("json tasks need xgrammar: pip install 'batchvlm[structured]'") from None
    return xgrammar


class Vocabulary:
    """A tokenizer as the grammar library sees it: built once per job (seconds for a large vocab)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        """`tokenizer`: a `tokenizers.Tokenizer`; `vocab_size`: the model's logits width (may exceed
        the tokenizer's); `stop_ids`: what ends an answer (the end-of-turn token)."""
        from transformers import PreTrainedTokenizerFast

        xgr = _xgrammar()
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
        detected = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.info = xgr.TokenizerInfo(text_vocab(tokenizer, vocab_size, stop_ids), detected.vocab_type,
                                      vocab_size=vocab_size, stop_token_ids=stop_ids,
                                      add_prefix_space=detected.add_prefix_space)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        next_VS, self.utf8_masks_SW = utf8_tables(self.info.decoded_vocab, vocab_size)
        self.utf8_next_VS = next_VS.numpy()  # read one entry per emitted token: numpy, no tensor op

    def compile(self, schema: dict[str, Any]) -> JsonGrammar:
        return JsonGrammar(self.compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=False), self)


def text_vocab(tokenizer, vocab_size: int, stop_ids: list[int]) -> list[str]:
    """Each token id's text as xgrammar reads it (the tokenizer's encoded form), "" for the ids no
    answer may write: the added tokens (control tokens such as <|image_pad|>, <think>, Florence-2's
    <loc_N>), but for the stop tokens, and the ids past the tokenizer. xgrammar never allows an
    empty token; it allows a stop token only where the grammar may end."""
    text = [""] * vocab_size
    refused = set(tokenizer.get_added_tokens_decoder()) - set(stop_ids)
    for token, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in refused:
            text[i] = token
    return text


# UTF-8 decoder states between tokens: what the bytes so far still need to be valid UTF-8.
# 0 complete; 1-3 need that many continuation bytes (80-BF); 4-7 need a restricted second byte
# (after E0: A0-BF, ED: 80-9F (no surrogates), F0: 90-BF, F4: 80-8F (<= U+10FFFF)), then 1 or 2.
UTF8_STATES = 8
_SECOND = {4: (0xA0, 0xBF, 1), 5: (0x80, 0x9F, 1), 6: (0x90, 0xBF, 2), 7: (0x80, 0x8F, 2)}


def _utf8_step(state: int, b: int) -> int:
    """-> the next state, or -1: not valid UTF-8, or a raw control byte (JSON has none)."""
    if state == 0:
        if b < 0x20:
            return -1
        if b < 0x80:
            return 0
        if 0xC2 <= b <= 0xDF:
            return 1
        return {0xE0: 4, 0xED: 5, 0xF0: 6, 0xF4: 7}.get(b, 2 if 0xE1 <= b <= 0xEF else 3 if 0xF1 <= b <= 0xF3 else -1)
    lo, hi, nxt = _SECOND.get(state, (0x80, 0xBF, state - 1))
    return nxt if lo <= b <= hi else -1


def utf8_tables(decoded_vocab: list[bytes], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (next state of each token from each state [V, S] int8, -1 = refused; the allowed tokens
    of each state as masks [S, W] int32).

    Why: xgrammar 0.2.9 lets raw control bytes into strings that have minLength / maxLength, and
    UTF-8 surrogates into any string (invalid JSON / text; llguidance refuses both). Compact JSON
    is valid UTF-8 with no raw byte < 0x20 anywhere, so ANDing every mask with its row's state
    mask removes exactly those answers and no valid one."""
    step_SB = np.array([[_utf8_step(st, b) for b in range(256)] for st in range(UTF8_STATES)] + [[-1] * 256],
                       dtype=np.int64)  # the last row: refused stays refused (state -1 indexes it)
    V = mask_words(vocab_size) * 32
    next_VS = np.full((V, UTF8_STATES), -1, dtype=np.int64)
    plain = np.array([len(t) > 0 and all(0x20 <= b < 0x80 for b in bytes(t)) for t in decoded_vocab], dtype=bool)
    next_VS[: len(decoded_vocab)][plain, 0] = 0  # printable ASCII: only after a complete character
    rest = np.flatnonzero(~plain)
    if len(rest):
        lens = np.array([len(decoded_vocab[v]) for v in rest])
        rest, lens = rest[np.argsort(-lens, kind="stable")], np.sort(lens)[::-1]  # at byte j, tokens longer lead
        flat = np.frombuffer(b"".join(bytes(decoded_vocab[v]) for v in rest), dtype=np.uint8).astype(np.int64)
        starts = np.cumsum(lens) - lens
        state_SN = np.repeat(np.arange(UTF8_STATES)[:, None], len(rest), axis=1)
        for j in range(int(lens[0])):  # byte j of every such token, from every start state at once
            n = int(np.searchsorted(-lens, -j, side="left"))  # tokens with more than j bytes
            state_SN[:, :n] = step_SB[state_SN[:, :n], flat[starts[:n] + j]]
        next_VS[rest] = state_SN.T
    next_VS = torch.from_numpy(next_VS).to(torch.int8)
    bits_SW32 = (next_VS.T >= 0).reshape(UTF8_STATES, -1, 32).long() << torch.arange(32)
    words_SW = bits_SW32.sum(-1)  # < 2**32: as int32, the same 32 bits
    return next_VS[:vocab_size], torch.where(words_SW >= 2**31, words_SW - 2**32, words_SW).to(torch.int32)


class JsonGrammar:
    """One schema compiled for one vocabulary; `answer()` starts an answer. Opaque to the engine
    (SeqSpec.grammar) but for `words`, the width of its masks."""

    def __init__(self, compiled, vocab: Vocabulary):
        self.compiled, self.vocab = compiled, vocab
        self.words = mask_words(vocab.vocab_size)

    def answer(self) -> Answer:
        return Answer(_xgrammar().GrammarMatcher(self.compiled), self.vocab)


class Answer:
    """The host-side grammar state of one answer: the matcher after its tokens so far and its
    UTF-8 state (UTF8_STATES). Fed only tokens its own last mask allowed."""

    def __init__(self, matcher, vocab: Vocabulary):
        self.matcher, self.vocab, self.utf8 = matcher, vocab, 0

    def accept(self, token: int) -> None:
        """A token the answer emitted. Once the grammar has ended (only a stop token was allowed)
        nothing more is fed: a stop token is never emitted, a zombie step's token is ignored."""
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} broke the grammar (its mask allowed it: a bug)")
        self.utf8 = int(self.vocab.utf8_next_VS[token, self.utf8])  # >= 0: the mask allowed the token

    @property
    def ended(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def complete(self) -> bool:
        """The answer is whole: its grammar ended, or matched all of it and allows nothing but the
        end next. An answer that became whole with the last token a limit allowed was cut by
        nothing (RawOutput.hit_limit)."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        mask = np.zeros((1, mask_words(self.vocab.vocab_size)), dtype=np.int32)  # host memory: no device op
        self.matcher.fill_next_token_bitmask(torch.from_numpy(mask))
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.vocab.vocab_size])
        return set(allowed.tolist()) <= set(self.vocab.info.stop_token_ids)


def mask_threads(device: torch.device) -> int:
    """xgrammar's threads for one step's masks, from the device the forward runs on. On a CPU
    device, 1: the forward itself needs the cores. On a CUDA device the host only launches and
    the masks are its longest work per step: half of this process's share of the cores (one
    process per GPU; the other half for the scheduler loop, the loaders and the image
    preprocessing), at most 8 (a cap not yet measured). An H200 host with 16 cores: 8. What it
    buys is to be measured on such a host: the json rows of the host bench (issue 37 item 6, mask
    time per step) at this count against 1."""
    if device.type != "cuda":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores // max(1, torch.cuda.device_count()) // 2))


_FILLERS: dict[int, Any] = {}  # xgrammar batch fillers by thread count, one each per process (a thread pool)


def fill_masks(answers: list[Answer], out_MW: np.ndarray | torch.Tensor, threads: int = 1) -> None:
    """The next-token masks of `answers` into `out_MW[:len(answers)]` (host int32, C-contiguous,
    `words` wide): the grammar's, ANDed with the UTF-8 state's, filled on `threads` threads (the
    masks do not depend on it). An ended answer gets every bit (its row may run one more step
    whose emission is ignored)."""
    out = torch.from_numpy(out_MW) if isinstance(out_MW, np.ndarray) else out_MW
    out[: len(answers)].fill_(ALL_ALLOWED)
    held = [i for i, a in enumerate(answers) if not a.ended]
    if not held:
        return
    if threads not in _FILLERS:
        _FILLERS[threads] = _xgrammar().BatchGrammarMatcher(max_threads=threads)
    _FILLERS[threads].batch_fill_next_token_bitmask([answers[i].matcher for i in held], out, indices=held)
    vocab = answers[held[0]].vocab
    out[held] &= vocab.utf8_masks_SW[[answers[i].utf8 for i in held]]


class RowGrammars:
    """Host-side grammar state of a static batch's rows (the transformers backend): each row holds
    an answer or nothing (free). Only one thread touches it, in step order: `advance` with the
    tokens a step emitted, then `fill` for the next step's rows."""

    def __init__(self, n_rows: int, vocab: Vocabulary):
        self.answers: list[Answer | None] = [None] * n_rows
        self.W = mask_words(vocab.vocab_size)

    def start(self, row: int, grammar: JsonGrammar | None) -> None:
        self.answers[row] = grammar.answer() if grammar is not None else None

    def advance(self, rows: list[int], tokens: list[int]) -> None:
        """Feed each row the token it emitted (free rows are skipped; so is a finished row's stop
        token, after which its grammar has ended)."""
        for r, t in zip(rows, tokens):
            if (a := self.answers[r]) is not None:
                a.accept(t)

    def fill(self, rows: list[int], out_BW: torch.Tensor) -> None:
        """Masks of `rows` into `out_BW[:len(rows)]` (a CPU int32 tensor); free rows unmasked."""
        out_BW[: len(rows)].fill_(ALL_ALLOWED)
        held = [i for i, r in enumerate(rows) if self.answers[r] is not None]
        if held:
            part = torch.empty(len(held), self.W, dtype=torch.int32)
            fill_masks([self.answers[rows[i]] for i in held], part)
            out_BW[held] = part


def apply_mask_(logits_BV: torch.Tensor, mask_BW: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens -> -inf, in place (the step's own logits: no [B, V] copy), on the device,
    in fixed shapes (no host sync; graph-safe); returns `logits_BV`.

    The one temporary is [B, 32 W] bytes: the mask's words read as bytes (little-endian, as on
    every device torch runs on: bit j of byte k of word w is token 32 w + 8 k + j), each byte's
    bits shifted out in place into a 0/1 "refused" byte, which is a valid bool."""
    V = logits_BV.shape[-1]
    shift_8 = torch.arange(8, device=mask_BW.device, dtype=torch.uint8)
    refused_BW48 = mask_BW.contiguous().view(torch.uint8).unsqueeze(-1) >> shift_8
    refused_BW48.bitwise_and_(1).bitwise_xor_(1)
    return logits_BV.masked_fill_(refused_BW48.view(torch.bool).flatten(1)[:, :V], float("-inf"))


class Grammars:
    """A family's schemas compiled for one tokenizer (a `tokenizers.Tokenizer`), each once, the
    vocabulary built on first use (seconds for a 150k-token vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._vocab: Vocabulary | None = None
        self._compiled: dict[str, JsonGrammar] = {}

    def compile(self, schema: dict[str, Any], field: str) -> JsonGrammar:
        """`field`: the job field the schema comes from, for the one-line error without xgrammar."""
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            raise FamilyError(f"{field}: needs xgrammar: pip install 'batchvlm[structured]'") from None
        if self._vocab is None:
            self._vocab = Vocabulary(self.tokenizer, self.vocab_size, self.stop_ids)
        key = json.dumps(schema, sort_keys=True)
        if key not in self._compiled:
            self._compiled[key] = self._vocab.compile(schema)
        return self._compiled[key]

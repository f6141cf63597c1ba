#!/usr/bin/env python
"""xgrammar vs llguidance for `json` tasks: compile time per schema and per-token mask time.

For each tokenizer (the tiny Qwen3-VL fixture's, and any tokenizer.json given with --tokenizer,
e.g. a 150k-vocabulary byte-level BPE) and each of the five test schemas: the time to compile the
schema into a grammar for that vocabulary (the tokenizer's own preparation is timed once,
separately), then a walk through the tokens of a valid compact answer, timing the mask of every
step (one matcher, and a batch of --batch matchers filled together, as the engine does). Each
library's mask must allow every token of the answer, and must refuse what the schema forbids:
checks that both enforce the keywords batchvlm lets a schema use.

  python scripts/bench_grammar.py [--tokenizer path/to/tokenizer.json] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from structured_cases import SCHEMAS  # noqa: E402  (tests/structured_cases.py: schema, a valid answer, a bad one)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, stop: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tok)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tok.get_vocab_size(), stop_token_ids=[stop])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.V = tok.get_vocab_size()
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=False)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def bitmask(self, n: int):
        return self.xgr.allocate_token_bitmask(n, self.V)

    def fill(self, matchers, mask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, stop: int):
        import llguidance
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=stop)
        self.V = tok.get_vocab_size()
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        m = self.ll.LLMatcher(self.tok, grammar)  # compiling happens here (per matcher, no shared object)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, grammar):
        return self.ll.LLMatcher(self.tok, grammar)

    def bitmask(self, n: int):
        return self.llt.allocate_token_bitmask(n, self.V)

    def fill(self, matchers, mask) -> None:
        if len(matchers) == 1:
            self.llt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token)


def allowed(mask: torch.Tensor, row: int, token: int) -> bool:
    return bool((mask[row, token // 32] >> (token % 32)) & 1)


def walk(lib, grammar, ids: list[int], batch: int) -> tuple[list[float], list[float]]:
    """Per-step mask times (ms) for one matcher and for `batch` matchers, along `ids`."""
    one, many = [lib.matcher(grammar)], [lib.matcher(grammar) for _ in range(batch)]
    m1, mb = lib.bitmask(1), lib.bitmask(batch)
    t_one, t_many = [], []
    for token in ids:
        t0 = time.perf_counter()
        lib.fill(one, m1)
        t_one.append(_ms(t0))
        t0 = time.perf_counter()
        lib.fill(many, mb)
        t_many.append(_ms(t0))
        if not allowed(m1, 0, token):
            raise AssertionError(f"{lib.name}: token {token} of a valid answer is masked")
        for m in one + many:
            lib.accept(m, token)
    return t_one, t_many


def refuses(lib, grammar, ids: list[int]) -> bool:
    """The grammar does not let the tokens of an answer that breaks the schema through."""
    m, mask = lib.matcher(grammar), lib.bitmask(1)
    for token in ids:
        lib.fill([m], mask)
        if not allowed(mask, 0, token) or not lib.accept(m, token):
            return True
    return False


def bench(tok, label: str, batch: int, stop: int) -> list[str]:
    rows = []
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        lib = cls(tok, stop)
        setup = _ms(t0)
        for name, (schema, good, bad) in SCHEMAS.items():
            t0 = time.perf_counter()
            grammar = lib.compile(schema)
            compile_ms = _ms(t0)
            ids = tok.encode(json.dumps(good, separators=(",", ":")), add_special_tokens=False).ids + [stop]
            t_one, t_many = walk(lib, grammar, ids, batch)
            bad_ids = tok.encode(json.dumps(bad, separators=(",", ":")), add_special_tokens=False).ids + [stop]
            rows.append(f"| {label} | {lib.name} | {setup:.0f} | {name} | {compile_ms:.1f} | "
                        f"{1e3 * statistics.median(t_one):.0f} | {1e3 * max(t_one):.0f} | "
                        f"{1e3 * statistics.median(t_many) / batch:.0f} | {refuses(lib, grammar, bad_ids)} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, action="append", default=[])
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    from qwen3vl_fixture import IDS, byte_tokenizer

    import llguidance.torch  # noqa: F401  (imports are not the libraries' setup time)
    import transformers  # noqa: F401
    import xgrammar  # noqa: F401

    toks = [("fixture", byte_tokenizer())] + [(p.name, Tokenizer.from_file(str(p))) for p in args.tokenizer]
    torch.set_num_threads(1)
    print("| tokenizer (vocab) | library | tokenizer setup ms | schema | compile ms | mask us/token (median) "
          f"| max (the first, for llguidance: it builds lexer states lazily) | us/row at batch {args.batch} | refuses a bad answer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, tok in toks:
        for row in bench(tok, f"{label} ({tok.get_vocab_size()})", args.batch, IDS["<|im_end|>"]):
            print(row, flush=True)


if __name__ == "__main__":
    main()

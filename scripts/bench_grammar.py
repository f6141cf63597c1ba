#!/usr/bin/env python
"""xgrammar vs llguidance for `json` tasks, in one run on one vocabulary (docs/benchmarks.md, "Grammar engines").

The vocabulary: a byte-level BPE of --vocab tokens (default 151,643, Qwen's size) trained here with
`tokenizers` on the Python, JSON and text files of this machine (no download; built once into
--tokenizer, a few minutes on one core), plus Qwen's special tokens; `<|im_end|>` ends an answer.
Compared, the libraries alternated (A B, then B A) so both see the same machine load:

- setup: the tokenizer's preparation (once per job), and its memory;
- per test schema (tests/support/structured_cases.py): compile time, the first mask (llguidance builds its
  lexer lazily), and the mask time per row per step at batch 1 / 64 / 256, rows filled together as
  the engine does (the mean over a walk's steps), each row on its own random walk: at each step
  a token drawn uniformly from the row's allowed tokens, until the stop token (a random model at
  its worst: any allowed token);
- correctness: every answer a walk finishes must be UTF-8, JSON and valid against its schema
  (jsonschema);
- keywords: for each keyword a job schema may use (batchvlm/json_schema.py KEYWORDS), a schema
  that needs it, a valid answer the mask must let through, answers breaking only that keyword it
  must refuse, and random walks that must validate;
- memory: resident memory a fresh process gains by the setup, the five grammars and 256 matchers
  each (one process per library, so neither sees the other's allocations).

`xgrammar+utf8` is xgrammar as batchvlm runs it (models/base/grammar.py: each mask ANDed with the
row's UTF-8 state). A library that is not installed is skipped with a line saying so.

  python scripts/bench_grammar.py [--tokenizer /tmp/bpe151k.json] [--repeats 2] [--steps 24]
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from support.structured_cases import SCHEMAS  # noqa: E402  (schema, a valid answer, a bad one)

from batchvlm.json_schema import KEYWORDS  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
STOP = "<|im_end|>"
BROKEN = ("the matcher refused a token its mask allowed", "a mask allowed nothing")  # not answers
MAX_TOKENS = 96  # a walk longer than this is counted as unfinished (free strings / numbers can run on)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def local_text(budget: int):
    """This machine's Python, JSON and text files (the stdlib and installed packages), up to `budget` chars."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    files = sorted(f for r in roots for ext in ("py", "json", "txt", "md", "rst")
                   for f in glob.glob(f"{r}/**/*.{ext}", recursive=True))
    n = 0
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8", errors="ignore")
        except OSError:
            continue
        if len(text) < 2_000_000:
            n += len(text)
            yield text
            if n > budget:
                return


def build_tokenizer(path: Path, vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(local_text(120_000_000), trainers.BpeTrainer(
        vocab_size=vocab + len(SPECIALS), special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    print(f"# built {path}: {tok.get_vocab_size()} tokens in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def token_bytes(tok) -> list[bytes]:
    """What each token writes (byte-level BPE; special tokens write nothing)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_of = {chr(c): b for b, c in zip(bs, cs)}
    out = [b""] * tok.get_vocab_size()
    specials = {t.content for t in tok.get_added_tokens_decoder().values()}
    for s, i in tok.get_vocab().items():
        out[i] = b"" if s in specials else bytes(byte_of[ch] for ch in s)
    return out


# --- the libraries, behind one small interface -------------------------------------------------------


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, stop: int):
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr, self.V = xgr, tok.get_vocab_size()
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=self.V,
                                                  stop_token_ids=[stop])
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=1)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                 strict_mode=False)

    def matcher(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def fill(self, matchers, mask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, m, token: int) -> bool:
        return m.accept_token(token)

    def ended(self, m) -> bool:
        return m.is_terminated()


class XGrammarUtf8:
    """xgrammar as batchvlm runs it: models/base/grammar.py's Vocabulary, Answer and fill_masks."""

    name = "xgrammar+utf8"

    def __init__(self, tok, stop: int):
        from batchvlm.models.base import grammar

        self.g, self.vocab = grammar, grammar.Vocabulary(tok, tok.get_vocab_size(), [stop])

    def compile(self, schema):
        return self.vocab.compile(schema)

    def matcher(self, grammar):
        return grammar.answer()

    def fill(self, matchers, mask) -> None:
        self.g.fill_masks(matchers, mask)

    def accept(self, m, token: int) -> bool:
        if m.ended:
            return False
        try:
            m.accept(token)
        except RuntimeError:
            return False
        return True

    def ended(self, m) -> bool:
        return m.ended


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, stop: int):
        import llguidance
        import llguidance.torch

        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=stop)
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema):
        """-> a matcher at the answer's start: the compiled grammar (llguidance has no separate
        compiled object), which every answer copies (`deep_copy`, cheaper than a new matcher)."""
        grammar = self.ll.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        m = self.ll.LLMatcher(self.tok, grammar)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, grammar):
        return grammar.deep_copy()

    def fill(self, matchers, mask) -> None:
        if len(matchers) == 1:
            self.llt.fill_next_token_bitmask(matchers[0], mask, 0)
        else:
            self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, m, token: int) -> bool:
        return m.consume_token(token) and not m.is_error()

    def ended(self, m) -> bool:
        return m.is_stopped()


LIBRARIES = {"xgrammar": ("xgrammar", XGrammar), "xgrammar+utf8": ("xgrammar", XGrammarUtf8),
             "llguidance": ("llguidance", LLGuidance)}


def installed() -> list[str]:
    out = []
    for name, (module, _) in LIBRARIES.items():
        try:
            __import__(module)
            out.append(name)
        except ImportError:
            print(f"# {name}: not installed, skipped ({module})")
    return out


# --- walks ----------------------------------------------------------------------------------------


def allowed_BV(mask_BW: torch.Tensor, V: int) -> np.ndarray:
    """[B, V] bool: bit v % 32 of word v // 32 (little-endian int32 words)."""
    bits = np.unpackbits(mask_BW.numpy().view(np.uint8), axis=1, bitorder="little")
    return bits[:, :V].astype(bool)


def check(text: bytes, schema) -> str | None:
    """-> None for a valid answer, else what is wrong."""
    import jsonschema

    try:
        value = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except ValueError:
        return "not JSON"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return f"invalid: {e.message[:60]}"
    return None


def walk(lib, grammar, schema, rows: int, steps: int, stop: int, vocab: list[bytes], seed: int):
    """`rows` random walks side by side for `steps` steps (a finished row starts a new answer).
    -> (mask ms per row of each step, answers finished, what was wrong: invalid answers, masks
    that allowed nothing or a token the matcher then refused)."""
    rng = np.random.default_rng(seed)
    V = len(vocab)
    mask = torch.zeros(rows, -(-V // 32), dtype=torch.int32)
    ms = [lib.matcher(grammar) for _ in range(rows)]
    out: list[list[int]] = [[] for _ in range(rows)]
    times, finished, wrong = [], 0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(ms, mask)
        times.append(_ms(t0) / rows)
        ok = allowed_BV(mask, V)
        for r in range(rows):
            choices = np.flatnonzero(ok[r])
            token = int(rng.choice(choices)) if len(choices) else -1
            if token < 0 or not lib.accept(ms[r], token):
                wrong.append(BROKEN[token < 0])
            else:
                if token != stop:
                    out[r].append(token)
                if token != stop and not lib.ended(ms[r]):
                    if len(out[r]) < MAX_TOKENS:
                        continue  # the answer goes on
                else:
                    finished += 1
                    if (why := check(b"".join(vocab[t] for t in out[r]), schema)) is not None:
                        wrong.append(why)
            ms[r], out[r] = lib.matcher(grammar), []  # ended, broken or too long: a new answer
    return times, finished, wrong


def passes(lib, grammar, ids: list[int], V: int) -> bool:
    """The mask lets every token of `ids` (an answer, then the stop token) through, in order."""
    m, mask = lib.matcher(grammar), torch.zeros(1, -(-V // 32), dtype=torch.int32)
    for token in ids:
        lib.fill([m], mask)
        if not (int(mask[0, token // 32]) >> (token % 32)) & 1 or not lib.accept(m, token):
            return False
    return True


# Per keyword: a schema needing it, an answer it allows, answers breaking only that keyword.
def _obj(prop: dict, **kw) -> dict:
    return {"type": "object", "properties": {"a": prop}, "required": ["a"], "additionalProperties": False} | kw


KEYWORD_CASES = {
    "type": (_obj({"type": "integer"}), {"a": 3}, [{"a": "3"}, {"a": True}]),
    "properties": (_obj({"type": "boolean"}), {"a": False}, [{"a": 0}]),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                  "required": ["a", "b"]}, {"a": 1, "b": 2}, [{"a": 1}]),
    "additionalProperties": (_obj({"type": "integer"}), {"a": 1}, [{"a": 1, "b": 2}]),
    "additionalProperties absent": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                    {"a": 1, "z": 2}, []),
    "items": (_obj({"type": "array", "items": {"type": "integer"}, "maxItems": 3}), {"a": [1, 2]}, [{"a": [1, "x"]}]),
    "prefixItems": (_obj({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 3}],
                          "items": False}), {"a": [1, "ab"]}, [{"a": ["ab", 1]}, {"a": [1, "ab", 2]}]),
    "minItems": (_obj({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
                 {"a": [1, 2]}, [{"a": [1]}]),
    "maxItems": (_obj({"type": "array", "items": {"type": "integer"}, "maxItems": 2}), {"a": [1, 2]},
                 [{"a": [1, 2, 3]}]),
    "enum": (_obj({"enum": ["red", "green", 3]}), {"a": "green"}, [{"a": "blue"}, {"a": 4}]),
    "const": (_obj({"const": "fixed"}), {"a": "fixed"}, [{"a": "fixes"}]),
    "anyOf": (_obj({"anyOf": [{"type": "integer"}, {"type": "null"}]}), {"a": None}, [{"a": "x"}, {"a": True}]),
    "minimum": (_obj({"type": "integer", "minimum": 2, "maximum": 70}), {"a": 2}, [{"a": 1}, {"a": -5}]),
    "maximum": (_obj({"type": "integer", "minimum": 0, "maximum": 7}), {"a": 7}, [{"a": 8}, {"a": 70}]),
    "minimum (number)": (_obj({"type": "number", "minimum": 0.5, "maximum": 1}), {"a": 0.75},
                         [{"a": 0.25}, {"a": 1.5}]),
    "exclusiveMinimum": (_obj({"type": "integer", "exclusiveMinimum": 2, "maximum": 9}), {"a": 3}, [{"a": 2}]),
    "exclusiveMaximum": (_obj({"type": "integer", "minimum": 0, "exclusiveMaximum": 7}), {"a": 6}, [{"a": 7}]),
    "minLength": (_obj({"type": "string", "minLength": 2, "maxLength": 5}), {"a": "ab"}, [{"a": "a"}, {"a": ""}]),
    "maxLength": (_obj({"type": "string", "maxLength": 4}), {"a": "abcd"}, [{"a": "abcde"}]),
    "pattern": (_obj({"type": "string", "pattern": "^[a-z]{2}[0-9]$"}), {"a": "ab1"}, [{"a": "ab12"}, {"a": "A1"}]),
    "$ref": ({"$defs": {"p": {"type": "integer", "minimum": 0, "maximum": 3}}, **_obj({"$ref": "#/$defs/p"})},
             {"a": 3}, [{"a": 4}]),
}
# "$defs" is exercised by the "$ref" case (a reference needs a definition).
assert KEYWORDS <= {k.split(" ")[0] for k in KEYWORD_CASES} | {"$defs"}, "a job-schema keyword has no case"


def encode(tok, value, stop: int) -> list[int]:
    return tok.encode(json.dumps(value, separators=(",", ":")), add_special_tokens=False).ids + [stop]


def keywords(lib, tok, stop: int, vocab: list[bytes]) -> list[str]:
    """-> the keywords the library fails to enforce (a valid answer refused, a bad one let
    through, or a random answer that does not validate), each with why."""
    failed = []
    for kw, (schema, good, bads) in KEYWORD_CASES.items():
        try:
            grammar = lib.compile(schema)
        except Exception as e:  # noqa: BLE001  (a library that cannot compile the keyword: reported)
            failed.append(f"{kw}: compile error {str(e)[:60]}")
            continue
        V = len(vocab)
        if not passes(lib, grammar, encode(tok, good, stop), V):
            failed.append(f"{kw}: refuses {json.dumps(good)}")
        failed += [f"{kw}: lets {json.dumps(b)} through" for b in bads if passes(lib, grammar, encode(tok, b, stop), V)]
        _, _, wrong = walk(lib, grammar, schema, 16, 24, stop, vocab, seed=7)
        if wrong:
            failed.append(f"{kw}: random answers {sorted(set(wrong))[:2]} ({len(wrong)})")
    return failed


# --- memory (one fresh process per library) -------------------------------------------------------


def memory_child(name: str, path: Path) -> None:
    from tokenizers import Tokenizer

    __import__(LIBRARIES[name][0])
    import transformers  # noqa: F401

    tok = Tokenizer.from_file(str(path))
    stop = tok.token_to_id(STOP)
    base = _rss_mib()
    lib = LIBRARIES[name][1](tok, stop)
    setup = _rss_mib()
    grammars = [lib.compile(schema) for schema, _, _ in SCHEMAS.values()]
    compiled = _rss_mib()
    mask = torch.zeros(256, -(-tok.get_vocab_size() // 32), dtype=torch.int32)
    held = []
    for g in grammars:
        held.append([lib.matcher(g) for _ in range(256)])
        lib.fill(held[-1], mask)
    print(json.dumps({"setup": setup - base, "grammars": compiled - setup, "matchers": _rss_mib() - compiled}))


def memory(name: str, path: Path) -> dict[str, float]:
    run = subprocess.run([sys.executable, __file__, "--memory-child", name, "--tokenizer", str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


# --- the run --------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, default=Path("/tmp/batchvlm-bench-bpe.json"),
                    help="a tokenizer.json; built there (trained on this machine's files) when absent")
    ap.add_argument("--vocab", type=int, default=151_643, help="tokens of a tokenizer built here")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=24, help="steps of each timed walk")
    ap.add_argument("--repeats", type=int, default=2, help="of each timed walk and compile, libraries alternated")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from tokenizers import Tokenizer

    if args.memory_child:
        return memory_child(args.memory_child, args.tokenizer)
    if not args.tokenizer.exists():
        build_tokenizer(args.tokenizer, args.vocab)
    names = installed()
    import transformers  # noqa: F401  (imports are not setup time)

    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(args.tokenizer))
    stop, vocab = tok.token_to_id(STOP), token_bytes(tok)
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"# {args.tokenizer}: {len(vocab)} tokens; one thread per library; load {load}")
    libs, setup = {}, {}
    for name in names:
        t0 = time.perf_counter()
        libs[name] = LIBRARIES[name][1](tok, stop)
        setup[name] = _ms(t0)

    print("\n| library | tokenizer setup ms | memory MiB: setup / 5 grammars / 5 x 256 matchers | keywords enforced |")
    print("|---|---|---|---|")
    for name, lib in libs.items():
        mem = memory(name, args.tokenizer)
        failed = keywords(lib, tok, stop, vocab)
        print(f"| {name} | {setup[name]:.0f} | {mem['setup']:.0f} / {mem['grammars']:.0f} / {mem['matchers']:.0f} | "
              f"{len(KEYWORD_CASES) - len({f.split(':')[0] for f in failed})} of {len(KEYWORD_CASES)}"
              f"{': ' + '; '.join(failed) if failed else ''} |", flush=True)

    cols = " | ".join(f"us/row at batch {b}" for b in args.batches)
    print(f"\n| schema | library | compile ms | first mask ms | {cols} | walk answers valid |")
    print("|---|---|---|---|" + "---|" * len(args.batches) + "---|")
    for sname, (schema, _, _) in SCHEMAS.items():
        res = {n: {"compile": [], "first": [], "finished": 0, "wrong": [], **{b: [] for b in args.batches}}
               for n in libs}
        for rep in range(args.repeats):
            for name in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):  # A B, then B A
                lib, r = libs[name], res[name]
                t0 = time.perf_counter()
                grammar = lib.compile(schema)
                r["compile"].append(_ms(t0))
                t0 = time.perf_counter()
                lib.fill([lib.matcher(grammar)], torch.zeros(1, -(-len(vocab) // 32), dtype=torch.int32))
                r["first"].append(_ms(t0))
                for b in args.batches:
                    times, finished, wrong = walk(lib, grammar, schema, b, args.steps if b > 1 else 4 * args.steps,
                                                  stop, vocab, seed=rep)
                    r[b].append(statistics.fmean(times) * 1e3)  # every step alike: the walk's cost per row-step
                    r["finished"] += finished
                    r["wrong"] += wrong
        for name, r in res.items():
            us = " | ".join(f"{statistics.median(r[b]):.0f}" for b in args.batches)
            invalid = [w for w in r["wrong"] if w not in BROKEN]
            wrong = r["wrong"]
            bad = f" ({'; '.join(f'{wrong.count(w)} x {w}' for w in sorted(set(wrong)))})" if wrong else ""
            print(f"| {sname} | {name} | {statistics.median(r['compile']):.1f} | {statistics.median(r['first']):.1f} | "
                  f"{us} | {r['finished'] - len(invalid)} of {r['finished']}{bad} |", flush=True)


if __name__ == "__main__":
    main()

"""Special and added tokens in json answers (models/base/grammar.py `text_vocab`): a mask never allows
one, but for the stop tokens where the answer may end; every other token's bit is xgrammar's own
on the tokenizer as transformers hands it over (the reference). Fixture tokenizers: Qwen's <|...|>
special tokens (and logits wider than the tokenizer), Qwen3's <think> added as a plain token, and
Florence-2's <loc_N> added tokens beside BART's <pad>. Their text stays writable byte by byte."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.qwen3vl_fixture import IDS, VOCAB
from support.qwen3vl_fixture import byte_tokenizer as qwen3vl_tokenizer
from support.tiny_vlms import QWEN_SPECIALS, byte_tokenizer, florence2_tokenizer

from batchvlm.models.base.grammar import Grammars, fill_masks

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"label": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["label", "n"]}
ANSWER = '{"label":"<|image_pad|> <think> <loc_1> <pad>","n":3}'


def qwen3_vl():
    return qwen3vl_tokenizer(), VOCAB, [IDS["<|im_end|>"], IDS["<|endoftext|>"]]


def qwen3_thinking():
    tok = byte_tokenizer(QWEN_SPECIALS, ["<think>", "</think>"]).backend_tokenizer
    return tok, tok.get_vocab_size(), [tok.token_to_id("<|im_end|>")]


def florence2():
    tok = florence2_tokenizer().backend_tokenizer
    return tok, tok.get_vocab_size(), [tok.token_to_id("</s>")]


def allowed(mask_W: np.ndarray, V: int) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask_W.view(np.uint8), bitorder="little")[:V]).tolist())


@pytest.mark.parametrize("tokenizer", [qwen3_vl, qwen3_thinking, florence2])
def test_added_tokens_are_refused_but_stops_where_the_answer_ends(tokenizer):
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok, V, stops = tokenizer()
    grammar = Grammars(tok, V, stops).compile(SCHEMA, "tasks.0.json.schema")
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=V,
                                              stop_token_ids=stops)
    ref = xgr.GrammarMatcher(xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"),
        strict_mode=False))
    added = set(tok.get_added_tokens_decoder())
    refused = (added - set(stops)) | set(range(tok.get_vocab_size(), V))
    byte_ids = [tok.token_to_id(bytes_to_unicode()[b]) for b in ANSWER.encode()]
    printable = {tok.token_to_id(bytes_to_unicode()[b]) for b in range(0x20, 0x7F)}
    answer, mask_1W, ref_1W = grammar.answer(), np.zeros((1, grammar.words), np.int32), xgr.allocate_token_bitmask(1, V)
    for step, token in enumerate([*byte_ids, None]):
        fill_masks([answer], mask_1W)
        ref.fill_next_token_bitmask(ref_1W)
        ours, theirs = allowed(mask_1W[0], V), allowed(ref_1W[0].numpy(), V)
        assert not ours & refused, f"step {step}: {sorted(tok.id_to_token(t) for t in ours & refused)[:5]} allowed"
        assert ours & set(stops) == (set(stops) if token is None else set()), f"step {step}"
        assert ours & printable == theirs & printable, f"step {step}"
        if token is not None:
            answer.accept(token)
            assert ref.accept_token(token)
    assert ours == set(stops) and tok.decode(byte_ids) == ANSWER

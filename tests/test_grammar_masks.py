"""The json grammar masks (models/grammar.py) on a tiny random Qwen3-VL (transformers' own
forward): every answer that ends by itself validates with `jsonschema` and is compact JSON."""

import json

import jsonschema
import pytest
import torch
from qwen3vl_fixture import IDS, byte_tokenizer, hf_config, randomize
from structured_cases import SCHEMAS

pytest.importorskip("xgrammar")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from batchvlm.models.grammar import RowGrammars, Vocabulary, apply_mask, mask_words  # noqa: E402

STOP = IDS["<|im_end|>"]
B, MAX_NEW = 6, 80


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3VLForConditionalGeneration

    m = Qwen3VLForConditionalGeneration(hf_config()).eval()
    randomize(m, seed=3)
    return m


@pytest.fixture(scope="module")
def vocab():
    return Vocabulary(byte_tokenizer(), 272, [STOP])


def generate(model, grammars: RowGrammars, prompts_BT: torch.Tensor) -> list[list[int]]:
    """Greedy decoding, each step's logits masked by the rows' grammars after the tokens so far."""
    rows = list(range(prompts_BT.shape[0]))
    out_BN, done = [], [False] * len(rows)
    tokens, past = prompts_BT, None
    mask_BW = torch.empty(len(rows), grammars.W, dtype=torch.int32)
    with torch.inference_mode():
        for k in range(MAX_NEW):
            res = model(input_ids=tokens, cache=past, use_cache=True)
            past = res.cache if hasattr(res, "cache") else res.past_key_values
            grammars.fill(rows, mask_BW)
            token_B = apply_mask(res.logits[:, -1], mask_BW).argmax(-1)
            emitted = token_B.tolist()
            grammars.advance(rows, emitted)
            for r, t in enumerate(emitted):
                if not done[r]:
                    out_BN.append((r, t))
                    done[r] = t == STOP
            if all(done):
                break
            tokens = token_B[:, None]
    return [[t for r2, t in out_BN if r2 == r] for r in rows]


def run(model, vocab, schema, seed=0):
    grammar = vocab.compile(schema)
    grammars = RowGrammars(B, vocab)
    for r in range(B):
        grammars.start(r, grammar)
    prompts = torch.randint(0, 200, (B, 7), generator=torch.Generator().manual_seed(seed))
    return generate(model, grammars, prompts)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_finished_answer_validates(model, vocab, name):
    schema = SCHEMAS[name][0]
    answers = run(model, vocab, schema, seed=len(name))
    tok = byte_tokenizer()
    finished = [a for a in answers if a and a[-1] == STOP]
    for a in finished:
        text = tok.decode(a[:-1])
        jsonschema.validate(json.loads(text), schema)
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)  # compact
    assert finished, f"{name}: no answer of the random model ended within {MAX_NEW} tokens"


class NewBytes(TorchDispatchMode):
    """Bytes of the storages the ops create (a view or an in-place result is not new)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        self.total += sum(t.untyped_storage().nbytes() for t in tree_flatten(out)[0]
                          if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held)
        return out


@pytest.mark.parametrize("V", [37, 64, 1000])
def test_apply_mask_refuses_exactly_the_clear_bits_with_one_byte_per_token_of_temporaries(V):
    B, W = 5, mask_words(V)
    mask_BW = torch.randint(-2**31, 2**31 - 1, (B, W), dtype=torch.int32, generator=torch.Generator().manual_seed(V))
    mask_BW[0] = -1  # a free row
    logits_BV = torch.randn(B, V, generator=torch.Generator().manual_seed(1))
    with NewBytes() as counted:
        out_BV = apply_mask(logits_BV, mask_BW)
    words = mask_BW.tolist()
    refused = [[not (words[b][v // 32] >> (v % 32)) & 1 for v in range(V)] for b in range(B)]
    assert out_BV.isinf().tolist() == refused and not any(refused[0])
    assert torch.equal(out_BV[~out_BV.isinf()], logits_BV[~out_BV.isinf()])
    assert counted.total - out_BV.nbytes <= B * W * 32 + 8  # the refused bytes and the 8 shifts

"""The mask step of models/base/grammar.py: `apply_mask_` refuses exactly the tokens whose bit is clear
in a row's packed mask, in place, and its only temporary is one byte per token. (That the masks
hold every answer to its schema is checked end to end: test_json_native.py on the native Qwen
engine, test_json_moondream.py, test_structured_transformers.py on the transformers backend.)
The masks are filled on threads that the device decides (`mask_threads`), and do not depend on
how many."""

import os

import numpy as np
import pytest
import torch
from support.tiny_vlms import QWEN_SPECIALS, byte_tokenizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchvlm.models.base.grammar import Grammars, apply_mask_, fill_masks, mask_threads, mask_words


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
def test_apply_mask_refuses_exactly_the_clear_bits_in_place_with_one_byte_per_token_of_temporaries(V):
    B, W = 5, mask_words(V)
    mask_BW = torch.randint(-2**31, 2**31 - 1, (B, W), dtype=torch.int32, generator=torch.Generator().manual_seed(V))
    mask_BW[0] = -1  # a free row
    logits_BV = torch.randn(B, V, generator=torch.Generator().manual_seed(1))
    before_BV = logits_BV.clone()
    with NewBytes() as counted:
        out_BV = apply_mask_(logits_BV, mask_BW)
    words = mask_BW.tolist()
    refused = [[not (words[b][v // 32] >> (v % 32)) & 1 for v in range(V)] for b in range(B)]
    assert out_BV.isinf().tolist() == refused and not any(refused[0])
    assert torch.equal(out_BV[~out_BV.isinf()], before_BV[~out_BV.isinf()])
    assert out_BV.data_ptr() == logits_BV.data_ptr()
    assert counted.total <= B * W * 32 + 8  # the refused bytes and the 8 shifts: no [B, V] output


def test_mask_threads_follow_the_device(monkeypatch):
    """One thread beside a CPU forward (the CPU suite never oversubscribes); on CUDA half of the
    process's share of the cores, at most 8."""
    assert mask_threads(torch.device("cpu")) == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    for gpus, threads in ((1, 8), (2, 4), (8, 1)):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        assert mask_threads(torch.device("cuda", 0)) == threads


def test_masks_do_not_depend_on_the_thread_count():
    pytest.importorskip("xgrammar")
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = byte_tokenizer(QWEN_SPECIALS).backend_tokenizer
    stop = tok.token_to_id("<|im_end|>")
    schema = {"type": "object", "properties": {"label": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["label", "n"]}
    grammar = Grammars(tok, tok.get_vocab_size(), [stop]).compile(schema, "tasks.0.json.schema")
    text = '{"label":"a \\"b\\" é","n":12}'.encode()
    answers = []
    for cut in range(0, len(text) + 1, 3):  # answers at different places, the last one whole
        a = grammar.answer()
        for b in text[:cut]:
            a.accept(tok.token_to_id(bytes_to_unicode()[b]))
        answers.append(a)
    one, two = (np.zeros((len(answers), grammar.words), np.int32) for _ in range(2))
    fill_masks(answers, one, threads=1)
    fill_masks(answers, two, threads=2)
    assert np.array_equal(one, two)
    assert len({m.tobytes() for m in one}) > 3  # the answers' masks differ

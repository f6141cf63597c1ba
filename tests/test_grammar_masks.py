"""The json mask machinery on a tiny random Qwen3-VL (transformers' own forward): every answer that
ends by itself validates with `jsonschema`, and no forward launch waits on a mask (the masks of
step k are computed on the host thread while the forward of step k runs)."""

import json
import time

import jsonschema
import pytest
import torch
from qwen3vl_fixture import IDS, byte_tokenizer, hf_config, randomize
from structured_cases import SCHEMAS

pytest.importorskip("xgrammar")

from batchvlm.engine.masks import MaskPipeline  # noqa: E402
from batchvlm.models.grammar import RowGrammars, Vocabulary, apply_mask  # noqa: E402

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


def generate(model, grammars: RowGrammars, pipe: MaskPipeline, prompts_BT: torch.Tensor, trace: list):
    """Greedy decoding with the mask step, in the engine's order: submit step k's masks (the
    tokens of step k-1), launch forward k, then wait for the mask only before sampling."""
    rows = list(range(prompts_BT.shape[0]))
    out_BN, done = [], [False] * len(rows)
    tokens, emitted = prompts_BT, []
    past = None
    with torch.inference_mode():
        for k in range(MAX_NEW):
            pipe.submit(k, rows if k else [], emitted, rows)
            t0 = time.perf_counter()
            res = model(input_ids=tokens, cache=past, use_cache=True)
            trace.append(("forward", k, t0, time.perf_counter()))
            past = res.cache if hasattr(res, "cache") else res.past_key_values
            t0 = time.perf_counter()
            token_B = apply_mask(res.logits[:, -1], pipe.mask(k)).argmax(-1)
            trace.append(("sample", k, t0, time.perf_counter()))
            emitted = token_B.tolist()
            for r, t in enumerate(emitted):
                if not done[r]:
                    out_BN.append((r, t))
                    done[r] = t == STOP
            if all(done):
                break
            tokens = token_B[:, None]
    answers = [[t for r2, t in out_BN if r2 == r] for r in rows]
    return answers


class SlowGrammars(RowGrammars):
    """Masks that take longer than the tiny forward, as a large vocabulary's can."""

    def fill(self, rows, out_BW):
        time.sleep(0.02)
        super().fill(rows, out_BW)


def run(model, vocab, schema, grammars_cls=RowGrammars, seed=0):
    grammar = vocab.compile(schema)
    grammars = grammars_cls(B, vocab)
    for r in range(B):
        grammars.start(r, grammar)
    trace: list = []
    pipe = MaskPipeline(grammars, B, torch.device("cpu"), trace)
    prompts = torch.randint(0, 200, (B, 7), generator=torch.Generator().manual_seed(seed))
    try:
        return generate(model, grammars, pipe, prompts, trace), trace
    finally:
        pipe.close()


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_finished_answer_validates(model, vocab, name):
    schema = SCHEMAS[name][0]
    answers, _ = run(model, vocab, schema, seed=len(name))
    tok = byte_tokenizer()
    finished = [a for a in answers if a and a[-1] == STOP]
    for a in finished:
        text = tok.decode(a[:-1])
        jsonschema.validate(json.loads(text), schema)
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)  # compact
    assert finished, f"{name}: no answer of the random model ended within {MAX_NEW} tokens"


def test_no_forward_launch_waits_on_a_mask(model, vocab):
    answers, trace = run(model, vocab, SCHEMAS["bounds"][0], SlowGrammars)
    events = {(what, k): (t0, t1) for what, k, t0, t1 in trace}
    steps = max(k for _, k, _, _ in trace) + 1
    assert steps > 3
    for k in range(steps):
        mask, forward, sample = events[("mask", k)], events[("forward", k)], events[("sample", k)]
        assert forward[0] < mask[1] - 0.01  # launched while its 20 ms mask was being computed
        assert sample[1] >= mask[1]  # the sampler is what waits
    # the slow masks change timing only: the answers are those of the fast ones
    assert answers == run(model, vocab, SCHEMAS["bounds"][0])[0]

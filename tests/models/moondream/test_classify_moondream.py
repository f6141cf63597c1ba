"""classify on the native Moondream engine (the demo model, whose answers mean something): each
choice is a row of one prefill step on the shared prefix (the image, bidirectional, then the
prompt, causal); its probabilities equal those from the model's own batch-1 forward of the image
prefix, then prompt + choice as the sequence's own tokens (the forward whose prefill logits
match upstream Moondream in test_moondream_parity), at engine batch sizes 1, 7 and 64."""

from __future__ import annotations

import random

import pytest
import torch
from support.moondream import LoadedMoondream

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
from batchvlm.attention import AttentionBatch, PrefixGroup, SharedPrefix, TaskGroup, slot_of
from batchvlm.models.moondream.generate import encode_images
from batchvlm.shapes.world import COUNT_QUESTION, NUMBERS, SPEC, draw_scene
from batchvlm.tasks import ClassifyTask, choice_values

COUNTS = list(NUMBERS)
SHARED = ["red", "red circle", "reddish", "blue"]  # choices that share leading tokens
FIFTY = [f"{c} {n}" for c in ("red", "green", "blue", "yellow", "purple") for n in range(10)]
CASES = [(COUNT_QUESTION, COUNTS), ("what colour is the circle?", SHARED), (COUNT_QUESTION, ["one"]),
         ("what is it?", FIFTY)]
TASKS = [ClassifyTask(classify={"question": q, "choices": c, "name": f"c{i}"}) for i, (q, c) in enumerate(CASES)]


def reference_scores(md: LoadedMoondream, image, prompts: list[list[int]], n_scored: list[int]) -> list[float]:
    """The image prefix once, then each prompt alone on it through the model's forward primitives
    (batch 1): the summed log-probabilities of its last n - 1 tokens and the end token."""
    m, eos = md.model, md.config.tokenizer.eos_id
    P, bs, T = m.config.prefix_len, 16, max(map(len, prompts))
    nb, nown = -(-P // bs), -(-T // bs)
    cache = m.new_kv_cache(1 + nb + nown, bs)
    prefix_t, own_t = torch.arange(1, 1 + nb)[None], torch.arange(1 + nb, 1 + nb + nown)[None]
    j, lens = torch.arange(P), torch.tensor([P])
    prefix = m.prefix_embeds(encode_images(m, [md.preprocessor(image)]))[0]
    batch = AttentionBatch(slot_of(prefix_t[0], j, bs), [PrefixGroup(j[None], prefix_t, lens, causal=False)], bs)
    m.forward_tokens(prefix, j, batch, cache)
    out = []
    for ids, n in zip(prompts, n_scored):
        o = torch.arange(len(ids))
        shared = SharedPrefix(prefix_t, lens, o[None], o[None])
        batch = AttentionBatch(slot_of(own_t[0], o, bs),
                               [TaskGroup(o[None], o[None], own_t, torch.tensor([len(ids)]), shared)], bs)
        hidden = m.forward_tokens(m.text.wte[torch.tensor(ids)], P + o, batch, cache)
        logp = torch.log_softmax(m.text.logits(hidden[len(ids) - n:]).float(), -1)
        out.append(float(logp.gather(-1, torch.tensor(ids[len(ids) - n + 1:] + [eos])[:, None]).sum()))
    return out


@pytest.fixture(scope="module")
def setup():
    md = LoadedMoondream("demo", dtype="float32")
    rng = random.Random(5)
    ims = [draw_scene(rng, SPEC)[0] for _ in range(2)]
    seqs = md.sequences(TASKS)
    expected = []
    with torch.inference_mode():
        for im in ims:
            scores = reference_scores(md, im, [list(s.spec.prefix_prompt + s.spec.prompt) for s in seqs],
                                      [s.spec.limit for s in seqs])
            expected.append([choice_values(c, [x for s, x in zip(seqs, scores) if s.task == t])
                             for t, (_, c) in enumerate(CASES)])
    return dict(md=md, seqs=seqs, prepared=[md.preprocessor(im) for im in ims], expected=expected)


@pytest.mark.parametrize("batch,pipelined,n_tasks,n_images", [(1, True, 3, 1), (7, False, 4, 1), (64, True, 4, 2)])
def test_probabilities_equal_the_models_forward(setup, batch, pipelined, n_tasks, n_images):
    md, tasks = setup["md"], TASKS[:n_tasks]
    seqs = [s for s in setup["seqs"] if s.task < n_tasks]
    assert all(s.spec.prefix_prompt == seqs[0].spec.prefix_prompt != () for s in seqs if s.task == 0)  # shared
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=batch, pipelined=pipelined), md.P)
    done = {im.sample.index: [s.output for s in im.seqs]
            for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(setup["prepared"][:n_images]))}
    assert engine.scheduler.blocks.used == 0
    for i in range(n_images):
        row = md.family.columns(tasks, seqs, done[i])
        for t, (label, scores) in enumerate(setup["expected"][i][:n_tasks]):
            got = row[f"c{t}_scores"]
            assert [s["label"] for s in got] == CASES[t][1]
            assert [s["prob"] for s in got] == pytest.approx([s["prob"] for s in scores], abs=1e-5, rel=0)
            assert row[f"c{t}"] == label
        assert row["c2_scores"] == [{"label": "one", "prob": 1.0}]


def test_only_the_scored_rows_get_logits(setup, monkeypatch):
    """A step with a caption's prompt and a classify's choices computes choice logits for the
    choices' scored rows alone, not for every prompt row of the step, and once per distinct
    context: the prompt's last token, which every choice repeats, and tokens that choices begin
    with alike, get one row."""
    from batchvlm.models.base import device as base_device
    from batchvlm.tasks import CaptionTask

    md = setup["md"]
    rows = []
    real = base_device.choice_scores

    def counting(logits_fn, prompt, state, end_id):
        rows.append((prompt.hidden_UC.shape[0], prompt.pick_N.shape[0]))
        return real(logits_fn, prompt, state, end_id)

    monkeypatch.setattr(base_device, "choice_scores", counting)
    tasks = [CaptionTask(caption={"length": "short"}), TASKS[0]]
    seqs = md.sequences(tasks)
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=64, max_new_tokens=4), md.P)
    list(engine.run([Sample(0, 0, "k0", setup["prepared"][0])]))
    choices = [s.spec for s in seqs if s.task == 1]
    contexts = {s.prompt[: len(s.prompt) - s.limit + j + 1] for s in choices for j in range(s.limit)}
    assert rows == [(len(contexts), sum(s.limit for s in choices))]
    assert len(contexts) <= sum(s.limit for s in choices) - (len(choices) - 1)  # the last prompt token: once


def test_a_step_of_choices_alone_computes_no_other_logits(setup, monkeypatch):
    """A step holding only classify choices skips the token decision: the language-model head
    runs on one row per distinct scored context and on nothing else."""
    md = setup["md"]
    text = md.engine.model.text
    rows = []
    real = text.logits

    def counting(hidden_NC):
        rows.append(hidden_NC.shape[0])
        return real(hidden_NC)

    monkeypatch.setattr(text, "logits", counting)
    seqs = md.sequences(TASKS[:1])
    engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=64, max_new_tokens=4), md.P)
    out = list(engine.run([Sample(0, 0, "k0", setup["prepared"][0])]))
    choices = [s.spec for s in seqs]
    contexts = {s.prompt[: len(s.prompt) - s.limit + j + 1] for s in choices for j in range(s.limit)}
    assert len(out) == 1 and rows == [len(contexts)]

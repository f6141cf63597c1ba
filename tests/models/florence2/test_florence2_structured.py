"""classify and json on the native Florence-2 engine, with a tiny random checkpoint that forces
the first token and bans repeated trigrams (tiny_vlms.py), and for classify one that forces nothing.

classify: each choice is a decoder row of one prefill step on the question's (image, prompt)
encoder prefix; its probabilities equal those computed from transformers' own teacher-forced
decoder log-probabilities of the choice's tokens and the end token after what greedy `generate`
feeds (decoder start, forced first token), at engine batch sizes 1, 7 and 64 (and on a second
checkpoint that forces no first token).
json: sampled answers of a random model (garbage when free) validate against the five schemas of
structured_cases.py wherever the token limit did not cut them (with the grammar off none is JSON);
labels are the same at any batch size, pipelined or not, through the CUDA-graph decode body or
not, and no pipelined launch waits for a
mask (mask_trace.py). The n-gram ban never leaves a json row without a token its grammar allows.
`batchvlm run` writes both kinds of column with the engine's labels.
"""

from __future__ import annotations

import dataclasses
import json

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from support.cli import cli_app
from support.mask_trace import MaskTrace
from support.structured_cases import CASES, SCHEMAS, assert_classify_columns, assert_finished_answers_validate
from support.florence2 import Reference, random_images
from support.tiny_vlms import florence2

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.base.decoding import RowState
from batchvlm.models.base.errors import FamilyError
from batchvlm.models.florence2 import decoding
from batchvlm.models.florence2.config import GenerationSettings
from batchvlm.models.registry import open_family
from batchvlm.tasks import ClassifyTask, JsonTask, choice_values

pytest.importorskip("transformers")

CLASSIFY = [ClassifyTask(classify={"question": q, "choices": c, "name": f"c{i}"}) for i, (q, c) in enumerate(CASES)]
JSON = [JsonTask(json={"prompt": "Describe it.", "schema": schema, "name": name})
        for name, (schema, _, _) in SCHEMAS.items()]
MAX_NEW = 60
N_IMAGES = 2


def checkpoint(folder, images) -> dict:
    family = open_family(ModelSpec(name=str(folder)))
    assert (family.name, family.backend) == ("florence2", "native")
    pre = family.preprocessor()
    return dict(folder=folder, family=family, model=family.load("float32", "cpu"), images=images,
                prepared=[pre(im) for im in images])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = florence2(tmp_path_factory.mktemp("florence2"), seed=3,
                       generation=dict(no_repeat_ngram_size=3, forced_bos_token_id=256))
    return checkpoint(folder, random_images(3, seed=5))


def run(setup, tasks, seqs, batch: int, pipelined: bool, n_images: int, trace: list | None = None,
        fixed_shape_decode: bool = False, **engine) -> list[dict]:
    """Labels of the first n_images; `trace`: gets the run's MaskTrace; `fixed_shape_decode`: decode
    steps through the CUDA-graph body (uncaptured)."""
    e = Engine(setup["model"], seqs, EngineSpec(max_batch_size=batch, pipelined=pipelined, **engine),
               setup["family"].max_prefix_len())
    if trace is not None:
        trace.append(MaskTrace.attach(e))
    if fixed_shape_decode:
        r = e.runner
        r.graphs = r.decode_graphs(capture=False)
    done = {im.sample.index: [s.output for s in im.seqs]
            for im in e.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(setup["prepared"][:n_images]))}
    assert e.scheduler.blocks.used == 0 and (not fixed_shape_decode or e.runner.graph_steps > 0)
    return [setup["family"].columns(tasks, seqs, done[i]) for i in range(n_images)]


def reference(setup) -> list[list[tuple[str, list[dict]]]]:
    """transformers alone: the processor's encoder input for the question, and per choice the
    decoder inputs greedy generate starts from, then the choice's ids; one right-padded
    teacher-forced forward per task scores the choice's ids and the end token."""
    ref = Reference(setup["folder"])
    g = ref.model.generation_config
    start = [g.decoder_start_token_id] + ([] if g.forced_bos_token_id is None else [g.forced_bos_token_id])
    tok = ref.processor.tokenizer
    out = []
    with torch.inference_mode():
        for im in setup["images"][:N_IMAGES]:
            per_task = []
            for question, choices in CASES:
                enc = ref.inputs(im, question)
                # what generate feeds before its first free token
                assert ref.model.generate(**enc, do_sample=False, max_new_tokens=2)[0, :len(start)].tolist() == start
                rows = [start + tok(c, add_special_tokens=False)["input_ids"] + [g.eos_token_id] for c in choices]
                L = max(map(len, rows))
                ids = torch.tensor([r + [g.pad_token_id] * (L - len(r)) for r in rows])
                B = len(rows)
                logits = ref.model(pixel_values=enc["pixel_values"].repeat(B, 1, 1, 1),
                                   input_ids=enc["input_ids"].repeat(B, 1),
                                   attention_mask=enc["attention_mask"].repeat(B, 1),
                                   decoder_input_ids=ids[:, :-1]).logits
                logp = torch.log_softmax(logits.float(), -1)
                n = len(start) - 1  # the last start token's row predicts the choice's first token
                scores = [float(logp[b, n: len(r) - 1].gather(-1, torch.tensor(r[n + 1:])[:, None]).sum())
                          for b, r in enumerate(rows)]
                per_task.append(choice_values(choices, scores))
            out.append(per_task)
    return out


@pytest.fixture(scope="module")
def expected(setup):
    return reference(setup)


def test_choices_are_decoder_rows_on_the_question_prefix(setup):
    family = setup["family"]
    seqs = family.sequences(CLASSIFY, EngineSpec())
    assert len(seqs) == 4 + 1 + 50 and all(s.spec.budget == 1 for s in seqs)
    shared = [s.spec for s in seqs if s.task == 0]
    assert {s.prefix_prompt for s in shared} == {family.prompt("What is it?")}
    g = family.generation
    assert all(s.prompt[:2] == (g.decoder_start, g.forced_bos) and s.limit == len(s.prompt) - 1 for s in shared)


def test_a_task_token_in_free_text_names_the_field(setup):
    task = JsonTask(json={"prompt": "<OCR> as JSON", "schema": {"type": "integer"}})
    with pytest.raises(FamilyError, match=r"^tasks\.1\.json\.prompt: task token <OCR> must be the only content"):
        setup["family"].sequences([CLASSIFY[1], task], EngineSpec())


@pytest.mark.parametrize("batch,pipelined,n_images", [(1, True, 1), (7, False, 2), (64, True, 2)])
def test_probabilities_equal_transformers(setup, expected, batch, pipelined, n_images):
    check_probabilities(setup, expected, batch, pipelined, n_images)


def test_probabilities_equal_transformers_without_a_forced_first_token(tmp_path):
    """A checkpoint that forces no first token: a choice row is the start token and the choice."""
    plain = checkpoint(florence2(tmp_path / "plain", seed=3), random_images(2, seed=5))
    assert plain["family"].generation.forced_bos is None
    check_probabilities(plain, reference(plain), 7, True, 2)


def check_probabilities(setup, expected, batch: int, pipelined: bool, n_images: int) -> None:
    seqs = setup["family"].sequences(CLASSIFY, EngineSpec())
    assert_classify_columns(list(run(setup, CLASSIFY, seqs, batch, pipelined, n_images)), expected)


@pytest.fixture(scope="module")
def json_seqs(setup):
    pytest.importorskip("xgrammar")
    # Sampled (counter-based, so batch-invariant too): answers vary
    seqs = setup["family"].sequences(JSON, EngineSpec(max_new_tokens=MAX_NEW, temperature=1.0))
    assert all(s.spec.grammar is not None and s.spec.prefix_prompt == setup["family"].prompt("Describe it.")
               for s in seqs)  # asked as a query
    return seqs


def test_json_answers_validate_and_do_not_depend_on_batch_or_pipelining(setup, json_seqs):
    trace: list[MaskTrace] = []
    first = run(setup, JSON, json_seqs, 64, True, 3, trace, max_new_tokens=MAX_NEW)
    trace[0].assert_no_launch_waits_for_a_mask()
    assert run(setup, JSON, json_seqs, 7, False, 3, max_new_tokens=MAX_NEW) == first
    assert run(setup, JSON, json_seqs, 5, True, 3, fixed_shape_decode=True, max_new_tokens=MAX_NEW) == first
    assert_finished_answers_validate(first)
    # the grammar off, the same sampled decoding: no answer is JSON at all
    free = [dataclasses.replace(s, spec=dataclasses.replace(s.spec, grammar=None)) for s in json_seqs]
    answers = [c[name] for c in run(setup, JSON, free, 64, False, 3, max_new_tokens=MAX_NEW) for name in SCHEMAS]
    assert len(answers) == 15 and not any(is_json(a) for a in answers)


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_the_ngram_ban_never_leaves_a_json_row_without_a_token():
    """Row 0's history ends in the bigram (5, 6) that began with token 7: the ban forbids 7, the one
    token its grammar allows, so the ban is lifted for it; row 1 allows 7 and 8: 8 is written."""
    g = GenerationSettings(decoder_start=0, eos=1, pad=2, forced_bos=None, forced_eos=None, no_repeat_ngram=3)
    V, W = 40, 8
    history = decoding.History(2, W, 0, torch.device("cpu"))
    history.tokens_RW[:, 1:5] = torch.tensor([5, 6, 7, 5])
    history.tokens_RW[:, 5] = 6
    logits = torch.zeros(2, V)
    logits[:, 7] = 5.0  # the model wants 7 most
    mask = torch.zeros(2, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 7
    mask[1, 0] = (1 << 7) | (1 << 8)
    n = torch.full((2,), 5)
    state = RowState(mode=torch.zeros(2, dtype=torch.long), phase=torch.zeros(2, dtype=torch.long), count=n,
                     limit=torch.full((2,), 50), after_prompt=torch.zeros(2, dtype=torch.bool),
                     temperature=torch.zeros(2), top_p=torch.ones(2), seed=torch.zeros(2, dtype=torch.long),
                     row=torch.arange(2))
    d = decoding.decide(logits, state, False, g, history, mask)
    assert d.token.tolist() == [7, 8]


def test_cli_writes_classify_and_json_columns(setup, tmp_path):
    """`batchvlm run` on the checkpoint: the classify and json columns land in Parquet, the same
    labels as the engine's, and `validate` refuses a json prompt with a task token by its field."""
    pytest.importorskip("xgrammar")
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, im in enumerate(setup["images"][:2]):
        im.save(folder / f"im{i}.png")
    tasks = [{"classify": {"question": q, "choices": c, "name": f"c{i}"}} for i, (q, c) in enumerate(CASES[:2])]
    tasks.append({"json": {"prompt": "Describe it.", "schema": SCHEMAS["bounds"][0], "name": "bounds"}})
    job = {"name": "f2", "input": {"folder": "imgs"}, "model": {"name": str(setup["folder"])}, "tasks": tasks,
           "engine": {"max_new_tokens": MAX_NEW}, "loader": {"workers": 0},
           "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cli_app(tmp_path, "run", tmp_path / "job.yaml", check=True)
    rows = sorted(pq.read_table(tmp_path / "out").to_pylist(), key=lambda row: row["key"])
    assert [row["status"] for row in rows] == ["ok", "ok"]
    tasks = [*CLASSIFY[:2], JsonTask(json={"prompt": "Describe it.", "schema": SCHEMAS["bounds"][0], "name": "bounds"})]
    seqs = setup["family"].sequences(tasks, EngineSpec(max_new_tokens=MAX_NEW))  # greedy: keys do not matter
    want = run(setup, tasks, seqs, 64, True, 2, max_new_tokens=MAX_NEW)
    for row, w in zip(rows, want):
        for k, v in w.items():
            if k.endswith("_scores"):  # probabilities as float32
                assert [s["label"] for s in row[k]] == [s["label"] for s in v]
                assert [s["prob"] for s in row[k]] == pytest.approx([s["prob"] for s in v], abs=1e-6)
            else:
                assert row[k] == v, k
        assert not row["bounds_truncated"] and json.loads(row["bounds"])["count"] in range(10)
    job["tasks"] = [{"json": {"prompt": "<OCR> as JSON", "schema": {"type": "integer"}}}]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(job))
    r = cli_app(tmp_path, "validate", tmp_path / "bad.yaml")
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1] == (
        "batchvlm: error: tasks.0.json.prompt: task token <OCR> must be the only content of the prompt")

"""Qwen3.5 through batchvlm's engine and CLI: greedy tokens identical to transformers' batch-1
`generate` for all four tasks, at engine batch sizes 1, 7 and 64, pipelined and synchronous, for
the dense model and its mixture-of-experts variant (`qwen3_5_moe`: 4 experts, top 2, a shared
expert; on fewer images); the linear-attention state each task forks from its image prefix is
exact."""

from __future__ import annotations

import pytest
from support.cli import heavy_imports_of_loading
from support.qwen35_fixture import write_checkpoint
from support.qwen_vl import MAX_NEW, MOE, PROMPTS, TASKS, cli_rows, images, prepared, reference_columns, reference_tokens

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.registry import open_family
from batchvlm.tasks import CaptionTask, QueryTask

pytest.importorskip("transformers")

N_IMAGES = 3  # small: batch-1 generate as the reference, and 2 cores for the whole suite
VARIANT_IMAGES = {"dense": N_IMAGES, "moe": 2}


FAMILY = {"dense": "qwen3_5", "moe": "qwen3_5_moe"}  # config.json's model_type


@pytest.fixture(scope="module", params=list(VARIANT_IMAGES))
def setup(request, tmp_path_factory):
    moe = dict(MOE, shared=40) if request.param == "moe" else None
    # seed 6 for the MoE variant: some of its sequences stop by themselves on these two images
    folder = write_checkpoint(tmp_path_factory.mktemp(f"qwen35-{request.param}"), seed=6 if moe else 2,
                              likely_stops=True, moe=moe)
    family = open_family(ModelSpec(name=str(folder)))  # backend auto: the native family, for both model types
    ims = images()[: VARIANT_IMAGES[request.param]]
    hf_class = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return dict(variant=request.param, folder=folder, family=family, model=family.load("float32", "cpu"), images=ims,
                seqs=family.sequences(TASKS, EngineSpec(max_new_tokens=MAX_NEW)),
                expected=reference_tokens(folder, ims, PROMPTS, hf_class, {"enable_thinking": False}, rows_per_call=1))


def run(setup, seqs, batch: int, pipelined: bool, n_images: int) -> list[list[list[int]]]:
    engine = Engine(setup["model"], seqs, EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch,
                                                     pipelined=pipelined), setup["family"].max_prefix_len())
    done = {im.sample.index: [s.output.tokens for s in im.seqs]
            for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared(setup)[:n_images]))}
    assert engine.scheduler.blocks.used == 0
    return [done[i] for i in range(n_images)]


@pytest.mark.parametrize("batch,pipelined,n_images", [(1, False, 1), (1, True, 1), (7, True, N_IMAGES),
                                                     (7, False, N_IMAGES), (64, True, N_IMAGES),
                                                     (64, False, N_IMAGES)])
def test_engine_tokens_equal_transformers(setup, batch, pipelined, n_images):
    n_images = min(n_images, len(setup["images"]))
    assert setup["family"].name == FAMILY[setup["variant"]] and setup["family"].backend == "native"
    assert run(setup, setup["seqs"], batch, pipelined, n_images) == setup["expected"][:n_images]


def test_some_sequences_stop_by_themselves(setup):
    lengths = [len(t) for per_image in setup["expected"] for t in per_image]
    assert min(lengths) < MAX_NEW == max(lengths), lengths  # both stop paths are exercised


def test_loading_imports_neither_dynamo_nor_sympy(setup):
    """The meta-device build (hub.empty_on, hub.embedding_table, CPU rotary tables) keeps them
    out of start-up."""
    assert heavy_imports_of_loading(setup["folder"]) == ""


@pytest.mark.parametrize("batch,n_images", [(1, 1), (64, N_IMAGES)])
def test_forked_state_is_exact(setup, batch, n_images):
    """A query that forks its image prefix's state beside a caption gets the same answer as the
    query alone (which forks it alone)."""
    if setup["variant"] == "moe":
        pytest.skip("the state bookkeeping does not depend on the MLP")
    query = QueryTask(query={"question": "What is in the picture?"})
    spec = EngineSpec(max_new_tokens=MAX_NEW)
    both = run(setup, setup["family"].sequences([CaptionTask(caption={"length": "short"}), query], spec), batch,
               True, n_images)
    alone = run(setup, setup["family"].sequences([query], spec), batch, True, n_images)
    assert [b[1] for b in both] == [a[0] for a in alone]
    assert any(b[0] != b[1] for b in both)  # two different answers were decoded side by side


def test_cli_on_a_sharded_hub_folder(setup, tmp_path):
    assert len(list(setup["folder"].glob("*.safetensors"))) > 1
    rows, meta = cli_rows(setup, tmp_path)
    # the family is named by config.json's model_type everywhere: model.family, job.json, the metadata
    assert meta["model"]["family"] == FAMILY[setup["variant"]] and meta["model"]["backend"] == "native"
    assert len(rows) == len(setup["images"])
    for key, want in reference_columns(setup).items():  # every row's texts are the reference tokens'
        assert rows[key]["status"] == "ok"
        assert {c: rows[key][c] for c in want} == want, key


def test_json_and_constrained_detect(setup):
    """json and output.constrain run on the recurrent family too (the masks are the shared Qwen
    decide's): answers that end validate, the same pipelined at batch 7 as synchronous at 64."""
    pytest.importorskip("xgrammar")
    import json

    import jsonschema
    from support.structured_cases import SCHEMAS

    from batchvlm.models.qwen_vl.labels import parses_cleanly
    from batchvlm.tasks import DetectTask, JsonTask

    tasks = [JsonTask(json={"prompt": "Count them.", "schema": SCHEMAS[n][0], "name": n, "max_new_tokens": 40})
             for n in ("bounds", "arrays")] + [DetectTask(detect={"objects": ["cat"]})]
    seqs = setup["family"].sequences(tasks, EngineSpec(max_new_tokens=MAX_NEW), constrain=True)
    runs = []
    for batch, pipelined in ((7, True), (64, False)):
        engine = Engine(setup["model"], seqs, EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch,
                                                         pipelined=pipelined), setup["family"].max_prefix_len())
        done = {im.sample.index: im for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared(setup)))}
        runs.append([setup["family"].columns(tasks, seqs, [s.output for s in done[i].seqs]) for i in sorted(done)])
    assert runs[0] == runs[1]
    for n in ("bounds", "arrays"):
        finished = [c[n] for c in runs[0] if not c[f"{n}_truncated"]]
        assert finished
        for text in finished:
            jsonschema.validate(json.loads(text), SCHEMAS[n][0])
    assert all(parses_cleanly(r["text"], "bbox_2d", 4) for c in runs[0] if not c["detect_truncated"]
               for r in c["detect_raw"])

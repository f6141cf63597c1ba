"""Qwen3.5 through batchvlm's engine and CLI: greedy tokens identical to transformers' batch-1
`generate` for all four tasks, at engine batch sizes 1, 7 and 64, pipelined and synchronous, for
the dense model and its mixture-of-experts variant (`qwen3_5_moe`: 4 experts, top 2, a shared
expert; on fewer images); the linear-attention state each task forks from its image prefix is
exact."""

from __future__ import annotations

import pytest
from support.qwen35_fixture import write_checkpoint
from support.qwen_tests import (cli_rows_checked, engine_setup, engine_tokens,  # noqa: F401 - the two tests
                                test_loading_imports_neither_dynamo_nor_sympy,  # run here, on this setup
                                test_some_sequences_stop_by_themselves)
from support.qwen_vl import MAX_NEW, MOE, prepared

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec
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
    return engine_setup(request.param, folder, VARIANT_IMAGES[request.param],
                        "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration",
                        template_kwargs={"enable_thinking": False}, rows_per_call=1)


@pytest.mark.parametrize("batch,pipelined,n_images", [(1, False, 1), (1, True, 1), (7, True, N_IMAGES),
                                                     (7, False, N_IMAGES), (64, True, N_IMAGES),
                                                     (64, False, N_IMAGES)])
def test_engine_tokens_equal_transformers(setup, batch, pipelined, n_images):
    n_images = min(n_images, len(setup["images"]))
    assert setup["family"].name == FAMILY[setup["variant"]] and setup["family"].backend == "native"
    assert engine_tokens(setup, setup["seqs"], batch, pipelined, n_images) == setup["expected"][:n_images]


@pytest.mark.parametrize("batch,n_images", [(1, 1), (64, N_IMAGES)])
def test_forked_state_is_exact(setup, batch, n_images):
    """A query that forks its image prefix's state beside a caption gets the same answer as the
    query alone (which forks it alone)."""
    if setup["variant"] == "moe":
        pytest.skip("the state bookkeeping does not depend on the MLP")
    query = QueryTask(query={"question": "What is in the picture?"})
    spec = EngineSpec(max_new_tokens=MAX_NEW)
    both = engine_tokens(setup, setup["family"].sequences([CaptionTask(caption={"length": "short"}), query], spec), batch,
               True, n_images)
    alone = engine_tokens(setup, setup["family"].sequences([query], spec), batch, True, n_images)
    assert [b[1] for b in both] == [a[0] for a in alone]
    assert any(b[0] != b[1] for b in both)  # two different answers were decoded side by side


def test_cli_on_a_sharded_hub_folder(setup, tmp_path):
    # the family is named by config.json's model_type everywhere: model.family, job.json, the metadata
    cli_rows_checked(setup, tmp_path, FAMILY[setup["variant"]])


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

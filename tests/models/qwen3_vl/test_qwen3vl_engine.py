"""Qwen3-VL through batchvlm's engine and CLI: greedy tokens identical to transformers'
`generate` for all four tasks, at engine batch sizes 1, 7 and 64, pipelined and synchronous; for
the dense model and its mixture-of-experts variant (`qwen3_vl_moe`: 4 experts, top 2, on fewer
images to keep the suite short)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from support.qwen3vl_fixture import IDS, write_checkpoint
from support.qwen_tests import (cli_rows_checked, engine_setup, engine_tokens,  # noqa: F401 - the two tests
                                test_loading_imports_neither_dynamo_nor_sympy,  # run here, on this setup
                                test_some_sequences_stop_by_themselves)
from support.qwen_vl import MAX_NEW, MOE, TASKS, prepared
from support.structured_cases import SCHEMAS

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.base.grounding import qwen3_boxes, qwen3_points
from batchvlm.models.qwen_vl.labels import parses_cleanly
from batchvlm.models.registry import open_family

pytest.importorskip("transformers")

N_IMAGES = {"dense": 7, "moe": 2}
FAMILY = {"dense": "qwen3_vl", "moe": "qwen3_vl_moe"}  # config.json's model_type


@pytest.fixture(scope="module", params=list(N_IMAGES))
def setup(request, tmp_path_factory):
    moe = MOE if request.param == "moe" else None
    folder = write_checkpoint(tmp_path_factory.mktemp(f"qwen3vl-{request.param}"), seed=2, likely_stops=True, moe=moe)
    return engine_setup(request.param, folder, N_IMAGES[request.param],
                        "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration")


@pytest.mark.parametrize("batch,pipelined,n_images", [(1, False, 2), (1, True, 1), (7, True, 7), (7, False, 7),
                                                     (64, True, 7), (64, False, 7)])
def test_engine_tokens_equal_transformers(setup, batch, pipelined, n_images):
    n_images = min(n_images, len(setup["images"]))
    assert setup["family"].name == FAMILY[setup["variant"]] and setup["family"].backend == "native"
    assert engine_tokens(setup, setup["seqs"], batch, pipelined, n_images) == setup["expected"][:n_images]


def test_cli_on_a_sharded_hub_folder(setup, tmp_path):
    # the family is named by config.json's model_type everywhere: model.family, job.json, the metadata
    rows, _ = cli_rows_checked(setup, tmp_path, FAMILY[setup["variant"]])
    tok = setup["family"].tokenizer
    for i, expected in enumerate(setup["expected"]):
        row = rows[f"im{i}.png"]
        texts = [tok.decode(t).strip() for t in expected]
        boxes = [("cat", b) for b in qwen3_boxes(texts[2])] + [("red car", b) for b in qwen3_boxes(texts[3])]
        assert [(d["label"], pytest.approx(tuple(v for k, v in d.items() if k != "label"))) for d in row["detect"]] \
            == boxes
        assert len(row["point"]) == len(qwen3_points(texts[4]))
        if not row["counts_truncated"]:
            jsonschema.validate(json.loads(row["counts"]), SCHEMAS["bounds"][0])
    assert not all(row["counts_truncated"] for row in rows.values())
    stats = json.loads(next((tmp_path / "out" / "__batchvlm__").glob("*.stats.json")).read_text())
    assert stats["parse_failures"] == sum(not parses_cleanly(r["text"], "bbox_2d", 4) for row in rows.values()
                                          for r in row["detect_raw"]) + \
        sum(not parses_cleanly(r["text"], "point_2d", 2) for row in rows.values() for r in row["point_raw"])


def test_columns_parse_the_json_the_model_writes(setup):
    from batchvlm.models.base.decoding import RawOutput

    if setup["variant"] == "moe":
        pytest.skip("the host side: the same for both model types")

    family = setup["family"]
    seqs = family.sequences(TASKS, EngineSpec(max_new_tokens=2000))  # no answer here reaches the limit
    tok = family.tokenizer
    texts = ["A cat on a mat.", "Blue.",
             '```json\n[\n\t{"bbox_2d": [100, 200, 300, 400], "label": "cat"},\n\t{"bbox_2d": [0, 0, 1200, 50], "label": "cat"}\n]\n```',
             '[{"bbox_2d": [10, 10, 20, 20], "label": "car"}, {"bbox_2d": [5',  # cut off by the token limit
             '```json\n[{"point_2d": [500, 250], "label": "dog"}]\n```']
    raws = [RawOutput(tok.encode(t) + [IDS["<|im_end|>"]], [], []) for t in texts]
    cols = family.columns(TASKS, seqs, raws)
    assert cols["caption"] == "A cat on a mat." and cols["query"] == "Blue."
    assert cols["detect"] == [
        {"label": "cat", "x_min": 0.1, "y_min": 0.2, "x_max": 0.3, "y_max": 0.4},
        {"label": "cat", "x_min": 0.0, "y_min": 0.0, "x_max": 1.0, "y_max": 0.05},
        {"label": "red car", "x_min": 0.01, "y_min": 0.01, "x_max": 0.02, "y_max": 0.02}]
    assert cols["point"] == [{"label": "dog", "x": 0.5, "y": 0.25}]
    assert cols["detect_raw"] == [{"label": "cat", "text": texts[2]}, {"label": "red car", "text": texts[3]}]
    assert cols["_parse_failures"] == 1  # the cut-off list (its complete object is kept)
    assert not cols["caption_truncated"] and not cols["detect_truncated"]
    # more objects than max_objects: the first ones are kept and the label says it was cut short
    many = '[' + ', '.join('{"point_2d": [%d, 10]}' % i for i in range(60)) + ']'
    raws[4] = RawOutput(tok.encode(many), [], [])
    cols = family.columns(TASKS, seqs, raws)
    assert len(cols["point"]) == 50 and cols["point_truncated"] and cols["_parse_failures"] == 1


def test_bfloat16_runs(setup):
    """The GPU default dtype, on CPU: every tower runs in bfloat16 (no float32 leaks into a
    bfloat16 matmul); tokens may differ from float32's, lengths stay within the limit."""
    model = setup["family"].load("bfloat16", "cpu")
    seqs = setup["family"].sequences(TASKS, EngineSpec(max_new_tokens=3))
    engine = Engine(model, seqs, EngineSpec(max_new_tokens=3), setup["family"].max_prefix_len())
    done = list(engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared(setup)[:2])))
    assert len(done) == 2 and all(len(s.output.tokens) <= 3 for im in done for s in im.seqs)


def test_model_family_is_the_config_model_type(setup):
    """What the README says model.family is, and what the log line and job.json name."""
    from batchvlm.models.base.errors import ModelLoadError

    name = FAMILY[setup["variant"]]
    assert open_family(ModelSpec(name=str(setup["folder"]), family=name), weights=False).name == name
    other = FAMILY["moe" if setup["variant"] == "dense" else "dense"]
    with pytest.raises(ModelLoadError, match=f"is a {name} model"):
        open_family(ModelSpec(name=str(setup["folder"]), family=other), weights=False)

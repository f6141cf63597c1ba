"""Qwen3-VL through batchvlm's engine and CLI: greedy tokens identical to transformers'
`generate` for all four tasks, at engine batch sizes 1, 7 and 64, pipelined and synchronous; for
the dense model and its mixture-of-experts variant (`qwen3_vl_moe`: 4 experts, top 2, on fewer
images to keep the suite short)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from helpers import heavy_imports_of_loading
from qwen3vl_fixture import IDS, write_checkpoint
from structured_cases import SCHEMAS
from test_pipeline import cli

from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.base.contract import WorkItem
from batchvlm.models.base.grounding import qwen3_boxes, qwen3_points
from batchvlm.models.qwen_vl.labels import parses_cleanly
from batchvlm.models.registry import open_family
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

pytest.importorskip("transformers")

MAX_NEW = 20
MOE = dict(experts=4, top_k=2, ff=24)
N_IMAGES = {"dense": 7, "moe": 2}
TASKS = [CaptionTask(caption={"length": "short"}), QueryTask(query={"question": "What colour is the sky?"}),
         DetectTask(detect={"objects": ["cat", "red car"]}), PointTask(point={"objects": ["dog"]})]


def images() -> list[Image.Image]:
    """Seven sizes and aspect ratios; grey and RGBA among them."""
    rng = np.random.default_rng(3)

    def rgb(h: int, w: int) -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    return [rgb(50, 70), rgb(100, 40), rgb(30, 200), rgb(160, 120), rgb(12, 20),
            Image.fromarray(rng.integers(0, 256, (75, 120), dtype=np.uint8), "L"),
            Image.fromarray(rng.integers(0, 256, (90, 60, 4), dtype=np.uint8), "RGBA")]


def reference_tokens(folder, ims: list[Image.Image], prompts: list[str], hf_class: str = "Qwen3VLForConditionalGeneration",
                     template_kwargs: dict | None = None, rows_per_call: int | None = None) -> list[list[list[int]]]:
    """transformers' own pipeline: chat template, image processor, pad expansion, greedy generate;
    per image one left-padded batch of every prompt, or calls of `rows_per_call` rows (1: batch 1)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = getattr(transformers, hf_class).from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    processor = Qwen2VLImageProcessorPil.from_pretrained(folder)
    stops = [IDS["<|im_end|>"], IDS["<|endoftext|>"]]
    out = []
    for im in ims:
        pix = processor(images=[im], return_tensors="pt")
        n = int(pix["image_grid_thw"].prod()) // 4
        rows = []
        for prompt in prompts:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                           **(template_kwargs or {}))
            rows.append(tok(text.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"])
        per_image = []
        step = rows_per_call or len(rows)
        for chunk in (rows[k : k + step] for k in range(0, len(rows), step)):
            L = max(map(len, chunk))
            ids = torch.tensor([[IDS["<|endoftext|>"]] * (L - len(r)) + r for r in chunk])
            mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in chunk])
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask,
                                     pixel_values=pix["pixel_values"].repeat(len(chunk), 1),
                                     image_grid_thw=pix["image_grid_thw"].repeat(len(chunk), 1),
                                     mm_token_type_ids=(ids == IDS["<|image_pad|>"]).int(), do_sample=False,
                                     max_new_tokens=MAX_NEW, eos_token_id=stops, pad_token_id=IDS["<|endoftext|>"])
            for row in gen[:, L:].tolist():
                end = next((j for j, t in enumerate(row) if t in stops), len(row))
                per_image.append(row[:end])
        out.append(per_image)
    return out


DETECT = 'Locate every instance that belongs to the following categories: "{}". Report bbox coordinates in JSON format.'
PROMPTS = ["Describe this image in one sentence.", "What colour is the sky?", DETECT.format("cat"),
           DETECT.format("red car"),
           "Locate every dog in this image with points. Output the point coordinates in JSON format."]


@pytest.fixture(scope="module", params=list(N_IMAGES))
def setup(request, tmp_path_factory):
    moe = MOE if request.param == "moe" else None
    folder = write_checkpoint(tmp_path_factory.mktemp(f"qwen3vl-{request.param}"), seed=2, likely_stops=True, moe=moe)
    family = open_family(ModelSpec(name=str(folder)))  # backend auto: the native family, for both model types
    seqs = family.sequences(TASKS, EngineSpec(max_new_tokens=MAX_NEW))
    ims = images()[: N_IMAGES[request.param]]
    return dict(variant=request.param, folder=folder, family=family, model=family.load("float32", "cpu"), seqs=seqs,
                images=ims, expected=reference_tokens(folder, ims, PROMPTS, "Qwen3VLMoeForConditionalGeneration"
                                                      if moe else "Qwen3VLForConditionalGeneration"))


def prepared(setup):
    from batchvlm.data.decode import decode
    from helpers import encode_image

    pre = setup["family"].preprocessor()
    out = []
    for im in setup["images"]:
        d = decode(encode_image(im, "PNG"), 10**8)
        out.append(pre(d.image, d.width, d.height))
    return out


@pytest.mark.parametrize("batch,pipelined,n_images", [(1, False, 2), (1, True, 1), (7, True, 7), (7, False, 7),
                                                     (64, True, 7), (64, False, 7)])
def test_engine_tokens_equal_transformers(setup, batch, pipelined, n_images):
    n_images = min(n_images, len(setup["images"]))
    assert setup["family"].name == "qwen3_vl" and setup["family"].backend == "native"
    engine = Engine(setup["model"], setup["seqs"], EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch,
                                                              pipelined=pipelined),
                    setup["family"].max_prefix_len())
    done = {im.ticket: [s.output.tokens for s in im.seqs]
            for im in engine.run(WorkItem(i, p, f"k{i}") for i, p in enumerate(prepared(setup)[:n_images]))}
    assert engine.scheduler.blocks.used == 0
    assert [done[i] for i in range(n_images)] == setup["expected"][:n_images]


def test_some_sequences_stop_by_themselves(setup):
    lengths = [len(t) for per_image in setup["expected"] for t in per_image]
    assert min(lengths) < MAX_NEW == max(lengths), lengths  # both stop paths are exercised


def test_loading_imports_neither_dynamo_nor_sympy(setup):
    """The meta-device build (hub.empty_on, hub.embedding_table, CPU rotary tables) keeps them
    out of start-up."""
    assert heavy_imports_of_loading(setup["folder"]) == ""


def cli_rows(setup, tmp_path, max_batch_size: int = 7) -> tuple[dict, dict]:
    """The job's images through `batchvlm run` on the checkpoint folder: rows by key, and the
    Parquet metadata; every row's texts checked against the reference tokens."""
    import yaml

    assert len(list(setup["folder"].glob("*.safetensors"))) > 1
    src = tmp_path / "images"
    src.mkdir()
    for i, im in enumerate(setup["images"]):
        im.save(src / f"im{i}.png")
    bounds = {"json": {"prompt": "Count them.", "schema": SCHEMAS["bounds"][0], "name": "counts", "max_new_tokens": 40}}
    job = {"name": "qwen", "input": {"folder": str(src)}, "model": {"name": str(setup["folder"])},
           "tasks": [t.model_dump() for t in TASKS] + [bounds],
           "engine": {"max_new_tokens": MAX_NEW, "max_batch_size": max_batch_size},
           "loader": {"workers": 1}, "output": {"dir": str(tmp_path / "out"), "raw_text": True}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    cli("run", tmp_path / "job.yaml")
    (path,) = (tmp_path / "out").glob("*.parquet")
    rows = {r["key"]: r for r in pq.read_table(path).to_pylist()}
    tok = setup["family"].tokenizer
    for i, expected in enumerate(setup["expected"]):
        row = rows[f"im{i}.png"]
        texts = [tok.decode(t).strip() for t in expected]
        assert row["status"] == "ok"
        assert row["caption"] == texts[0] and row["query"] == texts[1]
        assert row["caption_truncated"] == (len(expected[0]) == MAX_NEW)
        assert row["detect_raw"] == [{"label": "cat", "text": texts[2]}, {"label": "red car", "text": texts[3]}]
        assert row["point_raw"] == [{"label": "dog", "text": texts[4]}]
    meta = json.loads(pq.read_schema(path).metadata[b"batchvlm"])
    assert meta["model"]["family"] == setup["family"].name and meta["model"]["backend"] == "native"
    return rows, meta


def test_cli_on_a_sharded_hub_folder(setup, tmp_path):
    rows, _ = cli_rows(setup, tmp_path)
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
    done = list(engine.run(WorkItem(i, p, f"k{i}") for i, p in enumerate(prepared(setup)[:2])))
    assert len(done) == 2 and all(len(s.output.tokens) <= 3 for im in done for s in im.seqs)

"""The Qwen-VL families' shared test pieces (Qwen3-VL and Qwen3.5): images, the tasks and the
prompts transformers gets for them, transformers' own greedy tokens as the reference, the
engine's prepared inputs, a CLI run of a checkpoint folder, and the parity tests' images
through batchvlm's decode and preprocessor."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image

from support.cli import cli
from support.inputs import encode_image
from support.qwen3vl_fixture import IDS
from support.structured_cases import SCHEMAS

from batchvlm.data.decode import decode
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

MAX_NEW = 20
MOE = dict(experts=4, top_k=2, ff=24)
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


def prepared(setup):
    """The engine's inputs: each image PNG-encoded, decoded and preprocessed as the loader does it."""
    pre = setup["family"].preprocessor()
    out = []
    for im in setup["images"]:
        d = decode(encode_image(im, "PNG"), 10**8)
        out.append(pre(d.image, d.width, d.height))
    return out


def cli_rows(setup, tmp_path, max_batch_size: int = 7) -> tuple[dict, dict]:
    """The job's images through `batchvlm run` on the checkpoint folder, with TASKS and a json
    task ("counts"): rows by key, and the Parquet metadata. Checks nothing: the tests do."""
    import yaml

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
    return rows, json.loads(pq.read_schema(path).metadata[b"batchvlm"])


def reference_columns(setup) -> dict[str, dict]:
    """Per image key, the text columns of TASKS that the reference tokens (setup["expected"]) make."""
    tok = setup["family"].tokenizer
    out = {}
    for i, expected in enumerate(setup["expected"]):
        texts = [tok.decode(t).strip() for t in expected]
        out[f"im{i}.png"] = {"caption": texts[0], "query": texts[1], "caption_truncated": len(expected[0]) == MAX_NEW,
                             "detect_raw": [{"label": "cat", "text": texts[2]}, {"label": "red car", "text": texts[3]}],
                             "point_raw": [{"label": "dog", "text": texts[4]}]}
    return out


def sample_images() -> list[Image.Image]:
    """Eight sizes and aspect ratios, RGB, grey, RGBA and palette."""
    rng = np.random.default_rng(0)

    def rgb(h: int, w: int) -> Image.Image:
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    rgba = Image.fromarray(rng.integers(0, 256, (90, 60, 4), dtype=np.uint8), "RGBA")
    grey = Image.fromarray(rng.integers(0, 256, (75, 120), dtype=np.uint8), "L")
    return [rgb(50, 70), rgb(100, 40), rgb(64, 64), rgb(30, 260), rgb(300, 180), rgb(12, 20), grey, rgba,
            rgb(64, 64).convert("P")]


def ours_uint8(case, im: Image.Image) -> torch.Tensor:
    """Through batchvlm's decode (as the loader does it) and preprocessor."""
    d = decode(encode_image(im, "PNG"), 10**8)
    return case["pre"](d.image, d.width, d.height).pixels

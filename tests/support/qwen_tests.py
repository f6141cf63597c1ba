"""What the Qwen3-VL and Qwen3.5 parity and engine tests share: the parity `case` (a tiny
checkpoint built natively beside transformers' model, processor and tokenizer), one image's prompt
ids checked against transformers' chat template, the engine `setup` and its run, the CLI run's
common checks, and two tests both engine modules collect as their own (imported by name: pytest
runs them there, on that module's `setup` fixture).

The data they run on (images, tasks, prompts, transformers' greedy tokens) is qwen_vl.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from support.cli import heavy_imports_of_loading
from support.qwen3vl_fixture import IDS
from support.qwen_vl import MAX_NEW, PROMPTS, TASKS, cli_rows, images, prepared, reference_columns, reference_tokens
from tokenizers import Tokenizer

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.base.hub import weight_files
from batchvlm.models.qwen_vl.chat import ChatTemplate, read_template, special_tokens
from batchvlm.models.qwen_vl.positions import next_position, prefix_positions
from batchvlm.models.qwen_vl.preprocess import PixelSettings, Preprocessor
from batchvlm.models.qwen_vl.weights import build_model, load_weights, read_config
from batchvlm.models.registry import open_family

# --- parity


def native_model(folder: Path, model_class: type, config, skip: tuple[str, ...] = (),
                 weights: Path | None = None) -> torch.nn.Module:
    """batchvlm's model of the checkpoint `folder`, float32 on the CPU, with the weights of
    `weights` (a folder; default `folder`) but for those under the prefixes `skip`."""
    settings = PixelSettings.read(folder)
    model = build_model(model_class, config, torch.from_numpy(settings.lookup_table()), torch.device("cpu"),
                        torch.float32)
    load_weights(model, weight_files(weights or folder), skip)
    return model


def parity_case(name: str, folder: Path, config_class: type, model_class: type, hf_class: str,
                skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parity tests' `case`: the checkpoint read and built natively (config, model, pre), and
    transformers' model `hf_class` (ref), image processor and tokenizer (hf_tok) of the same folder."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    config = read_config(folder, config_class)
    return dict(name=name, folder=folder, config=config, model=native_model(folder, model_class, config, skip),
                pre=Preprocessor.create(config.vision, PixelSettings.read(folder)),
                ref=getattr(transformers, hf_class).from_pretrained(folder).eval(),
                processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                hf_tok=AutoTokenizer.from_pretrained(folder))


def prompt_ids(case, question: str, n: int, **template_kwargs) -> tuple[list[int], list[int], list[int], str]:
    """One image of `n` tokens and `question`: (head, task, ids) as batchvlm's chat template makes
    them, checked equal to transformers' rendering (with `template_kwargs`) and pad expansion; and
    that rendering."""
    folder = case["folder"]
    template = ChatTemplate(*read_template(folder), special_tokens(folder), "<|image_pad|>", "<|vision_end|>")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    head = tok.encode(template.head(), add_special_tokens=False).ids
    task = tok.encode(template.split(question)[1], add_special_tokens=False).ids
    ids = head + [IDS["<|image_pad|>"]] * n + [IDS["<|vision_end|>"]] + task
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
    text = case["hf_tok"].apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    assert case["hf_tok"](text.replace("<|image_pad|>", "<|image_pad|>" * n))["input_ids"] == ids
    return head, task, ids, text


def positions(head: int, grid: tuple[int, int], task: int) -> torch.Tensor:
    """[3, head + image + task] rotary positions: the image prefix's, then the task's after it."""
    after = next_position(head, grid)
    return torch.cat([prefix_positions(head, grid), torch.arange(after, after + task).expand(3, -1)], dim=1)


def reference_logits(case, ids_T: torch.Tensor, im) -> torch.Tensor:
    """transformers' logits [T, V] for one image's sequence `ids_T`."""
    single = case["processor"](images=[im], return_tensors="pt")
    with torch.inference_mode():
        return case["ref"](input_ids=ids_T[None], pixel_values=single["pixel_values"],
                           image_grid_thw=single["image_grid_thw"],
                           mm_token_type_ids=(ids_T == IDS["<|image_pad|>"]).int()[None]).logits[0]


# --- the engine


def engine_setup(variant: str, folder: Path, n_images: int, hf_class: str, **reference: Any) -> dict[str, Any]:
    """The engine tests' `setup`: the native family of `folder` (backend auto), loaded float32 on
    the CPU, TASKS' sequences, `n_images` images and transformers' tokens for them (`reference`:
    reference_tokens' keywords)."""
    family = open_family(ModelSpec(name=str(folder)))
    ims = images()[:n_images]
    return dict(variant=variant, folder=folder, family=family, model=family.load("float32", "cpu"), images=ims,
                seqs=family.sequences(TASKS, EngineSpec(max_new_tokens=MAX_NEW)),
                expected=reference_tokens(folder, ims, PROMPTS, hf_class, **reference))


def engine_tokens(setup, seqs, batch: int, pipelined: bool, n_images: int) -> list[list[list[int]]]:
    """The engine's tokens per image and sequence for the first `n_images`; every KV block comes back."""
    engine = Engine(setup["model"], seqs, EngineSpec(max_new_tokens=MAX_NEW, max_batch_size=batch,
                                                     pipelined=pipelined), setup["family"].max_prefix_len())
    done = {im.sample.index: [s.output.tokens for s in im.seqs]
            for im in engine.run(Sample(0, i, f"k{i}", p) for i, p in enumerate(prepared(setup)[:n_images]))}
    assert engine.scheduler.blocks.used == 0
    return [done[i] for i in range(n_images)]


def cli_rows_checked(setup, tmp_path: Path, family: str) -> tuple[dict, dict]:
    """cli_rows on the sharded checkpoint folder, checked: the family named by config.json's
    model_type in the Parquet metadata and job.json, a row per image, every row's texts the
    reference tokens'. -> (rows by key, the Parquet metadata)."""
    assert len(list(setup["folder"].glob("*.safetensors"))) > 1
    rows, meta = cli_rows(setup, tmp_path)
    assert meta["model"]["family"] == family and meta["model"]["backend"] == "native"
    job = json.loads((tmp_path / "out" / "__batchvlm__" / "job.json").read_text())
    assert job["model"]["family"] == family, job["model"]
    assert len(rows) == len(setup["images"])
    for key, want in reference_columns(setup).items():
        assert rows[key]["status"] == "ok"
        assert {c: rows[key][c] for c in want} == want, key
    return rows, meta


def test_some_sequences_stop_by_themselves(setup):
    lengths = [len(t) for per_image in setup["expected"] for t in per_image]
    assert min(lengths) < MAX_NEW == max(lengths), lengths  # both stop paths are exercised


def test_loading_imports_neither_dynamo_nor_sympy(setup):
    """The meta-device build (hub.empty_on, hub.embedding_table, CPU rotary tables) keeps them
    out of start-up."""
    assert heavy_imports_of_loading(setup["folder"]) == ""

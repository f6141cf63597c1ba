"""Builders shared by tests: hub-like model folders, id tokenizers, tiny random models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from batchvlm.models.moondream.config import MoondreamConfig
from batchvlm.models.moondream.model import MoondreamModel


def id_tokenizer(vocab_size: int) -> Tokenizer:
    """encode("12 7") -> [12, 7]: the stand-in the parity fixtures were made with."""
    tok = Tokenizer(models.WordLevel({str(i): i for i in range(vocab_size)}, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def hub_folder(dest: Path, config: dict, weights: Path | dict, tokenizer: Tokenizer | None) -> Path:
    """A folder laid out like the hub repo: wrapper config.json, model.safetensors, tokenizer.json."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps({"model_type": "moondream1", "config": config}))
    if isinstance(weights, Path):
        shutil.copyfile(weights, dest / "model.safetensors")
    else:
        save_file(weights, str(dest / "model.safetensors"))
    if tokenizer is not None:
        tokenizer.save(str(dest / "tokenizer.json"))
    return dest


def random_state(config: MoondreamConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights with non-trivial attention (the fixtures' recipe, roughly)."""
    g = torch.Generator().manual_seed(seed)
    model = MoondreamModel(config)
    out = {}
    for name, p in model.named_parameters():
        t = torch.randn(p.shape, generator=g)
        if name.endswith(("ln.weight", "ln1.weight", "ln2.weight", "post_ln.weight")):
            t = 1 + 0.05 * t
        elif name.endswith(".bias"):
            t = 0.02 * t
        elif name.endswith("qkv.weight"):
            t = 2 * t / p.shape[1] ** 0.5
        elif name.endswith(".weight"):
            t = t / p.shape[1] ** 0.5
        out[f"model.{name}"] = t.contiguous()
    return out

"""Reading a Moondream 2 checkpoint folder (found by base/hub.py).

A model folder is laid out like the hub repository:
    config.json        {"model_type": "moondream1", "config": {text, vision, region, tokenizer}}
                       (an empty "config" is full-size Moondream 2)
    model.safetensors  tensors named model.vision.*, model.text.*, model.region.*
                       (or shards with model.safetensors.index.json)
    tokenizer.json     optional; else the tokenizer repo moondream/starmie-v1
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.errors import ModelLoadError
from ..base.hub import empty_on, load_strict, read_json
from ..base.errors import ConfigError
from .config import MoondreamConfig
from .model import MoondreamModel

MODEL_TYPE = "moondream1"
TOKENIZER_REPO = "moondream/starmie-v1"


def read_config(folder: Path) -> MoondreamConfig:
    path = folder / "config.json"
    raw = read_json(path)
    if "config" in raw:
        if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ModelLoadError(f"{path}: model_type {raw['model_type']!r} is not {MODEL_TYPE}")
        raw = raw["config"] or {}
    try:
        return MoondreamConfig.from_dict(raw)
    except (ConfigError, TypeError) as e:
        raise ModelLoadError(f"{path}: {e}") from e


def build_model(config: MoondreamConfig, device: torch.device, dtype: torch.dtype) -> MoondreamModel:
    """Allocate in the target dtype without initializing (weights are loaded next): the cast
    happens on the meta device, so no float32 copy of the model ever exists."""
    with torch.device("meta"):
        model = MoondreamModel(config).to(dtype)
    model = empty_on(model, device)
    model.reset_buffers()
    return model.eval().requires_grad_(False)


def load_weights(model: MoondreamModel, files: list[Path]) -> None:
    """Strict copy: every parameter present with its exact shape, nothing extra."""
    load_strict({f"model.{k}": p for k, p in model.named_parameters()}, files)

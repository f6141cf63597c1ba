"""Building the Qwen3-VL module tree and filling it from the checkpoint's safetensors."""

from __future__ import annotations

from pathlib import Path

import torch

from ..family import ModelLoadError
from ..hub import load_strict, read_json
from .config import ConfigError, Qwen3VLConfig
from .model import Qwen3VLModel


def read_config(folder: Path) -> Qwen3VLConfig:
    try:
        return Qwen3VLConfig.from_dict(read_json(folder / "config.json"))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def load_weights(model: Qwen3VLModel, files: list[Path]) -> None:
    """Strict: every parameter present with its exact shape, nothing extra. A tied checkpoint may
    still store the output head (a copy of the embeddings); it is not used."""
    tied = model.config.text.tie_embeddings
    load_strict(dict(model.named_parameters()), files,
                lambda key: None if tied and key == "lm_head.weight" else key)


def build_model(config: Qwen3VLConfig, lut: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Qwen3VLModel:
    """Allocate in the target dtype without initializing (weights are loaded next): the cast
    happens on the meta device, so no float32 copy of the model ever exists (~8.5 GB for 2B)."""
    with torch.device("meta"):
        model = Qwen3VLModel(config).to(dtype)
    model = model.to_empty(device=device)
    model.reset_buffers(lut)
    return model.eval().requires_grad_(False)

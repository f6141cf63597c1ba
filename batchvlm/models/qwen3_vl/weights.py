"""Reading the Qwen3-VL config and building its module tree (weights: qwen_vl/weights.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..family import ModelLoadError
from ..hub import read_json
from ..qwen_vl import weights
from ..qwen_vl.config import ConfigError
from ..qwen_vl.weights import load_weights
from .config import Qwen3VLConfig
from .model import Qwen3VLModel

__all__ = ["build_model", "load_weights", "read_config"]


def read_config(folder: Path) -> Qwen3VLConfig:
    try:
        return Qwen3VLConfig.from_dict(read_json(folder / "config.json"))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def build_model(config: Qwen3VLConfig, lut: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Qwen3VLModel:
    return weights.build_model(Qwen3VLModel, config, lut, device, dtype)

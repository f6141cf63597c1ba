"""Reading the Qwen3.5 config and building its module tree (weights: qwen_vl/weights.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..family import ModelLoadError
from ..hub import read_json
from ..qwen_vl import weights
from ..qwen_vl.config import ConfigError
from .config import Qwen35Config
from .model import Qwen35Model

SKIP = ("mtp.",)  # the multi-token prediction head of the released checkpoints: not run here


def read_config(folder: Path) -> Qwen35Config:
    try:
        return Qwen35Config.from_dict(read_json(folder / "config.json"))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def build_model(config: Qwen35Config, lut: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Qwen35Model:
    return weights.build_model(Qwen35Model, config, lut, device, dtype)


def load_weights(model: Qwen35Model, files: list[Path]) -> None:
    weights.load_weights(model, files, SKIP)

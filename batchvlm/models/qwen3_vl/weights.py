"""Building the Qwen3-VL module tree and filling it from the checkpoint's safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ConfigError, Qwen3VLConfig
from .model import Qwen3VLModel

# Tied checkpoints may still carry the output head (a copy of the embeddings): not a mismatch.
OPTIONAL = {"lm_head.weight"}


def read_config(folder: Path) -> Qwen3VLConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{folder}: no config.json")
    try:
        return Qwen3VLConfig.from_dict(json.loads(path.read_text()))
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        raise ConfigError(f"{folder}: no model.safetensors and no model.safetensors.index.json")
    names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise ConfigError(f"{index}: shard(s) missing: {missing[:3]}")
    return [folder / n for n in names]


def load_weights(model: Qwen3VLModel, files: list[Path]) -> None:
    """Strict copy: every parameter present once with its exact shape, nothing extra."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in seen:
                    raise ConfigError(f"{path}: tensor {name} appears in two files")
                seen.add(name)
                if name not in params:
                    if name in OPTIONAL:
                        continue
                    raise ConfigError(f"{path}: unexpected tensor {name}")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    raise ConfigError(f"{path}: tensor {name} has shape {list(shape)}, "
                                      f"expected {list(params[name].shape)}")
                with torch.no_grad():
                    params[name].copy_(f.get_tensor(name))
    missing = sorted(params.keys() - seen)
    if missing:
        raise ConfigError(f"{files[0].parent}: missing {len(missing)} tensor(s), e.g. {missing[:3]}")


def build_model(config: Qwen3VLConfig, lut: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Qwen3VLModel:
    """Allocate without initializing (weights are loaded next)."""
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    model = model.to_empty(device=device).to(dtype)
    model.reset_buffers(lut)
    return model.eval().requires_grad_(False)

"""Building the Florence-2 module tree (on the meta device, then allocated in the target dtype)
and filling it from the checkpoint's safetensors (one file or shards with an index)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..base.errors import ModelLoadError
from ..base.hub import load_strict, read_json
from ..base.errors import ConfigError
from .config import Florence2Config
from .model import Florence2Model

# Copies of the shared embedding a checkpoint may store beside it (tied; not read).
TIED = {"lm_head.weight", "model.language_model.encoder.embed_tokens.weight",
        "model.language_model.decoder.embed_tokens.weight"}


def read_config(folder: Path) -> Florence2Config:
    try:
        return Florence2Config.from_dict(read_json(folder / "config.json"))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def build_model(config: Florence2Config, lut: torch.Tensor, device: torch.device, dtype: torch.dtype) -> Florence2Model:
    """Allocate without initializing (weights are loaded next); the pixel table stays float32."""
    with torch.device("meta"):
        model = Florence2Model(config)
    model = model.to_empty(device=device).to(dtype)
    model.lut = lut.to(device=device, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def load_weights(model: Florence2Model, files: list[Path]) -> None:
    """Strict: every parameter present with its exact shape, nothing extra but tied copies."""
    load_strict(dict(model.named_parameters()), files, lambda key: None if key in TIED else key)

"""Building a Qwen vision-language module tree and filling it from the checkpoint's safetensors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ..hub import load_strict
from .model import QwenVLModel

M = TypeVar("M", bound=QwenVLModel)


def load_weights(model: QwenVLModel, files: list[Path], skip_prefixes: tuple[str, ...] = ()) -> None:
    """Strict: every parameter present with its exact shape, nothing extra but tensors under
    `skip_prefixes` (parts batchvlm does not run, e.g. Qwen3.5's multi-token prediction head
    `mtp.`). A tied checkpoint may still store the output head (a copy of the embeddings); it is
    not used."""
    tied = model.config.text.tie_embeddings
    load_strict(dict(model.named_parameters()), files,
                lambda key: None if (tied and key == "lm_head.weight") or key.startswith(skip_prefixes) else key)


def build_model(make: Callable[[object], M], config, lut: torch.Tensor, device: torch.device,
                dtype: torch.dtype) -> M:
    """Allocate in the target dtype without initializing (weights are loaded next)."""
    with torch.device("meta"):
        model = make(config).to(dtype)
    model = model.to_empty(device=device)
    model.reset_buffers(lut)
    return model.eval().requires_grad_(False)

"""Building the SigLIP module tree (on the meta device, then allocated in the target dtype) and
filling it from the checkpoint's safetensors. A fixed-resolution checkpoint's patch convolution
[C, 3, p, p] is read into the patch linear [C, p * p * 3] (the patches' order: rows, columns,
channels), so one vision tower serves both kinds."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..base.errors import ConfigError, ModelLoadError
from ..base.hub import empty_on, load_strict, read_json
from .config import SiglipConfig
from .model import SiglipModel

PATCH = "vision_model.embeddings.patch_embedding.weight"
SKIPPED = ("text_model.embeddings.position_ids", "vision_model.embeddings.position_ids")  # buffers some files keep


def read_config(folder: Path) -> SiglipConfig:
    try:
        return SiglipConfig.from_dict(read_json(folder / "config.json"))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def build_model(config: SiglipConfig, device: torch.device, dtype: torch.dtype) -> SiglipModel:
    with torch.device("meta"):
        model = SiglipModel(config)
    return empty_on(model, device).to(dtype).eval().requires_grad_(False)


def load_weights(model: SiglipModel, files: list[Path]) -> None:
    """Strict: every parameter present with its exact shape, nothing extra."""
    params = dict(model.named_parameters())
    conv = _conv_patch(files)
    if conv is not None:
        params = {k: v for k, v in params.items() if k != PATCH}
    load_strict(params, files, lambda key: None if key in SKIPPED or (conv is not None and key == PATCH) else key)
    if conv is not None:
        target = model.vision_model.embeddings.patch_embedding.weight
        if conv.shape[0] != target.shape[0] or conv.shape[1] != 3 or conv[0].numel() != target.shape[1]:
            raise ModelLoadError(f"{files[0].parent}: tensor {PATCH} has shape {list(conv.shape)}, expected "
                                 f"[{target.shape[0]}, 3, p, p] (p: the patch size)")
        with torch.no_grad():
            target.copy_(conv.permute(0, 2, 3, 1).reshape(conv.shape[0], -1))


def _conv_patch(files: list[Path]) -> torch.Tensor | None:
    """The patch embedding when stored as a convolution (fixed-resolution checkpoints), else None."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            if PATCH in f.keys() and len(f.get_slice(PATCH).get_shape()) == 4:
                return f.get_tensor(PATCH)
    return None

"""Reading a Qwen vision-language config, building its module tree and filling it from the
checkpoint's (sharded) safetensors.

Expert weights (the `*_moe` model types) are held stacked per layer, `experts.gate_up_proj`
[E, 2I, C] and `experts.down_proj` [E, C, I]; checkpoints store them one of three ways, each read
straight into those parameters (views of them: every tensor is copied once, in the checkpoint's
dtype into the model's, with no float32 or stacked transient):
  fused            the same shapes (transformers' own save_pretrained);
  fused transposed [E, C, 2I] and [E, I, C] (the released Qwen3-VL-MoE checkpoints);
  per expert       `experts.<e>.gate_proj.weight` [I, C], `up_proj`, `down_proj` [C, I]
                   (the released Qwen3.5-MoE checkpoints).
As transformers does, a fused tensor whose shape is already the parameter's is not transposed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open

from ..base.errors import ModelLoadError
from ..base.hub import empty_on, load_strict, read_json
from ..base.errors import ConfigError
from .config import QwenVLConfig
from .model import QwenVLModel
from .moe import SparseMoE, path_for, set_path

M = TypeVar("M", bound=QwenVLModel)
C = TypeVar("C", bound=QwenVLConfig)


def read_config(folder: Path, config_class: type[C]) -> C:
    try:
        return config_class.from_dict(read_json(folder / "config.json"))
    except ConfigError as e:
        raise ModelLoadError(f"{folder / 'config.json'}: {e}") from e


def stored_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the safetensors headers (no data read)."""
    shapes = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def load_targets(model: QwenVLModel, stored: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the tensor it is copied into: the parameters, with each MoE layer's
    stacked experts replaced by the views its checkpoint layout needs (module docstring)."""
    targets = dict(model.named_parameters())
    for name, m in model.named_modules():
        if not isinstance(m, SparseMoE):
            continue
        gate_up, down = m.experts.gate_up_proj, m.experts.down_proj
        fused = f"{name}.experts.gate_up_proj"
        if fused in stored:
            for key, p in ((fused, gate_up), (f"{name}.experts.down_proj", down)):
                if stored.get(key) != tuple(p.shape):
                    targets[key] = p.transpose(1, 2)
            continue
        del targets[fused], targets[f"{name}.experts.down_proj"]
        I = m.experts.ff_dim
        for e in range(gate_up.shape[0]):
            at = f"{name}.experts.{e}"
            targets |= {f"{at}.gate_proj.weight": gate_up[e, :I], f"{at}.up_proj.weight": gate_up[e, I:],
                        f"{at}.down_proj.weight": down[e]}
    return targets


def load_weights(model: QwenVLModel, files: list[Path], skip_prefixes: tuple[str, ...] = ()) -> None:
    """Strict: every parameter present with its exact shape, nothing extra but tensors under
    `skip_prefixes` (parts batchvlm does not run, e.g. Qwen3.5's multi-token prediction head
    `mtp.`). A tied checkpoint may still store the output head (a copy of the embeddings); it is
    not used."""
    tied = model.config.text.tie_embeddings
    targets = load_targets(model, stored_shapes(files)) if model.config.text.moe else dict(model.named_parameters())
    load_strict(targets, files,
                lambda key: None if (tied and key == "lm_head.weight") or key.startswith(skip_prefixes) else key)


def build_model(make: Callable[[object], M], config, lut: torch.Tensor, device: torch.device,
                dtype: torch.dtype) -> M:
    """Allocate in the target dtype without initializing (weights are loaded next; the cast
    happens on the meta device, so no float32 copy of the model ever exists); MoE layers run
    their experts the way that suits the device (moe.py)."""
    with torch.device("meta"):
        model = make(config).to(dtype)
    model = empty_on(model, device)
    model.reset_buffers(lut)
    set_path(model, path_for(model, device, dtype))
    return model.eval().requires_grad_(False)

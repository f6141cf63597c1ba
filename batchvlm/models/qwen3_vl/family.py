"""Qwen3-VL behind the family interface (models/family.py): the host side shared with Qwen3.5
(qwen_vl/host.py), this family's config and its device side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..family import ModelLoadError
from ..hub import load_tokenizer, resolve_device, resolve_dtype, weight_files, weights_sha256
from ..qwen_vl.config import ConfigError
from ..qwen_vl.host import QwenVLHost
from ..qwen_vl.preprocess import PixelSettings
from .engine_model import Qwen3VLEngineModel
from .weights import build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import ModelSpec


class Qwen3VL(QwenVLHost):
    name = "qwen3_vl"
    title = "Qwen3-VL"

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> Qwen3VL:
        if spec.max_crops is not None:
            raise ModelLoadError("model.max_crops is Moondream's; Qwen3-VL sizes images by model.min_pixels / "
                                 "model.max_pixels")
        try:
            return cls(read_config(folder), PixelSettings.read(folder), load_tokenizer(folder), folder, spec.name,
                       revision, spec.min_pixels, spec.max_pixels)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from e

    def load(self, dtype: str = "auto", device: str = "auto") -> Qwen3VLEngineModel:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        files = weight_files(self.folder)
        model = build_model(self.config, torch.from_numpy(self.settings.lookup_table()), dev, dt)
        load_weights(model, files)
        info = self.model_info(weights_sha256(files), str(dt).removeprefix("torch."), str(dev))
        return Qwen3VLEngineModel(model, info, self.head, self.stop_ids, self.pre, self.tokenizer.id_of("<|im_end|>"))

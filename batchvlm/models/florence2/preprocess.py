"""CPU-side image preparation for Florence-2, equal to transformers' CLIP image processor (PIL
backend) with the checkpoint's preprocessor_config.json: a resize to exactly height x width
(768 x 768 for the released models; aspect ratio not kept), then rescale and normalize.

The worker resizes in PIL on uint8 pixels and ships the uint8 image; rescale and normalize run on
the device through a 3 x 256 lookup table built with the processor's float arithmetic (uint8 ->
float64 * scale -> float32, then float32 (x - mean) / std), so the device's pixel values are
bit-equal to the processor's while the worker ships 1 byte per pixel channel instead of 4.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..base.errors import ConfigError
from ..base.pixels import level_table

RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
            3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


@dataclass(frozen=True)
class PixelSettings:
    """preprocessor_config.json."""

    height: int
    width: int
    resample: int  # PIL's resampling filter number
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float | None  # None: do_rescale false
    normalize: bool
    image_tokens: int  # image_seq_length: what the processor writes for the image

    @classmethod
    def read(cls, folder: Path) -> PixelSettings:
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: no preprocessor_config.json")
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        if raw.get("do_resize", True) is False or "height" not in size or "width" not in size:
            raise ConfigError(f"{path}: Florence-2 resizes to a fixed size; expected size.height and size.width")
        crop = raw.get("crop_size") or size
        if raw.get("do_center_crop", False) and (crop.get("height"), crop.get("width")) != (size["height"], size["width"]):
            raise ConfigError(f"{path}: a center crop smaller than the resize is not supported")
        resample = int(raw.get("resample", 3))
        if resample not in RESAMPLE:
            raise ConfigError(f"{path}: unknown resample {resample}")
        return cls(int(size["height"]), int(size["width"]), resample, tuple(raw.get("image_mean", (0.485, 0.456, 0.406))),
                   tuple(raw.get("image_std", (0.229, 0.224, 0.225))),
                   float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
                   bool(raw.get("do_normalize", True)), int(raw.get("image_seq_length", 577)))

    def lookup_table(self) -> np.ndarray:
        return level_table(self.rescale, self.normalize, self.mean, self.std)


def normalize(pixels_BHW3: torch.Tensor, lut_3L: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float32 [B, 3, H, W] pixel values, on the device of the table."""
    idx = pixels_BHW3.to(lut_3L.device, non_blocking=True).long().permute(0, 3, 1, 2)
    return torch.stack([lut_3L[c][idx[:, c]] for c in range(3)], dim=1)


@dataclass
class PreparedImage:
    """One image resized for the vision tower; every image has the same size and token count."""

    pixels: torch.Tensor  # uint8 [H, W, 3]

    @property
    def cost(self) -> int:
        """Vision work in units of a 384 x 384 image (the engine's vision batches hold 128 units:
        32 images of the released models' 768 x 768)."""
        return max(1, self.pixels.shape[0] * self.pixels.shape[1] // 384**2)

    @property
    def seen(self) -> tuple[int, int]:
        return self.pixels.shape[1], self.pixels.shape[0]


@dataclass(frozen=True)
class Preprocessor:
    """Picklable: runs in the loader workers before the weights are loaded."""

    settings: PixelSettings

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        """A JPEG may decode at reduced size (draft mode) while it stays at least this large."""
        return self.settings.width, self.settings.height

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> PreparedImage:
        s = self.settings
        resized = image.convert("RGB").resize((s.width, s.height), RESAMPLE[s.resample])
        return PreparedImage(torch.from_numpy(np.array(resized, dtype=np.uint8)))

"""CPU-side image preparation, equal to transformers' SigLIP image processors (the PIL backend):
Siglip2ImageProcessor's NaFlex (a size whose patch count is at most `max_num_patches`, aspect
ratio kept, each side a multiple of the patch; bilinear) and SiglipImageProcessor's fixed square
(bicubic).

The worker resizes in PIL on uint8 pixels and cuts the image into patches, still uint8 (a
reshape: [rows, cols] patches of patch x patch x 3, the processor's order); rescale and normalize
happen on the device through a 3 x 256 lookup table (base/pixels.py), so the device's pixel
values are bit-equal to the processor's while a worker ships one byte per value."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..base.errors import ConfigError
from ..base.pixels import level_table
from .config import SiglipConfig

RESAMPLE = {0: Image.Resampling.NEAREST, 1: Image.Resampling.LANCZOS, 2: Image.Resampling.BILINEAR,
            3: Image.Resampling.BICUBIC, 4: Image.Resampling.BOX, 5: Image.Resampling.HAMMING}


def naflex_size(height: int, width: int, patch: int, max_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """(height, width) for at most `max_patches` patches: transformers'
    get_image_size_for_max_num_patches (a binary search over the scale), step for step."""

    def scaled(scale: float, size: int) -> int:
        return int(max(patch, math.ceil(size * scale / patch) * patch))

    lo, hi = eps / 10, 100.0
    while hi - lo >= eps:
        scale = (lo + hi) / 2
        if (scaled(scale, height) / patch) * (scaled(scale, width) / patch) <= max_patches:
            lo = scale
        else:
            hi = scale
    return scaled(lo, height), scaled(lo, width)


@dataclass(frozen=True)
class PixelSettings:
    """The image processor's config: NaFlex (`max_patches`) or a fixed square (`size`)."""

    max_patches: int | None
    size: tuple[int, int] | None  # (height, width) of a fixed-resolution processor
    resample: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float | None
    normalize: bool

    @classmethod
    def read(cls, folder: Path, config: SiglipConfig) -> PixelSettings:
        """preprocessor_config.json, or the image processor inside processor_config.json."""
        raw = None
        if (folder / "preprocessor_config.json").is_file():
            raw = json.loads((folder / "preprocessor_config.json").read_text())
        elif (folder / "processor_config.json").is_file():
            raw = json.loads((folder / "processor_config.json").read_text()).get("image_processor")
        if not isinstance(raw, dict):
            raise ConfigError(f"{folder}: no preprocessor_config.json (the image processor's settings)")
        if raw.get("do_resize", True) is False:
            raise ConfigError(f"{folder}: image processor do_resize false is not supported")
        if raw.get("patch_size", config.patch) != config.patch:
            raise ConfigError(f"{folder}: the image processor's patch_size {raw['patch_size']} is not the model's "
                              f"{config.patch}")
        common = dict(mean=tuple(raw.get("image_mean", (0.5, 0.5, 0.5))), std=tuple(raw.get("image_std", (0.5, 0.5, 0.5))),
                      rescale=float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
                      normalize=bool(raw.get("do_normalize", True)))
        if config.naflex:
            n = int(raw.get("max_num_patches", 256))
            return cls(n, None, int(raw.get("resample", 2)), **common)
        size = raw.get("size") or {}
        hw = (int(size.get("height", config.image_size)), int(size.get("width", config.image_size)))
        if hw != (config.image_size, config.image_size):
            raise ConfigError(f"{folder}: the image processor's size {hw} is not the model's "
                              f"{config.image_size}x{config.image_size}")
        return cls(None, hw, int(raw.get("resample", 3)), **common)

    def lookup_table(self) -> np.ndarray:
        return level_table(self.rescale, self.normalize, self.mean, self.std)


@dataclass
class PreparedImage:
    """One image as uint8 patches, in the processor's order (row-major, each patch row-major
    pixels of 3 channels)."""

    patches: torch.Tensor  # uint8 [rows * cols, patch * patch * 3]
    grid: tuple[int, int]  # (rows, cols) of patches

    @property
    def prefix_len(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def next_pos(self) -> int:
        return 0

    @property
    def cost(self) -> int:
        return max(1, self.prefix_len // 1024)

    @property
    def seen(self) -> tuple[int, int]:
        return self.grid[1] * self._patch, self.grid[0] * self._patch

    @property
    def _patch(self) -> int:
        return math.isqrt(self.patches.shape[1] // 3)


@dataclass(frozen=True)
class Preprocessor:
    """Picklable: runs in the loader workers before the weights are loaded."""

    settings: PixelSettings
    patch: int

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        s = self.settings
        if s.size is not None:
            return s.size[1], s.size[0]
        h, w = naflex_size(height, width, self.patch, s.max_patches)
        return w, h

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        return self.resized_size(width, height)

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> PreparedImage:
        w, h = self.resized_size(width or image.width, height or image.height)
        pixels = np.asarray(image.convert("RGB").resize((w, h), RESAMPLE[self.settings.resample]), dtype=np.uint8)
        p = self.patch
        rows, cols = h // p, w // p
        patches = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
        return PreparedImage(torch.from_numpy(np.ascontiguousarray(patches)), (rows, cols))

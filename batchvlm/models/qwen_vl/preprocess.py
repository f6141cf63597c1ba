"""CPU-side image preparation for Qwen3-VL, equal to transformers' Qwen2-VL image processor.

The worker resizes (bicubic, in PIL, on uint8 pixels) to a size `smart_resize` picks and ships
the resized image as uint8. Rescale and normalize happen on the device through a 3 x 256
lookup table built here with the processor's exact float arithmetic (uint8 -> float64 * scale
-> float32, then float32 (x - mean) / std), so the device's pixel values are bit-equal to the
processor's while the worker ships 1 byte per pixel instead of the processor's 2 x 4 (float32,
each patch written twice for the two temporal slots).
"""

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
from .config import VisionConfig
from .positions import next_position
from ..base.prune import kept_groups

MAX_ASPECT = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width): both multiples of `factor`, area within [min_pixels, max_pixels] where
    the rounding allows, aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds {MAX_ASPECT}:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class PixelSettings:
    """preprocessor_config.json: the resize bounds and the normalization."""

    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float | None  # None: do_rescale false
    normalize: bool

    @classmethod
    def read(cls, folder: Path) -> PixelSettings:
        path = folder / "preprocessor_config.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: no preprocessor_config.json")
        raw = json.loads(path.read_text())
        size = raw.get("size") or {}
        lo = size.get("shortest_edge", raw.get("min_pixels"))
        hi = size.get("longest_edge", raw.get("max_pixels"))
        if lo is None or hi is None:
            raise ConfigError(f"{path}: no pixel bounds (size.shortest_edge / longest_edge or min_pixels / max_pixels)")
        if raw.get("do_resize", True) is False:
            raise ConfigError(f"{path}: do_resize false is not supported")
        return cls(int(lo), int(hi), tuple(raw.get("image_mean", (0.5, 0.5, 0.5))),
                   tuple(raw.get("image_std", (0.5, 0.5, 0.5))),
                   float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else None,
                   bool(raw.get("do_normalize", True)))

    def lookup_table(self) -> np.ndarray:
        return level_table(self.rescale, self.normalize, self.mean, self.std)


@dataclass
class PreparedImage:
    """One resized image and the shape of its image prefix (positions.py)."""

    pixels: torch.Tensor  # uint8 [H, W, 3]; H, W multiples of patch * merge
    grid: tuple[int, int]  # merged grid (rows, cols): one text token per cell
    head_len: int  # template tokens before the image tokens
    # model.prune_duplicates: the cells kept (long, raster order; base/prune.py); None: every cell
    keep: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Image tokens: the kept cells."""
        return self.grid[0] * self.grid[1] if self.keep is None else self.keep.numel()

    @property
    def prefix_len(self) -> int:
        """KV slots: head, image tokens, vision_end."""
        return self.head_len + self.tokens + 1

    @property
    def next_pos(self) -> int:
        return next_position(self.head_len, self.grid)

    @property
    def cost(self) -> int:
        """Vision work in units of 1024 patches (at least 1)."""
        return max(1, self.tokens * 4 // 1024)

    @property
    def seen(self) -> tuple[int, int]:
        return self.pixels.shape[1], self.pixels.shape[0]


@dataclass(frozen=True)
class Preprocessor:
    """Picklable: runs in the loader workers before the weights are loaded."""

    settings: PixelSettings
    factor: int  # patch * merge: one text token per factor x factor pixels
    merge: int
    head_len: int
    prune: float | None = None  # model.prune_duplicates (base/prune.py)

    @classmethod
    def create(cls, vision: VisionConfig, settings: PixelSettings, head_len: int = 0, min_pixels: int | None = None,
               max_pixels: int | None = None, prune: float | None = None) -> Preprocessor:
        lo, hi = min_pixels or settings.min_pixels, max_pixels or settings.max_pixels
        if lo > hi:
            raise ConfigError(f"model.min_pixels {lo} > model.max_pixels {hi}")
        s = PixelSettings(lo, hi, settings.mean, settings.std, settings.rescale, settings.normalize)
        return cls(s, vision.patch_size * vision.merge, vision.merge, head_len, prune)

    def max_tokens(self) -> int:
        """An upper bound of the image tokens of any image: the area bound, or what smart_resize's
        rounding can exceed it by at the extreme aspect ratio (a side forced up to one factor when
        shrinking; both sides rounded up when growing to min_pixels)."""
        f, lo, hi = self.factor, self.settings.min_pixels, self.settings.max_pixels
        shrunk_thin = math.isqrt(MAX_ASPECT * hi) // f + 1
        grown = (math.isqrt(MAX_ASPECT * lo) + 2 * f) * (math.isqrt(lo // MAX_ASPECT) + 2 * f) // f**2
        return max(hi // f**2, shrunk_thin, grown)

    def resized_size(self, width: int, height: int) -> tuple[int, int]:
        h, w = smart_resize(height, width, self.factor, self.settings.min_pixels, self.settings.max_pixels)
        return w, h

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        """The (width, height) the image is resized to: a JPEG may decode at reduced size (draft
        mode) as long as it stays at least this large."""
        return self.resized_size(width, height)

    def resize(self, image: Image.Image, width: int | None = None, height: int | None = None) -> np.ndarray:
        """RGB image -> uint8 [H, W, 3] at the resized size. `width` / `height`: the full size
        when `image` was decoded at reduced size (the resize target follows the full size)."""
        w, h = self.resized_size(width or image.width, height or image.height)
        return np.array(image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC), dtype=np.uint8)

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> PreparedImage:
        pixels = self.resize(image, width, height)
        f = self.factor
        keep = None if self.prune is None else kept_groups(pixels, f, self.prune)
        return PreparedImage(torch.from_numpy(pixels), (pixels.shape[0] // f, pixels.shape[1] // f), self.head_len,
                             keep)

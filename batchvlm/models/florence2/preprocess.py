"""CPU-side image preparation for Florence-2, equal to transformers' CLIP image processor (PIL
backend) with the checkpoint's preprocessor_config.json: a resize to exactly height x width
(768 x 768 for the released models; aspect ratio not kept), then rescale and normalize.

The worker resizes in PIL on uint8 pixels and ships the uint8 image; rescale and normalize run on
the device through a 3 x 256 lookup table built with the processor's float arithmetic (uint8 ->
float64 * scale -> float32, then float32 (x - mean) / std), so the device's pixel values are
bit-equal to the processor's while the worker ships 1 byte per pixel channel instead of 4.

With model.prune_duplicates the worker also decides which cells of the last DaViT stage are kept
(`Footprint`, base/prune.py): DaViT itself runs on the full grid, the dropped cells' image tokens
are left out after it (device.py).
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
from ..base.prune import kept_cells
from .config import VisionConfig

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


def _side(n: int, kernel: int, stride: int, pad: int) -> int:
    return (n + 2 * pad - kernel) // stride + 1


@dataclass(frozen=True)
class Footprint:
    """Where a cell of the last DaViT stage reads the image: the receptive field of the strided
    convs alone (the stem of each stage), a size x size window at (row * stride - pad, col *
    stride - pad) of the resized image, centred on the cell (768: cells of 32 px reading 63 x 63
    windows). Two cells whose windows are equal get equal conv features; only the blocks'
    depthwise convs and window / channel attention, and the 2-D position embedding, set them
    apart. The duplicate test compares these windows (docs/tune.md, Florence-2)."""

    grid: tuple[int, int]  # (rows, cols) of the last stage
    stride: int
    size: int
    pad: int  # what the convs pad, in input pixels, on the top / left

    @classmethod
    def of(cls, vision: VisionConfig, height: int, width: int) -> Footprint:
        h, w, stride, size, pad = height, width, 1, 1, 0
        for k, s, p in zip(vision.patch_size, vision.patch_stride, vision.patch_padding):
            h, w = _side(h, k, s, p), _side(w, k, s, p)
            size += (k - 1) * stride
            pad += p * stride
            stride *= s
        return cls((h, w), stride, size, pad)

    @property
    def cells(self) -> int:
        return self.grid[0] * self.grid[1]

    def kept(self, pixels_HW3: np.ndarray, tolerance: float) -> torch.Tensor | None:
        """The kept cells (raster order, long; None: all). Outside the image the convs read their
        zero padding, the mean colour after normalization: padded here with a value no pixel
        has, so a window reaching past the border equals only one that reaches past it alike."""
        (gh, gw), s, z, p = self.grid, self.stride, self.size, self.pad
        padded = np.full(((gh - 1) * s + z, (gw - 1) * s + z, 3), -256, dtype=np.int16)
        inside = pixels_HW3[: padded.shape[0] - p, : padded.shape[1] - p]
        padded[p : p + inside.shape[0], p : p + inside.shape[1]] = inside
        return kept_cells(padded, self.grid, s, z, tolerance)


@dataclass
class PreparedImage:
    """One image resized for the vision tower; every image has the same size and DaViT grid."""

    pixels: torch.Tensor  # uint8 [H, W, 3]
    cells: int  # cells of the last DaViT stage: image tokens = the pooled one + a token per cell
    # model.prune_duplicates: the cells kept (long, raster order); None: every cell
    keep: torch.Tensor | None = None

    @property
    def prefix_len(self) -> int:
        """Image tokens the encoder reads: the pooled token and the kept cells."""
        return 1 + (self.cells if self.keep is None else self.keep.numel())

    @property
    def next_pos(self) -> int:
        return 0  # the decoder's own positions start at 0

    @property
    def cost(self) -> int:
        """Vision work in units of a 384 x 384 image (the engine's vision batches hold 128 units:
        32 images of the released models' 768 x 768). Pruning leaves it: DaViT reads every cell."""
        return max(1, self.pixels.shape[0] * self.pixels.shape[1] // 384**2)

    @property
    def seen(self) -> tuple[int, int]:
        return self.pixels.shape[1], self.pixels.shape[0]


@dataclass(frozen=True)
class Preprocessor:
    """Picklable: runs in the loader workers before the weights are loaded."""

    settings: PixelSettings
    footprint: Footprint
    prune: float | None = None  # model.prune_duplicates

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        """A JPEG may decode at reduced size (draft mode) while it stays at least this large."""
        return self.settings.width, self.settings.height

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> PreparedImage:
        s = self.settings
        pixels = np.array(image.convert("RGB").resize((s.width, s.height), RESAMPLE[s.resample]), dtype=np.uint8)
        keep = None if self.prune is None else self.footprint.kept(pixels, self.prune)
        return PreparedImage(torch.from_numpy(pixels), self.footprint.cells, keep)

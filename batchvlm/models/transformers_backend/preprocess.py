"""The loader workers' part: the decoded image, checked by the model's image processor.

The processor itself runs beside `generate` (it expands each prompt's image tokens from the
image's size, so images and prompts go through it together). In the workers the image processor
runs once on every image so that an image it refuses (too small, too elongated) becomes that
row's error, not a failed batch. JPEGs are decoded at full size: the image processors resize
from full resolution, and a draft decode would change the pixels they start from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image


@dataclass
class RGBImage:
    pixels: np.ndarray  # uint8 [H, W, 3]
    seen: tuple[int, int] | None  # (width, height) after the image processor's resize, where it reports one


def seen_size(features, image_processor) -> tuple[int, int] | None:
    """Qwen-VL style image processors report the image's patch grid: its size after the resize."""
    grid = features.get("image_grid_thw")
    patch = getattr(image_processor, "patch_size", None)
    if grid is None or not isinstance(patch, int):
        return None
    _, h, w = (int(x) for x in grid[0])
    return w * patch, h * patch


@dataclass(frozen=True)
class ImagePreprocessor:
    image_processor: Any  # a transformers PIL-backend image processor (picklable)

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        return width, height

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> RGBImage:
        # raises ValueError for what it refuses; the labeler's processor call resizes it the same way
        features = self.image_processor(images=[image], return_tensors="np")
        return RGBImage(np.asarray(image.convert("RGB")), seen_size(features, self.image_processor))

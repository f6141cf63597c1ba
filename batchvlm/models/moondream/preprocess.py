"""CPU-side image preparation for Moondream: a picklable callable for loader workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from .config import VisionConfig
from .image_crops import overlap_crops, resized_size, tiling_for
from .vision import n_crops


@dataclass
class PreparedImage:
    crops: torch.Tensor  # uint8 [n_crops, S, S, 3]; crop 0 global, then local crops row-major
    tiling: tuple[int, int]
    prefix_len: int  # BOS + image tokens: the same for every image

    @property
    def next_pos(self) -> int:
        return self.prefix_len

    @property
    def cost(self) -> int:
        return n_crops(self.tiling)

    seen = None  # a global crop and local crops: no one size


@dataclass(frozen=True)
class Preprocessor:
    vision: VisionConfig
    max_crops: int

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        """Largest (width, height) the crops are resized to: a JPEG may decode at reduced size
        (draft mode) as long as it stays at least this large."""
        tiling = tiling_for(width, height, self.vision, self.max_crops)
        rw, rh = resized_size(tiling, self.vision) if tiling != (1, 1) else (0, 0)
        s = self.vision.crop_size
        return max(rw, s), max(rh, s)

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> PreparedImage:
        """`width`/`height`: the image's full size when `image` was decoded at reduced size."""
        tiling = tiling_for(width or image.width, height or image.height, self.vision, self.max_crops)
        crops, tiling = overlap_crops(image, self.vision, self.max_crops, tiling)
        return PreparedImage(torch.from_numpy(crops), tiling, 1 + self.vision.n_image_tokens)

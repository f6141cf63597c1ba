"""CPU-side image preparation for Moondream: a picklable callable for loader workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from PIL import Image

from ..base.prune import kept_groups
from .config import VisionConfig
from .image_crops import overlap_crops, resized_size, tiling_for
from .vision import n_crops


@dataclass
class PreparedImage:
    crops: torch.Tensor  # uint8 [n_crops, S, S, 3]; crop 0 global, then local crops row-major
    tiling: tuple[int, int]
    image_tokens: int  # grid**2: the image tokens of the full grid, the same for every image
    # model.prune_duplicates: the kept tokens (long, raster order over the grid; vision.py
    # forward_kept), every token when none repeats; None: pruning is off
    keep: torch.Tensor | None = None

    @property
    def prefix_len(self) -> int:
        """KV slots: BOS and the (kept) image tokens."""
        return 1 + (self.image_tokens if self.keep is None else self.keep.numel())

    @property
    def next_pos(self) -> int:
        """Kept tokens keep their positions on the full grid: the text after them starts at the
        same position whatever was dropped."""
        return 1 + self.image_tokens

    @property
    def cost(self) -> int:
        return n_crops(self.tiling)

    seen = None  # a global crop and local crops: no one size


@dataclass(frozen=True)
class Preprocessor:
    vision: VisionConfig
    max_crops: int
    prune: float | None = None  # model.prune_duplicates (base/prune.py): decided on the global crop

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
        n = self.vision.n_image_tokens
        keep = None
        if self.prune is not None:
            keep = kept_groups(crops[0], self.vision.enc_patch_size, self.prune)
            keep = torch.arange(n) if keep is None else keep
        return PreparedImage(torch.from_numpy(crops), tiling, n, keep)

"""Overlap crops: one global crop plus a grid of overlapping local crops, as uint8.

Region math (all sizes in pixels of the resized image; S = crop_size, p = patch size,
m = overlap_margin in patches):

    window = (S/p - 2m) * p        useful part of each local crop (266 px for Moondream 2)
    resized = tiling * window + 2 * m * p
    local crop (i, j) = resized[i*window : i*window + S, j*window : j*window + S]

Neighbouring crops therefore overlap by 2*m*p pixels; when the features are stitched back
(vision.py) each crop keeps its centre window plus the outer margins at the image border.
Normalization to [-1, 1] happens on the device; the CPU ships uint8 only.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from .config import VisionConfig


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops for an image whose margins are already removed."""
    if height <= window or width <= window:
        return (1, 1)
    min_h = math.ceil(height / window)
    min_w = math.ceil(width / window)
    if min_h * min_w > max_crops:
        ratio = math.sqrt(max_crops / (min_h * min_w))
        return (max(1, math.floor(min_h * ratio)), max(1, math.floor(min_w * ratio)))
    h_tiles = max(math.floor(math.sqrt(max_crops * height / width)), min_h)
    w_tiles = max(math.floor(math.sqrt(max_crops * width / height)), min_w)
    if h_tiles * w_tiles > max_crops:
        if w_tiles > h_tiles:
            w_tiles = math.floor(max_crops / h_tiles)
        else:
            h_tiles = math.floor(max_crops / w_tiles)
    return (max(1, h_tiles), max(1, w_tiles))


def tiling_for(width: int, height: int, config: VisionConfig, max_crops: int) -> tuple[int, int]:
    margin_px = config.enc_patch_size * config.overlap_margin
    window = (config.grid - 2 * config.overlap_margin) * config.enc_patch_size
    return select_tiling(height - 2 * margin_px, width - 2 * margin_px, window, max_crops)


def resized_size(tiling: tuple[int, int], config: VisionConfig) -> tuple[int, int]:
    """(width, height) the image is resized to before local crops are cut."""
    margin_px = config.enc_patch_size * config.overlap_margin
    window = (config.grid - 2 * config.overlap_margin) * config.enc_patch_size
    return (tiling[1] * window + 2 * margin_px, tiling[0] * window + 2 * margin_px)


def overlap_crops(
    image: Image.Image, config: VisionConfig, max_crops: int, tiling: tuple[int, int] | None = None
) -> tuple[np.ndarray, tuple[int, int]]:
    """crops_NHWC (uint8; crop 0 is global, then local crops row-major) and the tiling.

    `tiling` may be given when `image` was decoded at reduced size (JPEG draft) so that it is
    chosen from the original dimensions.
    """
    if image.mode != "RGB":
        image = image.convert("RGB")
    size = config.crop_size
    if tiling is None:
        tiling = tiling_for(image.width, image.height, config, max_crops)
    rows, cols = tiling
    global_crop = image.resize((size, size), resample=Image.Resampling.LANCZOS)
    if rows == cols == 1:
        # The single local crop is the same S x S resize as the global crop; the vision
        # stage knows this and encodes it once (vision.encode_images).
        return np.array(global_crop)[None], tiling
    crops_NHWC = np.zeros((1 + rows * cols, size, size, 3), dtype=np.uint8)
    crops_NHWC[0] = np.asarray(global_crop)
    resized = np.asarray(image.resize(resized_size(tiling, config), resample=Image.Resampling.LANCZOS))
    window = (config.grid - 2 * config.overlap_margin) * config.enc_patch_size
    for i in range(rows):
        for j in range(cols):
            piece = resized[i * window : i * window + size, j * window : j * window + size]
            crops_NHWC[1 + i * cols + j, : piece.shape[0], : piece.shape[1]] = piece
    return crops_NHWC, tiling

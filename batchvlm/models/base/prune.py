"""Duplicate visual tokens (model.prune_duplicates): which cells of an image's token grid are kept.

A cell is one visual token; it reads a size x size window of the pixels the tower reads, at
(row * stride, col * stride). Qwen: its merge group, the 2 x 2 patches that become one text
token (stride = size = patch * merge; qwen_vl/preprocess.py). Florence-2: the receptive field of
DaViT's convolutional stem, overlapping windows (florence2/preprocess.py).

In raster order over the grid, a cell is dropped when its window equals, within the tolerance,
the window of the kept cell its left or upper neighbour is or stands for: every dropped cell is
compared with a kept one, so a tolerance never drifts along a run of near-equal cells (at
tolerance 0 equality is transitive, and equal neighbours are enough). The first cell is always
kept. The tolerance is the largest difference of any pixel channel, as a share of 0-255. Decided
on the uint8 pixels the tower reads, in the loader workers, once per image: every task of the
image shares it.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view


def kept_groups(pixels_HW3: np.ndarray, factor: int, tolerance: float) -> torch.Tensor | None:
    """Non-overlapping factor x factor cells (Qwen's merge groups) -> the kept cells' indices
    (raster order, long), or None when every cell is kept."""
    H, W, _ = pixels_HW3.shape
    return kept_cells(pixels_HW3, (H // factor, W // factor), factor, factor, tolerance)


def kept_cells(pixels_HW3: np.ndarray, grid: tuple[int, int], stride: int, size: int,
               tolerance: float) -> torch.Tensor | None:
    """-> the kept cells' indices (raster order over `grid`, long), or None when every cell is
    kept. Cell (r, c) reads pixels_HW3[r * stride : r * stride + size, c * stride : ...]: the
    array holds every window (pad it first). Any integer dtype (a pad value outside 0-255 equals
    no pixel)."""
    gh, gw = grid
    px = pixels_HW3.astype(np.int16)
    flat = px.reshape(px.shape[0], -1)  # [H, W * 3]: channels interleaved, so a window is size x 3 * size
    limit = tolerance * 255
    same_left = np.zeros((gh, gw), dtype=bool)
    same_up = np.zeros((gh, gw), dtype=bool)
    if gw > 1:  # diff[y, x]: |flat[y, x + 3 stride] - flat[y, x]|, so cell (r, c) vs (r, c - 1) is a window of it
        diff = np.abs(flat[:, 3 * stride :] - flat[:, : -3 * stride])
        same_left[:, 1:] = _window_max(diff, gh, gw - 1, stride, size) <= limit
    if gh > 1:
        diff = np.abs(flat[stride:] - flat[:-stride])
        same_up[1:] = _window_max(diff, gh - 1, gw, stride, size) <= limit
    candidate = same_left | same_up
    if not candidate.any():
        return None
    if limit == 0:
        keep = ~candidate
    else:
        keep = np.ones((gh, gw), dtype=bool)
        rep = np.arange(gh * gw).reshape(gh, gw)  # the kept cell each cell is, or stands for

        def window(i: int) -> np.ndarray:
            r, c = divmod(int(i), gw)
            return px[r * stride : r * stride + size, c * stride : c * stride + size]

        for r, c in zip(*np.nonzero(candidate)):  # raster order: neighbours are decided first
            for near in ([rep[r, c - 1]] if same_left[r, c] else []) + ([rep[r - 1, c]] if same_up[r, c] else []):
                if np.abs(window(r * gw + c) - window(near)).max() <= limit:
                    keep[r, c], rep[r, c] = False, near
                    break
    return torch.from_numpy(np.flatnonzero(keep.reshape(-1)))


def _window_max(diff_YX: np.ndarray, rows: int, cols: int, stride: int, size: int) -> np.ndarray:
    """[rows, cols]: the largest value of each window of diff_YX (channels interleaved: a window is
    size rows x 3 * size values) at (r * stride, 3 * c * stride). Separable: rows, then columns
    (numpy reduces a long last axis fast and a short one slowly)."""
    if size == stride:  # windows tile the array: a reshape
        tiles = diff_YX[: rows * size, : cols * 3 * size].reshape(rows, size, cols, 3 * size)
        return tiles.max(axis=1).max(axis=-1)
    bands = np.stack([diff_YX[r * stride : r * stride + size].max(axis=0) for r in range(rows)])  # [rows, X]
    return sliding_window_view(bands, 3 * size, axis=1)[:, :: 3 * stride][:, :cols].max(axis=-1)

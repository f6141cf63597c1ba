"""Duplicate visual tokens (model.prune_duplicates): which cells of an image's token grid are kept.

A cell is one visual token; it reads a size x size window of the pixels the tower reads, at
(row * stride, col * stride). Qwen: its merge group, the 2 x 2 patches that become one text
token (stride = size = patch * merge; qwen_vl/preprocess.py). Moondream: a patch of the global
crop (stride = size = patch; moondream/preprocess.py). Florence-2: the receptive field of
DaViT's convolutional stem, overlapping windows (florence2/preprocess.py).

In raster order over the grid, a cell is dropped when its window equals, within the tolerance,
the window of the kept cell its left or upper neighbour is or stands for: every dropped cell is
compared with a kept one, so a tolerance never drifts along a run of near-equal cells (at
tolerance 0 equality is transitive, and equal neighbours are enough). The first cell is always
kept. The tolerance is the largest difference of any pixel channel, as a share of 0-255. Above 0,
a cell's representative depends on its neighbours': decided an anti-diagonal at a time
(`_kept_within`), equal to the raster-order loop (tests/models/test_prune_blocks.py). Decided
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
    px = np.asarray(pixels_HW3, dtype=np.int16)  # a copy unless it is int16 already
    flat = px.reshape(px.shape[0], -1)  # [H, W * 3]: channels interleaved, so a window is size x 3 * size
    limit = tolerance * 255
    # each cell's largest difference from its left / upper neighbour (-1 where it has none)
    left_max = np.full((gh, gw), -1, dtype=np.int16)
    up_max = np.full((gh, gw), -1, dtype=np.int16)
    if gw > 1:  # diff[y, x]: |flat[y, x + 3 stride] - flat[y, x]|, so cell (r, c) vs (r, c - 1) is a window of it
        diff = np.abs(flat[:, 3 * stride :] - flat[:, : -3 * stride])
        left_max[:, 1:] = _window_max(diff, gh, gw - 1, stride, size)
    if gh > 1:
        diff = np.abs(flat[stride:] - flat[:-stride])
        up_max[1:] = _window_max(diff, gh - 1, gw, stride, size)
    same_left = (left_max >= 0) & (left_max <= limit)
    same_up = (up_max >= 0) & (up_max <= limit)
    candidate = same_left | same_up
    if not candidate.any():
        return None
    if limit == 0:
        keep = ~candidate
    else:
        t = torch.from_numpy
        keep = _kept_within(t(px), (gh, gw), stride, size, (t(same_left), t(left_max)), (t(same_up), t(up_max)),
                            limit).numpy()
    return torch.from_numpy(np.flatnonzero(keep.reshape(-1)))


def _kept_within(px_HW3: torch.Tensor, grid: tuple[int, int], stride: int, size: int,
                 left: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor], limit: float
                 ) -> torch.Tensor:
    """Tolerance > 0: -> keep [gh, gw]. A cell's representative depends on its left and upper
    neighbours', so the cells of one anti-diagonal (r + c = d) depend only on the diagonal before:
    decided a diagonal at a time, all of its cells at once. A cell is compared with its
    neighbour's representative's window only where that is not already known: a kept neighbour
    is its own representative, and a cell equal to its neighbour (largest difference 0) is as
    near the representative as the neighbour is. `left` / `up`: (within the tolerance of that
    neighbour, the largest difference from it) per cell."""
    gh, gw = grid
    keep = torch.ones(gh, gw, dtype=torch.bool)
    rep = torch.arange(gh * gw).view(gh, gw)  # the kept cell each cell is, or stands for
    candidate = left[0] | up[0]
    span = torch.arange(size)

    def window(i: torch.Tensor) -> torch.Tensor:
        """Cells' windows [n, size, size, 3]."""
        y = (i // gw * stride)[:, None, None] + span[None, :, None]
        x = (i % gw * stride)[:, None, None] + span[None, None, :]
        return px_HW3[y, x]

    def by(r: torch.Tensor, c: torch.Tensor, nr: torch.Tensor, nc: torch.Tensor, near: torch.Tensor,
           most: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the neighbour's representative, whether the cell is dropped for it)."""
        nr, nc = nr.clamp(min=0), nc.clamp(min=0)
        nb = rep[nr, nc]
        ok = near[r, c].clone()
        check = (ok & ~keep[nr, nc] & (most[r, c] != 0)).nonzero().view(-1)
        if check.numel():
            diff = (window((r * gw + c)[check]) - window(nb[check])).abs()
            ok[check] = diff.flatten(1).amax(-1) <= limit
        return nb, ok

    for d in range(1, gh + gw - 1):
        r = torch.arange(max(0, d - gw + 1), min(d, gh - 1) + 1)
        c = d - r
        on = candidate[r, c]
        if not on.any():
            continue
        r, c = r[on], c[on]
        from_left, by_left = by(r, c, r, c - 1, *left)
        from_up, by_up = by(r, c, r - 1, c, *up)
        by_up &= ~by_left
        drop = by_left | by_up
        keep[r[drop], c[drop]] = False
        rep[r[drop], c[drop]] = torch.where(by_left, from_left, from_up)[drop]
    return keep


def _window_max(diff_YX: np.ndarray, rows: int, cols: int, stride: int, size: int) -> np.ndarray:
    """[rows, cols]: the largest value of each window of diff_YX (channels interleaved: a window is
    size rows x 3 * size values) at (r * stride, 3 * c * stride). Separable: rows, then columns
    (numpy reduces a long last axis fast and a short one slowly)."""
    if size == stride:  # windows tile the array: a reshape
        tiles = diff_YX[: rows * size, : cols * 3 * size].reshape(rows, size, cols, 3 * size)
        return tiles.max(axis=1).max(axis=-1)
    bands = np.stack([diff_YX[r * stride : r * stride + size].max(axis=0) for r in range(rows)])  # [rows, X]
    return sliding_window_view(bands, 3 * size, axis=1)[:, :: 3 * stride][:, :cols].max(axis=-1)

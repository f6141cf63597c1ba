"""Duplicate merge groups (model.prune_duplicates): which text tokens of an image are kept.

A merge group is the factor x factor pixel block (patch * merge a side) that becomes one text
token. In raster order over the merged grid, a group is dropped when its pixels equal, within
the tolerance, those of the kept group its left or upper neighbour is or stands for: every
dropped group is compared with a kept one, so a tolerance never drifts along a run of near-equal
groups (at tolerance 0 equality is transitive, and equal neighbours are enough). The first group
is always kept. Dropped groups are neither encoded nor prefilled; kept tokens keep their
positions on the full grid (positions.py, vision.py), so the model reads the same image with
the repeats left out. Decided on the uint8 pixels the tower reads, in the loader workers.
"""

from __future__ import annotations

import numpy as np
import torch


def kept_groups(pixels_HW3: np.ndarray, factor: int, tolerance: float) -> torch.Tensor | None:
    """-> the kept merge groups' indices (raster order over the merged grid, long), or None when
    every group is kept."""
    H, W, _ = pixels_HW3.shape
    gh, gw = H // factor, W // factor
    blocks = pixels_HW3.reshape(gh, factor, gw, factor, 3).transpose(0, 2, 1, 3, 4).reshape(gh, gw, -1)
    blocks = blocks.astype(np.int16)
    limit = tolerance * 255
    same_left = np.zeros((gh, gw), dtype=bool)
    same_up = np.zeros((gh, gw), dtype=bool)
    same_left[:, 1:] = np.abs(blocks[:, 1:] - blocks[:, :-1]).max(axis=-1) <= limit
    same_up[1:] = np.abs(blocks[1:] - blocks[:-1]).max(axis=-1) <= limit
    candidate = same_left | same_up
    if not candidate.any():
        return None
    if limit == 0:
        keep = ~candidate
    else:
        keep = np.ones((gh, gw), dtype=bool)
        rep = np.arange(gh * gw).reshape(gh, gw)  # the kept group each group is, or stands for
        flat = blocks.reshape(gh * gw, -1)
        for r, c in zip(*np.nonzero(candidate)):  # raster order: neighbours are decided first
            for near in ([rep[r, c - 1]] if same_left[r, c] else []) + ([rep[r - 1, c]] if same_up[r, c] else []):
                if np.abs(flat[r * gw + c] - flat[near]).max() <= limit:
                    keep[r, c], rep[r, c] = False, near
                    break
    return torch.from_numpy(np.flatnonzero(keep.reshape(-1)))

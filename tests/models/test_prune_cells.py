"""base/prune.py: the duplicate test over a grid of windows, tiled (Qwen's merge groups) or
overlapping (Florence-2's stem footprints), against a plain per-window reading of its rule."""

from __future__ import annotations

import numpy as np
import pytest

from batchvlm.models.base.prune import kept_cells


def plain(px: np.ndarray, grid: tuple[int, int], stride: int, size: int, tol: float) -> list[int] | None:
    """The rule read literally: raster order, a cell is dropped when its window is within the
    tolerance of the window of the kept cell its left or upper neighbour is or stands for."""
    gh, gw = grid
    px = px.astype(np.int64)

    def window(i: int) -> np.ndarray:
        r, c = divmod(i, gw)
        return px[r * stride : r * stride + size, c * stride : c * stride + size]

    rep: dict[int, int] = {}
    for i in range(gh * gw):
        r, c = divmod(i, gw)
        rep[i] = i
        for near in ([i - 1] if c else []) + ([i - gw] if r else []):
            if np.abs(window(i) - window(near)).max() <= tol * 255 and np.abs(window(i) - window(rep[near])).max() <= tol * 255:
                rep[i] = rep[near]
                break
    kept = [i for i in range(gh * gw) if rep[i] == i]
    return None if len(kept) == gh * gw else kept


@pytest.mark.parametrize("stride,size", [(4, 4), (4, 7), (3, 8)])
def test_kept_cells_follow_the_rule(stride, size):
    rng = np.random.default_rng(stride * size)
    dropped = 0
    for trial in range(60):
        gh, gw = (int(v) for v in rng.integers(1, 6, 2))
        side_h, side_w = (gh - 1) * stride + size, (gw - 1) * stride + size
        px = (rng.integers(0, 2, (side_h // 4 + 1, side_w // 4 + 1, 1)).repeat(4, 0).repeat(4, 1)[:side_h, :side_w]
              * 3 + 100).repeat(3, 2)
        if trial % 2:
            px = px + rng.integers(0, 2, px.shape)
        if trial % 5 == 0:
            px[:2] = -256  # padding: equals no pixel
        for tol in (0.0, 1 / 255, 2.5 / 255, 0.05):
            got = kept_cells(px, (gh, gw), stride, size, tol)
            want = plain(px, (gh, gw), stride, size, tol)
            assert (None if got is None else got.tolist()) == want, (trial, tol)
            dropped += want is not None
    assert dropped > 20  # the images repeat enough to drop cells

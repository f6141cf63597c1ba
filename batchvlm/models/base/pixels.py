"""The image processors' pixel arithmetic as one table: every family that ships uint8 pixels to
the device and normalizes them there looks each level up in it."""

from __future__ import annotations

import numpy as np


def level_table(rescale: float | None, normalize: bool, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[3, 256] float32: the processed value of each uint8 level in each channel (`rescale` None:
    do_rescale false), computed as the processors compute it (rescale in float64, then float32)."""
    levels = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256))
    x = (levels.astype(np.float64) * rescale).astype(np.float32) if rescale else levels.astype(np.float32)
    if normalize:
        x = (x - np.array(mean, np.float32)[:, None]) / np.array(std, np.float32)[:, None]
    return np.ascontiguousarray(x, dtype=np.float32)

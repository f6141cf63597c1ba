"""The duplicate-cell rule's tolerance > 0 path (models/base/prune.py): the vectorised decision (an
anti-diagonal at a time) keeps exactly the cells the raster-order loop it replaced keeps, on
random and real images, tiled (Qwen, Moondream) and overlapping (Florence-2) windows."""

from __future__ import annotations

import io
import random

import numpy as np
import torch
from PIL import Image, ImageDraw

from batchvlm.models.base.prune import kept_cells
from batchvlm.shapes.world import draw_scene, encode


def loop_reference(pixels_HW3: np.ndarray, grid: tuple[int, int], stride: int, size: int,
                   tolerance: float) -> torch.Tensor | None:
    """The loop as first written: one cell at a time in raster order."""
    gh, gw = grid
    px = pixels_HW3.astype(np.int16)
    limit = tolerance * 255

    def window(i: int) -> np.ndarray:
        r, c = divmod(int(i), gw)
        return px[r * stride : r * stride + size, c * stride : c * stride + size]

    near = {i: [j for j in ([i - 1] if i % gw else []) + ([i - gw] if i >= gw else [])
                if np.abs(window(i) - window(j)).max() <= limit] for i in range(gh * gw)}
    if not any(near.values()):
        return None
    keep = np.ones(gh * gw, dtype=bool)
    rep = np.arange(gh * gw)
    for i in range(gh * gw):
        for j in near[i]:
            if np.abs(window(i) - window(rep[j])).max() <= limit:
                keep[i], rep[i] = False, rep[j]
                break
    return torch.from_numpy(np.flatnonzero(keep))


def check(pixels: np.ndarray, stride: int, size: int, tolerances) -> None:
    grid = ((pixels.shape[0] - size) // stride + 1, (pixels.shape[1] - size) // stride + 1)
    for tol in tolerances:
        got, want = kept_cells(pixels, grid, stride, size, tol), loop_reference(pixels, grid, stride, size, tol)
        assert (got is None and want is None) or torch.equal(got, want), (pixels.shape, stride, size, tol)


def test_equal_to_the_loop_on_random_images():
    """Few grey levels 2 apart: runs of near-equal cells whose representatives drift apart."""
    rng = np.random.default_rng(0)
    for case in range(80):
        gh, gw = (int(v) for v in rng.integers(1, 10, 2))
        stride, size = [(1, 1), (2, 2), (3, 3), (2, 3), (3, 5)][case % 5]
        a = (rng.integers(0, 4, ((gh - 1) * stride + size, (gw - 1) * stride + size, 3)) * 2).astype(np.uint8)
        check(a, stride, size, (1 / 255, 2 / 255, 3 / 255, 4 / 255, 6 / 255))


def page(rng: random.Random, w: int, h: int) -> Image.Image:
    im = Image.new("RGB", (w, h), (250, 250, 248))
    d = ImageDraw.Draw(im)
    for y in range(20, h - 20, 14):
        d.text((20 + rng.randint(0, 30), y), " ".join("lorem"[: rng.randint(2, 5)] for _ in range(rng.randint(3, 9))),
               fill=(rng.randint(0, 40),) * 3)
    return im


def test_equal_to_the_loop_on_real_images():
    rng = random.Random(1)
    images = [page(rng, 336, 224)]
    for _ in range(3):
        data, _ = encode(draw_scene(rng)[0], rng, jpeg_share=1.0)  # JPEG: near-equal, not equal, backgrounds
        images.append(Image.open(io.BytesIO(data)).convert("RGB").resize((224, 168)))
    for im in images:
        a = np.asarray(im)
        for stride, size in ((14, 14), (32, 32), (8, 14)):
            check(a, stride, size, (0.01, 0.02, 0.05))

"""Host <-> device staging of one step: pinned slots, emissions, and query grouping by image.

A step's inputs arrive through its slot's pinned staging buffer (one H2D copy per dtype) and
its emissions leave through its slot's pinned output buffer (one D2H copy on the copy stream).
Two slots ping-pong: a slot is reused only after its previous step was collected, so the host
never overwrites memory a DMA still reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass
from typing import TypeVar

import numpy as np
import torch

from .plan import StepPlan


T = TypeVar("T")
ARRAY, TUPLE, NESTED = 0, 1, 2  # a field of a step's inputs: an array, a tuple of arrays, a dataclass of them
_KINDS: dict[type, list[tuple[str, int]]] = {}


def _kinds(obj) -> list[tuple[str, int]]:
    """(name, kind) of each field of a dataclass of arrays, read off its type's first instance (a
    field's kind is its type's, never its value's): upload runs every step, so this runs once."""
    kinds = _KINDS.get(type(obj))
    if kinds is None:
        kinds = _KINDS[type(obj)] = [
            (f.name, NESTED if is_dataclass(v := getattr(obj, f.name)) else TUPLE if isinstance(v, tuple) else ARRAY)
            for f in fields(obj)]
    return kinds


def _leaves(obj, out: list[np.ndarray]) -> list[np.ndarray]:
    for name, kind in _kinds(obj):
        v = getattr(obj, name)
        if kind == ARRAY:
            out.append(v)
        elif kind == TUPLE:
            out.extend(v)
        else:
            _leaves(v, out)
    return out


def _rebuild(obj: T, values: Iterator) -> T:
    """`obj` with its arrays replaced, in `_leaves` order, by the next of `values`."""
    args = []
    for name, kind in _kinds(obj):
        v = getattr(obj, name)
        args.append(next(values) if kind == ARRAY else tuple(next(values) for _ in v) if kind == TUPLE
                    else _rebuild(v, values))
    return type(obj)(*args)


class Staging:
    """Pinned staging for one in-flight step (inputs up, emissions down)."""

    def __init__(self, device: torch.device, capacity: int, n_rows: int):
        self.pinned = device.type == "cuda"
        self.ints = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
        self.floats = torch.empty(capacity, dtype=torch.float32, pin_memory=self.pinned)
        # Emissions: flat buffers, so the first n rows' views are contiguous (a strided
        # device-to-host copy would stage through pageable memory and block the host).
        self.out_ints = torch.empty(3 * n_rows, dtype=torch.int64, pin_memory=self.pinned)
        self.out_floats = torch.empty(2 * n_rows, dtype=torch.float32, pin_memory=self.pinned)
        # Token masks of constrained rows (StepPlan.masks), grown on first use: jobs without
        # constrained sequences never allocate them.
        self.mask_ints = torch.empty(0, dtype=torch.int64, pin_memory=self.pinned)
        self.mask_words = torch.empty(0, dtype=torch.int32, pin_memory=self.pinned)
        self.done: torch.cuda.Event | None = None

    def out_views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous [3, n] int and [n, 2] float views of the emission buffers."""
        return self.out_ints[: 3 * n].view(3, n), self.out_floats[: 2 * n].view(n, 2)

    def upload(self, inputs: T, device: torch.device, stream) -> T:
        """Pack a dataclass of int64 / float32 arrays (nested dataclasses and tuples of arrays
        included) into the slot's pinned buffers, copy up once per dtype, return the same
        dataclass of device views."""
        arrays = _leaves(inputs, [])
        is_float = [a.dtype == np.float32 for a in arrays]
        up_i = iter(self._up([a for a, f in zip(arrays, is_float) if not f], "ints", device, stream))
        up_f = iter(self._up([a for a, f in zip(arrays, is_float) if f], "floats", device, stream))
        return _rebuild(inputs, iter([next(up_f) if f else next(up_i) for f in is_float]))

    def upload_masks(self, rows_M: np.ndarray, words_MW: np.ndarray, device: torch.device, stream
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's mask rows and int32 mask words, through their own pinned buffers (the step's
        other inputs hold `ints`)."""
        return self._up([rows_M], "mask_ints", device, stream)[0], self._up([words_MW], "mask_words", device, stream)[0]

    def _up(self, arrays: list[np.ndarray], name: str, device: torch.device, stream) -> list[torch.Tensor]:
        total = sum(a.size for a in arrays)
        buf = getattr(self, name)
        if total > buf.numel():
            # Grow (rare: a bigger step than any before). A copy still reading the old buffer keeps
            # it alive: the pinned allocator frees a block only after its recorded copies finish.
            buf = torch.empty(max(total, 2 * buf.numel()), dtype=buf.dtype, pin_memory=self.pinned)
            setattr(self, name, buf)
        if total:
            np.concatenate([a.reshape(-1) for a in arrays], out=buf.numpy()[:total])
        if device.type == "cpu":
            flat = buf[:total].clone()
        else:
            with torch.cuda.stream(stream):
                flat = buf[:total].to(device, non_blocking=True)
        out, at = [], 0
        for a in arrays:
            out.append(flat[at : at + a.size].view(a.shape))
            at += a.size
        return out


@dataclass
class InFlight:
    plan: StepPlan
    slot: Staging
    oom_rows: int = 0  # rows of the step when it ran out of memory (and ran in parts)


def rows_by_image(image_of_row: np.ndarray, q_rows: np.ndarray, n_images: int, pad: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Group a [B, T] block of query rows (pads == pad) by image, keeping their order.
    -> ([n_images, M] rows of each image's queries, [B, T] slot of each query in [n_images * M])."""
    valid = q_rows != pad
    image = np.broadcast_to(image_of_row[:, None], q_rows.shape)[valid]  # row-major order
    counts = np.bincount(image, minlength=n_images)
    M = int(counts.max()) if image.size else 0
    order = np.argsort(image, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - (np.cumsum(counts) - counts)[image[order]]
    rows = np.full((n_images, M), pad, dtype=np.int64)
    rows[image, rank] = q_rows[valid]
    slots = np.full(q_rows.shape, n_images * M, dtype=np.int64)
    slots[valid] = image * M + rank
    return rows, slots

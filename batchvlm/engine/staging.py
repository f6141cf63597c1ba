"""Host <-> device staging of one step: pinned slots, emissions, and query grouping by image.

A step's inputs are written by the host straight into its slot's preallocated pinned buffers
(int64 and float32; no per-step arrays packed afterwards) and go up in one non-blocking copy
per buffer: an eager step's through `write` / `upload` (device views of the copy), a graph
step's through `views` / `send` (a buffer of its own, straight into the graph's static inputs,
graphs.py). Its
emissions leave through the slot's pinned output buffer (one D2H copy on the copy stream).
Two slots ping-pong: a slot is reused only after its previous step was collected (its copy-stream
event `done`, recorded after the step, has been waited on), so the host never overwrites memory
a DMA still reads. On CPU the same code runs, unpinned, with synchronous copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def _map(obj: T, fn: Callable) -> T:
    """`obj` with each of its arrays (nested dataclasses and tuples included) replaced by fn(array)."""
    args = []
    for name, kind in _kinds(obj):
        v = getattr(obj, name)
        args.append(fn(v) if kind == ARRAY else tuple(fn(a) for a in v) if kind == TUPLE else _map(v, fn))
    return type(obj)(*args)


def carve(flat, shapes: list[tuple[int, ...]]) -> list:
    """Consecutive views of a flat buffer (numpy or torch), one per shape, from its start."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[at : at + n].reshape(shape))
        at += n
    return out


class SlotFull(Exception):
    """A step's inputs outgrew the slot's buffer of this dtype (Staging.write grows it and rebuilds)."""


class SlotWriter:
    """One step's host inputs, allocated in order in a slot's staging buffers (int64, float32): the
    host writes each array in place and `Staging.upload` copies each buffer's used part once. Every
    array a dataclass to upload holds must come from here (`empty`, `full`, `put`)."""

    def __init__(self, ints: np.ndarray, floats: np.ndarray):
        self.bufs = {np.int64: ints, np.float32: floats}
        self.used = {np.int64: 0, np.float32: 0}
        self.arrays: dict[type, list[np.ndarray]] = {np.int64: [], np.float32: []}  # each buffer's, in order

    def empty(self, shape: int | tuple[int, ...], dtype: type = np.int64) -> np.ndarray:
        shape = (shape,) if isinstance(shape, int) else shape
        n, at, buf = math.prod(shape), self.used[dtype], self.bufs[dtype]
        if at + n > buf.size:
            raise SlotFull(dtype)
        a = buf[at : at + n].reshape(shape)
        self.used[dtype] = at + n
        self.arrays[dtype].append(a)
        return a

    def full(self, shape: int | tuple[int, ...], fill, dtype: type = np.int64) -> np.ndarray:
        a = self.empty(shape, dtype)
        a.fill(fill)
        return a

    def put(self, values: np.ndarray) -> np.ndarray:
        """float32 or integer values (a slot holds nothing else: a float64 would be cut to int64)."""
        if values.dtype.kind not in "iub" and values.dtype != np.float32:
            raise TypeError(f"staging takes float32 or integer inputs, not {values.dtype}")
        a = self.empty(values.shape, np.float32 if values.dtype == np.float32 else np.int64)
        a[...] = values
        return a


class Staging:
    """Pinned staging for one in-flight step (inputs up, emissions down)."""

    def __init__(self, device: torch.device, capacity: int, n_rows: int):
        self.pinned = device.type == "cuda"
        self.ints = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
        self.floats = torch.empty(capacity, dtype=torch.float32, pin_memory=self.pinned)
        self._writer: SlotWriter | None = None  # the last `write`
        # A graph step's inputs (`views` / `send`): a buffer of their own, so that a step that runs
        # both an eager forward and a graph (runner.py `_split`) never overwrites the eager part's
        # inputs before their copy ran.
        self.graph_ints = torch.empty(0, dtype=torch.int64, pin_memory=self.pinned)
        self._views: dict[tuple, list[np.ndarray]] = {}  # `views` by layout, into the current `graph_ints`
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

    def write(self, build: Callable[[SlotWriter], T]) -> T:
        """build(writer): a step's host inputs written in place in this slot's buffers (its result
        returned). A step larger than any before grows the full buffer and builds again (rare)."""
        while True:
            w = SlotWriter(self.ints.numpy(), self.floats.numpy())
            try:
                out = build(w)
            except SlotFull as full:
                name = "ints" if full.args[0] is np.int64 else "floats"
                self._grow(name, 2 * getattr(self, name).numel())
                continue
            self._writer = w
            return out

    def upload(self, inputs: T, device: torch.device, stream) -> T:
        """The dataclass of arrays the last `write` built (nested dataclasses and tuples of arrays
        included), as device views: one copy per buffer (int64, float32) of its used part."""
        w = self._writer
        on_device = {}
        for dtype, buf in ((np.int64, self.ints), (np.float32, self.floats)):
            arrays = w.arrays[dtype]
            flat = self._copy(buf, w.used[dtype], device, stream)
            for a, part in zip(arrays, flat.split([a.size for a in arrays])):  # consecutive: one split
                on_device[id(a)] = part if a.ndim == 1 else part.view(a.shape)
        return _map(inputs, lambda a: on_device[id(a)])

    def views(self, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        """Host views of the graph buffer's start, one per shape (the same arrays each call until
        the buffer grows): a step written straight into them goes up with `send`."""
        key = tuple(shapes)
        views = self._views.get(key)
        if views is None:
            self._grow("graph_ints", sum(math.prod(s) for s in shapes))
            views = self._views[key] = carve(self.graph_ints.numpy(), shapes)
        return views

    def send(self, target: torch.Tensor, stream) -> None:
        """Copy the graph buffer's first target.numel() values (written through `views`) into
        target, a flat device buffer: one copy, asynchronous on CUDA (on `stream`)."""
        n = target.numel()
        if target.device.type == "cpu":
            target.copy_(self.graph_ints[:n])
        else:
            with torch.cuda.stream(stream):
                target.copy_(self.graph_ints[:n], non_blocking=True)

    def upload_masks(self, rows_M: np.ndarray, words_MW: np.ndarray, device: torch.device, stream
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's mask rows and int32 mask words, through their own pinned buffers (the step's
        other inputs hold `ints`)."""
        return self._up(rows_M, "mask_ints", device, stream), self._up(words_MW, "mask_words", device, stream)

    def _up(self, a: np.ndarray, name: str, device: torch.device, stream) -> torch.Tensor:
        self._grow(name, a.size)
        buf = getattr(self, name)
        buf.numpy()[: a.size] = a.reshape(-1)
        return self._copy(buf, a.size, device, stream).view(a.shape)

    def _grow(self, name: str, total: int) -> None:
        """At least `total` values in buffer `name`. A copy still reading the old buffer keeps it
        alive: the pinned allocator frees a block only after its recorded copies finish."""
        buf = getattr(self, name)
        if total > buf.numel():
            setattr(self, name, torch.empty(max(total, 2 * buf.numel()), dtype=buf.dtype, pin_memory=self.pinned))
            if name == "graph_ints":
                self._views.clear()

    @staticmethod
    def _copy(buf: torch.Tensor, n: int, device: torch.device, stream) -> torch.Tensor:
        if device.type == "cpu":
            return buf[:n].clone()
        with torch.cuda.stream(stream):
            return buf[:n].to(device, non_blocking=True)


@dataclass
class InFlight:
    plan: StepPlan
    slot: Staging
    oom_rows: int = 0  # rows of the step when it ran out of memory (and ran in parts)


def image_ranks(image: np.ndarray, n_images: int) -> tuple[np.ndarray, int]:
    """-> (each query's rank among its image's queries, in order; the most queries of one image)."""
    counts = np.bincount(image, minlength=n_images)
    order = np.argsort(image, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - (np.cumsum(counts) - counts)[image[order]]
    return rank, int(counts.max()) if image.size else 0


def rows_by_image(image_of_row: np.ndarray, q_rows: np.ndarray, n_images: int, pad: int,
                  w: SlotWriter | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Group a [B, T] block of query rows (pads == pad) by image, keeping their order.
    -> ([n_images, M] rows of each image's queries, [B, T] slot of each query in [n_images * M]),
    in the slot writer's buffer when one is given."""
    full = np.full if w is None else (lambda shape, fill, dtype: w.full(shape, fill))
    valid = q_rows != pad
    image = np.broadcast_to(image_of_row[:, None], q_rows.shape)[valid]  # row-major order
    rank, M = image_ranks(image, n_images)
    rows = full((n_images, M), pad, dtype=np.int64)
    rows[image, rank] = q_rows[valid]
    slots = full(q_rows.shape, n_images * M, dtype=np.int64)
    slots[valid] = image * M + rank
    return rows, slots

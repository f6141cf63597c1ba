"""The vision stage: images encoded into feature slots, ahead of the steps that prefill them.

The scheduler hands out the slots and frees them (scheduler.py); this is their device half: each
slot's features and the mark of the vision batch that wrote them, until the step that prefills
the slot is collected. On CUDA each batch runs on the vision stream with its own event, so a
prefill waits for its own images only, never for a newer batch still encoding.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..models.base.contract import EngineModel, Prepared


class HostEvent:
    """A vision batch's mark on CPU, where encoding has finished when `encode` returns: nothing
    to wait for, but the per-batch bookkeeping is the same as CUDA's."""


class VisionStage:
    def __init__(self, model: EngineModel, n_feature_slots: int):
        self.model = model
        self.device = model.device
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.features: list[Any] = [None] * n_feature_slots
        self.events: list[torch.cuda.Event | HostEvent | None] = [None] * n_feature_slots

    @torch.inference_mode()
    def encode(self, images: list[Prepared], slots: list[int]) -> None:
        """Encode images into feature slots. On CUDA this runs on its own stream, overlapping
        decode steps; a step that prefills these images waits for this batch's event."""
        if self.stream is None:
            event, feats = HostEvent(), self._encode_fitting(images)
        else:
            event = torch.cuda.Event()
            with torch.cuda.stream(self.stream):
                feats = self._encode_fitting(images)
                event.record(self.stream)
        for slot, f in zip(slots, feats):
            self.features[slot], self.events[slot] = f, event

    def _encode_fitting(self, images: list[Prepared]) -> list[Any]:
        """The vision batch; on out-of-memory, its two halves, recursively (rare: the warm-up
        measured a maximal batch, but other allocations may have grown since)."""
        try:
            return self.model.encode(images)
        except torch.OutOfMemoryError:
            if len(images) < 2:
                raise
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(images) // 2
        return self._encode_fitting(images[:half]) + self._encode_fitting(images[half:])

    def waits(self, slots: np.ndarray) -> list[torch.cuda.Event | HostEvent]:
        """The events of the vision batches holding these slots, each once."""
        events = {id(e): e for e in (self.events[s] for s in slots.tolist()) if e is not None}
        return list(events.values())

    def read(self, slots: np.ndarray) -> list[Any]:
        return [self.features[s] for s in slots.tolist()]

    def spent(self, slots: np.ndarray) -> None:
        """The step that prefills these slots has run: their features are no longer needed."""
        for s in slots.tolist():
            self.features[s] = self.events[s] = None

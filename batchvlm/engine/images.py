"""The image-level output path: an encoder-only model's labels from batched vision forwards, no
sequences and no decode (an encoder is not a decode loop with zero tokens).

Samples arrive from the loader (decoded and preprocessed in its worker processes) and wait in
buckets of equal padded length (models/base/contract.py ImageModel.bucket: a NaFlex image's patch
count rounded up; one bucket at a fixed resolution). A full bucket runs as one batch; so does the
bucket of the oldest waiting sample once `max_batch_size` * 2 samples wait, so no image waits
unboundedly for rare sizes. One batch is in flight while the next is gathered and launched: on
CUDA the host's work (and the loader and writer, in other processes and threads) hides behind the
device's; on CPU a launch computes the batch, and collecting it is free.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..job import EngineSpec
from ..models.base.contract import ImageModel, SampleT, TaskSequence
from ..models.base.decoding import RawOutput


class ImageLabeler:
    def __init__(self, model: ImageModel, seqs: list[TaskSequence], settings: EngineSpec):
        self.model = model
        model.start(seqs)
        self.batch = settings.batch_size_for(model.device.type)  # a batch's most images (an OOM lowers it)
        self.buckets: dict[int, list[Any]] = {}
        self.waiting = 0
        self.stats = {"batches": 0, "images": 0}

    def summary(self) -> str:
        s = self.stats
        return f"{s['batches']} image batches of at most {self.batch}, {s['images']} images"

    def label(self, samples: Iterable[SampleT]) -> Iterator[tuple[SampleT, list[RawOutput]]]:
        inflight: list[tuple[list[Any], Any]] = []  # the batch launched last (in parts, after an OOM)
        for sample in samples:
            ready = self._add(sample)
            if ready is None:
                continue
            launched = self._launch(*ready)
            yield from self._collect(inflight)
            inflight = launched
        for length in sorted(self.buckets):  # the end of the input: every bucket, partial or not
            launched = self._launch(length, self.buckets[length])
            yield from self._collect(inflight)
            inflight = launched
        self.buckets.clear()
        yield from self._collect(inflight)

    def _add(self, sample: Any) -> tuple[int, list[Any]] | None:
        """Queue a sample; -> a batch to run (bucket length, samples), or None."""
        length = self.model.bucket(sample.prepared)
        bucket = self.buckets.setdefault(length, [])
        bucket.append(sample)
        self.waiting += 1
        if len(bucket) < self.batch and self.waiting < 2 * self.batch:
            return None
        if len(bucket) < self.batch:
            # Too many wait: the bucket of the oldest sample runs, partial. Buckets leave whole, so
            # the oldest bucket still there (dicts keep insertion order) holds the oldest sample.
            length = next(iter(self.buckets))
        ready = self.buckets.pop(length)
        self.waiting -= len(ready)
        return length, ready

    def _launch(self, length: int, samples: list[Any]) -> list[tuple[list[Any], Any]]:
        """Run a batch, in chunks of the batch size (a bucket can have filled before an OOM lowered
        it); out of accelerator memory, its halves (recursively), and later batches take at most
        half as many images."""
        if len(samples) > self.batch:
            return self._launch(length, samples[: self.batch]) + self._launch(length, samples[self.batch:])
        try:
            handle = self.model.run(samples, length)
        except torch.OutOfMemoryError:
            if len(samples) < 2:
                raise
            if self.model.device.type == "cuda":
                torch.cuda.empty_cache()
            half = len(samples) // 2
            self.batch = max(1, min(self.batch, half))
            self.stats["oom_halvings"] = self.stats.get("oom_halvings", 0) + 1
            return self._launch(length, samples[:half]) + self._launch(length, samples[half:])
        for s in samples:
            s.prepared = None  # the pixels are on the device: nothing keeps them alive
        self.stats["batches"] += 1
        self.stats["images"] += len(samples)
        return [(samples, handle)]

    def _collect(self, inflight: list[tuple[list[Any], Any]]) -> Iterator[tuple[Any, list[RawOutput]]]:
        for samples, handle in inflight:
            yield from zip(samples, self.model.collect(handle))

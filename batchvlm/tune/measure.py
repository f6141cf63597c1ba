"""Label the drawn sample at every setting in one process, the weights loaded once.

Each setting gets its own host side (its preprocessing: resize, crops, pruning) and its own
engine on the one loaded module tree. Images are preprocessed before the clock starts (a run
does that in loader workers, beside the device); images/s is the labelling alone: vision,
prefill and decoding, the same engine a run drives, measured back to back in this process.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..data.loader import prepare
from ..data.sources import Encoded
from ..engine.engine import EngineLabeler
from ..job import Job
from ..models.base.budget import Budget
from ..models.registry import open_family
from .agreement import Agreement
from .settings import FULL, Setting


@dataclass
class Measured:
    setting: Setting
    images: int  # labelled (preprocessing errors left out)
    prefix_tokens: float  # mean image-prefix tokens (KV slots: the image tokens and the template tokens around them)
    vision_cost: float  # mean vision work per image (Prepared.cost: crops, or patches / 1024)
    seconds: float
    agreement: dict[str, dict[str, Any]]

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting.name, "value": self.setting.value, "prune": self.setting.prune,
                "images": self.images, "prefix_tokens": round(self.prefix_tokens, 1),
                "vision_cost": round(self.vision_cost, 2), "seconds": round(self.seconds, 3),
                "images_per_s": round(self.images_per_s, 2), "agreement": self.agreement}


def check_settings(job: Job, settings: list[Setting], budget: Budget | None) -> None:
    """Each setting's host side opened and its sequences built: what a setting cannot run is
    refused here, before any image is read or weight loaded."""
    for s in settings:
        open_family(s.spec(job.model, budget), weights=False).sequences(job.tasks, job.engine, job.output.constrain)


def measure(job: Job, settings: list[Setting], images: list[Encoded], log: Callable[[str], None]) -> list[Measured]:
    """-> one Measured per setting, in order; settings[0] is the full budget (the reference)."""
    base = open_family(FULL.spec(job.model, None))
    budget = base.budget()
    loaded = base.load(job.model.dtype, job.model.device)
    reference: dict[int, dict[str, Any] | None] = {}
    out = []
    for s in settings:
        family = open_family(s.spec(job.model, budget))
        model = loaded if s == FULL else family.device_side(loaded.model, loaded.info)
        seqs = family.sequences(job.tasks, job.engine, job.output.constrain)
        pre = family.preprocessor()
        samples = [prepare(enc, pre, job.loader, 0, i) for i, enc in enumerate(images)]
        good = [x for x in samples if x.error is None]
        tokens = sum(x.prepared.prefix_len for x in good) / max(1, len(good))
        cost = sum(x.prepared.cost for x in good) / max(1, len(good))
        labeler = EngineLabeler(model, seqs, job.engine, family.max_prefix_len(), log)
        rows: dict[int, dict[str, Any] | None] = {x.index: None for x in samples}
        sync(loaded.device)
        t0 = time.perf_counter()
        for sample, raws in labeler.label(good):
            rows[sample.index] = family.columns(job.tasks, seqs, raws, sample.seen)
        sync(loaded.device)
        seconds = time.perf_counter() - t0
        del labeler
        free(loaded.device)
        if s == FULL:
            reference = rows
        agreement = Agreement(job.tasks)
        for i, ref in reference.items():
            agreement.add(ref, rows[i])
        out.append(Measured(s, len(good), tokens, cost, seconds, agreement.table()))
        log(f"batchvlm: tune: {s.name}: {len(good)} images in {seconds:.1f} s")
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """The last engine's cache goes before the next allocates its own."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()



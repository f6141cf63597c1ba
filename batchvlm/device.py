"""The device a worker runs on, and the job settings that depend on it.

`model.device: auto` becomes this rank's GPU (or the CPU), and `model.dtype: auto` the
device's precision, before anything compares settings: a folder labelled in float32 on a CPU
and resumed in bfloat16 on a GPU would mix precisions under one fingerprint otherwise.
"""

from __future__ import annotations

from .dist import Rank
from .job import Job
from .models.hub import resolve_device, resolve_dtype


def for_device(job: Job, rank: Rank) -> Job:
    """The job with a concrete `model.device` and `model.dtype`; raises ModelLoadError for a
    device this machine does not have."""
    import torch

    device = job.model.device
    if device == "auto" and torch.cuda.is_available():  # each local process takes its own GPU
        device = f"cuda:{rank.local % torch.cuda.device_count()}"
    dev = resolve_device(device)
    dtype = str(resolve_dtype(job.model.dtype, dev)).removeprefix("torch.")
    return job.model_copy(update={"model": job.model.model_copy(update={"device": str(dev), "dtype": dtype})})

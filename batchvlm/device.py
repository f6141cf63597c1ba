"""The device a worker runs on, and the job settings that depend on it.

`model.device: auto` becomes this rank's GPU (or the CPU), and `model.dtype: auto` the
device's precision, before anything compares settings: a folder labelled in float32 on a CPU
and resumed in bfloat16 on a GPU would mix precisions under one fingerprint otherwise.
"""

from __future__ import annotations

from .dist import Rank
from .job import EngineSpec, Job, JobError
from .models.base.hub import resolve_device, resolve_dtype

CUDA_BLOCK_SIZES = (16, 32, 64, 128)  # KV block sizes whose tiles the Triton attention kernels divide


def check_block_size(engine: EngineSpec, device_type: str) -> None:
    """On CUDA the paged mask's KV block is the cache block: flex_attention's Triton kernels need
    a tile (BLOCK_N, 16 at least) that divides it (attention/fused.py)."""
    if device_type == "cuda" and engine.block_size not in CUDA_BLOCK_SIZES:
        raise JobError(f"engine.block_size: {engine.block_size} on CUDA; use one of "
                       f"{', '.join(map(str, CUDA_BLOCK_SIZES))} (the attention kernels' tiles must divide it)")


def exact_float32(device_type: str, dtype: str) -> None:
    """Labels in float32 are exact by contract (the CPU's arithmetic, up to summation order). On
    CUDA, torch runs float32 convolutions in TF32 by default (cudnn.allow_tf32; matmuls' default
    is off): a float32 job turns both off for its process. Other precisions leave them alone."""
    import torch

    if device_type == "cuda" and dtype == "float32":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


def for_device(job: Job, rank: Rank) -> Job:
    """The job with a concrete `model.device` and `model.dtype`, and this process's float32
    arithmetic set for it (`exact_float32`); raises ModelLoadError for a device this machine
    does not have."""
    import torch

    device = job.model.device
    if device == "auto" and torch.cuda.is_available():  # each local process takes its own GPU
        device = f"cuda:{rank.local % torch.cuda.device_count()}"
    dev = resolve_device(device)
    check_block_size(job.engine, dev.type)
    dtype = str(resolve_dtype(job.model.dtype, dev)).removeprefix("torch.")
    exact_float32(dev.type, dtype)
    return job.model_copy(update={"model": job.model.model_copy(update={"device": str(dev), "dtype": dtype})})

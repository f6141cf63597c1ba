"""The device a job runs on sets the process's float32 arithmetic (device.py `exact_float32`):
a float32 job on CUDA runs no TF32 convolution or matmul (labels in float32 are exact by
contract); other precisions and the CPU leave torch's defaults alone."""

import pytest
import torch
from support.inputs import write_job

import batchvlm.device as device_mod
from batchvlm.dist import Rank
from batchvlm.job import load_job


@pytest.mark.parametrize("device, dtype, tf32", [("cuda:0", "float32", False), ("cuda:0", "bfloat16", True),
                                                 ("cpu", "float32", True)])
def test_a_float32_job_on_cuda_turns_tf32_off(tmp_path, monkeypatch, device, dtype, tf32):
    monkeypatch.setattr(device_mod, "resolve_device", torch.device)  # a CUDA device without one
    job = load_job(write_job(tmp_path / "job.yaml", "data/*.tar", model={"device": device, "dtype": dtype}))
    backends = torch.backends.cudnn, torch.backends.cuda.matmul
    before = [b.allow_tf32 for b in backends]
    try:
        for b in backends:
            b.allow_tf32 = True  # cuDNN's default; set for matmuls too, to see it turned off
        assert device_mod.for_device(job, Rank(0, 1, 0)).model.dtype == dtype
        assert [b.allow_tf32 for b in backends] == [tf32, tf32]
    finally:
        for b, was in zip(backends, before):
            b.allow_tf32 = was

"""How many image-prefix tokens an admission step prefills on CUDA (the scheduler's budget).

An admission step prefills its images' prefixes, compute-bound (2 FLOPs per weight per token),
in the same forward as the running rows' decode, memory-bound (a decode step reads the weights
and what its rows attend to). The budget lets one admission step's prefill take about as long
as PREFILL_DECODE_STEPS decode steps:

    tokens = N * t_decode / t_token,   t_decode = (W + R) / bandwidth,   t_token = 2 * (W / b) / flops

W: the weights' bytes on the device; R: what a decode step reads besides (the prefix K/V of the
images its rows hold, their own K/V at its longest, recurrent state); b: bytes per weight. With
R = 0 the model drops out: tokens = N * b / 2 * flops / bandwidth, the device's ridge point (an
H200 in bfloat16: 989 TFLOP/s dense / 4.8 TB/s = 206 tokens per decode step). Moondream 2 at 256
rows (W ~3.7 GB, R ~5 GB, issue 37): a decode step ~1.8 ms = ~485 prefill tokens, so N = 8 gives
~3.8k tokens, ~15 ms of prefill.

Why 8: an admission step runs eagerly, ~1,250 kernel launches for Moondream (~15 ms of host time
on CUDA, issue 37; docs/engine.md "Admission steps"): a prefill that lasts as long keeps the device
busy while the host launches it. Larger budgets mean fewer admission steps per image but more
activation memory (the warm-up sizes the cache after the largest step, sizing.py) and longer
waits for the decode rows; smaller ones are host-bound. `engine.prefill_tokens_per_step` sets
it; `scripts/gpu_check.sh` sweeps it (bench_engine.py --prefill-sweep).

Rates are datasheet peaks (dense); both sides are peaks, so it is their ratio that counts. A
device not in the table, and every CPU, keeps PREFILL_TOKENS_PER_STEP (plan.py).
"""

from __future__ import annotations

import torch

from .plan import PREFILL_TOKENS_PER_STEP

PREFILL_DECODE_STEPS = 8
MIN_TOKENS, MAX_TOKENS, ROUND = 1024, 16384, 256
# Device name fragment (first match) -> (bf16 / fp16 dense FLOP/s, float32 FLOP/s without TF32,
# memory bytes/s). Float32 jobs run without TF32 (labels in float32 are exact by contract).
DEVICE_RATES = {
    "H200": (989e12, 67e12, 4.8e12),  # GH200 too (its HBM3e)
    "H100 PCIe": (756e12, 51e12, 2.0e12),
    "H100": (989e12, 67e12, 3.35e12),
    "A100": (312e12, 19.5e12, 2.0e12),
}


def prefill_budget(device_name: str, dtype: torch.dtype, weight_bytes: int, decode_read_bytes: int) -> int:
    """Prefill tokens per admission step on this device (the module docstring)."""
    rates = next((r for name, r in DEVICE_RATES.items() if name in device_name), None)
    if rates is None or weight_bytes <= 0:
        return PREFILL_TOKENS_PER_STEP
    dense, fp32, bandwidth = rates
    flops = fp32 if dtype == torch.float32 else dense
    b = torch.empty(0, dtype=dtype).element_size()
    t_decode = (weight_bytes + decode_read_bytes) / bandwidth
    t_token = 2 * (weight_bytes / b) / flops
    tokens = int(PREFILL_DECODE_STEPS * t_decode / t_token) // ROUND * ROUND
    return min(max(tokens, MIN_TOKENS), MAX_TOKENS)

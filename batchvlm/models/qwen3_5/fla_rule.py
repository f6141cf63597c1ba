"""The gated delta rule on flash-linear-attention's CUDA kernels (the optional `fla` extra), in
delta_rule.py's terms: the same inputs (q, k normalised and repeated to the value heads, q scaled;
float32, heads before time), the same results, computed by Triton kernels:

  chunked_varlen  prefill: `chunk_gated_delta_rule` over the real tokens of a wave of runs, one
                  flat sequence cut by `cu_seqlens` (no padding), initial states by run
  step            decode: `fused_recurrent_gated_delta_rule`, one token per row

`kernels(device)` says whether they run here: CUDA, fla importable and `ENABLED` (tests compare
the two paths by turning it off). Elsewhere linear_attention.py runs delta_rule.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

ENABLED = True


@functools.cache
def _ops() -> tuple[Any, Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # not installed, or it fails to import (a triton it does not know): the torch path
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def kernels(device: torch.device) -> bool:
    return ENABLED and device.type == "cuda" and _ops() is not None


def chunked_varlen(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                   beta_TH: torch.Tensor, state_NHKV: torch.Tensor, cu_seqlens: torch.Tensor,
                   cu_seqlens_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """N runs as one flat sequence of T tokens (time first, no padding), run n at tokens
    cu_seqlens[n] .. cu_seqlens[n + 1] - 1, starting from state_NHKV[n] (not written).
    -> (o [T, H, V], end states [N, H, K, V])."""
    chunk, _ = _ops()
    o, S = chunk(q_THK[None], k_THK[None], v_THV[None], g_TH[None], beta_TH[None], scale=1.0,
                 initial_state=state_NHKV, output_final_state=True, cu_seqlens=cu_seqlens,
                 cu_seqlens_cpu=cu_seqlens_cpu)
    return o[0], S


def step(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor, beta_BH: torch.Tensor,
         state_BHKV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from state_BHKV (not written). -> (o [B, H, V], new states [B, H, K, V])."""
    _, recurrent = _ops()
    o, S = recurrent(q_BHK[:, None], k_BHK[:, None], v_BHV[:, None], g_BH[:, None], beta=beta_BH[:, None],
                     scale=1.0, initial_state=state_BHKV, output_final_state=True)
    return o[:, 0], S

"""The sparse mixture-of-experts MLP of the Qwen MoE text models (`qwen3_vl_moe`, `qwen3_5_moe`).

Per token x [C]: router logits = gate x [E]; softmax in float32; the top_k experts and their
probabilities, renormalised to sum 1 and cast to x's dtype (w [K]); the output is
sum_k w_k * down_e(silu(gate_e x) * up_e x) over the picked experts e, plus (Qwen3.5-MoE) the
shared expert's SwiGLU scaled by sigmoid(shared_expert_gate x).

Expert weights are stacked, as transformers holds them: `experts.gate_up_proj` [E, 2I, C]
(gate rows, then up rows) and `experts.down_proj` [E, C, I] (weights.py reads the checkpoints'
other layouts into them).

Three ways to run the experts, the same sums (`path`, chosen for the device by path_for):
  loop     the reference: per expert, gather its tokens, two matmuls, scatter back. Shapes
           depend on the routing (nonzero): CPU only, where that costs no device sync; used
           where torch has no CPU grouped GEMM (before 2.10).
  grouped  the assignments (token, k) sorted by expert, one grouped GEMM per projection over the
           sorted rows (`grouped_mm` with per-expert end offsets), unsorted and summed over k.
           Every shape is N * K rows: fixed for a step bucket, no host sync, CUDA-graph safe.
           CUDA with bfloat16 on SM90 / SM100 (Hopper, Blackwell datacenter parts: torch's
           CUTLASS kernel; elsewhere torch falls back to a loop over the experts that reads the
           offsets back to the host, a sync per call that also fails inside a CUDA graph
           capture), and CPU where torch has `F.grouped_mm` (2.10+; faster there than the loop,
           and the tests then run the CUDA path's code). Both want 16-byte aligned rows: dim and
           ff_dim multiples of 8 in bfloat16, of 4 in float32 (every released checkpoint's are; a
           model whose are not runs gathered on CUDA, by the loop on the CPU).
  gathered the same sorted rows, each multiplied by its own expert's weights gathered per row
           (a batched matmul) in fixed chunks of rows: fixed shapes, no host sync; the fallback
           where the grouped kernel cannot run (float32, or other GPUs, on CUDA). Memory per chunk:
           CHUNK_ROWS * 3 * I * C weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import MoEConfig, TextConfig
from .mlp import MLP

PATHS = ("loop", "grouped", "gathered")
CHUNK_ROWS = 64  # gathered: assignments per batched matmul


def grouped_mm_available() -> bool:
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _grouped_mm(x_RC: torch.Tensor, w_ECO: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """Rows of group e (offs[e-1]:offs[e]) times w[e]: [R, C] x [E, C, O] -> [R, O]."""
    mm = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return mm(x_RC, w_ECO, offs=offs_E)


def grouped_kernel_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's CUDA grouped GEMM runs as one kernel here (GroupedBlas.cpp's fast path:
    bfloat16 on compute capability 9.0 or 10.x); anything else takes its per-expert fallback."""
    if device.type != "cuda" or dtype != torch.bfloat16 or not grouped_mm_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) == (9, 0) or major == 10


def aligned(model: nn.Module, dtype: torch.dtype) -> bool:
    """grouped_mm's operands need 16-byte aligned rows, on CUDA and on the CPU alike (8 bfloat16, 4
    float32): the width and the expert width of every SparseMoE layer."""
    size = torch.empty((), dtype=dtype).element_size()
    return all(m.experts.gate_up_proj.shape[-1] * size % 16 == 0 and m.experts.ff_dim * size % 16 == 0
               for m in model.modules() if isinstance(m, SparseMoE))


def path_for(model: nn.Module, device: torch.device, dtype: torch.dtype) -> str:
    """The expert path for `model`'s SparseMoE layers on this device and dtype."""
    if device.type != "cuda":
        return "grouped" if hasattr(F, "grouped_mm") and aligned(model, dtype) else "loop"
    return "grouped" if grouped_kernel_on(device, dtype) and aligned(model, dtype) else "gathered"


class Experts(nn.Module):
    def __init__(self, n: int, dim: int, ff_dim: int):
        super().__init__()
        self.ff_dim = ff_dim
        self.gate_up_proj = nn.Parameter(torch.empty(n, 2 * ff_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n, dim, ff_dim))

    def loop(self, x_NC: torch.Tensor, w_NK: torch.Tensor, e_NK: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x_NC)
        for e in range(self.gate_up_proj.shape[0]):
            token, k = torch.nonzero(e_NK == e, as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = F.linear(x_NC[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w_NK[token, k, None]
            out.index_add_(0, token, y)
        return out

    def sorted_rows(self, e_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The N * K assignments ordered by expert (stable: by token within an expert): their
        flat index (token * K + k), and each expert's end offset [E] (int32)."""
        flat = e_NK.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.gate_up_proj.shape[0], dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        return order, counts.cumsum(0, dtype=torch.int32)

    def grouped(self, x_NC: torch.Tensor, w_NK: torch.Tensor, e_NK: torch.Tensor) -> torch.Tensor:
        N, K = e_NK.shape
        order, offs = self.sorted_rows(e_NK)
        x_RC = x_NC[order // K]
        gate, up = _grouped_mm(x_RC, self.gate_up_proj.transpose(1, 2), offs).chunk(2, dim=-1)
        y_RC = _grouped_mm(F.silu(gate) * up, self.down_proj.transpose(1, 2), offs)
        return self._combine(y_RC, order, w_NK)

    def gathered(self, x_NC: torch.Tensor, w_NK: torch.Tensor, e_NK: torch.Tensor) -> torch.Tensor:
        N, K = e_NK.shape
        order, _ = self.sorted_rows(e_NK)
        experts_R = e_NK.flatten()[order]
        x_RC = x_NC[order // K]
        parts = []
        for at in range(0, N * K, CHUNK_ROWS):  # N * K is fixed per step bucket: a fixed number of chunks
            e = experts_R[at : at + CHUNK_ROWS]
            h = torch.bmm(self.gate_up_proj[e], x_RC[at : at + CHUNK_ROWS, :, None])[..., 0]
            gate, up = h.chunk(2, dim=-1)
            parts.append(torch.bmm(self.down_proj[e], (F.silu(gate) * up)[..., None])[..., 0])
        return self._combine(torch.cat(parts), order, w_NK)

    @staticmethod
    def _combine(y_RC: torch.Tensor, order_R: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
        """Back to (token, k) order, weighted, summed over k: [N * K, C] sorted -> [N, C]."""
        N, K = w_NK.shape
        y = torch.empty_like(y_RC).index_copy_(0, order_R, y_RC).view(N, K, -1)
        return (y * w_NK[..., None]).sum(1)


class SparseMoE(nn.Module):
    def __init__(self, dim: int, c: MoEConfig):
        super().__init__()
        self.top_k = c.top_k
        self.path = "loop"  # set for the device by set_path
        self.gate = nn.Linear(dim, c.n_experts, bias=False)
        self.experts = Experts(c.n_experts, dim, c.ff_dim)
        if c.shared_ff_dim:
            self.shared_expert = MLP(dim, c.shared_ff_dim)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def route(self, x_NC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> weights [N, K] (x's dtype, summing to 1 per token), experts [N, K] (long)."""
        probs = F.softmax(self.gate(x_NC), dim=-1, dtype=torch.float32)
        w, e = torch.topk(probs, self.top_k, dim=-1)
        return (w / w.sum(-1, keepdim=True)).to(x_NC.dtype), e

    def forward(self, x_NC: torch.Tensor) -> torch.Tensor:
        w, e = self.route(x_NC)
        out = getattr(self.experts, self.path)(x_NC, w, e)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x_NC)) * self.shared_expert(x_NC)
        return out


def layer_mlp(c: TextConfig, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: sparse where the config has experts for it, else dense."""
    return SparseMoE(c.dim, c.moe) if c.sparse(layer) and c.moe is not None else MLP(c.dim, c.ff_dim)


def set_path(model: nn.Module, path: str) -> None:
    """Every SparseMoE under `model` runs its experts by `path` (one of PATHS)."""
    if path not in PATHS:
        raise ValueError(f"MoE path {path!r} is not one of {PATHS}")
    for m in model.modules():
        if isinstance(m, SparseMoE):
            m.path = path

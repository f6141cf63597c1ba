"""The MoE expert paths' CUDA constraints, checked on CPU (models/qwen_vl/moe.py): which path each
GPU gets, torch's own grouped-GEMM checks (its meta kernel mirrors the CUDA one's: bfloat16, 16-byte
aligned strides) on the grouped path at released checkpoints' shapes, and the grouped path run in
bfloat16 against the float32 loop."""

import pytest
import torch

from batchvlm.models.qwen_vl.config import MoEConfig
from batchvlm.models.qwen_vl.moe import SparseMoE, grouped_mm_available, path_for

pytestmark = pytest.mark.skipif(not grouped_mm_available(), reason="torch without grouped_mm")


def moe(dim: int, experts: int, top_k: int, ff: int, device: str = "cpu") -> SparseMoE:
    with torch.device(device):
        return SparseMoE(dim, MoEConfig(experts, top_k, ff, 0, ()))


@pytest.mark.parametrize("capability,ff,path", [((9, 0), 768, "grouped"), ((10, 0), 768, "grouped"),
                                                ((8, 0), 768, "gathered"), ((8, 9), 768, "gathered"),
                                                ((12, 0), 768, "gathered"), ((9, 0), 20, "gathered")])
def test_cuda_gets_the_grouped_kernel_only_where_torch_has_it(monkeypatch, capability, ff, path):
    """Elsewhere torch's grouped_mm loops over the experts reading the offsets on the host: a sync
    per call, and an error inside a CUDA graph capture. Misaligned widths (ff 20) would fail its
    stride check."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    m = moe(64, 4, 2, ff, "meta")
    assert path_for(m, torch.device("cuda"), torch.bfloat16) == path
    assert path_for(m, torch.device("cuda"), torch.float32) == "gathered"


@pytest.mark.parametrize("dim,experts,top_k,ff", [(2048, 128, 8, 768), (2048, 256, 8, 512), (64, 4, 2, 24)])
def test_grouped_path_passes_the_cuda_kernel_checks_in_bfloat16(dim, experts, top_k, ff):
    """Qwen3-VL-30B-A3B, Qwen3.5-35B-A3B and the test checkpoints' MoE shapes, on the meta device."""
    m = moe(dim, experts, top_k, ff, "meta").to(torch.bfloat16)
    m.path = "grouped"
    x = torch.empty(37, dim, device="meta", dtype=torch.bfloat16)
    assert m(x).shape == (37, dim)


@pytest.mark.parametrize("ff,dtype,error", [(20, torch.bfloat16, "16 bytes"), (24, torch.float32, "BF16")])
def test_the_meta_check_refuses_what_cuda_would(ff, dtype, error):
    m = moe(64, 4, 2, ff, "meta").to(dtype)
    m.path = "grouped"
    with pytest.raises(RuntimeError, match=error):
        m(torch.empty(5, 64, device="meta", dtype=dtype))


def test_grouped_path_in_bfloat16_equals_the_loop():
    torch.manual_seed(0)
    m = moe(64, 6, 2, 24)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    x = torch.randn(50, 64)
    with torch.inference_mode():
        m.path = "loop"
        expected = m(x)
        m.to(torch.bfloat16).path = "grouped"
        got = m(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("dim,ff,dtype,path", [(64, 24, torch.float32, "grouped"), (66, 24, torch.float32, "loop"),
                                               (64, 22, torch.float32, "loop"), (64, 20, torch.bfloat16, "loop"),
                                               (64, 24, torch.bfloat16, "grouped")])
def test_the_cpu_checks_alignment_as_cuda_does(dim, ff, dtype, path):
    """torch's CPU grouped_mm wants 16-byte strides too: a width that is no multiple of 4 (float32)
    failed with `strides should be multiple of 16 bytes`; such a model runs the loop, the same sums."""
    torch.manual_seed(0)
    m = moe(dim, 4, 2, ff).to(dtype)
    assert path_for(m, torch.device("cpu"), dtype) == path
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    x = torch.randn(9, dim, dtype=dtype)
    with torch.inference_mode():
        m.path = path
        got = m(x)
        m.path = "loop"
        assert torch.allclose(got.float(), m(x).float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
        if path == "loop":  # what the grouped path does with it
            m.path = "grouped"
            with pytest.raises(RuntimeError, match="16 bytes"):
                m(x)

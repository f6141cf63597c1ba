"""The seam where flash-linear-attention's kernels run Qwen3.5's Gated DeltaNet on CUDA
(models/qwen3_5/fla_rule.py), checked on the CPU with stand-ins of fla's two kernels that take
fla's arguments and layouts (time first, one flat varlen sequence cut by cu_seqlens, states
[N, H, K, V]) and compute them with the torch path (delta_rule.py). What this checks is the
seam's layout work (unpadding, the wave's cu_seqlens, state gathers and writes); the kernels
themselves are checked against the torch path on a GPU (tests/gpu/test_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchvlm.cache.spans import ZERO
from batchvlm.models.qwen3_5 import fla_rule
from batchvlm.models.qwen3_5.delta_rule import chunked, recurrent_step_
from batchvlm.models.qwen3_5.linear_attention import GatedDeltaNet
from batchvlm.models.qwen3_5.linear_state import Segments


def fake_chunk(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu):
    assert q.shape[0] == 1 and scale == 1.0 and output_final_state
    cu = cu_seqlens_cpu.tolist()
    assert cu == cu_seqlens.tolist() and cu[0] == 0 and cu[-1] == q.shape[1] and len(cu) == len(initial_state) + 1
    outs, states = [], []
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        heads_first = [x[0, a:b].transpose(0, 1)[None] for x in (q, k, v, g, beta)]
        o, S = chunked(*heads_first, initial_state[n : n + 1])
        outs.append(o[0].transpose(0, 1))
        states.append(S)
    return torch.cat(outs)[None], torch.cat(states)


def fake_recurrent(q, k, v, g, beta, scale, initial_state, output_final_state):
    assert q.shape[1] == 1 and scale == 1.0 and output_final_state
    S = initial_state.clone()
    return recurrent_step_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S)[:, None], S


def test_fla_seam_equals_the_torch_path(monkeypatch):
    c = SimpleNamespace(dim=32, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8, lin_v_dim=8, conv_kernel=4, rms_eps=1e-6)
    c.conv_dim = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim
    torch.manual_seed(0)
    layer = GatedDeltaNet(c)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    # two runs from zeros (70 tokens: past one chunk, and 5), one run from state 1 into state 2,
    # then decode steps on states 0 and 3
    lengths, reads, writes = [70, 5, 9], [ZERO, ZERO, 1], [0, 1, 2]
    starts = [0, 70, 75]
    steps = torch.tensor([0, 3])
    x = torch.randn(sum(lengths) + len(steps), c.dim)

    def run(kernels: bool):
        monkeypatch.setattr(fla_rule, "kernels", lambda device: kernels)
        g = torch.Generator().manual_seed(1)  # the same starting states for both paths
        conv = torch.randn(4, c.conv_dim, c.conv_kernel - 1, generator=g)
        rec = torch.randn(4, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim, generator=g) * 0.1
        seg = Segments.of(starts, lengths, reads, writes, steps, sum(lengths), x.device)
        with torch.inference_mode():
            return layer(x, seg, conv, rec), conv, rec

    calls: list[str] = []
    counted = lambda f: lambda *a, **kw: (calls.append(f.__name__), f(*a, **kw))[1]  # noqa: E731
    monkeypatch.setattr(fla_rule, "_ops", lambda: (counted(fake_chunk), counted(fake_recurrent)))
    want, got = run(False), run(True)
    assert calls == ["fake_chunk", "fake_chunk", "fake_recurrent"]  # two waves (from zeros, then not), the steps
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)

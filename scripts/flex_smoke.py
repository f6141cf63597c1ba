#!/usr/bin/env python
"""The first thing a GPU runs: the compiled flex_attention kernels at the engine's real shapes,
against the reference attention. Fails loudly (exit 1) on any mismatch or error.

Cases: Moondream 2 (32/32 heads x 64, MHA) in bfloat16 and float32, Qwen3-VL-2B (16/8 x 128),
Qwen3-VL-8B-style GQA (32/8 x 128) and Qwen3.5-2B's full attention (8/2 x 256) in bfloat16; 1, 8,
64 and 128 queries per row (1-64: inductor's decode kernel, 64 x 4 heads needing a 256-query block;
128: the main kernel), KV block 16. Each
case runs its own part (causal, per row) and its shared-prefix part (per image), then one call is
captured in a CUDA graph and replayed on new queries, and must match again. dynamo is reset first
and the fallback is an error (fail_on_recompile_limit_hit): an unfused run cannot pass silently.

    python scripts/flex_smoke.py                 # CUDA, every check
    python scripts/flex_smoke.py --part first    # the cut a first device call runs (FIRST_CALL)
    python scripts/flex_smoke.py --part rest     # every other check (a second call)
    python scripts/flex_smoke.py --small         # CPU, tiny shapes, eager flex: checks the script itself
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from paged_step import paged_step

from batchvlm.attention import KVCache, ReferenceAttention, attend, plan_groups
from batchvlm.attention.fused import FusedAttention

CASES = [  # name, heads, kv heads, head dim, dtype
    ("moondream2", 32, 32, 64, torch.bfloat16),
    ("moondream2", 32, 32, 64, torch.float32),
    ("qwen3vl-2b", 16, 8, 128, torch.bfloat16),
    ("qwen3vl-8b", 32, 8, 128, torch.bfloat16),
    ("qwen3.5-2b", 8, 2, 256, torch.bfloat16),  # its full-attention layers: head dim 256
]
QUERIES = (1, 8, 64, 128)  # per row
# The first device call's cut: the goal model's and the head-dim-256 shapes, one decode (1) and one
# main-kernel (128) query count each.
FIRST_CALL = {("moondream2", torch.bfloat16, 1), ("moondream2", torch.bfloat16, 128),
              ("qwen3.5-2b", torch.bfloat16, 1), ("qwen3.5-2b", torch.bfloat16, 128)}
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 2e-4}


def check(name, H, Hkv, D, dtype, Tq, dev, compile_, small) -> bool:
    images, rows, prefix = (2, 5, 37) if small else (16, 64, 730)
    batch, n_slots, _ = paged_step(images, rows, prefix, own_max=max(Tq, 40), bs=16, device=dev, queries=Tq, seed=Tq)
    g = torch.Generator(device=dev).manual_seed(Tq)
    k, v = (torch.randn(1, n_slots, Hkv, D, generator=g, device=dev, dtype=dtype) for _ in range(2))
    N = batch.write_slots.shape[0]
    q, k_new, v_new = (torch.randn(N, h, D, generator=g, device=dev, dtype=dtype) for h in (H, Hkv, Hkv))
    fused = FusedAttention(compile=compile_)
    caches = {label: KVCache(k.clone(), v.clone(), 16, b) for label, b in (("ref", ReferenceAttention()),
                                                                          ("fused", fused))}

    def run(label):
        c = caches[label]
        return attend(q, k_new, v_new, c.k[0], c.v[0], batch, plan_groups(batch, c))

    t0 = time.perf_counter()
    with torch.inference_mode():
        want, got = run("ref").float(), run("fused").float()
        tol = TOLERANCE[dtype] * max(1.0, want.abs().max().item())
        err = (got - want).abs().max().item()
        ok = err <= tol and bool(torch.isfinite(got).all())
        replay_err = 0.0
        if dev.type == "cuda":  # the same call captured and replayed on new queries
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run("fused")
            q.copy_(torch.randn(q.shape, generator=g, device=dev, dtype=dtype))
            graph.replay()
            torch.cuda.synchronize(dev)
            replay_err = (out.float() - run("ref").float()).abs().max().item()
            ok = ok and replay_err <= tol
    print(f"{'ok ' if ok else 'BAD'} {name:>11} {H}/{Hkv}x{D} {str(dtype)[6:]:>8} {Tq:>3} queries/row: "
          f"max |diff| {err:.1e}, graph replay {replay_err:.1e} (tol {tol:.0e}); "
          f"{fused.compiled_shapes} shapes compiled in {fused.compile_s:.1f} s; {time.perf_counter() - t0:.1f} s",
          flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny shapes, eager flex on CPU")
    ap.add_argument("--part", choices=("all", "first", "rest"), default="all",
                    help="first: the first device call's cut (FIRST_CALL); rest: every other check")
    a = ap.parse_args()
    dev = torch.device("cpu")
    if not a.small:
        assert torch.cuda.is_available(), "flex_smoke: no CUDA device"
        dev = torch.device("cuda", torch.cuda.current_device())  # set_device refuses a device without an index
        print(f"flex_smoke: {torch.cuda.get_device_name(dev)}, capability {torch.cuda.get_device_capability(dev)}, "
              f"torch {torch.__version__}, triton {_triton()}", flush=True)
    torch._dynamo.reset()
    results = []
    for name, H, Hkv, D, dtype, Tq in checks(a.part, a.small):
        try:
            results.append(check(name, H, Hkv, D, dtype, Tq, dev, not a.small, a.small))
        except Exception as e:  # noqa: BLE001 - report every failing case, then fail
            print(f"BAD {name} {H}/{Hkv}x{D} {dtype} {Tq} queries/row: {type(e).__name__}: {str(e)[:400]}",
                  flush=True)
            results.append(False)
    print(f"flex_smoke: {sum(results)}/{len(results)} cases ok")
    return 0 if all(results) else 1


def checks(part: str, small: bool) -> list[tuple]:
    """(name, heads, kv heads, head dim, dtype, queries per row) of the part; small (CPU): the part's
    checks of the first case it holds, and of Qwen3.5's head dim 256 if it holds one."""
    every = [(*case, Tq) for case in CASES for Tq in QUERIES]
    chosen = [c for c in every if part == "all" or ((c[0], c[4], c[5]) in FIRST_CALL) == (part == "first")]
    if small:
        keep = {chosen[0][:5]} | {c[:5] for c in chosen if c[3] == 256}
        chosen = [c for c in chosen if c[:5] in keep]
    return chosen


def _triton() -> str:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return "missing"


if __name__ == "__main__":
    sys.exit(main())

"""Decode-step attention: the reference and the fused backend on the same paged batch, side by side.

One decode step = one query per row, every layer: write the step's K/V, attend the shared image
prefix (once per image) and each row's own tokens, merge. Prints device time per step (compile
time of the fused kernels apart), the ratio, and bytes moved against the minimal K/V read, for
each KV block size given (the decode kernel's KV tile is min(block, 64): 16 at block 16).

On CUDA both paths are timed with CUDA events on a step captured in a CUDA graph (as the engine
replays decode steps), so host launch time is not counted; the fused step eagerly is shown too.
The fused output must equal the reference within a tolerance (bf16 3e-2, fp32 2e-4), else the
script exits 1.

  python scripts/bench_attention.py                    # CUDA: Moondream 2 shapes, bfloat16, blocks 16 and 64
  python scripts/bench_attention.py --images 8 --rows 56 --layers 4 --block-sizes 16   # a CPU-sized shape
  python scripts/bench_attention.py --decode-sweep     # CUDA: the decode kernel's num_stages x num_warps
                                                       # (attention/paged_mask.py DECODE_OPTIONS), each timed

Bytes: "minimal" is every K/V byte the step must read (each image's prefix once, each row's own
tokens), per layer. The reference's "written" is measured: the bytes of every tensor its aten
ops produce (a dispatch-mode count). The fused path's traffic is its kernels' inputs: the K/V
of the visited blocks (the minimum rounded up to whole blocks), queries and outputs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
from paged_step import paged_step
from torch.utils._python_dispatch import TorchDispatchMode

from batchvlm.attention import AttentionBatch, KVCache, ReferenceAttention, attend, plan_groups
from batchvlm.attention import paged_mask
from batchvlm.attention.fused import FusedAttention

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 2e-4}


class BytesWritten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and not func._schema.is_mutable and o._base is None:
                self.bytes += o.numel() * o.element_size()
        return out


def device_time(fn: Callable[[], object], steps: int, dev: torch.device, graph: bool) -> float:
    """Seconds per call: CUDA events around `steps` calls (graph: replays of one captured call)."""
    if dev.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t0) / steps
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def bench(a, dev: torch.device, dtype: torch.dtype, bs: int, compile_: bool) -> bool:
    batch, n_slots, min_tokens = paged_step(a.images, a.rows, a.prefix, a.own_max, bs, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    k, v = (torch.randn(n_slots, a.kv_heads, a.head_dim, generator=g, device=dev, dtype=dtype) for _ in range(2))
    q = torch.randn(a.rows, a.heads, a.head_dim, generator=g, device=dev, dtype=dtype)
    k_new, v_new = k[: a.rows].clone(), v[: a.rows].clone()
    per_token = 2 * a.kv_heads * a.head_dim * dtype.itemsize  # K and V
    minimal = min_tokens * per_token * a.layers
    print(f"block {bs}: minimal K/V read per step {minimal / 1e6:.1f} MB")
    results = {}
    for label, backend in (("reference", ReferenceAttention()), ("fused", FusedAttention(compile=compile_))):
        cache = KVCache(k[None], v[None], bs, backend)

        def step():
            plans = plan_groups(batch, cache)
            for _ in range(a.layers):
                out = attend(q, k_new, v_new, cache.k[0], cache.v[0], batch, plans)
            return out

        with torch.inference_mode():
            t0 = time.perf_counter()
            out = step()  # warm-up (compiles the fused kernels)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            first = time.perf_counter() - t0
            per_step = device_time(step, a.steps, dev, graph=dev.type == "cuda")
            eager = device_time(step, a.steps, dev, graph=False) if label == "fused" and dev.type == "cuda" else None
            written = None
            if label == "reference":
                with BytesWritten() as count:
                    step()
                written = count.bytes
        results[label] = out.float()
        timing = "graph replay, CUDA events" if dev.type == "cuda" else "host clock"
        extra = ""
        if label == "fused":
            extra = f", first step {first:.2f} s (compile {backend.compile_s:.2f} s, {backend.compiled_shapes} shapes)"
            if eager is not None:
                extra += f", eager {eager * 1e3:.2f} ms"
        moved = (f"writes {written / 1e6:.1f} MB ({written / minimal:.1f}x the minimal read)" if written is not None
                 else f"reads the visited blocks: {_visited(batch, bs) * per_token * a.layers / 1e6:.1f} MB")
        print(f"{label:>9}: {per_step * 1e3:9.2f} ms per decode step ({timing}){extra}; {moved}")
        results[label + "_s"] = per_step
    err = (results["fused"] - results["reference"]).abs().max().item()
    tol = TOLERANCE[dtype] * max(1.0, results["reference"].abs().max().item())
    ok = err <= tol
    print(f"block {bs}: fused is {results['reference_s'] / results['fused_s']:.2f}x the reference; "
          f"max |difference| {err:.2e} ({'within' if ok else 'OVER'} the tolerance {tol:.1e})")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prefix", type=int, default=730)
    ap.add_argument("--own-max", type=int, default=64, help="longest own part (prompt + generated) of a row")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile flex_attention (default: on CUDA only; eager flex elsewhere)")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="time the flex decode kernel at each num_stages x num_warps of --stages / --warps (CUDA)")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    compile_ = dev.type == "cuda" if a.compile is None else a.compile
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"workload: decode step, {a.images} images x {a.prefix}-token prefix, {a.rows} rows (own <= {a.own_max}), "
          f"{a.layers} layers, {a.heads}/{a.kv_heads} heads x {a.head_dim}, {dtype}; "
          f"device: {name}; torch {torch.__version__}")
    if a.decode_sweep:
        sys.exit(0 if decode_sweep(a, dev, dtype, compile_) else 1)
    ok = all([bench(a, dev, dtype, bs, compile_) for bs in a.block_sizes])
    sys.exit(0 if ok else 1)


def decode_sweep(a, dev: torch.device, dtype: torch.dtype, compile_: bool) -> bool:
    """Every (num_stages, num_warps) of the decode kernel through `bench` (each checked against the
    reference); a choice that does not compile (shared memory) is said and skipped. Inductor's own
    choice first."""
    ok = True
    for options in [{}] + [{"num_stages": s, "num_warps": w} for s in a.stages for w in a.warps]:
        paged_mask.DECODE_OPTIONS.clear()
        paged_mask.DECODE_OPTIONS.update(options)
        torch._dynamo.reset()  # kernel options are compile-time constants: a fresh compile each
        print(f"--- decode kernel options: {options or 'inductor default'}")
        for bs in a.block_sizes:
            try:
                ok &= bench(a, dev, dtype, bs, compile_)
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at this choice
                print(f"block {bs}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    paged_mask.DECODE_OPTIONS.clear()
    return ok


def _visited(batch: AttentionBatch, bs: int) -> int:
    """K/V tokens in the blocks the fused kernels visit (whole blocks up to each length)."""
    (g,) = batch.groups
    ceil = lambda n: int((-(-n // bs)).sum()) * bs  # noqa: E731
    return ceil(g.own_len) + ceil(g.prefix.lens)


if __name__ == "__main__":
    main()

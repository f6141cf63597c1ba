#!/usr/bin/env python
"""The mixture-of-experts MLP (batchvlm/models/qwen_vl/moe.py) on a 30B-A3B-shaped layer stack
with random weights: tokens/s of each expert path vs a dense SwiGLU layer of the same active
size, at decode- and prefill-sized token counts.

Shapes (--shape 30b-a3b, Qwen3-VL-30B-A3B's text MLPs): width 2048, 128 experts of width 768,
8 active per token; the dense comparison is one SwiGLU of width 8 x 768 = 6144 (the same
multiply-adds per token). Each stack is --layers residual layers x + mlp(x).

Checks, each a non-zero exit when it fails:
  - every path (grouped GEMM, the gathered fallback, the reference loop) gives the loop's output
    within the dtype's tolerance;
  - on CUDA, the grouped and gathered stacks are captured in a CUDA graph per token count and
    replayed with new inputs (routing changes, shapes do not): the replay equals eager, so the
    paths are capture-safe (no host sync, no data-dependent shapes). Timings are of the replays.

    python scripts/bench_moe.py                     # CUDA, bf16, 30B-A3B shapes
    python scripts/bench_moe.py --shape tiny --device cpu --dtype float32   # the dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from batchvlm.models.qwen_vl.config import MoEConfig
from batchvlm.models.qwen_vl.mlp import MLP
from batchvlm.models.qwen_vl.moe import SparseMoE, grouped_kernel_on, grouped_mm_available

GATHERED_MAX_ROWS = 2048  # token x top-k assignments the gathered fallback is timed at
SHAPES = {"30b-a3b": dict(dim=2048, experts=128, top_k=8, ff=768),
          "tiny": dict(dim=64, experts=8, top_k=2, ff=32)}


def stack(layers: list[torch.nn.Module]):
    def run(x: torch.Tensor) -> torch.Tensor:
        for m in layers:
            x = x + m(x)
        return x
    return run


def timed(fn, x: torch.Tensor, dev: torch.device, graph: bool, iters: int) -> tuple[float, torch.Tensor]:
    """Seconds per call (best of 3 rounds of `iters`), and the output for `x`. With `graph`, the
    call is captured once on a static input and replayed."""
    if graph:
        static = x.clone()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(static)  # warm-up outside the graph
        torch.cuda.current_stream(dev).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fn(static)

        def call() -> torch.Tensor:
            g.replay()
            return out
        static.copy_(x)
    else:
        fn(x)

        def call() -> torch.Tensor:
            return fn(x)
    best = float("inf")
    for _ in range(3):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(iters):
            y = call()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = min(best, (time.perf_counter() - t) / iters)
    return best, call().clone()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                       ("cpu" if args.device == "auto" else args.device))
    dt = getattr(torch, args.dtype)
    s = SHAPES[args.shape]
    C, E, K, I = s["dim"], s["experts"], s["top_k"], s["ff"]
    g = torch.Generator().manual_seed(0)

    def rand(m: torch.nn.Module) -> torch.nn.Module:
        with torch.no_grad():
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        return m.to(dev, dt).eval().requires_grad_(False)

    moe = [rand(SparseMoE(C, MoEConfig(E, K, I, 0, ()))) for _ in range(args.layers)]
    dense = [rand(MLP(C, K * I)) for _ in range(args.layers)]
    paths = ["loop", "gathered"] + (["grouped"] if grouped_kernel_on(dev, dt) or
                                    (dev.type == "cpu" and grouped_mm_available()) else [])
    graphs = dev.type == "cuda"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"# bench_moe: {args.shape} width {C}, {E} experts x {I}, top {K}, {args.layers} layers; dense SwiGLU "
          f"{K * I}; {name} {args.dtype} torch {torch.__version__}; CUDA graphs: {graphs}", flush=True)
    tol = dict(atol=2e-2, rtol=2e-2) if dt == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    rows, ok = [], True
    with torch.inference_mode():
        for T in args.tokens:
            x = torch.randn(T, C, generator=g).to(dev, dt)
            row = {"tokens": T}
            row["dense"] = timed(stack(dense), x, dev, graphs, args.iters)[0]
            outs = {}
            for path in paths:
                if path == "gathered" and T * K > GATHERED_MAX_ROWS:
                    continue  # the fallback re-reads an expert's weights per row: decode sizes only
                for m in moe:
                    m.path = path
                # the loop syncs (nonzero): eager only
                row[path], outs[path] = timed(stack(moe), x, dev, graphs and path != "loop", args.iters)
            for path in outs:
                err = (outs[path].float() - outs["loop"].float()).abs().max().item()
                row[f"{path}_max_err"] = err
                if not torch.allclose(outs[path].float(), outs["loop"].float(), **tol):
                    print(f"!! {path} at {T} tokens: max error {err:.3g} vs the loop", flush=True)
                    ok = False
            rows.append(row)
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    lines = ["| tokens | dense tok/s | " + " | ".join(f"{p} tok/s" for p in paths) + " | dense s / best MoE s |",
             "|---|---|" + "---|" * len(paths) + "---|"]
    for r in rows:
        best = min(r[p] for p in paths if p in r)
        lines.append(f"| {r['tokens']} | {r['tokens'] / r['dense']:.0f} | " +
                     " | ".join(f"{r['tokens'] / r[p]:.0f}" if p in r else "-" for p in paths) +
                     f" | {r['dense'] / best:.2f} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"device": name, "args": vars(args) | {"json": str(args.json)}, "rows": rows},
                                        indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

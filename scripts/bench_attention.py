"""Decode-step attention: the reference and the fused backend on the same paged batch, side by side.

One decode step = one query per row, every layer: write the step's K/V, attend the shared image
prefix (once per image) and each row's own tokens, merge. Prints time per step (compile time of
the fused kernels apart), the ratio, and bytes moved against the minimal K/V read.

  python scripts/bench_attention.py                    # CUDA: Moondream 2 shapes, bfloat16
  python scripts/bench_attention.py --images 8 --rows 56 --layers 4    # a CPU-sized shape

Bytes: "minimal" is every K/V byte the step must read (each image's prefix once, each row's own
tokens), per layer. The reference's "written" is measured: the bytes of every tensor its aten
ops produce (a dispatch-mode count). The fused path's traffic is its kernels' inputs: the K/V
of the visited blocks (the minimum rounded up to whole blocks), queries and outputs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from batchvlm.engine.staging import rows_by_image
from batchvlm.models.attention import (AttentionBatch, KVCache, ReferenceAttention, SharedPrefix, TaskGroup, attend,
                                       plan_groups)
from batchvlm.models.fused_attention import FusedAttention


def decode_step(images: int, rows: int, prefix: int, own_max: int, bs: int, device: torch.device, seed: int = 0
                ) -> tuple[AttentionBatch, int, int]:
    """One decode step: rows on images round-robin, own lengths uniform in [1, own_max].
    -> (batch, cache slots, minimal K/V tokens read per layer)."""
    g = np.random.default_rng(seed)
    nbp, nbo = -(-prefix // bs), -(-own_max // bs)
    image_tables = 1 + np.arange(images * nbp).reshape(images, nbp)
    own_tables = 1 + images * nbp + np.arange(rows * nbo).reshape(rows, nbo)
    own = g.integers(0, own_max, size=rows)  # own index of the decode token
    own_tables[np.arange(nbo)[None] * bs > own[:, None]] = 0  # unused table tail -> null block
    image = np.arange(rows) % images
    by_image, slot = rows_by_image(image, np.arange(rows)[:, None], images, rows)
    blocks = own_tables[np.arange(rows), own // bs]

    def t(a):
        return torch.as_tensor(np.asarray(a), dtype=torch.long, device=device)

    group = TaskGroup(t(np.arange(rows)[:, None]), t(own[:, None]), t(own_tables), t(own + 1),
                      SharedPrefix(t(image_tables), t(np.full(images, prefix)), t(by_image), t(slot)))
    n_slots = (1 + images * nbp + rows * nbo) * bs
    return AttentionBatch(t(blocks * bs + own % bs), [group], bs), n_slots, images * prefix + int((own + 1).sum())


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
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="compile flex_attention (default: on CUDA only; eager flex elsewhere)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    compile_ = dev.type == "cuda" if a.compile is None else a.compile
    batch, n_slots, min_tokens = decode_step(a.images, a.rows, a.prefix, a.own_max, a.block_size, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    k, v = (torch.randn(n_slots, a.kv_heads, a.head_dim, generator=g, device=dev, dtype=dtype) for _ in range(2))
    q = torch.randn(a.rows, a.heads, a.head_dim, generator=g, device=dev, dtype=dtype)
    k_new, v_new = k[: a.rows].clone(), v[: a.rows].clone()
    per_token = 2 * a.kv_heads * a.head_dim * dtype.itemsize  # K and V
    minimal = min_tokens * per_token * a.layers
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"workload: decode step, {a.images} images x {a.prefix}-token prefix, {a.rows} rows (own <= {a.own_max}), "
          f"{a.layers} layers, {a.heads}/{a.kv_heads} heads x {a.head_dim}, block {a.block_size}, {dtype}; "
          f"device: {name}; torch {torch.__version__}")
    print(f"minimal K/V read per step: {minimal / 1e6:.1f} MB")

    results = {}
    for label, backend in (("reference", ReferenceAttention()), ("fused", FusedAttention(compile=compile_))):
        cache = KVCache(k[None], v[None], a.block_size, backend)

        def step():
            plans = plan_groups(batch, cache)
            for _ in range(a.layers):
                out = attend(q, k_new, v_new, cache.k[0], cache.v[0], batch, plans)
            return out

        with torch.inference_mode():
            t0 = time.perf_counter()
            out = step()  # warm-up (compiles the fused kernels)
            sync()
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            sync()
            per_step = (time.perf_counter() - t0) / a.steps
            written = None
            if label == "reference":
                with BytesWritten() as count:
                    step()
                written = count.bytes
        results[label] = out.float()
        compile_s = getattr(backend, "compile_s", 0.0)
        extra = f", first step {first:.2f} s (compile {compile_s:.2f} s)" if label == "fused" else ""
        moved = (f"writes {written / 1e6:.1f} MB ({written / minimal:.1f}x the minimal read)" if written is not None
                 else f"reads the visited blocks: {_visited(batch, a.block_size) * per_token * a.layers / 1e6:.1f} MB")
        print(f"{label:>9}: {per_step * 1e3:9.2f} ms per decode step{extra}; {moved}")
        results[label + "_s"] = per_step
    err = (results["fused"] - results["reference"]).abs().max().item()
    print(f"fused is {results['reference_s'] / results['fused_s']:.2f}x the reference; max |difference| {err:.2e}")


def _visited(batch: AttentionBatch, bs: int) -> int:
    """K/V tokens in the blocks the fused kernels visit (whole blocks up to each length)."""
    (g,) = batch.groups
    ceil = lambda n: int((-(-n // bs)).sum()) * bs  # noqa: E731
    return ceil(g.own_len) + ceil(g.prefix.lens)


if __name__ == "__main__":
    main()

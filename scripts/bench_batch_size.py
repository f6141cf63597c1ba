#!/usr/bin/env python
"""Sweep engine.max_batch_size on one device: images/s, peak RSS and system CPU time per size.

Each batch size runs in a fresh process (peak RSS and system time are per process), on a
Moondream-shaped checkpoint with random weights: the full vision tower's depth and crop
(27 layers, 378-px crops, 729-token image prefix) with narrower widths, so a CPU sweep ends
in minutes; `--full` uses full-size Moondream 2 shapes (for a GPU). Every sequence runs to its
length limit (EOS forbidden), so each batch size does the same work. The defaults in
job.py's DEFAULT_MAX_BATCH_SIZE come from this curve (docs/benchmarks.md, "Batch size").

    python scripts/bench_batch_size.py                        # CPU
    python scripts/bench_batch_size.py --full --batch 64 128 256 512 1024 --images 512   # GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

SHAPED = {  # Moondream 2's structure, narrower: what a CPU sweep can afford
    "vision": {"enc_n_layers": 27, "crop_size": 378, "enc_patch_size": 14, "enc_dim": 192, "enc_ff_dim": 768,
               "enc_n_heads": 3, "proj_inner_dim": 512, "proj_out_dim": 384, "max_crops": 1},
    "text": {"dim": 384, "ff_dim": 1536, "n_layers": 8, "n_heads": 6, "n_kv_heads": 6},
    "region": {"dim": 384, "coord_feat_dim": 64, "coord_out_dim": 256, "size_feat_dim": 128, "size_out_dim": 384,
               "inner_dim": 768},
}


def one(batch: int, images: int, full: bool, device: str, max_new_tokens: int) -> dict:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    from batchvlm.data.loader import Sample
    from batchvlm.engine.engine import Engine
    from batchvlm.job import EngineSpec
    from batchvlm.models.base.contract import ModelInfo
    from batchvlm.models.base.hub import resolve_device, resolve_dtype
    from batchvlm.models.moondream.config import MoondreamConfig
    from batchvlm.models.moondream.host import Moondream
    from batchvlm.models.moondream.device import MoondreamEngineModel
    from batchvlm.models.moondream.weights import build_model
    from batchvlm.shapes.world import SPEC, draw_scene
    from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    config = MoondreamConfig.from_dict({} if full else SHAPED)
    model = build_model(config, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.ones_like(p) if "ln" in name and name.endswith("weight") else torch.zeros_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32).to(dtype) * 0.02)
        model.text.lm_head.bias[config.tokenizer.eos_id] = -1e4  # fixed lengths: the same work at every size
    tok = Tokenizer(models.WordLevel({"[unk]": 0} | {w: i + 1 for i, w in enumerate("abcdefghij")}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    family = Moondream(config, tok, Path(), "shaped", None)
    engine_model = MoondreamEngineModel(model, ModelInfo("shaped", None, "", "random", str(dtype), str(dev), "moondream",
                                                    "native"))
    tasks = [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": "a b c"}),
             DetectTask(detect={"objects": ["a", "b"]}), PointTask(point={"objects": ["c"]})]
    spec = EngineSpec(max_batch_size=batch, max_new_tokens=max_new_tokens, max_objects=4)
    seqs = family.sequences(tasks, spec)
    spec = spec.model_copy(update={"max_images_in_flight": max(8, 2 * batch // len(seqs))})
    rng = random.Random(1)
    pre = family.preprocessor()
    prepared = [pre(draw_scene(rng, SPEC)[0]) for _ in range(images)]
    engine = Engine(engine_model, seqs, spec, family.max_prefix_len())
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    for _ in engine.run([Sample(0, i, str(i), p) for i, p in enumerate(prepared)]):
        pass
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"batch": batch, "images_per_s": round(images / wall, 3), "seconds": round(wall, 2),
            "sys_s": round(after.ru_stime - before.ru_stime, 2), "user_s": round(after.ru_utime - before.ru_utime, 2),
            "peak_rss_gb": round(after.ru_maxrss / 2**20, 2),
            "peak_gpu_gb": round(torch.cuda.max_memory_allocated(dev) / 2**30, 2) if dev.type == "cuda" else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--full", action="store_true", help="full-size Moondream 2 shapes")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: one batch size
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.images, args.full, args.device, args.max_new_tokens)))
        return 0
    import torch

    hw = torch.cuda.get_device_name(0) if args.device != "cpu" and torch.cuda.is_available() else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"# bench_batch_size: {'full-size' if args.full else 'Moondream-shaped (narrow)'} model, {hw}, "
          f"torch {torch.__version__}, {args.images} images x 4 tasks (6 sequences), {args.max_new_tokens} tokens")
    print("| max_batch_size | images/s | seconds | user CPU s | system CPU s | peak RSS GB | peak GPU GB |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch:
        cmd = [sys.executable, __file__, "--one", str(batch), "--images", str(args.images), "--device", args.device,
               "--max-new-tokens", str(args.max_new_tokens)] + (["--full"] if args.full else [])
        r = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"| {batch} | {r['images_per_s']} | {r['seconds']} | {r['user_s']} | {r['sys_s']} | {r['peak_rss_gb']} | "
              f"{r['peak_gpu_gb'] if r['peak_gpu_gb'] is not None else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Side-by-side throughput of four ways to label the same images, in one run:

  (a) one-at-a-time   each (image, task sequence) alone, batch 1, as Moondream is used today
  (b) static batch    the simple batched generation (models/moondream/generate.py)
  (c) engine sync     continuous batching, paged KV, device-side decoding; synchronous steps
  (d) engine piped    the same engine, pipelined (host commits step t while step t+1 runs)

Every runner must produce identical labels (checked); the script prints images/s, emitted
tokens/s (text tokens + coordinates + sizes) and ratios, as a markdown table.

    python scripts/bench_engine.py                       # CPU, the built-in demo model
    python scripts/bench_engine.py --model full-random --batch 64 256 --fixed-lengths   # GPU
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch

from batchvlm.engine.engine import Engine
from batchvlm.engine.labeler import WorkItem
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.moondream.family import Moondream, MoondreamEngine
from batchvlm.models.moondream.generate import generate
from batchvlm.models.registry import open_family
from batchvlm.shapes.world import SPEC, draw_scene
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

WORKLOADS = {
    "caption": [CaptionTask(caption={"length": "normal"})],
    "detect+point": [DetectTask(detect={"objects": ["circle", "square", "triangle"]}),
                     PointTask(point={"objects": ["red circle", "blue square"]})],
    "mixed": [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": "how many shapes are there?"}),
              DetectTask(detect={"objects": ["circle", "square", "triangle"]}),
              PointTask(point={"objects": ["red circle", "blue square"]})],
}


class Bench:
    """The host family and the loaded engine model of one Moondream."""

    def __init__(self, family: Moondream, engine: MoondreamEngine):
        self.family, self.engine, self.model = family, engine, engine.model
        self.preprocessor = family.preprocessor()

    def sequences(self, tasks, max_new_tokens: int, max_objects: int):
        return self.family.sequences(tasks, EngineSpec(max_new_tokens=max_new_tokens, max_objects=max_objects))


def load_model(name: str, device: str, fixed_lengths: bool) -> Bench:
    if name == "full-random":
        md = full_random(device)
    else:
        family = open_family(ModelSpec(name=name))
        md = Bench(family, family.load("auto", device))
    if fixed_lengths:
        # Benchmark-only: EOS can never win, so every sequence runs to its limit.
        with torch.no_grad():
            md.model.text.lm_head.bias[md.family.config.tokenizer.eos_id] = -1e4
    return md


def full_random(device: str) -> Bench:
    """Full-size Moondream 2 shapes with random weights (no checkpoint needed)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from batchvlm.models.family import ModelInfo
    from batchvlm.models.hub import resolve_device, resolve_dtype
    from batchvlm.models.moondream.config import MoondreamConfig
    from batchvlm.models.moondream.weights import build_model

    dev = resolve_device(device)
    dtype = resolve_dtype("auto", dev)
    config = MoondreamConfig.from_dict({})
    model = build_model(config, dev, dtype)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.ones_like(p) if "ln" in name and name.endswith("weight") else torch.zeros_like(p))
            else:
                p.copy_(torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32).to(dtype) * 0.02)
    tok = Tokenizer(models.WordLevel({"[unk]": 0} | {w: i + 1 for i, w in enumerate("abcdefghij")}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    info = ModelInfo("full-random", None, "", "random", str(dtype), str(dev), "moondream", "native")
    return Bench(Moondream(config, tok, Path(), "full-random", None), MoondreamEngine(model, info))


def images(n: int, md: Bench, seed: int) -> list:
    rng = random.Random(seed)
    return [md.preprocessor(draw_scene(rng, SPEC)[0]) for _ in range(n)]


def emitted(outputs) -> int:
    return sum(len(o.tokens) + 2 * len(o.objects) + sum(len(obj) == 4 for obj in o.objects) for o in outputs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_one_at_a_time(md, prepared, specs):
    return [[generate(md.model, [p], [s])[0][0] for s in specs] for p in prepared]


def run_static(md, prepared, specs, batch):
    per = max(1, batch // len(specs))
    out = []
    for i in range(0, len(prepared), per):
        out += generate(md.model, prepared[i : i + per], specs)
    return out


def run_engine(md, prepared, seqs, batch, pipelined, cuda_graphs):
    spec = EngineSpec(max_batch_size=batch, pipelined=pipelined, cuda_graphs=cuda_graphs,
                      max_images_in_flight=max(8, 2 * batch // len(seqs)))
    engine = Engine(md.engine, seqs, spec, md.family.max_prefix_len())
    items = [WorkItem(i, p, str(i)) for i, p in enumerate(prepared)]
    out = {im.ticket: [s.output for s in im.seqs] for im in engine.run(items)}
    return [out[i] for i in range(len(prepared))]


def busy_fraction(fn) -> float:
    """Share of wall time with a kernel running on the GPU (torch profiler), during fn()."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, end = 0.0, -1.0
    for s, e in spans:  # union of kernel intervals, in microseconds
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy / 1e6 / wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="demo | full-random | a model folder")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--images", type=int, default=48)
    ap.add_argument("--batch", type=int, nargs="+", default=[256])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-objects", type=int, default=10)
    ap.add_argument("--fixed-lengths", action="store_true", help="forbid EOS: every sequence runs to its limit")
    ap.add_argument("--repeat", type=int, default=1, help="time each runner this many times, keep the fastest")
    ap.add_argument("--skip-one-at-a-time", action="store_true")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--profile", action="store_true", help="GPU busy fraction of the pipelined engine (CUDA)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()

    md = load_model(args.model, args.device, args.fixed_lengths)
    dev = md.model.device
    prepared = images(args.images, md, seed=1)
    host = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({host})"
    print(f"# bench_engine: model={args.model} device={hw} torch={torch.__version__} images={args.images} "
          f"max_new_tokens={args.max_new_tokens} max_objects={args.max_objects} fixed_lengths={args.fixed_lengths} "
          f"repeat={args.repeat} (best of)")
    results = []
    for name in args.workloads:
        seqs = md.sequences(WORKLOADS[name], args.max_new_tokens, args.max_objects)
        specs = [s.spec for s in seqs]
        for batch in args.batch:
            runners = {}
            if not args.skip_one_at_a_time:
                runners["one-at-a-time"] = lambda: run_one_at_a_time(md, prepared, specs)
            runners["static batch"] = lambda: run_static(md, prepared, specs, batch)
            runners["engine sync"] = lambda: run_engine(md, prepared, seqs, batch, False, not args.no_cuda_graphs)
            runners["engine pipelined"] = lambda: run_engine(md, prepared, seqs, batch, True, not args.no_cuda_graphs)
            row = {"workload": name, "batch": batch, "sequences_per_image": len(specs)}
            reference = None
            for label, fn in runners.items():
                fn() if dev.type == "cuda" else None  # warm-up (graph capture, allocator)
                times = []
                for _ in range(args.repeat):  # the best of several: shared machines are noisy
                    sync(dev)
                    t0 = time.perf_counter()
                    out = fn()
                    sync(dev)
                    times.append(time.perf_counter() - t0)
                dt = min(times)
                labels = [[(o.tokens, o.objects) for o in img] for img in out]
                if reference is None:
                    reference = labels
                elif labels != reference:
                    print(f"!! {label} labels differ from the first runner's", file=sys.stderr)
                    return 1
                row[label] = {"seconds": round(dt, 3), "images_per_s": round(len(prepared) / dt, 2),
                              "tokens_per_s": round(emitted([o for img in out for o in img]) / dt, 1)}
            if args.profile and dev.type == "cuda":
                row["gpu_busy_pipelined"] = round(busy_fraction(runners["engine pipelined"]), 3)
                row["gpu_busy_sync"] = round(busy_fraction(runners["engine sync"]), 3)
            results.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(table(results, dev))
    if args.json:
        args.json.write_text(json.dumps({"hardware": hw, "args": vars(args) | {"json": str(args.json)},
                                         "results": results}, indent=1))
    return 0


def table(results: list[dict], device: torch.device) -> str:
    """Ratios of the engine in its default mode on this device (engine.pipelined: auto)."""
    auto = "engine pipelined" if device.type == "cuda" else "engine sync"
    lines = ["| workload | batch | one-at-a-time img/s | static img/s | engine sync img/s | engine pipelined img/s "
             f"| {auto} tok/s | {auto} / one-at-a-time | {auto} / static | pipelined / sync |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        one = r.get("one-at-a-time", {}).get("images_per_s")
        st, sy, pi = (r[k]["images_per_s"] for k in ("static batch", "engine sync", "engine pipelined"))
        en = r[auto]["images_per_s"]
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        lines.append(f"| {r['workload']} | {r['batch']} | {one or '-'} | {st} | {sy} | {pi} | "
                     f"{r[auto]['tokens_per_s']} | {ratio(en, one)} | {ratio(en, st)} | {ratio(pi, sy)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

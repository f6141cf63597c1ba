#!/usr/bin/env python
"""Side-by-side throughput of four ways to label the same images, in one run:

  (a) one-at-a-time   each (image, task sequence) alone, batch 1, as Moondream is used today
  (b) static batch    the simple batched generation (models/moondream/generate.py)
  (c) engine sync     continuous batching, paged KV, device-side decoding; synchronous steps
  (d) engine piped    the same engine, pipelined (host commits step t while step t+1 runs)

Each engine is built once per configuration (KV sizing, warm-up and CUDA-graph capture happen
there, outside the timing); only its runs are timed, the best of --repeat. In float32 every
runner must produce identical labels (checked, else exit 1); in lower precision, batch
composition legitimately changes rounding, so the share of sequences identical to the first
runner's is reported instead. The script prints images/s, emitted tokens/s (text tokens +
coordinates + sizes) and ratios, as a markdown table.

A workload named `NAME@WxH` runs NAME on the synthetic scenes resized to W x H with up to 12
local crops, like real photos (1024x768 is 13 crops in Moondream 2); plain names use the
scenes at their drawn size (one crop).

    python scripts/bench_engine.py                       # CPU, the built-in demo model
    python scripts/bench_engine.py --model full-random --batch 64 256 --fixed-lengths   # GPU
    python scripts/bench_engine.py --runners "engine pipelined" "engine sync" --profile "engine sync"

--json is rewritten after every runner: a run killed mid-row keeps the runners it finished.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from batchvlm.data.loader import Sample
from batchvlm.engine import engine as engine_module
from batchvlm.engine.engine import Engine
from batchvlm.engine.sizing import Sizer
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.moondream.host import Moondream
from batchvlm.models.moondream.device import MoondreamEngineModel
from batchvlm.models.moondream.generate import generate
from batchvlm.models.moondream.preprocess import Preprocessor
from batchvlm.models.registry import open_family
from batchvlm.shapes.world import SPEC, draw_scene
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

RUNNERS = ("one-at-a-time", "static batch", "engine sync", "engine pipelined")
ENGINE_RUNNERS = {"engine sync": False, "engine pipelined": True}  # label -> pipelined
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

    def __init__(self, family: Moondream, engine: MoondreamEngineModel):
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

    from batchvlm.models.base.contract import ModelInfo
    from batchvlm.models.base.hub import resolve_device, resolve_dtype
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
    return Bench(Moondream(config, tok, Path(), "full-random", None), MoondreamEngineModel(model, info))


PHOTO_CROPS = 12  # Moondream 2's default max_crops


def images(n: int, md: Bench, seed: int, size: tuple[int, int] | None = None) -> list:
    """Synthetic scenes, preprocessed; at `size` (resized, up to PHOTO_CROPS local crops) when given."""
    rng = random.Random(seed)
    scenes = [draw_scene(rng, SPEC)[0] for _ in range(n)]
    if size is None:
        return [md.preprocessor(im) for im in scenes]
    pre = Preprocessor(md.family.config.vision, max(md.family.max_crops, PHOTO_CROPS))
    return [pre(im.resize(size)) for im in scenes]


def parse_workload(name: str) -> tuple[str, tuple[int, int] | None]:
    tasks, _, size = name.partition("@")
    if tasks not in WORKLOADS:
        raise SystemExit(f"unknown workload {tasks!r}: one of {', '.join(WORKLOADS)}")
    if not size:
        return tasks, None
    w, _, h = size.partition("x")
    return tasks, (int(w), int(h))


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


class FixedSizer(Sizer):
    """The engine's sizing with a KV cache of `blocks` blocks whatever the workload (after the same
    warm-up and memory check), so every row of a run attends over one cache size."""

    blocks: int = 0

    def _kv_blocks(self, n_rows: int, n_prefix: int) -> tuple[int, int, int, bool]:
        sized, n_rows, view_bytes, by_job = super()._kv_blocks(n_rows, n_prefix)
        return self.blocks or sized, n_rows, view_bytes, by_job


def engine_runner(md, prepared, seqs, batch, pipelined, cuda_graphs, kv_blocks: int = 0,
                  prefill_tokens: int | None = None, split_admission: bool = True) -> tuple[Engine, object]:
    """Build the engine now (KV sizing, warm-up, graph capture); -> (engine, its timed run).
    prefill_tokens: engine.prefill_tokens_per_step; split_admission False: admission steps run as
    one mixed eager forward (runner.py `_split`)."""
    spec = EngineSpec(max_batch_size=batch, pipelined=pipelined, cuda_graphs=cuda_graphs,
                      max_images_in_flight=max(8, 2 * batch // len(seqs)), prefill_tokens_per_step=prefill_tokens)
    FixedSizer.blocks = kv_blocks
    with mock.patch.object(engine_module, "Sizer", FixedSizer):
        engine = Engine(md.engine, seqs, spec, md.family.max_prefix_len(), log=lambda m: print(m, file=sys.stderr))
    engine.runner.split_admission = split_admission

    def run():
        items = [Sample(0, i, str(i), p) for i, p in enumerate(prepared)]
        out = {im.sample.index: [s.output for s in im.seqs] for im in engine.run(items)}
        return [out[i] for i in range(len(prepared))]

    return engine, run


def identical_share(labels, reference) -> float:
    pairs = [(a, b) for img, ref in zip(labels, reference) for a, b in zip(img, ref)]
    return sum(a == b for a, b in pairs) / len(pairs)


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
    ap.add_argument("--rows", nargs="+", default=None, metavar="WORKLOAD/BATCH",
                    help="run these (workload, batch) rows in this order instead of --workloads x --batch")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-objects", type=int, default=10)
    ap.add_argument("--fixed-lengths", action="store_true", help="forbid EOS: every sequence runs to its limit")
    ap.add_argument("--repeat", type=int, default=3, help="time each runner this many times, keep the fastest")
    ap.add_argument("--runners", nargs="+", choices=RUNNERS, default=list(RUNNERS),
                    help="these runners, in this order (the first is the labels' reference)")
    ap.add_argument("--skip-one-at-a-time", action="store_true")
    ap.add_argument("--one-at-a-time-images", type=int, default=None, help="one-at-a-time on the first N images only")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--profile", nargs="*", choices=list(ENGINE_RUNNERS), default=None, metavar="RUNNER",
                    help="GPU busy fraction of these engine runners (CUDA; none named: both), one run more each")
    ap.add_argument("--kv-blocks", type=int, default=0,
                    help="one KV cache size (blocks) for every engine: at least what each row needs")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here (after every runner)")
    ap.add_argument("--prefill-sweep", type=int, nargs="+", default=[], metavar="TOKENS",
                    help="also run the engine in its default mode at these engine.prefill_tokens_per_step")
    ap.add_argument("--mixed-admission", action="store_true",
                    help="also run the engine in its default mode with admission steps as one mixed eager forward")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no new (workload, batch) row after this many seconds; print what is done")
    args = ap.parse_args()
    profiled = set(ENGINE_RUNNERS if args.profile == [] else args.profile or ())
    runners = [r for r in args.runners if not (args.skip_one_at_a_time and r == "one-at-a-time")]
    runners += [label for label, _, _ in variants(args)]

    md = load_model(args.model, args.device, args.fixed_lengths)
    dev = md.model.device
    exact = md.model.dtype == torch.float32
    if args.rows:
        pairs = [r.rpartition("/") for r in args.rows]
        args.workloads = list(dict.fromkeys(name for name, _, _ in pairs))
        order = [(name, int(batch)) for name, _, batch in pairs]
    else:
        order = [(name, batch) for name in args.workloads for batch in args.batch]
    workloads = [parse_workload(w) for w in args.workloads]
    image_sets = {size: images(args.images, md, seed=1, size=size) for size in {size for _, size in workloads}}
    host = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({host})"
    print(f"# bench_engine: model={args.model} device={hw} torch={torch.__version__} dtype={md.model.dtype} "
          f"images={args.images} max_new_tokens={args.max_new_tokens} max_objects={args.max_objects} "
          f"fixed_lengths={args.fixed_lengths} repeat={args.repeat} (best of; set-up untimed)")
    results = []
    started = time.perf_counter()
    parsed = dict(zip(args.workloads, workloads))
    rows = [(name, *parsed[name], batch) for name, batch in order]
    for name, tasks, size, batch in rows:
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            print(f"# deadline: {args.deadline_s:.0f} s passed, rows from {name} / {batch} on not run", flush=True)
            break
        prepared = image_sets[size]
        torch._dynamo.reset()  # each row compiles its own flex shapes (its runners share them), counted in its stats
        seqs = md.sequences(WORKLOADS[tasks], args.max_new_tokens, args.max_objects)
        specs = [s.spec for s in seqs]
        row = {"workload": name, "batch": batch, "sequences_per_image": len(specs),
               "crops_per_image": round(sum(p.cost for p in prepared) / len(prepared), 1)}
        # label -> a set-up (untimed) that returns (engine or None, the timed run). An engine is built
        # just before its runs and dropped after: two engines alive at once would split the KV memory.
        few = prepared[: args.one_at_a_time_images or len(prepared)]
        setups = {"one-at-a-time": lambda: (None, lambda: run_one_at_a_time(md, few, specs)),
                  "static batch": lambda: (None, lambda: run_static(md, prepared, specs, batch))}
        for label, pipelined in ENGINE_RUNNERS.items():
            setups[label] = lambda p=pipelined: engine_runner(md, prepared, seqs, batch, p,
                                                              not args.no_cuda_graphs, args.kv_blocks)
        for label, prefill, split in variants(args):  # the default mode: pipelined on CUDA
            setups[label] = lambda t=prefill, s=split: engine_runner(md, prepared, seqs, batch, dev.type == "cuda",
                                                                     not args.no_cuda_graphs, args.kv_blocks, t, s)
        results.append(row)
        reference = None
        for label in runners:
            setup = setups[label]
            sync(dev)
            t0 = time.perf_counter()
            engine, fn = setup()
            if engine is not None:
                row[f"{label} setup_s"] = round(time.perf_counter() - t0, 2)
                row[f"{label} stats"] = engine.stats
            if dev.type == "cuda":
                fn()  # warm-up: allocator and kernel caches (graphs were captured at set-up)
            times = []
            for _ in range(args.repeat):  # the best of several: shared machines are noisy
                sync(dev)
                t0 = time.perf_counter()
                out = fn()
                sync(dev)
                times.append(time.perf_counter() - t0)
            dt = min(times)
            labels = [[(o.tokens, o.objects) for o in img] for img in out]
            n = len(labels)
            if reference is None:
                reference = labels
            elif exact and labels[: len(reference)] != reference[:n]:
                print(f"!! {label} labels differ from the first runner's (float32)", file=sys.stderr)
                return 1
            row[label] = {"images": n, "seconds": round(dt, 3), "images_per_s": round(n / dt, 2),
                          "tokens_per_s": round(emitted([o for img in out for o in img]) / dt, 1)}
            if not exact:
                row[label]["identical_share"] = round(identical_share(labels, reference), 4)
            if label in profiled and dev.type == "cuda":
                row[f"{label} gpu_busy"] = round(busy_fraction(fn), 3)
            fn = out = engine = None  # the engine and its KV cache go before the next is built
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if args.json:
                args.json.write_text(json.dumps({"hardware": hw, "args": vars(args) | {"json": str(args.json)},
                                                 "results": results}, indent=1))
        print(json.dumps(row), flush=True)
    print()
    print(table(results, dev))
    print("\n".join(notes(results)))
    return 0


def variants(args) -> list[tuple[str, int | None, bool]]:
    """The extra engine runners: (label, engine.prefill_tokens_per_step, split admission)."""
    out = [(f"engine prefill {t}", t, True) for t in args.prefill_sweep]
    return out + [("engine mixed admission", None, False)] if args.mixed_admission else out


def table(results: list[dict], device: torch.device) -> str:
    """Ratios of the engine in its default mode on this device (engine.pipelined: auto)."""
    auto = "engine pipelined" if device.type == "cuda" else "engine sync"
    lines = ["| workload | batch | one-at-a-time img/s | static img/s | engine sync img/s | engine pipelined img/s "
             f"| {auto} tok/s | {auto} / one-at-a-time | {auto} / static | pipelined / sync |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:  # a runner not run (--runners, a crash) reads "-"
        one, st, sy, pi = (r.get(k, {}).get("images_per_s") for k in RUNNERS)
        en, tok = r.get(auto, {}).get("images_per_s"), r.get(auto, {}).get("tokens_per_s")
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        lines.append(f"| {r['workload']} | {r['batch']} | {one or '-'} | {st or '-'} | {sy or '-'} | {pi or '-'} | "
                     f"{tok or '-'} | {ratio(en, one)} | {ratio(en, st)} | {ratio(pi, sy)} |")
    return "\n".join(lines)


def notes(results: list[dict]) -> list[str]:
    """Per row: the share of engine steps that replayed a CUDA graph, compiled flex shapes and
    seconds, GPU busy fractions and, in
    lower precision, the share of sequences identical to the first runner's."""
    out = []
    for r in results:
        parts = []
        for label in ("engine sync", "engine pipelined"):
            st = r.get(f"{label} stats", {})
            if st.get("steps") and st.get("graph_capture_s"):
                parts.append(f"{label}: {st['graph_steps'] / st['steps']:.0%} graph steps")
            if st.get("compiled_shapes"):
                parts.append(f"{label}: flex_attention {st['compiled_shapes']} shapes compiled "
                             f"in {st['compile_s']:.1f} s")
            if f"{label} gpu_busy" in r:
                parts.append(f"{label}: GPU busy {r[f'{label} gpu_busy']:.0%}")
        extra = [k for k, v in r.items() if isinstance(v, dict) and "images_per_s" in v
                 and (k.startswith("engine prefill") or k == "engine mixed admission")]
        for label in ["engine pipelined"] * bool(extra) + extra:
            st = r.get(f"{label} stats", {})
            parts.append(f"{label}: {r[label]['images_per_s']} img/s ({st.get('prefill_tokens')} prefill tokens, "
                         f"{st.get('split_steps')} split admission steps of {st.get('steps')})")
        same = {k: v["identical_share"] for k, v in r.items() if isinstance(v, dict) and "identical_share" in v}
        if same:
            parts.append("identical sequences: " + ", ".join(f"{k} {v:.1%}" for k, v in same.items()))
        if parts:
            out.append(f"- {r['workload']} / {r['batch']}: " + "; ".join(parts))
    return out


if __name__ == "__main__":
    sys.exit(main())

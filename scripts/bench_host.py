#!/usr/bin/env python
"""Host time per engine step with the device work stood in for (issue 37 item 6).

The pipelined engine only pays if the host's work per step is shorter than the device's step
(a Moondream 2 decode step at 256 rows is ~2 ms on an H200). This runs the real engine
(batchvlm/engine: scheduler, staging, CUDA-graph padding path, commit, json masks) on CPU, with
each family's device work replaced by a stand-in: no vision encoder (features are the image's
prefix length), no transformer (hidden states are seeded noise of the family's width), a KV
cache of one layer, one head of width 8 (never read). The family's own host half stays real:
its sequences, head schedules, grammar (`emit`), json masks (`fill_masks`), and its `decide`
on those noise states (a tiny random model of the family's architecture: its lm head, sampler,
coordinate heads), so sequences end, emit points and boxes, and json answers follow their
masks as a random model would. Prefixes have the real models' lengths (Moondream 2: 730 slots,
Qwen3-VL / Qwen3.5 at 1024x768: 768 image tokens, Florence-2: 577), so block tables have
their real widths.

Decode-only steps take the CUDA-graph path (padding, staging, the static copies) with the graph
body run eagerly, as tests run it on CPU, and so do the decode rows of admission steps, beside
the eager part (runner.py `_split`, as on CUDA; --mixed-admission: one mixed eager step); the
engine is pipelined, as on CUDA (json rows take turns, scheduler.py). Timed per step, in microseconds of host time:

  plan     Scheduler.schedule (admission, the StepPlan), less its masks
  masks    the json masks (fill_masks: xgrammar) of the step's constrained rows
  staging  StepInputs / padded DecodeInputs built and packed into the pinned slot, mask upload
  commit   Runner.collect and Scheduler.commit (the family's emit per row)
  host     their sum: what the host adds to a pipelined step

What is not counted: eager steps' torch calls (on CUDA kernel launches: admission steps run
eagerly) and the device work itself. p50 / p90 over the steps after the first --skip (the
ramp-up, where every step admits).

The json mix runs the Qwen families at a 151,643-token vocabulary (Qwen's logits width): a
byte-level BPE trained here on 40 MB of the machine's Python / Markdown files, up to that size or
what the corpus allows (the tokenizer's size is printed; ids past it are never allowed, as ids
past a tokenizer are), built once into --workdir (a minute or two).
Moondream (the demo model) and Florence-2 run json at their fixtures' vocabularies.

  python scripts/bench_host.py                              # 64 and 256 rows, every family and mix
  python scripts/bench_host.py --rows 256 --families moondream --mixes caption --steps 50
  python scripts/bench_host.py --json out.json              # the table as JSON as well
  python scripts/bench_host.py --against /path/to/old/checkout --repeat 3   # old and this tree side by side

--against runs every row in fresh processes, this tree's and the other checkout's alternately
(--repeat pairs), and prints each part's p50 for both and the ratio this / other (the median of
the pairs' ratios): on a shared machine a ratio of runs taken side by side says more than two
tables taken minutes apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import itertools
import json
import os
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pydantic import TypeAdapter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tiny checkpoints the tests build (tests/support)
# --against runs this script on another checkout's batchvlm (the tree in BENCH_HOST_TREE)
sys.path.insert(0, os.environ.get("BENCH_HOST_TREE", str(ROOT)))

from batchvlm.cache.specs import PagedKV  # noqa: E402
from batchvlm.engine import runner as runner_mod  # noqa: E402
from batchvlm.engine.engine import Engine  # noqa: E402
from batchvlm.job import EngineSpec, ModelSpec  # noqa: E402
from batchvlm.data.loader import Sample  # noqa: E402
from batchvlm.models.base.contract import PrefixInputs  # noqa: E402
from batchvlm.models.registry import open_family  # noqa: E402
from batchvlm.tasks import Task  # noqa: E402

FAMILIES = ("moondream", "qwen3_vl", "qwen3_5", "florence2")
MIXES = ("caption", "detect+point", "classify10", "json")
PARTS = ("plan", "masks", "staging", "commit")
QWEN_VOCAB = 151_643
# Image prefix slots of the real models: (prefix length, rotary position after it).
PREFIX = {"moondream": (730, 730),  # Moondream 2: 729 patches + BOS
          "qwen3_vl": (772, 36),  # 1024x768: 32 x 24 merged patches + the template's 4 tokens (M-RoPE)
          "qwen3_5": (772, 36),
          "florence2": (577, 0)}  # 768x768: 576 + 1 image tokens; the decoder counts from 0
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24}, "people": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
    "year": {"anyOf": [{"type": "integer", "minimum": 1900, "maximum": 2100}, {"type": "null"}]}},
    "required": ["title", "people", "tags", "year"], "additionalProperties": False}
CHOICES = ["cat", "dog", "bird", "car", "bicycle", "tree", "house", "person", "boat", "flower"]


def mix_tasks(mix: str, family: str) -> list:
    """The mix's tasks (Florence-2 cannot point: its detect+point is detect alone)."""
    specs = {"caption": [{"caption": {"length": "normal"}}],
             "detect+point": [{"detect": {"objects": ["person", "car", "dog"]}},
                              {"point": {"objects": ["person", "bicycle"]}}],
             "classify10": [{"classify": {"question": "What is in the picture?", "choices": CHOICES}}],
             "json": [{"json": {"prompt": "Describe the picture as JSON.", "schema": SCHEMA}}]}[mix]
    if family == "florence2":
        specs = [t for t in specs if "point" not in t]
    return [TypeAdapter(Task).validate_python(t) for t in specs]


# --- the tiny checkpoints ------------------------------------------------------------------------


def corpus(budget: int) -> str:
    """This machine's Python and Markdown text (the stdlib and installed packages: no download),
    at most about `budget` characters, as scripts/bench_grammar.py trains its vocabulary on."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    parts, n = [], 0
    for path in sorted(f for r in roots for ext in ("py", "md") for f in glob.glob(f"{r}/**/*.{ext}", recursive=True)):
        text = Path(path).read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        n += len(text)
        if n >= budget:
            break
    return "\n".join(parts)


def checkpoint(family: str, workdir: Path, vocab: int | None, corpus_chars: int = 40_000_000) -> str:
    """A model folder of the family (built once into workdir): the demo model for Moondream; a
    `vocab`-token tokenizer is trained on about `corpus_chars` characters (corpus)."""
    if family == "moondream":
        return "demo"
    dest = workdir / (family + (f"-{vocab}" if vocab else ""))
    if (dest / "config.json").exists():
        return str(dest)
    extra = {"vocab": vocab, "corpus": corpus(corpus_chars), "shard_size": "2GB"} if vocab else {}
    t0 = time.perf_counter()
    if family == "qwen3_vl":
        from support.qwen3vl_fixture import write_checkpoint
        write_checkpoint(dest, **extra)
    elif family == "qwen3_5":
        from support.qwen35_fixture import write_checkpoint
        write_checkpoint(dest, **extra)
    else:
        from support.tiny_vlms import florence2
        florence2(dest)
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(dest / "tokenizer.json")).get_vocab_size()
    print(f"# built {dest} in {time.perf_counter() - t0:.0f} s: a {size}-token tokenizer", file=sys.stderr, flush=True)
    return str(dest)


# --- the stand-in --------------------------------------------------------------------------------


@dataclasses.dataclass
class FakeImage:
    """A Prepared of the real model's prefix size, with no pixels (nothing is encoded)."""

    prefix_len: int
    next_pos: int
    cost: int = 1
    seen: tuple[int, int] | None = (1024, 768)


class StandIn:
    """The family's loaded (tiny) EngineModel with its device work stood in for: `encode`,
    `prefix_inputs` and `forward` return tensors of the shapes the family returns (hidden states:
    seeded noise of its width), no model arithmetic. Everything else is the family's own."""

    def __init__(self, real, prefix: tuple[int, int]):
        self.real = real
        self.info, self.device, self.dtype = real.info, real.device, real.dtype
        self.causal_prefix = real.causal_prefix
        self.causal_prefix_prompt = getattr(real, "causal_prefix_prompt", False)
        if hasattr(real, "image_tokens"):  # Florence-2 reads its prefix length off itself
            real.image_tokens = prefix[0]
        self.width = real.embed_tokens(torch.zeros(1, dtype=torch.long)).shape[-1]
        # Hidden states: rows of a fixed noise bank, a different window each forward (cheap).
        self.noise = torch.randn(4099, self.width, generator=torch.Generator().manual_seed(0)).to(self.dtype) * 4
        self.calls = 0
        self.fill_masks = real.fill_masks

    def __getattr__(self, name):  # prefix_layout, own_positions, embed_*, decide, emit
        return getattr(self.real, name)

    def state_specs(self):
        """One layer, one head of width 8 of each paged kind (never read); recurrent kinds as they are."""
        return [dataclasses.replace(s, layers=1, kv_heads=1, head_dim=8) if isinstance(s, PagedKV) else s
                for s in self.real.state_specs()]

    def encode(self, images):
        return list(images)  # features: the image itself (its prefix length)

    def largest_vision_batch(self):
        return [FakeImage(*PREFIX["moondream"])]

    def prefix_inputs(self, features, prompts) -> PrefixInputs:
        n = sum(self.real.prefix_layout(f, tuple(p.tolist()))[0] for f, p in zip(features, prompts))
        positions = self.real.own_positions(torch.arange(n, device=self.device))
        return PrefixInputs(torch.zeros(n, self.width, dtype=self.dtype), positions)

    def forward(self, embeds_NC, positions, batch, cache, prefix=None):
        self.calls += 1
        rows = (torch.arange(embeds_NC.shape[0]) + self.calls * 7919) % self.noise.shape[0]
        return self.noise[rows]


# --- the timers ----------------------------------------------------------------------------------


class Clock:
    """Microseconds per part for the step in progress."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.now = dict.fromkeys(PARTS + ("body",), 0.0)  # body: the graph body (device work), not counted
        self.steps: list[dict[str, float]] = []
        self.launched = False

    def wrap(self, part: str, fn: Callable, less: tuple[str, ...] = ()) -> Callable:
        """fn, its time added to `part` (less what the parts in `less` took meanwhile)."""
        def timed(*args, **kwargs):
            before = sum(self.now[p] for p in less)
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                inner = sum(self.now[p] for p in less) - before
                self.now[part] += (self.clock() - t0) * 1e6 - inner
        return timed

    def close_step(self) -> None:
        """End of an engine step call; one that launched nothing (a pipelined engine's last call,
        or a wait) adds its time to the next."""
        if not self.launched:
            return
        self.launched = False
        self.steps.append(self.now)
        self.now = dict.fromkeys(PARTS + ("body",), 0.0)


def instrument(engine: Engine, clock: Clock, split_admission: bool = True) -> None:
    sched, runner = engine.scheduler, engine.runner
    runner.split_admission = split_admission  # as on CUDA (runner.py `_split`); an --against tree may ignore it
    if sched.fill_masks is not None:
        sched.fill_masks = clock.wrap("masks", sched.fill_masks)
    sched.schedule = clock.wrap("plan", sched.schedule, less=("masks",))
    sched.commit = clock.wrap("commit", sched.commit)
    runner.collect = clock.wrap("commit", runner.collect)
    launch = runner.launch
    runner.launch = lambda plan: (setattr(clock, "launched", True), launch(plan))[1]
    for slot in runner.staging:
        slot.upload = clock.wrap("staging", slot.upload)
        slot.upload_masks = clock.wrap("staging", slot.upload_masks)
        if hasattr(slot, "write"):  # step_inputs inside it: counted once (an --against tree may lack it)
            slot.write = clock.wrap("staging", slot.write, less=("staging",))
    runner_mod.step_inputs = clock.wrap("staging", runner_mod.step_inputs)
    # Decode-only steps: the graph path, its body (the replay on CUDA) run eagerly and not counted.
    graphs = runner.decode_graphs(capture=False)
    graphs.step = clock.wrap("body", graphs.step)  # the uncaptured body: run() calls it per step
    graphs.run = clock.wrap("staging", graphs.run, less=("body", "staging"))
    runner.graphs = graphs
    sched.admit_rows = max(1, engine.stats["rows"] // 8)  # as the engine sets it when it has graphs


_STEP_INPUTS = runner_mod.step_inputs  # restored after each run (instrument wraps it)


# --- one run -------------------------------------------------------------------------------------


def images(prefix: tuple[int, int]):
    i = 0
    while True:
        yield Sample(0, i, f"img{i:08d}", FakeImage(*prefix))
        i += 1


def run_one(family: str, mix: str, rows: int, steps: int, skip: int, workdir: Path, json_vocab: int,
            cpu_clock: bool = False, split_admission: bool = True, corpus_chars: int = 40_000_000) -> dict:
    folder = checkpoint(family, workdir, json_vocab if mix == "json" and family.startswith("qwen") else None,
                        corpus_chars)
    fam = open_family(ModelSpec(name=folder))
    settings = EngineSpec(max_batch_size=rows, max_new_tokens=64 if mix != "json" else 96, max_objects=8,
                          pipelined=True, max_images_in_flight=min(rows, 256))
    seqs = fam.sequences(mix_tasks(mix, family), settings)
    model = StandIn(fam.load("float32", "cpu"), PREFIX[family])
    engine = Engine(model, seqs, settings, PREFIX[family][0] + 64, log=lambda m: None)
    clock = Clock(time.thread_time if cpu_clock else time.perf_counter)
    instrument(engine, clock, split_admission)
    step = engine.step
    engine.step = lambda: (step(), clock.close_step())[0]
    t0 = time.perf_counter()
    labelled = 0
    try:
        for _ in engine.run(images(PREFIX[family])):
            labelled += 1
            if len(clock.steps) >= skip + steps:
                break
        # a run that ends before enough steps (tiny sizes) keeps what it has
    finally:
        runner_mod.step_inputs = _STEP_INPUTS
    wall = time.perf_counter() - t0
    measured = clock.steps[skip : skip + steps] or clock.steps
    host = [sum(s[p] for p in PARTS) for s in measured]
    out = {"family": family, "mix": mix, "rows": engine.stats["rows"], "steps": len(measured),
           "images": labelled, "wall_s": round(wall, 1), "seqs_per_image": len(seqs),
           "graph_share": round(engine.runner.graph_steps / max(engine.stats["steps"], 1), 2)}
    for p in (*PARTS, "host"):
        vals = host if p == "host" else [s[p] for s in measured]
        out[p] = {"p50": round(statistics.median(vals), 1), "p90": round(float(np.percentile(vals, 90)), 1)}
    return out


def row_line(r: dict) -> str:
    cells = " | ".join(f"{r[p]['p50']:.0f} / {r[p]['p90']:.0f}" for p in (*PARTS, "host"))
    return (f"| {r['family']} | {r['mix']} | {r['rows']} | {cells} | {r['graph_share']:.0%} | "
            f"{r['steps']} |")


def finish(args, results: list[dict]) -> None:
    print(f"# load after: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def against(args) -> None:
    """Each row in --repeat pairs of fresh processes, the other tree's and this one's alternately."""
    import subprocess
    import tempfile

    print(f"# this tree / {args.against}, p50 us per step, {args.repeat} pair(s) per row, {args.clock} clock, "
          f"load {os.getloadavg()[0]:.2f}")
    print("| family | mix | rows | staging other → this | host other → this | staging ratio | host ratio |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for family, mix, rows in itertools.product(args.families, args.mixes, args.rows):
        runs: dict[str, list[dict]] = {"other": [], "this": []}
        for _ in range(args.repeat):
            for name, tree in (("other", str(args.against)), ("this", str(ROOT))):
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "r.json"
                    cmd = [sys.executable, __file__, "--families", family, "--mixes", mix, "--rows", str(rows),
                           "--steps", str(args.steps), "--skip", str(args.skip), "--workdir", str(args.workdir),
                           "--json-vocab", str(args.json_vocab), "--clock", args.clock, "--json", str(out),
                           "--corpus-chars", str(args.corpus_chars)]
                    cmd += ["--mixed-admission"] * args.mixed_admission
                    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                                   env=os.environ | {"BENCH_HOST_TREE": tree})
                    runs[name].append(json.loads(out.read_text())[0])
        row = {"family": family, "mix": mix, "rows": rows}
        cells = []
        for part in ("staging", "host"):
            old = [r[part]["p50"] for r in runs["other"]]
            new = [r[part]["p50"] for r in runs["this"]]
            row[part] = {"other": old, "this": new,
                         "ratio": round(statistics.median(n / o for n, o in zip(new, old)), 3)}
            cells.append(f"{statistics.median(old):.0f} → {statistics.median(new):.0f}")
        results.append(row)
        print(f"| {family} | {mix} | {rows} | {cells[0]} | {cells[1]} | {row['staging']['ratio']:.2f} | "
              f"{row['host']['ratio']:.2f} |", flush=True)
    finish(args, results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=MIXES)
    ap.add_argument("--steps", type=int, default=200, help="steps measured per row of the table")
    ap.add_argument("--skip", type=int, default=40, help="ramp-up steps not measured")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/bench_host"), help="tiny checkpoints, built once")
    ap.add_argument("--json-vocab", type=int, default=QWEN_VOCAB, help="the Qwen families' vocabulary in the json mix")
    ap.add_argument("--json", type=Path, help="write the results here as well")
    ap.add_argument("--corpus-chars", type=int, default=40_000_000,
                    help="the text the json mix's tokenizer is trained on, in characters (smaller: a quicker build)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (a loaded machine's preemptions left out; json masks "
                         "on more than one thread are then undercounted)")
    ap.add_argument("--mask-threads", type=int, default=1,
                    help="xgrammar's threads filling json masks (batchvlm ships 1: models/base/grammar.py)")
    ap.add_argument("--mixed-admission", action="store_true",
                    help="admission steps as one mixed eager forward (on CUDA they split: the decode rows by their graph)")
    ap.add_argument("--against", type=Path, help="another checkout (its root): run both side by side")
    ap.add_argument("--repeat", type=int, default=3, help="--against: pairs of runs per row")
    args = ap.parse_args()
    if args.against:
        return against(args)
    if args.mask_threads != 1 and "json" in args.mixes:
        import xgrammar

        from batchvlm.models.base import grammar
        grammar._BATCH = xgrammar.BatchGrammarMatcher(max_threads=args.mask_threads)  # the filler it would make
    args.workdir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    print(f"# {os.uname().nodename}: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, torch {torch.__version__}, "
          f"json masks on {args.mask_threads} thread(s), {args.clock} clock")
    print("| family | mix | rows | plan us p50 / p90 | masks | staging | commit | host | graph steps | steps |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for family, mix, rows in itertools.product(args.families, args.mixes, args.rows):
        r = run_one(family, mix, rows, args.steps, args.skip, args.workdir, args.json_vocab,
                    args.clock == "cpu", not args.mixed_admission, args.corpus_chars)
        results.append(r)
        print(row_line(r), flush=True)
    finish(args, results)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Deterministic per-step costs of the engine on the demo workload: host Python calls, torch ops
and host<->device copies per engine step, and the functions with the most calls. Counts, not
times, so two engine versions compare on a loaded machine.

    python scripts/engine_counts.py                          # this checkout
    python scripts/engine_counts.py --against ../old         # this checkout vs another one, side by side

With --against, each tree runs in its own process (PYTHONPATH set to it) and the figures are
printed in two columns. Works with the engine before contract v2 (`MoondreamEngine`) and after.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

TOP = 25


def measure(images: int, batch: int, pipelined: bool) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from batchvlm.engine.engine import Engine
    try:
        from batchvlm.models.base.contract import SampleLike  # noqa: F401 - the engine takes samples

        def item(i, p):
            from batchvlm.data.loader import Sample
            return Sample(0, i, str(i), p)

        def index(done):
            return done.sample.index
    except ImportError:  # a tree from before the engine took the loader's samples (WorkItem, ticket)
        try:
            from batchvlm.models.base.contract import WorkItem
        except ImportError:  # a tree from before WorkItem moved beside the family interface
            from batchvlm.engine.labeler import WorkItem

        def item(i, p):
            return WorkItem(i, p, str(i))

        def index(done):
            return done.ticket
    from batchvlm.job import EngineSpec, ModelSpec
    from batchvlm.models.registry import open_family
    from batchvlm.shapes.world import SPEC, draw_scene
    from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

    torch.set_num_threads(1)
    tasks = [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": "how many shapes are there?"}),
             DetectTask(detect={"objects": ["circle", "square", "triangle"]}),
             PointTask(point={"objects": ["red circle", "blue square"]})]
    family = open_family(ModelSpec(name="demo"))
    model = family.load("float32", "cpu")
    seqs = family.sequences(tasks, EngineSpec(max_new_tokens=32, max_objects=10))
    pre = family.preprocessor()
    rng = random.Random(0)
    prepared = [pre(draw_scene(rng, SPEC)[0]) for _ in range(images)]
    spec = EngineSpec(max_batch_size=batch, pipelined=pipelined, cuda_graphs=False,
                      max_images_in_flight=max(8, 2 * batch // len(seqs)))

    def run(engine: Engine) -> list:
        items = [item(i, p) for i, p in enumerate(prepared)]
        return [index(done) for done in engine.run(items)]

    run(Engine(model, seqs, spec, family.max_prefix_len(), log=lambda m: None))  # warm: lazy imports, caches

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter[str] = Counter()
            self.elements: Counter[str] = Counter()  # output elements: a shape change shows here

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket.__name__)
            self.ops[name] += 1
            out = func(*args, **(kwargs or {}))
            self.elements[name] += sum(t.numel() for t in (out if isinstance(out, (tuple, list)) else [out])
                                       if isinstance(t, torch.Tensor))
            return out

    engine = Engine(model, seqs, spec, family.max_prefix_len(), log=lambda m: None)
    prof = cProfile.Profile()  # Python calls: without the op counter, whose calls would count too
    prof.enable()
    run(engine)
    prof.disable()
    with Ops() as ops:
        run(Engine(model, seqs, spec, family.max_prefix_len(), log=lambda m: None))
    steps = engine.stats["steps"]
    st = pstats.Stats(prof)
    calls = sum(v[1] for v in st.stats.values())  # primitive + recursive calls of every function
    every: Counter[str] = Counter()
    for k, v in st.stats.items():
        every[f"{Path(k[0]).name}:{k[2]}"] += v[1]
    by_fn = sorted(((v[1], f"{Path(k[0]).name}:{k[2]}") for k, v in st.stats.items()
                    if "batchvlm" in k[0]), reverse=True)[:TOP]
    return {"steps": steps, "python_calls_per_step": calls / steps, "torch_ops_per_step": sum(ops.ops.values()) / steps,
            "copies_per_step": (ops.ops["_to_copy"] + ops.ops["copy_"]) / steps,
            "output_elements_per_step": sum(ops.elements.values()) / steps,
            "top_elements_per_step": {k: v / steps for k, v in ops.elements.most_common(TOP)},
            "top_batchvlm_calls_per_step": {name: n / steps for n, name in by_fn},
            "top_ops_per_step": {k: v / steps for k, v in ops.ops.most_common(TOP)},
            "calls_per_step": {k: v / steps for k, v in every.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=24)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--pipelined", action="store_true")
    ap.add_argument("--against", type=Path, default=None, help="another checkout: print both side by side")
    ap.add_argument("--json", action="store_true", help="print this tree's figures as JSON (used by --against)")
    a = ap.parse_args()
    if a.against is None:
        r = measure(a.images, a.batch, a.pipelined)
        print(json.dumps(r) if a.json else json.dumps(r, indent=1))
        return 0
    here = Path(__file__).resolve().parents[1]
    results = {}
    for name, tree in (("this", here), ("against", a.against.resolve())):
        env = os.environ | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
        args = [sys.executable, str(Path(__file__).resolve()), "--json", "--images", str(a.images),
                "--batch", str(a.batch)] + (["--pipelined"] if a.pipelined else [])
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
    this, other = results["this"], results["against"]
    print(f"demo model, mixed workload, {a.images} images, batch {a.batch}, "
          f"{'pipelined' if a.pipelined else 'synchronous'}, CPU\n")
    print(f"{'':32} {'this':>12} {'against':>12}")
    for k in ("steps", "python_calls_per_step", "torch_ops_per_step", "copies_per_step", "output_elements_per_step"):
        print(f"{k:32} {this[k]:12.1f} {other[k]:12.1f}")
    both = set(this["calls_per_step"]) | set(other["calls_per_step"])
    delta = {k: this["calls_per_step"].get(k, 0) - other["calls_per_step"].get(k, 0) for k in both}
    this["largest_differences"] = {k: this["calls_per_step"].get(k, 0)
                                   for k in sorted(delta, key=lambda k: -abs(delta[k]))[:TOP]}
    other["largest_differences"] = {k: other["calls_per_step"].get(k, 0) for k in this["largest_differences"]}
    for section in ("top_batchvlm_calls_per_step", "top_ops_per_step", "top_elements_per_step", "largest_differences"):
        print(f"\n{section}")
        for key in list(dict.fromkeys([*this[section], *other[section]])):
            print(f"  {key[:48]:48} {this[section].get(key, 0):10.1f} {other[section].get(key, 0):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

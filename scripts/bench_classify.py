"""classify vs query: engine time of a classify with 10 choices against a query with
max_new_tokens 8 on the same images (alternated A B A B, so both see the same machine load) and,
on the demo model, accuracy of "how many shapes are there?" as a classify over the count words
against the free-text query, on fresh shapes scenes.

    python scripts/bench_classify.py [--images 200] [--repeats 3]          # the demo model, CPU
    python scripts/bench_classify.py --model qwen3_vl --config mid --images 32
        # a random-weight Qwen3-VL (scripts/bench_qwen3vl.py's configs), whose free answers run
        # to max_new_tokens: query decodes 8 tokens, classify none
    python scripts/bench_classify.py --model qwen3_vl --config 2b --device cuda --dtype bfloat16 --batch 256

The demo answers a count in one token, so its query is one prefill step and one decode step.
Also timed: a query with max_new_tokens 1 (vision + prefill, no decode loop), about the least a
classify can cost, so query(8) / query(1) bounds what classify can gain on a workload.
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
import time
from pathlib import Path

import torch

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.registry import open_family
from batchvlm.shapes.world import COUNT_QUESTION, NUMBERS, SPEC, draw_scene
from batchvlm.tasks import ClassifyTask, QueryTask

TEN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def label(family, model, tasks, prepared, batch: int) -> tuple[list[dict], tuple[float, float]]:
    """-> each image's columns, (wall, process CPU) seconds of the engine's run (on a loaded CPU
    machine the CPU seconds are the steadier of the two)."""
    if model.device.type == "cuda":  # each arm's engine sizes its KV cache from the same free memory
        gc.collect()
        torch.cuda.empty_cache()
    seqs = family.sequences(tasks, EngineSpec(max_new_tokens=8))
    engine = Engine(model, seqs, EngineSpec(max_new_tokens=8, max_batch_size=batch), family.max_prefix_len())
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t0, c0 = time.perf_counter(), time.process_time()
    done = {im.sample.index: [s.output for s in im.seqs] for im in engine.run(Sample(0, i, f"k{i}", p)
                                                                         for i, p in enumerate(prepared))}
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - t0, time.process_time() - c0
    return [family.columns(tasks, seqs, done[i]) for i in range(len(prepared))], seconds


def random_checkpoint(name: str, config: str, dest: Path) -> Path:
    """A random-weight checkpoint of scripts/bench_qwen3vl.py's shapes, written by transformers."""
    import bench_qwen3vl as bq

    fixture, _, configs, _ = bq.FAMILIES[name]
    return fixture.write_checkpoint(dest, seed=0, corpus=bq.CORPUS, **configs[config])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["demo", "qwen3_vl", "qwen3_5"], default="demo")
    ap.add_argument("--config", choices=["tiny", "mid", "2b"], default="mid", help="random Qwen shapes")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        name = "demo" if args.model == "demo" else str(random_checkpoint(args.model, args.config, Path(tmp)))
        family = open_family(ModelSpec(name=name))
        model = family.load(args.dtype, args.device)
        rng = random.Random(1234)
        scenes = [draw_scene(rng, SPEC) for _ in range(args.images)]
        pre = family.preprocessor()
        prepared = [pre(im) for im, _ in scenes]
        query = [QueryTask(query={"question": COUNT_QUESTION, "max_new_tokens": 8, "name": "q"})]
        ten = [ClassifyTask(classify={"question": COUNT_QUESTION, "choices": TEN, "name": "c"})]
        rows_q, _ = label(family, model, query, prepared, args.batch)  # also the warm-up of each
        rows_t, _ = label(family, model, ten, prepared, args.batch)
        if args.model == "demo":
            truth = [scene.answer(COUNT_QUESTION) for _, scene in scenes]
            counts = [ClassifyTask(classify={"question": COUNT_QUESTION, "choices": list(NUMBERS), "name": "c"})]
            rows_c, _ = label(family, model, counts, prepared, args.batch)
            acc = lambda rows, col: sum(r[col] == t for r, t in zip(rows, truth)) / len(truth)  # noqa: E731
            print(f"{args.images} scenes: query exact {acc(rows_q, 'q'):.3f}, classify({len(NUMBERS)}) "
                  f"{acc(rows_c, 'c'):.3f}, classify(10) {acc(rows_t, 'c'):.3f}")
        tokens = [len(family.tokenizer.encode(r["q"])) for r in rows_q]
        print(f"{args.model} ({'' if args.model == 'demo' else args.config + ', '}{args.device}, {args.dtype}), "
              f"batch {args.batch}: query answers {sum(tokens) / len(tokens):.1f} tokens on average")
        # A query that stops after its first token costs vision + prefill, about what a classify
        # can cost at best: query(8) / query(1) is the most classify can gain on this workload.
        one = [QueryTask(query={"question": COUNT_QUESTION, "max_new_tokens": 1, "name": "q"})]
        label(family, model, one, prepared, args.batch)
        times: dict[str, list[tuple[float, float]]] = {"query(8)": [], "classify(10)": [], "query(1)": []}
        for _ in range(args.repeats):  # alternate A / B / C
            for arm, tasks in zip(times, (query, ten, one)):
                times[arm].append(label(family, model, tasks, prepared, args.batch)[1])
        for k, what in enumerate(("wall", "CPU")):
            q, c, q1 = (min(t[k] for t in times[arm]) for arm in times)
            print(f"engine {what} time, best of {args.repeats}: query(max_new_tokens 8) {q:.2f} s, classify(10) "
                  f"{c:.2f} s, query(max_new_tokens 1) {q1:.2f} s; query / classify {q / c:.2f}x (each run: "
                  f"{[round(a[k] / b[k], 2) for a, b in zip(times['query(8)'], times['classify(10)'])]}), "
                  f"query(8) / query(1) {q / q1:.2f}x")

if __name__ == "__main__":
    main()

"""classify vs query on the demo model, on fresh shapes scenes: accuracy of "how many shapes are
there?" as a classify over the count words against the free-text query, and engine time of a
classify with 10 choices against a query with max_new_tokens 8 on the same images (alternated,
so both see the same machine load).

    python scripts/bench_classify.py [--images 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import time

from batchvlm.engine.engine import Engine
from batchvlm.engine.labeler import WorkItem
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.registry import open_family
from batchvlm.shapes.world import COUNT_QUESTION, NUMBERS, SPEC, draw_scene
from batchvlm.tasks import ClassifyTask, QueryTask

TEN = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def label(family, model, tasks, prepared, batch: int) -> tuple[list[dict], float]:
    seqs = family.sequences(tasks, EngineSpec(max_new_tokens=8))
    engine = Engine(model, seqs, EngineSpec(max_new_tokens=8, max_batch_size=batch), family.max_prefix_len())
    t0 = time.perf_counter()
    done = {im.ticket: [s.output for s in im.seqs] for im in engine.run(WorkItem(i, p, f"k{i}")
                                                                         for i, p in enumerate(prepared))}
    seconds = time.perf_counter() - t0
    return [family.columns(tasks, seqs, done[i]) for i in range(len(prepared))], seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    family = open_family(ModelSpec(name="demo"))
    model = family.load("float32", "cpu")
    rng = random.Random(1234)
    scenes = [draw_scene(rng, SPEC) for _ in range(args.images)]
    pre = family.preprocessor()
    prepared = [pre(im) for im, _ in scenes]
    truth = [scene.answer(COUNT_QUESTION) for _, scene in scenes]
    query = [QueryTask(query={"question": COUNT_QUESTION, "max_new_tokens": 8, "name": "q"})]
    counts = [ClassifyTask(classify={"question": COUNT_QUESTION, "choices": list(NUMBERS), "name": "c"})]
    ten = [ClassifyTask(classify={"question": COUNT_QUESTION, "choices": TEN, "name": "c"})]
    rows_q, _ = label(family, model, query, prepared, args.batch)
    rows_c, _ = label(family, model, counts, prepared, args.batch)
    rows_t, _ = label(family, model, ten, prepared, args.batch)
    acc = lambda rows, col: sum(r[col] == t for r, t in zip(rows, truth)) / len(truth)  # noqa: E731
    print(f"{args.images} scenes: query exact {acc(rows_q, 'q'):.3f}, classify({len(NUMBERS)}) {acc(rows_c, 'c'):.3f}, "
          f"classify(10) {acc(rows_t, 'c'):.3f}")
    tq, tc = [], []
    for _ in range(args.repeats):  # alternate A / B
        tq.append(label(family, model, query, prepared, args.batch)[1])
        tc.append(label(family, model, ten, prepared, args.batch)[1])
    q, c = min(tq), min(tc)
    print(f"engine time, best of {args.repeats}: query(max_new_tokens 8) {q:.2f} s, classify(10) {c:.2f} s, "
          f"query / classify {q / c:.2f}x (each run: {[round(a / b, 2) for a, b in zip(tq, tc)]})")


if __name__ == "__main__":
    main()

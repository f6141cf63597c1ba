"""Scoring a model (in memory) on fresh shapes scenes drawn from the spec."""

from __future__ import annotations

import io
import random

from PIL import Image

from ..models.base.decoding import MODE_TEXT, SeqSpec
from ..models.moondream.grammar import MODE_DETECT, MODE_POINT, spec
from ..models.moondream.generate import generate
from ..models.moondream.model import MoondreamModel
from ..models.moondream.preprocess import Preprocessor
from .metrics import Scores
from .vocab import TEMPLATES
from .world import COLOURS, KINDS, SPEC, draw_scene, encode


def eval_queries(scene, rng: random.Random) -> list[str]:
    """Every kind, plus two colour+kind queries (one present when possible)."""
    present = [f"{s.colour} {s.kind}" for s in scene.shapes]
    every = [f"{c} {k}" for c in COLOURS for k in KINDS]
    return list(KINDS) + [rng.choice(present), rng.choice(every)]


def score_model(model: MoondreamModel, tokenizer, pre: Preprocessor, n_images: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    scores = Scores()
    for _ in range(n_images):
        image, scene = draw_scene(rng, SPEC)
        data, _ = encode(image, rng)
        image = Image.open(io.BytesIO(data)).convert("RGB")
        questions = scene.questions()
        queries = eval_queries(scene, rng)
        q, d, p = TEMPLATES["query"], TEMPLATES["detect"], TEMPLATES["point"]
        specs = [SeqSpec(MODE_TEXT, tuple(TEMPLATES["caption"]["normal"]), 40)]
        specs += [SeqSpec(MODE_TEXT, tuple(q["prefix"] + tokenizer.encode(x) + q["suffix"] * 2), 8) for x in questions]
        specs += [spec(MODE_DETECT, tuple(d["prefix"] + tokenizer.encode(" " + x) + d["suffix"]), 10) for x in queries]
        specs += [spec(MODE_POINT, tuple(p["prefix"] + tokenizer.encode(" " + x) + p["suffix"]), 10) for x in queries]
        outs = generate(model, [pre(image)], specs)[0]
        scores.add_caption(scene, tokenizer.decode(outs[0].tokens))
        for x, o in zip(questions, outs[1:]):
            scores.add_query(scene, x, tokenizer.decode(o.tokens))
        n = 1 + len(questions)
        for x, o in zip(queries, outs[n : n + len(queries)]):
            scores.add_detect(scene, x, o.objects)
        for x, o in zip(queries, outs[n + len(queries) :]):
            scores.add_point(scene, x, o.objects)
    return {k: round(v, 4) for k, v in scores.table().items()}


def score_output(out_dir) -> tuple[dict[str, float], int]:
    """Score a job's output folder against the `<key>.json` ground truth in its input shards.
    -> (metrics of the task kinds the job ran that the shapes truth can score, number of images)."""
    from ..output.reader import Output
    from ..tasks import args_of, column_of, kind_of
    from .shards import read_truth

    output = Output.open(out_dir)
    scores = Scores()
    kinds: set[str] = set()
    n, truth, truth_of = 0, {}, None
    for shard, row in output.rows():  # rows come shard by shard
        if truth_of != shard.stem:
            truth, truth_of = read_truth(shard.url), shard.stem
        scene = truth.get(row["key"])
        if scene is None or row["status"] != "ok":
            continue
        n += 1
        for task in output.job.tasks:
            kind, value = kind_of(task), row.get(column_of(task))
            kinds.add(kind)
            if kind == "caption":
                scores.add_caption(scene, value)
            elif kind == "query":
                scores.add_query(scene, args_of(task).question, value)
            elif kind == "classify":
                scores.add_classify(scene, args_of(task).question, value)
            elif kind in ("detect", "point"):
                for obj in args_of(task).objects:
                    mine = [v for v in value if v["label"] == obj]
                    if kind == "detect":
                        scores.add_detect(scene, obj, [(b["x_min"], b["y_min"], b["x_max"], b["y_max"]) for b in mine])
                    else:
                        scores.add_point(scene, obj, [(p["x"], p["y"]) for p in mine])
    names = {"caption": "caption_exact", "query": "query_exact", "detect": "detect_f1@0.5", "point": "point_f1",
             "classify": "classify_exact"}  # other kinds have no shapes ground truth
    table = scores.table()
    return {names[k]: round(table[names[k]], 4) for k in names if k in kinds}, n

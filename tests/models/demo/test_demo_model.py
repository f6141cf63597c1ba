"""The shipped demo model labels the shapes world right, through the real pipeline."""

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.dataset as ds
import yaml
from support.moondream import LoadedMoondream
from support.paths import DATA, REPO

from batchvlm.data.loader import Sample
from batchvlm.engine.engine import Engine
from batchvlm.job import EngineSpec, load_job
from batchvlm.models.moondream.generate import generate
from batchvlm.shapes.evaluate import score_model, score_output
from batchvlm.shapes.world import SPEC, draw_scene



def test_demo_job_meets_the_quality_bar(tmp_path):
    job = yaml.safe_load((REPO / "jobs" / "demo.yaml").read_text())
    shutil.copytree(REPO / "jobs" / "data", tmp_path / "data")
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(job))
    r = subprocess.run([sys.executable, "-m", "batchvlm.cli", "run", str(tmp_path / "demo.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    metrics, n = score_output(tmp_path / "out" / "shapes-demo")
    assert n == 100 and set(metrics) == {"caption_exact", "query_exact", "detect_f1@0.5", "point_f1"}
    assert min(metrics.values()) >= 0.9, metrics
    # The labels are exactly those of the demo job before the family boundary (issue 18).
    table = ds.dataset(sorted((tmp_path / "out" / "shapes-demo").glob("*.parquet")), format="parquet").to_table()
    got = sorted(({"shard": Path(r["source"]).name} | {k: r[k] for k in ("key", "caption", "n_shapes", "detect", "point")}
                  for r in table.to_pylist()), key=lambda r: (r["shard"], r["key"]))
    before = [json.loads(line) for line in (DATA / "demo-labels-before-family-boundary.jsonl").open()]
    assert got == before


def test_fresh_scenes_meet_the_quality_bar():
    md = LoadedMoondream("demo")
    scores = score_model(md.model, md.family.tokenizer, md.preprocessor, 60, seed=31337)
    assert min(scores.values()) >= 0.9, scores


def test_demo_labels_identical_across_engine_modes_and_the_simple_generation():
    job = load_job(REPO / "jobs" / "demo.yaml")
    md = LoadedMoondream("demo")
    seqs = md.sequences(job.tasks, job.engine.max_new_tokens, job.engine.max_objects)
    rng = random.Random(77)
    prepared = [md.preprocessor(draw_scene(rng, SPEC)[0]) for _ in range(40)]
    reference = [[(o.tokens, o.objects) for o in img] for img in generate(md.model, prepared, [s.spec for s in seqs])]
    for batch in (1, 7, 64, 256):
        # batches of 1 and 7 rows hold at most two images' sequences at once: 8 images take their paths
        n = 8 if batch < 2 * len(seqs) else len(prepared)
        for pipelined in (False, True):
            engine = Engine(md.engine, seqs, EngineSpec(max_batch_size=batch, pipelined=pipelined), md.P)
            out = {im.sample.index: [(s.output.tokens, s.output.objects) for s in im.seqs]
                   for im in engine.run(Sample(0, i, str(i), p) for i, p in enumerate(prepared[:n]))}
            assert [out[i] for i in range(n)] == reference[:n], (batch, pipelined)

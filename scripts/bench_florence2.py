#!/usr/bin/env python
"""Florence-2 throughput, native vs transformers, on the same images and tasks, in one run:

  (a) transformers  the transformers backend's labeler: batched `generate`, one call per task
                    sequence over a batch of images (each call runs the vision tower again)
  (b) native        batchvlm's Florence-2 on its engine: vision once per image, the encoder once
                    per (image, prompt) prefix, every sequence continuously batched

Both greedy, same random-weight checkpoint (written by transformers itself), float32; the
labels (token ids) of both must be identical (checked). The runners alternate (a b a b ...)
and the ratio is taken pair by pair, so a machine whose speed drifts still gives a fair ratio.
Each run's process CPU time is reported beside its wall time: on a machine shared with other
jobs (more runnable threads than cores) wall time also counts the waits for a core, CPU time not.
Workload: 4 tasks per image (short caption, query, detect one object, OCR).

    python scripts/bench_florence2.py                      # CPU, the mid-size config
    python scripts/bench_florence2.py --config base        # Florence-2-base shapes (random weights)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from pydantic import TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the random hub-layout checkpoint
from support.tiny_vlms import florence2  # noqa: E402

from batchvlm.data.loader import Sample  # noqa: E402
from batchvlm.engine.engine import EngineLabeler  # noqa: E402
from batchvlm.job import EngineSpec, ModelSpec  # noqa: E402
from batchvlm.models.registry import open_family  # noqa: E402
from batchvlm.tasks import Task  # noqa: E402

TASKS = [{"caption": {"length": "short"}}, {"query": {"question": "What is in the picture?"}},
         {"detect": {"objects": ["car"]}}, {"ocr": {}}]
CONFIGS = {
    # Florence-2's proportions (the vision tower the larger part of an image's work), scaled down
    # to minutes on 2 CPU cores
    "mid": dict(side=512, text=dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                                    decoder_attention_heads=6, encoder_ffn_dim=1536, decoder_ffn_dim=1536,
                                    max_position_embeddings=1024),
                vision=dict(depths=[1, 1, 3, 1], patch_size=[7, 3, 3, 3], patch_stride=[4, 2, 2, 2],
                            patch_padding=[3, 1, 1, 1], patch_prenorm=[False, True, True, True],
                            embed_dim=[64, 128, 256, 512], num_heads=[2, 4, 8, 16], num_groups=[2, 4, 8, 16],
                            window_size=8, max_position_embeddings=50, max_temporal_embeddings=100)),
    # Florence-2-base's shapes
    "base": dict(side=768, text=dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                                     decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072,
                                     max_position_embeddings=1024),
                 vision=dict(depths=[1, 1, 9, 1], patch_size=[7, 3, 3, 3], patch_stride=[4, 2, 2, 2],
                             patch_padding=[3, 1, 1, 1], patch_prenorm=[False, True, True, True],
                             embed_dim=[128, 256, 512, 1024], num_heads=[4, 8, 16, 32], num_groups=[4, 8, 16, 32],
                             window_size=12, max_position_embeddings=50, max_temporal_embeddings=100)),
}


def make_images(n: int) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    sizes = [(640, 480), (480, 640), (512, 384), (800, 600)]
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in
            (sizes[i % len(sizes)] for i in range(n))]


def runner(backend: str, folder: Path, images: list[Image.Image], engine: EngineSpec, device: str):
    family = open_family(ModelSpec(name=str(folder), backend=backend))
    tasks = [TypeAdapter(Task).validate_python(t) for t in TASKS]
    seqs = family.sequences(tasks, engine)
    model = family.load("float32", device)
    pre = family.preprocessor()
    prepared = [pre(im) for im in images]

    # Start-up once, outside the timed runs, as a job does once per process: the engine's
    # cache allocation (its start-up seconds are printed).
    t0 = time.perf_counter()
    labeler = (EngineLabeler(model, seqs, engine, family.max_prefix_len(), log=lambda _: None)
               if backend == "native" else model.labeler(seqs, engine))
    print(f"# {backend} labeler start-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def run() -> list[list[tuple[int, ...]]]:
        # fresh samples each run: the engine drops a sample's pixels once it has encoded them
        out = {s.index: raws for s, raws in labeler.label(Sample(0, i, str(i), p) for i, p in enumerate(prepared))}
        return [[tuple(r.tokens) for r in out[i]] for i in range(len(images))]

    return run, len(seqs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=list(CONFIGS), default="mid")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--hf-batch", type=int, default=16, help="images per transformers generate call")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--pairs", type=int, default=3, help="a / b runs, alternating")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench-florence2-"))
    t0 = time.perf_counter()
    florence2(folder, seed=0, **CONFIGS[args.config])
    print(f"# checkpoint written in {time.perf_counter() - t0:.1f} s: {folder}", file=sys.stderr)
    images = make_images(args.images)
    hf_engine = EngineSpec(max_new_tokens=args.max_new_tokens, max_batch_size=args.hf_batch)
    hf, n_seqs = runner("transformers", folder, images, hf_engine, args.device)
    native_engine = EngineSpec(max_new_tokens=args.max_new_tokens, max_batch_size=args.hf_batch * n_seqs)
    native, _ = runner("native", folder, images, native_engine, args.device)
    print(f"# bench_florence2: config={args.config} device={args.device} torch={torch.__version__} "
          f"threads={torch.get_num_threads()} images={args.images} sequences/image={n_seqs} "
          f"max_new_tokens={args.max_new_tokens} hf images/call={args.hf_batch} native sequences/batch="
          f"{native_engine.max_batch_size} pairs={args.pairs}")
    times: dict[str, list[float]] = {"transformers": [], "native": []}
    cpu: dict[str, list[float]] = {"transformers": [], "native": []}
    outputs = {}
    with torch.inference_mode():
        for _ in range(args.pairs):
            for label, fn in (("transformers", hf), ("native", native)):
                t, c = time.perf_counter(), time.process_time()
                outputs[label] = fn()
                times[label].append(time.perf_counter() - t)
                cpu[label].append(time.process_time() - c)
                print(json.dumps({label: round(times[label][-1], 3), "cpu_s": round(cpu[label][-1], 3)}),
                      file=sys.stderr, flush=True)
    same = outputs["transformers"] == outputs["native"]
    ratios = [a / b for a, b in zip(times["transformers"], times["native"])]
    cpu_ratios = [a / b for a, b in zip(cpu["transformers"], cpu["native"])]
    result = {"config": args.config, "images": args.images, "sequences_per_image": n_seqs,
              "transformers_s": [round(t, 3) for t in times["transformers"]],
              "native_s": [round(t, 3) for t in times["native"]],
              "speedup_median": round(statistics.median(ratios), 2), "speedups": [round(r, 2) for r in ratios],
              "transformers_cpu_s": [round(t, 3) for t in cpu["transformers"]],
              "native_cpu_s": [round(t, 3) for t in cpu["native"]],
              "cpu_speedup_median": round(statistics.median(cpu_ratios), 2),
              "cpu_speedups": [round(r, 2) for r in cpu_ratios],
              "labels_identical": same,
              "tokens": sum(len(t) for img in outputs["native"] for t in img)}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

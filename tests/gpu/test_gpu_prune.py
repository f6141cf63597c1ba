"""Duplicate-token pruning on CUDA (issue 43): the demo model's pruned labels in CUDA graphs equal
its eager ones there, and agree with its pruned labels on the CPU (float32 both; the kept-patch
tower's per-crop attention grouped by length and the prefix's position gaps run on the device's
kernels, whose sums differ from the CPU's: a near tie may flip a token, as in test_gpu.py's
CPU comparisons)."""

import random

import pytest
import torch
from support.moondream import LoadedMoondream, run_engine

from batchvlm.models.moondream.preprocess import Preprocessor
from batchvlm.shapes.world import COUNT_QUESTION, SPEC, draw_scene
from batchvlm.tasks import CaptionTask, DetectTask, PointTask, QueryTask

pytestmark = pytest.mark.gpu

TASKS = [CaptionTask(caption={"length": "normal"}), QueryTask(query={"question": COUNT_QUESTION}),
         DetectTask(detect={"objects": ["circle", "square"]}), PointTask(point={"objects": ["red circle"]})]


def test_pruned_demo_labels_on_cuda_equal_the_cpu():
    torch._dynamo.reset()
    rng = random.Random(43)
    images = [draw_scene(rng, SPEC)[0] for _ in range(32)]
    labels = {}
    for device in ("cpu", "cuda"):
        md = LoadedMoondream("demo", device=device, dtype="float32")
        pre = Preprocessor(md.config.vision, md.family.max_crops, 0.0)
        prepared = [pre(im) for im in images]
        seqs = md.sequences(TASKS, 24, 6)
        graphs = (False, True) if device == "cuda" else (False,)
        for g in graphs:
            labels[device, g] = run_engine(md, prepared, seqs, max_batch_size=64, pipelined=True,
                                           **({"cuda_graphs": g} if device == "cuda" else {}))
    assert labels["cuda", True] == labels["cuda", False]
    pairs = [(a, b) for img_a, img_b in zip(labels["cuda", False], labels["cpu", False]) for a, b in zip(img_a, img_b)]
    share = sum(a == b for a, b in pairs) / len(pairs)
    print(f"pruned demo: {share:.0%} of the sequences equal the CPU engine's")
    assert share >= 0.9

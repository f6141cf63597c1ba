"""Florence-2's shared test pieces: the tasks, transformers' model and processor as the reference,
random images of varied sizes, flat ones for duplicate pruning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import TypeAdapter

from batchvlm.tasks import Task

TASKS = [{"caption": {"length": "short"}}, {"query": {"question": "What is it?"}},
         {"detect": {"objects": ["car", "dog"]}}, {"ocr": {}}, {"regions": {}}]
NEW_TOKENS = 10


def tf():
    return pytest.importorskip("transformers")


class Reference:
    """transformers' model and processor for one checkpoint."""

    def __init__(self, folder: Path):
        from batchvlm.models.transformers_backend.processor import load_processor

        self.model = tf().Florence2ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        self.processor = load_processor(tf(), "florence2", folder)
        self.eos = self.model.generation_config.eos_token_id

    def inputs(self, image: Image.Image, text: str):
        return self.processor(images=image, text=text, return_tensors="pt")

    @torch.inference_mode()
    def generate(self, images: list[Image.Image], text: str, budget: int = NEW_TOKENS) -> list[tuple[int, ...]]:
        """Greedy tokens of each image with one prompt, in one batched call: every row has the
        same prompt, so nothing is padded."""
        enc = self.processor(images=images, text=[text] * len(images), return_tensors="pt")
        out = []
        for ids in self.model.generate(**enc, do_sample=False, num_beams=1, max_new_tokens=budget)[:, 1:].tolist():
            out.append(tuple(ids[: ids.index(self.eos)] if self.eos in ids else ids))
        return out


def random_images(n: int, seed: int = 0) -> list[Image.Image]:
    """Images of varied sizes and aspect ratios (the resize to the square input is exercised)."""
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (int(rng.integers(20, 120)), int(rng.integers(20, 120)), 3),
                                        dtype=np.uint8)) for _ in range(n)]


def flat_images(side: int, n: int = 4) -> list[Image.Image]:
    """side x side flat backgrounds with two rectangles each (duplicate pruning drops most of their
    cells), then one noise image (it drops none)."""
    rng = np.random.default_rng(side)
    out = []
    for i in range(n):
        a = np.full((side, side, 3), (230 - 40 * i, 220, 200 + 10 * i), dtype=np.uint8)
        for _ in range(2):
            w, h = (int(v) for v in rng.integers(side // 8, side // 3, 2))
            x, y = (int(v) for v in rng.integers(0, side - w, 2))
            a[y : y + h, x : x + w] = rng.integers(0, 256, 3, dtype=np.uint8)
        out.append(Image.fromarray(a))
    out.append(Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)))
    return out


def tasks_of(specs: list[dict]) -> list:
    return [TypeAdapter(Task).validate_python(t) for t in specs]

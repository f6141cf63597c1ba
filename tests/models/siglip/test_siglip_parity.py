"""SigLIP parity with transformers on tiny random checkpoints: pixel values bit-equal to the image
processor's, texts equal to the tokenizer's (as the zero-shot pipeline calls it), image embeddings
within 1e-5 of get_image_features (normalized), classify probabilities (softmax of
logits_per_image over the choices) and similarity (sigmoid of an image's logit with its own text)
within 1e-5, at batch 1 / 7 / 64, through the image-level labeler."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from batchvlm.engine.images import ImageLabeler
from batchvlm.job import EngineSpec, ModelSpec
from batchvlm.models.registry import open_family
from batchvlm.tasks import Task
from pydantic import TypeAdapter
from support.siglip_fixture import random_images, siglip2_checkpoint, siglip_checkpoint

tf = pytest.importorskip("transformers")
CHOICES = ["cat", "Dog", "red car", "a b c"]


@pytest.fixture(scope="module", params=["siglip2", "siglip"])
def checkpoint(request, tmp_path_factory):
    build = siglip2_checkpoint if request.param == "siglip2" else siglip_checkpoint
    return request.param, build(tmp_path_factory.mktemp(request.param))


class Reference:
    def __init__(self, kind: str, folder):
        self.kind = kind
        self.model = tf.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = tf.AutoTokenizer.from_pretrained(folder)
        if kind == "siglip2":
            from transformers.models.siglip2.image_processing_pil_siglip2 import Siglip2ImageProcessorPil

            self.images = Siglip2ImageProcessorPil.from_pretrained(folder)
        else:
            from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

            self.images = SiglipImageProcessorPil.from_pretrained(folder)

    def pixels(self, images):
        return self.images(images=images, return_tensors="pt")

    def text(self, texts):  # the zero-shot pipeline's call for SigLIP models
        return self.tokenizer(texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")

    @torch.inference_mode()
    def image_embeds(self, images):
        out = self.model.get_image_features(**self.pixels(images)).pooler_output
        return out / out.norm(dim=-1, keepdim=True)

    @torch.inference_mode()
    def logits(self, images, texts):
        return self.model(**self.pixels(images), **self.text(texts)).logits_per_image


def tasks(*specs) -> list:
    return [TypeAdapter(Task).validate_python(t) for t in specs]


def label(family, model, task_list, images, texts=None):
    seqs = family.sequences(task_list, EngineSpec())
    pre = family.preprocessor()
    samples = [SimpleNamespace(key=str(i), prepared=pre(im), meta={"txt": texts[i]} if texts else None, seen=None)
               for i, im in enumerate(images)]
    order = {id(s): i for i, s in enumerate(samples)}
    rows = [None] * len(samples)
    for s, raws in ImageLabeler(model, seqs, EngineSpec()).label(samples):
        rows[order[id(s)]] = family.columns(task_list, seqs, raws)
    return rows


def test_pixels_equal_the_processor(checkpoint):
    kind, folder = checkpoint
    family = open_family(ModelSpec(name=str(folder)))
    model = family.load("float32", "cpu")
    ref = Reference(kind, folder)
    pre = family.preprocessor()
    for im in random_images(12, seed=3):
        prepared = pre(im)
        ours = model.pixel_values([prepared], prepared.prefix_len)[0]
        out = ref.pixels([im])
        if kind == "siglip2":
            assert tuple(out["spatial_shapes"][0].tolist()) == prepared.grid
            theirs = out["pixel_values"][0, : prepared.prefix_len]
        else:  # [3, H, W] -> the patches' order: rows, columns, then (y, x, channel) in a patch
            p = 4
            x = out["pixel_values"][0]
            g = x.shape[1] // p
            theirs = x.reshape(3, g, p, g, p).permute(1, 3, 2, 4, 0).reshape(g * g, -1)
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("flags", [False, True])
def test_texts_equal_the_tokenizer(checkpoint, flags, tmp_path):
    kind, folder = checkpoint
    if flags:  # tokenizer_config.json's add_bos / add_eos flags (transformers keeps tokenizer.json's template),
        # and no padding_side: the tokenizer class's default
        import json
        import shutil

        folder = Path(shutil.copytree(folder, tmp_path / "flags"))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(add_bos_token=True, add_eos_token=True, bos_token="<bos>")
        config.pop("padding_side", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    family = open_family(ModelSpec(name=str(folder)))
    ref = Reference(kind, folder)
    texts = ["This is a photo of A Cat.", "x" * 100, "", "Hello, World!"]
    ids, mask = family.text(texts)
    enc = ref.text(texts)
    assert torch.equal(ids, enc["input_ids"])
    assert torch.equal(mask, enc["attention_mask"])


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_embed_classify_similarity(checkpoint, batch):
    kind, folder = checkpoint
    family = open_family(ModelSpec(name=str(folder)))
    model = family.load("float32", "cpu")
    ref = Reference(kind, folder)
    images = random_images(batch, seed=batch)
    texts = [f"Photo {i} of a {'cat' if i % 2 else 'DOG'}" for i in range(batch)]
    rows = label(family, model, tasks({"embed": {}}, {"classify": {"choices": CHOICES}},
                                      {"similarity": {"text_column": "txt"}}), images, texts)
    emb = ref.image_embeds(images)
    ours = torch.tensor(np.array([r["embed"] for r in rows]))
    assert (ours - emb).abs().max() < 1e-5
    probs = ref.logits(images, [f"This is a photo of {c}." for c in CHOICES]).softmax(-1)
    ours = torch.tensor([[s["prob"] for s in r["classify_scores"]] for r in rows])
    assert (ours - probs).abs().max() < 1e-5
    assert [r["classify"] for r in rows] == [CHOICES[i] for i in probs.argmax(-1).tolist()]
    sim = torch.sigmoid(ref.logits(images, texts).diagonal())
    ours = torch.tensor([r["similarity"] for r in rows])
    assert (ours - sim).abs().max() < 1e-5
    if batch > 1:  # the tiny model tells images and texts apart
        assert sim.std() > 1e-3 and probs.std() > 1e-3

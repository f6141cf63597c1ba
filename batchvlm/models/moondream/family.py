"""Moondream as batchvlm uses it: weights + tokenizer + provenance, task prompts in, labels out."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from ...tasks import Task, column_of, column_value, sequences_for
from .config import ConfigError
from .decoding import RawOutput
from .generate import SeqSpec, generate
from .model import MoondreamModel
from .preprocess import PreparedImage, Preprocessor
from .weights import (ModelLoadError, build_model, load_tokenizer, load_weights, read_config, resolve_dir,
                      weights_sha256)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    revision: str | None
    path: str
    weights_sha256: str
    dtype: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Sequence:
    """One sequence of a task on every image: task index, object label, what to run."""

    task: int
    label: str | None
    spec: SeqSpec


class TokenizerAdapter:
    def __init__(self, tok):
        self._tok = tok

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device: {device!r} but torch {torch.__version__} sees no CUDA device")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"model.device: {device!r} but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


class Moondream:
    def __init__(self, model: MoondreamModel, tokenizer, info: ModelInfo, max_crops: int | None = None):
        self.model = model
        self.tokenizer = TokenizerAdapter(tokenizer)
        self.info = info
        self.config = model.config
        self.preprocessor = Preprocessor(self.config.vision, max_crops or self.config.vision.max_crops)

    @classmethod
    def load(cls, name: str, revision: str | None = None, dtype: str = "auto", device: str = "auto",
             max_crops: int | None = None, folder: Path | None = None) -> Moondream:
        if folder is None:
            folder, revision = resolve_dir(name, revision)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        config = read_config(folder)
        tokenizer = load_tokenizer(folder)
        weights = folder / "model.safetensors"
        if not weights.is_file():  # before building the model
            raise ModelLoadError(f"{folder}: no model.safetensors")
        model = build_model(config, dev, dt)
        load_weights(model, weights)
        info = ModelInfo(name, revision, str(folder), weights_sha256(weights), str(dt).removeprefix("torch."), str(dev))
        return cls(model, tokenizer, info, max_crops)

    def sequences(self, tasks: list[Task], max_new_tokens: int, max_objects: int,
                  temperature: float = 0.0, top_p: float = 1.0) -> list[Sequence]:
        """The sequences every image runs, in task order (the same for all images)."""
        templates = self.config.tokenizer.templates
        seqs = [
            Sequence(t, label, spec)
            for t, task in enumerate(tasks)
            for label, spec in sequences_for(task, templates, self.tokenizer, max_new_tokens, max_objects,
                                             temperature, top_p)
        ]
        P, n_ctx = self.config.prefix_len, self.config.text.max_context
        for s in seqs:
            if P + len(s.spec.prompt) + s.spec.budget > n_ctx:
                raise ConfigError(
                    f"tasks.{s.task}: a {len(s.spec.prompt)}-token prompt and up to {s.spec.budget} generated "
                    f"tokens after the {P}-token image prefix exceed the model's context of {n_ctx}; shorten it "
                    "or lower engine.max_new_tokens / engine.max_objects")
        return seqs

    def columns(self, tasks: list[Task], seqs: list[Sequence], raws: list[RawOutput]) -> dict[str, Any]:
        """One image's raw sequence outputs -> {column: value}."""
        out = {}
        for t, task in enumerate(tasks):
            mine = [(s.label, r) for s, r in zip(seqs, raws) if s.task == t]
            out[column_of(task)] = column_value(task, [m[0] for m in mine], [m[1] for m in mine], self.tokenizer)
        return out

    def label(self, images: list[Image.Image | PreparedImage], tasks: list[Task], max_new_tokens: int = 128,
              max_objects: int = 50, temperature: float = 0.0, top_p: float = 1.0) -> list[dict[str, Any]]:
        """Label a list of images with the simple batched generation -> one dict per image."""
        prepared = [im if isinstance(im, PreparedImage) else self.preprocessor(im) for im in images]
        seqs = self.sequences(tasks, max_new_tokens, max_objects, temperature, top_p)
        raws = generate(self.model, prepared, [s.spec for s in seqs])
        return [self.columns(tasks, seqs, r) for r in raws]

"""Qwen3-VL behind the family interface (models/family.py): the host side.

Every task is one user turn [image, text] in the checkpoint's chat template with the generation
prompt; the image prefix (template head, image tokens, vision_end) is shared by every task on
the image, and each sequence's prompt is the rest of the rendered turn. All sequences are plain
text: boxes and points are parsed from the JSON the model writes (labels.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...tasks import args_of, kind_of
from ..decoding import MODE_TEXT, RawOutput, SeqSpec
from ..family import FamilyError, ModelInfo, ModelLoadError, TaskSequence
from ..hub import TokenizerAdapter, load_tokenizer, resolve_device, resolve_dtype, weight_files, weights_sha256
from ..qwen_prompts import QWEN3
from .chat import ChatTemplate, read_template, special_tokens
from .config import ConfigError, Qwen3VLConfig
from .engine_model import Qwen3VLEngineModel
from .labels import column_values
from .preprocess import PixelSettings, Preprocessor
from .weights import build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import EngineSpec, ModelSpec
    from ...tasks import Task

def _token(tokenizer: TokenizerAdapter, id_: int) -> str:
    token = tokenizer.token_of(id_)
    if token is None:
        raise ConfigError(f"token id {id_} is not in the tokenizer")
    return token


def stop_ids(folder: Path, tokenizer: TokenizerAdapter) -> list[int]:
    """<|im_end|>, the tokenizer's eos_token and generation_config.json's eos_token_id."""
    ids = {tokenizer.id_of("<|im_end|>")}
    eos = special_tokens(folder).get("eos_token")
    if eos:
        ids.add(tokenizer.id_of(eos))
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e])
    return sorted(i for i in ids if isinstance(i, int))


class Qwen3VL:
    name = "qwen3_vl"
    backend = "native"

    def __init__(self, config: Qwen3VLConfig, settings: PixelSettings, tokenizer, folder: Path, model_name: str,
                 revision: str | None, min_pixels: int | None = None, max_pixels: int | None = None):
        self.config, self.folder, self.model_name, self.revision = config, folder, model_name, revision
        self.settings = settings
        self.tokenizer = TokenizerAdapter(tokenizer, skip_special=True)
        self.template = ChatTemplate(read_template(folder), special_tokens(folder),
                                     _token(self.tokenizer, config.image_token_id),
                                     _token(self.tokenizer, config.vision_end_id))
        self.head = self.tokenizer.encode(self.template.head())
        self.stop_ids = stop_ids(folder, self.tokenizer)
        self.pre = Preprocessor.create(config.vision, settings, len(self.head), min_pixels, max_pixels)
        self.max_objects: dict[int, int] = {}  # task -> objects kept per name (set by sequences)

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> Qwen3VL:
        if spec.max_crops is not None:
            raise ModelLoadError("model.max_crops is Moondream's; Qwen3-VL sizes images by model.min_pixels / "
                                 "model.max_pixels")
        try:
            return cls(read_config(folder), PixelSettings.read(folder), load_tokenizer(folder), folder, spec.name,
                       revision, spec.min_pixels, spec.max_pixels)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from e

    def preprocessor(self) -> Preprocessor:
        return self.pre

    def max_prefix_len(self) -> int:
        return len(self.head) + self.pre.max_tokens() + 1

    def sequences(self, tasks: list[Task], engine: EngineSpec) -> list[TaskSequence]:
        seqs = []
        for t, task in enumerate(tasks):
            kind, a = kind_of(task), args_of(task)
            if kind in ("caption", "query"):
                pairs = [(None, QWEN3.words(kind, a), a.max_new_tokens or engine.max_new_tokens)]
            else:
                self.max_objects[t] = a.max_objects or engine.max_objects
                pairs = [(obj, QWEN3.words(kind, a, obj), engine.max_new_tokens) for obj in a.objects]
            for label, text, limit in pairs:
                prompt = tuple(self.tokenizer.encode(self.template.split(text)[1]))
                seqs.append(TaskSequence(t, label, SeqSpec(MODE_TEXT, prompt, limit, engine.temperature,
                                                           engine.top_p)))
        P, n_ctx = self.max_prefix_len(), self.config.text.max_context
        for s in seqs:
            if P + len(s.spec.prompt) + s.spec.budget > n_ctx:
                raise FamilyError(
                    f"tasks.{s.task}: a {len(s.spec.prompt)}-token prompt and up to {s.spec.budget} generated tokens "
                    f"after an image prefix of up to {P} tokens exceed the model's context of {n_ctx}; lower "
                    "model.max_pixels or engine.max_new_tokens")
        return seqs

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput]) -> dict[str, Any]:
        return column_values(tasks, seqs, raws, self.tokenizer.decode, self.max_objects)

    def load(self, dtype: str = "auto", device: str = "auto") -> Qwen3VLEngineModel:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        files = weight_files(self.folder)
        model = build_model(self.config, torch.from_numpy(self.settings.lookup_table()), dev, dt)
        load_weights(model, files)
        info = ModelInfo(self.model_name, self.revision, str(self.folder), weights_sha256(files),
                         str(dt).removeprefix("torch."), str(dev), self.name, self.backend)
        return Qwen3VLEngineModel(model, info, self.head, self.stop_ids, self.pre)

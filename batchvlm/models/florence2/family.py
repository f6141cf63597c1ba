"""Florence-2 behind the family interface (models/family.py): the host side.

Every sequence is one (image, prompt) pair: the prompt (`<s>` instruction `</s>`, prompts.py) is
read by the encoder after the image tokens (`SeqSpec.prefix_prompt`: engine contract v2's prefix
segment), and the decoder writes the answer from the decoder start token (`SeqSpec.prompt`), its
own tokens at positions 0, 1, ... for every sequence.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...tasks import args_of, kind_of
from ..columns import task_columns
from ..decoding import MODE_TEXT, RawOutput, SeqSpec
from ..family import FamilyError, ModelInfo, ModelLoadError, TaskSequence, check_kinds, refuse_constrain
from ..hub import load_tokenizer, read_json, resolve_device, resolve_dtype, weight_files, weights_sha256
from .config import ConfigError, Florence2Config, GenerationSettings
from .engine import Florence2EngineModel
from .labels import task_values
from .preprocess import PixelSettings, Preprocessor
from .prompts import KINDS, instruction, task_text
from .weights import build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import EngineSpec, ModelSpec
    from ...tasks import Task

# transformers' clean_up_tokenization, applied to text when the tokenizer config asks for it
_CLEANUP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


class Tokenizer:
    """The checkpoint's tokenizer.json, with its special tokens (<s>, </s>, the image token)."""

    def __init__(self, tok, folder: Path):
        self._tok = tok
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        self.cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        # a token may be written as {"content": "<s>", ...} (an AddedToken)
        self.bos, self.eos = (t["content"] if isinstance(t, dict) else t
                              for t in (config.get("bos_token", "<s>"), config.get("eos_token", "</s>")))

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: tuple[int, ...], special: bool) -> str:
        """`special`: keep special tokens (the <loc_N> text the post-processor reads)."""
        text = self._tok.decode(list(ids), skip_special_tokens=not special)
        if self.cleanup:
            for a, b in _CLEANUP:
                text = text.replace(a, b)
        return text


def _side(n: int, kernel: int, stride: int, pad: int) -> int:
    return (n + 2 * pad - kernel) // stride + 1


def image_token_count(config: Florence2Config, settings: PixelSettings) -> int:
    """1 pooled token + the cells of the last DaViT stage."""
    h, w = settings.height, settings.width
    v = config.vision
    for k, s, p in zip(v.patch_size, v.patch_stride, v.patch_padding):
        h, w = _side(h, k, s, p), _side(w, k, s, p)
    return 1 + h * w


class Florence2:
    name = "florence2"
    backend = "native"

    def __init__(self, config: Florence2Config, settings: PixelSettings, generation: GenerationSettings,
                 tokenizer: Tokenizer, folder: Path, model_name: str, revision: str | None):
        self.config, self.settings, self.generation, self.tokenizer = config, settings, generation, tokenizer
        self.folder, self.model_name, self.revision = folder, model_name, revision
        self.image_tokens = image_token_count(config, settings)
        if self.image_tokens != settings.image_tokens:
            raise ConfigError(f"{folder}: preprocessor_config.json image_seq_length {settings.image_tokens}, but a "
                              f"{settings.width}x{settings.height} image makes {self.image_tokens} image tokens")

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> Florence2:
        for field in ("max_crops", "min_pixels", "max_pixels"):
            if getattr(spec, field) is not None:
                raise ModelLoadError(f"model.{field}: not a Florence-2 setting (images are resized to the size in "
                                     "the checkpoint's preprocessor_config.json)")
        try:
            text = read_json(folder / "config.json").get("text_config") or {}
            return cls(read_config(folder), PixelSettings.read(folder), GenerationSettings.read(folder, text),
                       Tokenizer(load_tokenizer(folder), folder), folder, spec.name, revision)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from e

    def preprocessor(self) -> Preprocessor:
        return Preprocessor(self.settings)

    def max_prefix_len(self) -> int:
        return self.image_tokens

    def prompt(self, text: str) -> tuple[int, ...]:
        """The encoder's prompt tokens for a task text, as the processor writes them."""
        return self.tokenizer.encode(self.tokenizer.bos + instruction(text) + self.tokenizer.eos)

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        check_kinds(tasks, KINDS, "Florence-2")
        refuse_constrain(tasks, constrain, "Florence-2")
        seqs = []
        for t, task in enumerate(tasks):
            kind, a = kind_of(task), args_of(task)
            limit = getattr(a, "max_new_tokens", None) or engine.max_new_tokens
            kept = (a.max_objects or engine.max_objects) if kind in ("detect", "regions") else None
            for obj in (a.objects if kind == "detect" else [None]):
                spec = SeqSpec(MODE_TEXT, (self.generation.decoder_start,), limit, engine.temperature, engine.top_p,
                               prefix_prompt=self.prompt(task_text(kind, a, obj)))
                seqs.append(TaskSequence(t, obj, spec, kept))
        n_pos = self.config.text.max_positions
        for s in seqs:
            if self.image_tokens + (n := len(s.spec.prefix_prompt)) > n_pos:
                raise FamilyError(f"tasks.{s.task}: {self.image_tokens} image tokens and a {n}-token "
                                  f"prompt exceed the encoder's {n_pos} positions; shorten it")
            if 1 + s.spec.limit > n_pos:
                raise FamilyError(f"tasks.{s.task}: up to {s.spec.limit} generated tokens exceed the decoder's {n_pos} "
                                  "positions; lower engine.max_new_tokens (or the task's max_new_tokens)")
        return seqs

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, partial(task_values, self.tokenizer))

    def load(self, dtype: str = "auto", device: str = "auto") -> Florence2EngineModel:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        files = weight_files(self.folder)
        model = build_model(self.config, torch.from_numpy(self.settings.lookup_table()), dev, dt)
        load_weights(model, files)
        info = ModelInfo(self.model_name, self.revision, str(self.folder), weights_sha256(files),
                         str(dt).removeprefix("torch."), str(dev), self.name, self.backend)
        return Florence2EngineModel(model, info, self.generation, self.image_tokens,
                                    (self.settings.width, self.settings.height))

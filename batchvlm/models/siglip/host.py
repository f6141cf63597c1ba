"""SigLIP's host side: config, image processor settings and tokenizer, no weights. Every task is
one image-level sequence (device.py ImageTask); a classify task's choices are put into its template
(transformers' zero-shot default, "This is a photo of {}.") and embedded once per job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...job import EngineSpec, ModelSpec
from ...tasks import DEFAULT_TEMPLATE, Task, args_of, kind_of
from ..base.columns import task_columns
from ..base.contract import ModelInfo, TaskSequence
from ..base.decoding import RawOutput
from ..base.errors import ConfigError, FamilyError, ModelLoadError
from ..base.host import FamilyBase, refuse_size_settings
from .config import SiglipConfig
from .device import ImageTask, SiglipImageModel
from .labels import task_values
from .preprocess import PixelSettings, Preprocessor
from .text import TextPrep
from .weights import build_model, load_weights, read_config

KINDS = ("embed", "classify", "similarity")


class Siglip(FamilyBase):
    name = "siglip"

    def __init__(self, config: SiglipConfig, settings: PixelSettings, text: TextPrep | None, no_text: str | None,
                 folder: Path, model_name: str, revision: str | None):
        self.config, self.settings, self.text, self.no_text = config, settings, text, no_text
        self.folder, self.model_name, self.revision = folder, model_name, revision
        self.embed_dim = config.embed_dim

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> Siglip:
        refuse_size_settings(spec, "SigLIP", "images are sized by the checkpoint's image processor")
        config = read_config(folder)
        try:
            settings = PixelSettings.read(folder, config)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from e
        try:  # only classify and similarity read text: an embed job runs without a tokenizer
            text, no_text = TextPrep(folder, lowercase=config.model_type == "siglip2", max_positions=config.max_text), None
        except ConfigError as e:
            text, no_text = None, str(e)
        return cls(config, settings, text, no_text, folder, spec.name, revision)

    def preprocessor(self) -> Preprocessor:
        return Preprocessor(self.settings, self.config.patch)

    def max_prefix_len(self) -> int:
        return self.settings.max_patches or self.config.positions

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        seqs = []
        for i, task in enumerate(tasks):
            kind, a = kind_of(task), args_of(task)
            if kind not in KINDS:
                raise FamilyError(f"tasks.{i}.{kind}: SigLIP is an encoder-only model: it cannot do {kind} tasks (it "
                                  f"can: {', '.join(KINDS)})")
            if kind in ("classify", "similarity") and self.text is None:
                raise FamilyError(f"tasks.{i}.{kind}: {self.no_text}")
            if kind == "classify":
                if a.question is not None:
                    raise FamilyError(f"tasks.{i}.classify.question: SigLIP answers no question; it scores each "
                                      f"choice put into `template` (default {DEFAULT_TEMPLATE!r}) against the image")
                template = a.template or DEFAULT_TEMPLATE
                spec = ImageTask(kind, texts=tuple(template.replace("{}", c) for c in a.choices))
            elif kind == "similarity":
                spec = ImageTask(kind, text_column=a.text_column)
            else:
                spec = ImageTask(kind)
            seqs.append(TaskSequence(i, None, spec))
        return seqs

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, task_values)

    def build(self, device: torch.device, dtype: torch.dtype) -> Any:
        return build_model(self.config, device, dtype)

    def load_weights(self, model: Any, files: list[Path]) -> None:
        load_weights(model, files)

    def device_side(self, model: Any, info: ModelInfo) -> SiglipImageModel:
        n = self.max_prefix_len()
        # NaFlex lengths pad up to eighths of the patch budget (most images fill it nearly whole)
        return SiglipImageModel(model, info, self.settings.lookup_table(), self.text, max(16, n // 8), n)

"""Any image-text-to-text model transformers ships, as a batchvlm family: host side (config,
processor, prompts, columns) without weights, then a static model whose labeler runs `generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...job import EngineSpec
from ...tasks import Task
from . import architectures
from .columns import column_values
from .generation import Generated, StaticLabeler
from .loading import HostSide, host_side, load_model
from .preprocess import ImagePreprocessor
from .prompts import Prompt, chat_renderer, prompts_for

BACKEND = "transformers"


class TransformersFamily:
    def __init__(self, host: HostSide):
        self.host = host
        self.model_type = host.model_type
        self.format = architectures.grounding_format(host.model_type)

    @classmethod
    def from_folder(cls, folder: Path) -> TransformersFamily:
        return cls(host_side(folder))

    def preprocessor(self) -> ImagePreprocessor:
        return ImagePreprocessor(self.host.processor.image_processor)

    def sequences(self, tasks: list[Task], engine: EngineSpec) -> list[Prompt]:
        return prompts_for(tasks, architectures.style(self.model_type), self.format, chat_renderer(self.host.processor),
                           self.model_type, engine.max_new_tokens, engine.max_objects)

    def columns(self, tasks: list[Task], seqs: list[Prompt], raws: list[Generated]) -> dict[str, Any]:
        return column_values(tasks, seqs, raws, self.host.processor.tokenizer, self.format)

    def load(self, dtype, device) -> StaticModel:
        return StaticModel(load_model(self.host, dtype, device), self.host.processor)


class StaticModel:
    """The loaded model; the run loop asks it for a labeler instead of driving it step by step."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    def labeler(self, seqs: list[Prompt], settings: EngineSpec) -> StaticLabeler:
        return StaticLabeler(self.model, self.processor, seqs, settings)

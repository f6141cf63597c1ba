"""Any image-text-to-text model transformers ships, as a batchvlm family: the host side (config,
processor, prompts, columns) without weights, then a static model whose labeler runs `generate`.

The family's name is the checkpoint's `model_type` (qwen2_5_vl, paligemma, ...); its backend is
"transformers". Both land in the provenance.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

from ...job import EngineSpec
from ...tasks import Task
from ..columns import task_columns
from ..decoding import RawOutput
from ..family import ModelInfo, TaskSequence, refuse_constrain
from ..hub import resolve_device, resolve_dtype, weight_files, weights_sha256
from ..qwen_prompts import refuse_thinking_only
from . import architectures
from .columns import task_values
from .generation import StaticLabeler
from .loading import HostSide, host_side, load_model
from .preprocess import ImagePreprocessor
from .prompts import chat_renderer, prompts_for
from .structured import with_choices


class TransformersFamily:
    backend = "transformers"

    def __init__(self, host: HostSide, model_name: str, revision: str | None):
        self.host, self.model_name, self.revision = host, model_name, revision
        self.name = host.model_type
        self.format = architectures.grounding_format(host.model_type)

    @classmethod
    def open(cls, folder: Path, model_name: str, revision: str | None) -> TransformersFamily:
        return cls(host_side(folder), model_name, revision)

    def preprocessor(self) -> ImagePreprocessor:
        return ImagePreprocessor(self.host.processor.image_processor)

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        refuse_constrain(tasks, constrain, "the transformers backend")
        style, render = architectures.style(self.name), chat_renderer(self.host.processor)
        if style == "chat" and render is not None:
            refuse_thinking_only(render("a"), self.model_name)
        prompts = prompts_for(tasks, style, self.format, render, self.name, engine.max_new_tokens, engine.max_objects)
        return with_choices(prompts, tasks, self.host.processor.tokenizer)

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, partial(task_values, self.host.processor.tokenizer, self.format))

    def load(self, dtype: str = "auto", device: str = "auto") -> StaticModel:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        files = weight_files(self.host.folder)
        info = ModelInfo(self.model_name, self.revision, str(self.host.folder), weights_sha256(files),
                         str(dt).removeprefix("torch."), str(dev), self.name, self.backend)
        return StaticModel(load_model(self.host, dt, dev), self.host.processor, info)


class StaticModel:
    """The loaded model; the run loop asks it for a labeler instead of driving it step by step."""

    def __init__(self, model, processor, info: ModelInfo):
        self.model, self.processor, self.info = model, processor, info

    def labeler(self, seqs: list[TaskSequence], engine: EngineSpec) -> StaticLabeler:
        return StaticLabeler(self.model, self.processor, seqs, engine)

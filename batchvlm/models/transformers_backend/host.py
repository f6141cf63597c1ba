"""Any image-text-to-text model transformers ships, as a batchvlm family: the host side (config,
processor, prompts, columns) without weights, then a static model whose labeler runs `generate`.

The family's name is the checkpoint's `model_type` (qwen2_5_vl, paligemma, ...); its backend is
"transformers". Both land in the provenance.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...job import EngineSpec, ModelSpec
from ...tasks import Task
from ..base.columns import task_columns
from ..base.decoding import RawOutput
from ..base.contract import ModelInfo, TaskSequence
from ..base.errors import ModelLoadError
from ..base.host import FamilyBase, refuse_constrain
from ..qwen_vl.prompts import refuse_thinking_only
from . import architectures
from .device import StaticModel
from .loading import HostSide, host_side, load_model
from .preprocess import ImagePreprocessor
from .prompts import chat_renderer, prompts_for
from .labels import task_values
from .structured import with_choices


class TransformersFamily(FamilyBase):
    backend = "transformers"

    def __init__(self, host: HostSide, model_name: str, revision: str | None):
        self.host, self.model_name, self.revision = host, model_name, revision
        self.folder = host.folder
        self.name = host.model_type
        self.format = architectures.grounding_format(host.model_type)

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> TransformersFamily:
        if spec.max_crops is not None:
            raise ModelLoadError("model.max_crops: a Moondream setting; the transformers backend sizes images "
                                 "with the checkpoint's own image processor")
        return cls(host_side(folder), spec.name, revision)

    def preprocessor(self) -> ImagePreprocessor:
        return ImagePreprocessor(self.host.processor.image_processor)

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        refuse_constrain(tasks, constrain, "the transformers backend")
        style, render = architectures.style(self.name), chat_renderer(self.host.processor, self.folder)
        if style == "chat" and render is not None:
            refuse_thinking_only(render("a"), self.model_name)
        prompts = prompts_for(tasks, style, self.format, render, self.name, engine.max_new_tokens, engine.max_objects)
        return with_choices(prompts, tasks, self.host.processor.tokenizer)

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, partial(task_values, self.host.processor.tokenizer, self.format))

    def build(self, device: torch.device, dtype: torch.dtype) -> Any:
        return load_model(self.host, dtype, device)

    def load_weights(self, model: Any, files: list[Path]) -> None:
        """Nothing left to do: transformers' `from_pretrained` read the weights while building."""

    def device_side(self, model: Any, info: ModelInfo) -> StaticModel:
        return StaticModel(model, self.host.processor, info)

"""The Qwen3-VL module tree: the shared Qwen vision tower (with DeepStack) and the Qwen3 text model."""

from __future__ import annotations

from ..qwen_vl.model import QwenVLModel
from .config import Qwen3VLConfig
from .text import TextModel


class Qwen3VLModel(QwenVLModel):
    def __init__(self, config: Qwen3VLConfig):
        super().__init__(config, TextModel(config.text))

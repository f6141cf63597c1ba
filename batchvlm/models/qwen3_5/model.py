"""The Qwen3.5 module tree: the shared Qwen vision tower (without DeepStack) and the hybrid text model."""

from __future__ import annotations

from ..qwen_vl.model import QwenVLModel
from .config import Qwen35Config
from .text import TextModel


class Qwen35Model(QwenVLModel):
    def __init__(self, config: Qwen35Config):
        super().__init__(config, TextModel(config.text))

"""Qwen3-VL configuration, read from a hub `config.json`: `model_type` `qwen3_vl` (dense) or
`qwen3_vl_moe` (the same model with sparse MLPs: qwen_vl/config.py MoEConfig, no shared
expert). The vision tower's part and the text settings shared with Qwen3.5: qwen_vl/config.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..qwen_vl import config as shared
from ..qwen_vl.config import QwenVLConfig

__all__ = ["Qwen3VLConfig", "TextConfig"]


@dataclass(frozen=True, kw_only=True)
class TextConfig(shared.TextConfig):
    n_layers: int  # every layer full attention


@dataclass(frozen=True)
class Qwen3VLConfig(QwenVLConfig):
    text: TextConfig
    model_types = ("qwen3_vl", "qwen3_vl_moe")
    deepstack = True
    default_ids = (151655, 151652, 151653)

    @classmethod
    def text_config(cls, raw: dict[str, Any], moe: bool) -> TextConfig:
        fields = shared.text_fields(raw, 1.0, (24, 20, 20), moe, shared_expert=False)
        return TextConfig(n_layers=int(raw["text_config"]["num_hidden_layers"]), **fields)

"""Qwen3-VL configuration, read from a hub `config.json` (`model_type: qwen3_vl`); the vision
tower's part is shared with Qwen3.5 (qwen_vl/config.py).

Only the dense models are supported; the MoE variants (`qwen3_vl_moe`) are refused by model_type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..qwen_vl.config import ConfigError, VisionConfig, text_rope, vision_config


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    dim: int
    ff_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]  # rotary frequencies driven by t, h, w (sum = head_dim / 2)
    max_context: int
    tie_embeddings: bool
    attention_bias: bool = False


@dataclass(frozen=True)
class Qwen3VLConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    vision_start_id: int
    vision_end_id: int

    @property
    def max_context(self) -> int:
        return self.text.max_context

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3VLConfig:
        if raw.get("model_type") != "qwen3_vl":
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not qwen3_vl")
        try:
            c = cls(_text(raw), vision_config(raw.get("vision_config") or {}, deepstack=True),
                    int(raw.get("image_token_id", 151655)), int(raw.get("vision_start_token_id", 151652)),
                    int(raw.get("vision_end_token_id", 151653)))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad qwen3_vl config: {e!r}") from e
        if c.vision.out_dim != c.text.dim:
            raise ConfigError(f"vision out_hidden_size {c.vision.out_dim} != text hidden_size {c.text.dim}")
        return c


def _text(raw: dict[str, Any]) -> TextConfig:
    t = raw["text_config"]
    rope = text_rope(t)
    theta = float(rope["rope_theta"])
    n_heads = int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or t["hidden_size"] // n_heads)
    section = tuple(int(s) for s in rope.get("mrope_section", (24, 20, 20)))
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ConfigError(f"mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 = {head_dim // 2}")
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return TextConfig(
        vocab_size=int(t["vocab_size"]), dim=int(t["hidden_size"]), ff_dim=int(t["intermediate_size"]),
        n_layers=int(t["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(t.get("num_key_value_heads") or n_heads), head_dim=head_dim,
        rms_eps=float(t.get("rms_norm_eps", 1e-6)), rope_theta=theta, mrope_section=section,  # type: ignore[arg-type]
        max_context=int(t.get("max_position_embeddings", 262144)), tie_embeddings=bool(tie),
        attention_bias=bool(t.get("attention_bias", False)))

"""Qwen3.5 configuration, read from a hub `config.json` (`model_type: qwen3_5`, the dense models).

The vision tower is Qwen3-VL's without DeepStack (qwen_vl/config.py). The text model is hybrid:
`layer_types` lists `linear_attention` (Gated DeltaNet) or `full_attention` (gated attention)
per layer; a config without it has every `full_attention_interval`-th layer (default 4) full.
Full attention rotates only the first `partial_rotary_factor` of each head (interleaved
multimodal rotary over those dims, `mrope_section` summing to half of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..qwen_vl.config import ConfigError, VisionConfig, text_rope, vision_config

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    dim: int
    ff_dim: int
    layer_types: tuple[str, ...]  # LINEAR or FULL per layer
    n_heads: int  # full attention
    n_kv_heads: int
    head_dim: int
    rotary_dim: int  # the first rotary_dim of each head are rotated
    rope_theta: float
    mrope_section: tuple[int, int, int]  # rotary frequencies driven by t, h, w (sum = rotary_dim / 2)
    lin_k_heads: int  # linear attention: query / key heads
    lin_v_heads: int  # value heads (a multiple of the key heads; each key head serves consecutive ones)
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int  # causal depthwise conv over q / k / v
    rms_eps: float
    max_context: int
    tie_embeddings: bool
    attention_bias: bool = False

    @property
    def n_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v side by side."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim


@dataclass(frozen=True)
class Qwen35Config:
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
    def from_dict(cls, raw: dict[str, Any]) -> Qwen35Config:
        if raw.get("model_type") != "qwen3_5":
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not qwen3_5")
        try:
            c = cls(_text(raw), vision_config(raw.get("vision_config") or {}, deepstack=False),
                    int(raw.get("image_token_id", 248056)), int(raw.get("vision_start_token_id", 248053)),
                    int(raw.get("vision_end_token_id", 248054)))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad qwen3_5 config: {e!r}") from e
        if c.vision.out_dim != c.text.dim:
            raise ConfigError(f"vision out_hidden_size {c.vision.out_dim} != text hidden_size {c.text.dim}")
        return c


def _text(raw: dict[str, Any]) -> TextConfig:
    t = raw["text_config"]
    rope = text_rope(t)
    n_heads = int(t.get("num_attention_heads", 16))
    head_dim = int(t.get("head_dim") or t["hidden_size"] // n_heads)
    rotary_dim = int(head_dim * float(rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 0.25))))
    section = tuple(int(s) for s in rope.get("mrope_section", (11, 11, 10)))
    if len(section) != 3 or sum(section) != rotary_dim // 2:
        raise ConfigError(f"mrope_section {list(section)} must be 3 numbers summing to the rotated dims / 2 = "
                          f"{rotary_dim // 2}")
    n_layers = int(t["num_hidden_layers"])
    every = int(t.get("full_attention_interval", 4))
    types = tuple(t.get("layer_types") or (FULL if (i + 1) % every == 0 else LINEAR for i in range(n_layers)))
    if len(types) != n_layers or set(types) - {LINEAR, FULL}:
        raise ConfigError(f"layer_types must list {LINEAR!r} or {FULL!r} for each of the {n_layers} layers")
    if t.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"text hidden_act {t['hidden_act']!r} is not supported (only silu)")
    k_heads, v_heads = int(t.get("linear_num_key_heads", 16)), int(t.get("linear_num_value_heads", 32))
    if v_heads % k_heads:
        raise ConfigError(f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
    tie = raw.get("tie_word_embeddings", t.get("tie_word_embeddings", False))
    return TextConfig(
        vocab_size=int(t["vocab_size"]), dim=int(t["hidden_size"]), ff_dim=int(t["intermediate_size"]),
        layer_types=types, n_heads=n_heads, n_kv_heads=int(t.get("num_key_value_heads") or n_heads),
        head_dim=head_dim, rotary_dim=rotary_dim, rope_theta=float(rope["rope_theta"]),
        mrope_section=section,  # type: ignore[arg-type]
        lin_k_heads=k_heads, lin_v_heads=v_heads, lin_k_dim=int(t.get("linear_key_head_dim", 128)),
        lin_v_dim=int(t.get("linear_value_head_dim", 128)), conv_kernel=int(t.get("linear_conv_kernel_dim", 4)),
        rms_eps=float(t.get("rms_norm_eps", 1e-6)), max_context=int(t.get("max_position_embeddings", 262144)),
        tie_embeddings=bool(tie), attention_bias=bool(t.get("attention_bias", False)))

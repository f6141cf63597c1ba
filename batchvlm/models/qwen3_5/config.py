"""Qwen3.5 configuration, read from a hub `config.json`: `model_type` `qwen3_5` (dense) or
`qwen3_5_moe` (sparse MLPs with a shared expert: qwen_vl/config.py MoEConfig).

The vision tower is Qwen3-VL's without DeepStack (qwen_vl/config.py). The text model is hybrid:
`layer_types` lists `linear_attention` (Gated DeltaNet) or `full_attention` (gated attention)
per layer; a config without it has every `full_attention_interval`-th layer (default 4) full.
Full attention rotates only the first `partial_rotary_factor` of each head (interleaved
multimodal rotary over those dims, `mrope_section` summing to half of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..qwen_vl import config as shared
from ..base.errors import ConfigError
from ..qwen_vl.config import QwenVLConfig

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True, kw_only=True)
class TextConfig(shared.TextConfig):
    layer_types: tuple[str, ...]  # LINEAR or FULL per layer
    lin_k_heads: int  # linear attention: query / key heads
    lin_v_heads: int  # value heads (a multiple of the key heads; each key head serves consecutive ones)
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int  # causal depthwise conv over q / k / v

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
class Qwen35Config(QwenVLConfig):
    text: TextConfig
    model_types = ("qwen3_5", "qwen3_5_moe")
    deepstack = False
    default_ids = (248056, 248053, 248054)

    @classmethod
    def text_config(cls, raw: dict[str, Any], moe: bool) -> TextConfig:
        t = raw["text_config"]
        fields = shared.text_fields(raw, 0.25, (11, 11, 10), moe, shared_expert=True)
        n_layers = int(t["num_hidden_layers"])
        every = int(t.get("full_attention_interval", 4))
        types = tuple(t.get("layer_types") or (FULL if (i + 1) % every == 0 else LINEAR for i in range(n_layers)))
        if len(types) != n_layers or set(types) - {LINEAR, FULL}:
            raise ConfigError(f"layer_types must list {LINEAR!r} or {FULL!r} for each of the {n_layers} layers")
        k_heads, v_heads = int(t.get("linear_num_key_heads", 16)), int(t.get("linear_num_value_heads", 32))
        if v_heads % k_heads:
            raise ConfigError(f"linear_num_value_heads {v_heads} is not a multiple of linear_num_key_heads {k_heads}")
        return TextConfig(layer_types=types, lin_k_heads=k_heads, lin_v_heads=v_heads,
                          lin_k_dim=int(t.get("linear_key_head_dim", 128)),
                          lin_v_dim=int(t.get("linear_value_head_dim", 128)),
                          conv_kernel=int(t.get("linear_conv_kernel_dim", 4)), **fields)

"""Qwen3-VL configuration, read from a hub `config.json` (`model_type: qwen3_vl`).

Both spellings of the text rotary settings load: `rope_parameters` (transformers 5) and the
`rope_theta` + `rope_scaling` pair the released checkpoints were written with. Only the dense
models are supported; the MoE variants (`qwen3_vl_moe`) are refused by model_type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    pass


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
class VisionConfig:
    depth: int
    dim: int
    ff_dim: int
    n_heads: int
    out_dim: int  # the text width
    patch_size: int
    temporal_patch: int
    merge: int  # spatial merge: merge x merge patches -> one text token
    n_pos_embeddings: int  # a square learned grid, side = sqrt(n)
    deepstack_layers: tuple[int, ...]  # vision layers whose features feed text layers 0, 1, ...
    rope_theta: float
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def pos_side(self) -> int:
        return int(self.n_pos_embeddings**0.5)


@dataclass(frozen=True)
class Qwen3VLConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    vision_start_id: int
    vision_end_id: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Qwen3VLConfig:
        if raw.get("model_type") != "qwen3_vl":
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not qwen3_vl")
        try:
            c = cls(_text(raw), _vision(raw.get("vision_config") or {}), int(raw.get("image_token_id", 151655)),
                    int(raw.get("vision_start_token_id", 151652)), int(raw.get("vision_end_token_id", 151653)))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad qwen3_vl config: {e!r}") from e
        if c.vision.out_dim != c.text.dim:
            raise ConfigError(f"vision out_hidden_size {c.vision.out_dim} != text hidden_size {c.text.dim}")
        return c


def _text(raw: dict[str, Any]) -> TextConfig:
    t = raw["text_config"]
    rope = dict(t.get("rope_scaling") or {}) | dict(t.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", t.get("rope_theta", 5_000_000.0)))
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"text rope_type {rope['rope_type']!r} is not supported (only default)")
    if not rope.get("mrope_interleaved", True):
        raise ConfigError("only interleaved multimodal rotary (mrope_interleaved: true) is supported")
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


def _vision(v: dict[str, Any]) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    patch, temporal = v.get("patch_size", 16), v.get("temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise ConfigError("vision patch_size / temporal_patch_size must be single numbers")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"vision hidden_act {act!r} is not supported (only gelu_pytorch_tanh)")
    c = VisionConfig(
        depth=int(v.get("depth", 27)), dim=int(v.get("hidden_size", 1152)), ff_dim=int(v.get("intermediate_size", 4304)),
        n_heads=int(v.get("num_heads", 16)), out_dim=int(v.get("out_hidden_size", 3584)), patch_size=patch,
        temporal_patch=temporal, merge=int(v.get("spatial_merge_size", 2)),
        n_pos_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_layers=tuple(int(i) for i in v.get("deepstack_visual_indexes", (8, 16, 24))),
        rope_theta=float(rope.get("rope_theta", 10000.0)), in_channels=int(v.get("in_channels", 3)))
    if c.pos_side**2 != c.n_pos_embeddings:
        raise ConfigError(f"num_position_embeddings {c.n_pos_embeddings} is not a square")
    if any(not 0 <= i < c.depth for i in c.deepstack_layers):
        raise ConfigError(f"deepstack_visual_indexes {list(c.deepstack_layers)} outside the {c.depth} vision layers")
    return c

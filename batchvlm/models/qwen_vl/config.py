"""What the Qwen vision-language families share in `config.json`: the vision tower's settings
(Qwen3-VL's tower; Qwen3.5 has the same one without DeepStack) and the error type of a config
that cannot be served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    pass


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
    deepstack_layers: tuple[int, ...]  # vision layers whose features feed text layers 0, 1, ... (none: no DeepStack)
    rope_theta: float
    in_channels: int = 3

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def pos_side(self) -> int:
        return int(self.n_pos_embeddings**0.5)


def vision_config(v: dict[str, Any], deepstack: bool) -> VisionConfig:
    """`vision_config` of config.json. `deepstack`: the family feeds vision layers into the text
    model (Qwen3-VL; default layers 8, 16, 24); without it the key must be absent (Qwen3.5)."""
    rope = v.get("rope_parameters") or {}
    patch, temporal = v.get("patch_size", 16), v.get("temporal_patch_size", 2)
    if not isinstance(patch, int) or not isinstance(temporal, int):
        raise ConfigError("vision patch_size / temporal_patch_size must be single numbers")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ConfigError(f"vision hidden_act {act!r} is not supported (only gelu_pytorch_tanh)")
    if not deepstack and v.get("deepstack_visual_indexes"):
        raise ConfigError("vision deepstack_visual_indexes: this family's text model takes no DeepStack features")
    layers = v.get("deepstack_visual_indexes", (8, 16, 24)) if deepstack else ()
    c = VisionConfig(
        depth=int(v.get("depth", 27)), dim=int(v.get("hidden_size", 1152)), ff_dim=int(v.get("intermediate_size", 4304)),
        n_heads=int(v.get("num_heads", 16)), out_dim=int(v.get("out_hidden_size", 3584)), patch_size=patch,
        temporal_patch=temporal, merge=int(v.get("spatial_merge_size", 2)),
        n_pos_embeddings=int(v.get("num_position_embeddings", 2304)),
        deepstack_layers=tuple(int(i) for i in layers),
        rope_theta=float(rope.get("rope_theta", 10000.0)), in_channels=int(v.get("in_channels", 3)))
    if c.pos_side**2 != c.n_pos_embeddings:
        raise ConfigError(f"num_position_embeddings {c.n_pos_embeddings} is not a square")
    if any(not 0 <= i < c.depth for i in c.deepstack_layers):
        raise ConfigError(f"deepstack_visual_indexes {list(c.deepstack_layers)} outside the {c.depth} vision layers")
    return c


def text_rope(t: dict[str, Any]) -> dict[str, Any]:
    """The text rotary settings in either spelling: `rope_parameters` (transformers 5) or the
    `rope_theta` + `rope_scaling` pair the released checkpoints were written with."""
    rope = dict(t.get("rope_scaling") or {}) | dict(t.get("rope_parameters") or {})
    rope.setdefault("rope_theta", t.get("rope_theta", 5_000_000.0))
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"text rope_type {rope['rope_type']!r} is not supported (only default)")
    if not rope.get("mrope_interleaved", True):
        raise ConfigError("only interleaved multimodal rotary (mrope_interleaved: true) is supported")
    return rope

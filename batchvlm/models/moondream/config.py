"""Moondream 2 configuration: the nested text / vision / region / tokenizer settings.

Field names and defaults follow the reference implementation, so a hub `config.json`
(`{"model_type": "moondream1", "config": {...}}`) or the reference's `to_dict()` output loads
as is; an empty dict is full-size Moondream 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import ConfigError


@dataclass(frozen=True)
class TextConfig:
    dim: int = 2048
    ff_dim: int = 8192
    n_layers: int = 24
    vocab_size: int = 51200
    max_context: int = 2048
    n_heads: int = 32
    n_kv_heads: int = 32
    prefix_attn: int = 730  # ignored, as in the reference: the prefix is 1 + grid**2
    group_size: int | None = None  # int4 groups of the quantized release; unsupported

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def rot_dim(self) -> int:
        # Partial rotary on the first half of each head (Phi's partial_rotary_factor 0.5).
        return self.head_dim // 2


@dataclass(frozen=True)
class VisionConfig:
    enc_dim: int = 1152
    enc_patch_size: int = 14
    enc_n_layers: int = 27
    enc_ff_dim: int = 4304
    enc_n_heads: int = 16
    proj_out_dim: int = 2048
    crop_size: int = 378
    in_channels: int = 3
    max_crops: int = 12
    overlap_margin: int = 4
    proj_inner_dim: int = 8192

    @property
    def grid(self) -> int:
        """Patches per crop side; the reference writes 27 (its layer count) here."""
        return self.crop_size // self.enc_patch_size

    @property
    def n_image_tokens(self) -> int:
        return self.grid * self.grid


@dataclass(frozen=True)
class RegionConfig:
    dim: int = 2048
    coord_feat_dim: int = 256
    coord_out_dim: int = 1024
    size_feat_dim: int = 512
    size_out_dim: int = 2048
    inner_dim: int = 8192
    group_size: int | None = None


def _default_templates() -> dict[str, Any]:
    return {
        "caption": {
            "short": [1, 32708, 2, 12492, 3],
            "normal": [1, 32708, 2, 6382, 3],
            "long": [1, 32708, 2, 4059, 3],
        },
        "query": {"prefix": [1, 15381, 2], "suffix": [3]},
        "detect": {"prefix": [1, 7235, 476, 2], "suffix": [3]},
        "point": {"prefix": [1, 2581, 2], "suffix": [3]},
    }


@dataclass(frozen=True)
class TokenizerConfig:
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    thinking_id: int = 4
    coord_id: int = 5
    size_id: int = 6
    start_ground_points_id: int = 7
    end_ground_id: int = 9
    templates: dict[str, Any] = field(default_factory=_default_templates)


@dataclass(frozen=True)
class MoondreamConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    region: RegionConfig = field(default_factory=RegionConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)

    @property
    def prefix_len(self) -> int:
        """BOS + image tokens: the bidirectional prefix every task on an image shares."""
        return 1 + self.vision.n_image_tokens

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoondreamConfig:
        sections = {"text": TextConfig, "vision": VisionConfig, "region": RegionConfig,
                    "tokenizer": TokenizerConfig}
        unknown = set(d) - set(sections)
        if unknown:
            raise ConfigError(f"config: unknown section(s) {sorted(unknown)}")
        parts = {}
        for name, klass in sections.items():
            values = d.get(name) or {}
            known = {f.name for f in dataclasses.fields(klass)}
            bad = set(values) - known
            if bad:
                raise ConfigError(f"config.{name}: unknown key(s) {sorted(bad)}")
            parts[name] = klass(**values)
        config = cls(**parts)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        t, v = self.text, self.vision
        if t.group_size is not None or self.region.group_size is not None:
            raise ConfigError("config: quantized (group_size) checkpoints are not supported")
        if t.dim % t.n_heads or t.n_heads % t.n_kv_heads:
            raise ConfigError("config.text: dim must divide into n_heads, n_heads into n_kv_heads")
        if t.head_dim % 4:
            raise ConfigError("config.text: head_dim must be a multiple of 4 (partial rotary)")
        if v.crop_size % v.enc_patch_size:
            raise ConfigError("config.vision: crop_size must be a multiple of enc_patch_size")
        if v.grid <= 2 * v.overlap_margin:
            raise ConfigError("config.vision: overlap_margin leaves no usable crop window")
        if v.enc_dim % v.enc_n_heads:
            raise ConfigError("config.vision: enc_dim must divide into enc_n_heads")
        if self.region.size_out_dim % 2:
            raise ConfigError("config.region: size_out_dim holds width and height bins")
        if self.prefix_len + 2 > t.max_context:
            raise ConfigError("config.text: max_context is shorter than the image prefix")
        if v.max_crops < 1:
            raise ConfigError("config.vision: max_crops must be >= 1")

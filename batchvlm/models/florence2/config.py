"""Florence-2 configuration, read from a hub `config.json` (`model_type: florence2`, transformers'
layout: `vision_config` for DaViT, `text_config` a BART config) and `generation_config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..base.errors import ConfigError

# The image tokens are one spatially pooled token, then every cell of the last DaViT stage
# (pooled over the single frame). transformers 5 hard-codes this; older configs spell it out.
FEATURE_SOURCE = ["spatial_avg_pool", "temporal_avg_pool"]


@dataclass(frozen=True)
class VisionConfig:
    """DaViT: four (or fewer) stages, each a strided conv then `depths[i]` dual-attention blocks."""

    depths: tuple[int, ...]
    patch_size: tuple[int, ...]
    patch_stride: tuple[int, ...]
    patch_padding: tuple[int, ...]
    patch_prenorm: tuple[bool, ...]
    dims: tuple[int, ...]
    heads: tuple[int, ...]  # window attention heads per stage
    groups: tuple[int, ...]  # channel attention groups per stage
    window: int
    mlp_ratio: float
    qkv_bias: bool
    projection_dim: int  # the language width
    max_positions: int  # side of the learned 2-D position table
    max_temporal: int
    in_channels: int = 3


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    dim: int
    encoder_layers: int
    decoder_layers: int
    encoder_heads: int
    decoder_heads: int
    encoder_ff: int
    decoder_ff: int
    max_positions: int  # learned positions of the encoder and of the decoder (each)
    scale_embedding: bool
    activation: str

    @property
    def decoder_head_dim(self) -> int:
        return self.dim // self.decoder_heads


@dataclass(frozen=True)
class Florence2Config:
    vision: VisionConfig
    text: TextConfig
    image_token_id: int

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Florence2Config:
        if raw.get("model_type") != "florence2":
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not florence2")
        if "vision_config" not in raw or "text_config" not in raw:
            raise ConfigError("no vision_config / text_config: not transformers' Florence-2 layout (a checkpoint "
                              "for remote code, e.g. microsoft/Florence-2-base, is not read; use its "
                              "florence-community conversion)")
        try:
            c = cls(_vision(raw["vision_config"]), _text(raw["text_config"]), int(raw.get("image_token_id", 51289)))
        except ConfigError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad florence2 config: {e!r}") from e
        v = c.vision
        if c.vision.projection_dim != c.text.dim:
            raise ConfigError(f"vision projection_dim {v.projection_dim} != text d_model {c.text.dim}")
        if not len(v.depths) == len(v.dims) == len(v.heads) == len(v.groups) == len(v.patch_size):
            raise ConfigError("vision_config: depths, embed_dim, num_heads, num_groups, patch_size differ in length")
        if c.text.dim % c.text.encoder_heads or c.text.dim % c.text.decoder_heads:
            raise ConfigError("text_config: d_model is not a multiple of the attention heads")
        if c.text.activation not in ("gelu", "relu"):
            raise ConfigError(f"text_config.activation_function {c.text.activation!r} is not supported")
        return c


def _vision(v: dict[str, Any]) -> VisionConfig:
    source = v.get("image_feature_source", FEATURE_SOURCE)
    if list(source) != FEATURE_SOURCE:
        raise ConfigError(f"vision_config.image_feature_source {source!r}: only {FEATURE_SOURCE} is supported")
    if v.get("activation_function", "gelu") != "gelu":
        raise ConfigError(f"vision_config.activation_function {v['activation_function']!r} is not supported")
    tup = lambda k, d: tuple(v.get(k, d))  # noqa: E731
    return VisionConfig(
        depths=tup("depths", (1, 1, 9, 1)), patch_size=tup("patch_size", (7, 3, 3, 3)),
        patch_stride=tup("patch_stride", (4, 2, 2, 2)), patch_padding=tup("patch_padding", (3, 1, 1, 1)),
        patch_prenorm=tup("patch_prenorm", (False, True, True, True)), dims=tup("embed_dim", (128, 256, 512, 1024)),
        heads=tup("num_heads", (4, 8, 16, 32)), groups=tup("num_groups", (4, 8, 16, 32)),
        window=int(v.get("window_size", 12)), mlp_ratio=float(v.get("mlp_ratio", 4.0)),
        qkv_bias=bool(v.get("qkv_bias", True)), projection_dim=int(v.get("projection_dim", 1024)),
        max_positions=int(v.get("max_position_embeddings", 50)),
        max_temporal=int(v.get("max_temporal_embeddings", 100)), in_channels=int(v.get("in_channels", 3)))


def _text(t: dict[str, Any]) -> TextConfig:
    if t.get("model_type", "bart") != "bart":
        raise ConfigError(f"text_config.model_type {t.get('model_type')!r} is not bart")
    return TextConfig(
        vocab_size=int(t["vocab_size"]), dim=int(t.get("d_model", 1024)),
        encoder_layers=int(t.get("encoder_layers", 12)), decoder_layers=int(t.get("decoder_layers", 12)),
        encoder_heads=int(t.get("encoder_attention_heads", 16)), decoder_heads=int(t.get("decoder_attention_heads", 16)),
        encoder_ff=int(t.get("encoder_ffn_dim", 4096)), decoder_ff=int(t.get("decoder_ffn_dim", 4096)),
        max_positions=int(t.get("max_position_embeddings", 1024)), scale_embedding=bool(t.get("scale_embedding", False)),
        activation=str(t.get("activation_function", "gelu")))


@dataclass(frozen=True)
class GenerationSettings:
    """generation_config.json (else the text config) as greedy decoding uses it. `forced_bos`:
    the first generated token, whatever the logits; `forced_eos`: the token written at the last
    allowed position; `no_repeat_ngram`: n > 0 bans a token that would repeat an n-gram."""

    decoder_start: int
    eos: int
    pad: int
    forced_bos: int | None
    forced_eos: int | None
    no_repeat_ngram: int

    @classmethod
    def read(cls, folder: Path, text: dict[str, Any]) -> GenerationSettings:
        path = folder / "generation_config.json"
        gen = json.loads(path.read_text()) if path.is_file() else {}
        get = lambda k, d=None: gen.get(k, text.get(k, d))  # noqa: E731
        eos = get("eos_token_id", 2)
        eos = eos[0] if isinstance(eos, list) else eos
        start = get("decoder_start_token_id", eos)
        if not isinstance(eos, int) or not isinstance(start, int):
            raise ConfigError(f"{folder}: eos_token_id / decoder_start_token_id must be token ids")
        forced_eos = get("forced_eos_token_id")
        return cls(start, eos, int(get("pad_token_id", 1)), get("forced_bos_token_id"),
                   forced_eos[0] if isinstance(forced_eos, list) else forced_eos, int(get("no_repeat_ngram_size") or 0))

"""SigLIP / SigLIP 2 config.json as frozen dataclasses: two towers of one encoder layout, and how
the vision tower reads an image (NaFlex patches up to a count, or a fixed square)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..base.errors import ConfigError

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class TowerConfig:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    eps: float
    act: str

    @classmethod
    def from_dict(cls, d: dict[str, Any], which: str) -> TowerConfig:
        try:
            t = cls(int(d.get("hidden_size", 768)), int(d.get("intermediate_size", 3072)),
                    int(d.get("num_hidden_layers", 12)), int(d.get("num_attention_heads", 12)),
                    float(d.get("layer_norm_eps", 1e-6)), str(d.get("hidden_act", "gelu_pytorch_tanh")))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{which}: {e}") from e
        if t.act not in ACTIVATIONS:
            raise ConfigError(f"{which}.hidden_act: {t.act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if t.hidden % t.heads:
            raise ConfigError(f"{which}: hidden_size {t.hidden} is not a multiple of num_attention_heads {t.heads}")
        return t


@dataclass(frozen=True)
class SiglipConfig:
    model_type: str  # siglip2 (NaFlex) | siglip (fixed resolution)
    vision: TowerConfig
    text: TowerConfig
    patch: int
    positions: int  # the vision position table's rows: a square grid
    image_size: int | None  # fixed resolution: the square side; None for NaFlex
    vocab: int
    max_text: int  # text positions
    projection: int  # the text head's width: the embedding width

    @property
    def naflex(self) -> bool:
        return self.model_type == "siglip2"

    @property
    def embed_dim(self) -> int:
        return self.vision.hidden

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SiglipConfig:
        mt = d.get("model_type")
        if mt not in ("siglip", "siglip2"):
            raise ConfigError(f"model_type {mt!r} is not siglip / siglip2")
        v, t = d.get("vision_config") or {}, d.get("text_config") or {}
        vision, text = TowerConfig.from_dict(v, "vision_config"), TowerConfig.from_dict(t, "text_config")
        patch = int(v.get("patch_size", 16))
        if mt == "siglip2":
            positions, image_size = int(v.get("num_patches", 256)), None
            if round(positions ** 0.5) ** 2 != positions:
                raise ConfigError(f"vision_config.num_patches {positions} is not a square")
        else:
            image_size = int(v.get("image_size", 224))
            if image_size % patch:
                raise ConfigError(f"vision_config.image_size {image_size} is not a multiple of patch_size {patch}")
            positions = (image_size // patch) ** 2
        if not v.get("vision_use_head", True):
            raise ConfigError("vision_config.vision_use_head false: the image embedding is the pooling head's")
        projection = int(t.get("projection_size") or text.hidden)
        if projection != vision.hidden:
            raise ConfigError(f"text_config.projection_size {projection} differs from the vision width {vision.hidden}")
        return cls(mt, vision, text, patch, positions, image_size, int(t.get("vocab_size", 32000)),
                   int(t.get("max_position_embeddings", 64)), projection)

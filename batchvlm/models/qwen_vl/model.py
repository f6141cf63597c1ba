"""The module tree of a Qwen vision-language model: the shared vision tower and the family's text
model. Parameter names are the checkpoint's: `model.visual.*`, `model.language_model.*` and
`lm_head.weight` (absent when the embeddings are tied)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..base.layers import Towers
from .vision import VisionTower


class QwenVLModel(nn.Module):
    """`config`: the family's (with `.vision` and `.text`); `text`: its text model (with
    `embed_tokens` and its rotary tables `rotary`)."""

    def __init__(self, config, text: nn.Module):
        super().__init__()
        self.config = config
        self.model = Towers(visual=VisionTower(config.vision), language_model=text)
        if not config.text.tie_embeddings:
            self.lm_head = nn.Linear(config.text.dim, config.text.vocab_size, bias=False)

    @property
    def visual(self) -> VisionTower:
        return self.model.visual

    @property
    def text(self) -> nn.Module:
        return self.model.language_model

    @property
    def device(self) -> torch.device:
        return self.text.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.embed_tokens.weight.dtype

    def reset_buffers(self, lut: torch.Tensor) -> None:
        """Recompute derived float32 tables (after meta construction or a dtype cast)."""
        self.visual.reset_buffers(lut)
        self.text.rotary.reset(self.device)

    def embed(self, tokens_N: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(tokens_N)

    def logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states -> float32 logits."""
        w = self.text.embed_tokens.weight if self.config.text.tie_embeddings else self.lm_head.weight
        return F.linear(hidden_NC, w).float()

"""Qwen3-VL behind the family interface: the device side the engine drives (the vision stage,
prefix inputs and decoding shared with Qwen3.5: qwen_vl/device.py). Every text layer is full
attention over paged K/V; the prefix inputs carry DeepStack features."""

from __future__ import annotations

import torch

from ...cache.specs import PagedKV
from ...cache.tensors import EngineCache
from ...attention import AttentionBatch, attend, plan_groups
from ..base.contract import PrefixInputs
from ..qwen_vl.device import QwenVLEngineModel
from .model import Qwen3VLModel


class Qwen3VLEngineModel(QwenVLEngineModel):
    model: Qwen3VLModel

    def state_specs(self) -> list[PagedKV]:
        t = self.model.config.text
        return [PagedKV("attn", t.n_layers, t.n_kv_heads, t.head_dim, self.dtype)]

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: EngineCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        kv = cache.paged["attn"]
        plans = plan_groups(batch, kv)

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(q, k, v, kv.k[layer], kv.v[layer], batch, plans)

        return self.model.text(embeds_NC, positions, attention, prefix.extras if prefix is not None else None)

"""Qwen3.5 behind the family interface: the device side the engine drives.

Image prefix of an image (qwen_vl/positions.py): [template head][gh * gw image tokens]
[vision_end], causal, 3-D rotary positions; own tokens get 1-D positions from `next_pos` on.
State kinds: the full-attention layers keep paged K/V ("attn"); the Gated DeltaNet layers keep a
fixed-size state per sequence ("linear": conv + recurrent, float32). A prefix's linear state at
its end is a snapshot each of the image's task sequences starts from by copy when its prompt is
prefilled (batch.states says where each run reads and writes), so several tasks per image cost
one image prefill.
"""

from __future__ import annotations

import torch

from ...cache.specs import PagedKV, Recurrent
from ...cache.tensors import EngineCache
from ...attention import AttentionBatch, attend, plan_groups
from ..base.contract import PrefixInputs
from ..qwen_vl.device import QwenVLEngineModel
from .linear_state import LinearState, Segments
from .model import Qwen35Model


class Qwen35EngineModel(QwenVLEngineModel):
    model: Qwen35Model

    def state_specs(self) -> list[PagedKV | Recurrent]:
        t = self.model.config.text
        return [PagedKV("attn", len(t.full_layers), t.n_kv_heads, t.head_dim, self.dtype),
                Recurrent("linear", LinearState.shapes(t))]

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: EngineCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        kv = cache.paged["attn"]
        plans = plan_groups(batch, kv)
        st = cache.recurrent["linear"]

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attend(q, k, v, kv.k[layer], kv.v[layer], batch, plans)

        return self.model.text(embeds_NC, positions, attention, Segments(batch.states, self.device),
                               LinearState(st["conv"], st["recurrent"]))

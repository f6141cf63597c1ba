"""The Moondream 2 module tree (vision, text, region) and the forward primitives the
generators and the engine build on. Parameter names are the checkpoint's minus `model.`."""

from __future__ import annotations

import torch
import torch.nn as nn

from ...attention import AttentionBatch, KVCache, backend_for
from .grammar import INPUT_COORD, INPUT_SIZE
from .config import MoondreamConfig
from .region import RegionModel
from .text import TextModel
from .vision import VisionModel


class MoondreamModel(nn.Module):
    def __init__(self, config: MoondreamConfig):
        super().__init__()
        self.config = config
        self.vision = VisionModel(config.vision)
        self.text = TextModel(config.text)
        self.region = RegionModel(config.region)

    def reset_buffers(self) -> None:
        """Recompute derived float32 tables (after meta construction or a dtype cast)."""
        self.text.reset_buffers()
        self.region.reset_buffers()

    @property
    def device(self) -> torch.device:
        return self.text.wte.device

    @property
    def dtype(self) -> torch.dtype:
        return self.text.wte.dtype

    def prefix_embeds(self, image_features_ITC: torch.Tensor) -> torch.Tensor:
        """[BOS, image tokens] for each image -> [I, P, C]."""
        I = image_features_ITC.shape[0]
        bos = self.text.wte[self.config.tokenizer.bos_id].expand(I, 1, -1)
        return torch.cat([bos, image_features_ITC.to(bos.dtype)], dim=1)

    def kept_prefix(self, features_TC: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Duplicate pruning (vision.py forward_kept): [BOS, kept tokens] of one image -> (embeddings
        [1 + n, C], positions [1 + n]): BOS at 0, a kept token at 1 + its grid index."""
        bos = self.text.wte[self.config.tokenizer.bos_id][None]
        positions = torch.cat([torch.zeros(1, dtype=torch.long, device=keep.device), 1 + keep])
        return torch.cat([bos, features_TC.to(bos.dtype)]), positions

    def input_embeds(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        """Embeddings of decode inputs: wte[token], or the encoding of a coordinate / size.

        Computed for every row and selected with `where`, so mixed text / point / detect
        batches need no host-side split (and CUDA graphs see fixed shapes).
        """
        tok = self.text.wte[token_N]
        coord = self.region.encode_coord(value_N2[:, 0]).to(tok.dtype)
        size = self.region.encode_size(value_N2).to(tok.dtype)
        kind = kind_N[:, None]
        return torch.where(kind == INPUT_COORD, coord, torch.where(kind == INPUT_SIZE, size, tok))

    def forward_tokens(
        self, embeds_NC: torch.Tensor, positions_N: torch.Tensor, batch: AttentionBatch, cache: KVCache
    ) -> torch.Tensor:
        return self.text(embeds_NC, positions_N, batch, cache)

    def new_kv_cache(self, n_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVCache:
        t = self.config.text
        return KVCache.allocate(t.n_layers, n_blocks, block_size, t.n_kv_heads, t.head_dim,
                                dtype or self.dtype, self.device, backend_for(self.device))

"""Moondream 2's device side (base/contract.py EngineModel): what the engine drives. Every image
prefix is `[BOS][729 image tokens]`, attended bidirectionally; positions equal slot indices.
With duplicate pruning (vision.py forward_kept) it is `[BOS][kept image tokens]`, each kept
token at its position on the full grid (1 + its grid index): the text model's rotary positions
then have gaps, and the text after the image starts at 1 + 729 as without pruning."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...attention import AttentionBatch
from ...cache.specs import PagedKV
from ...cache.tensors import EngineCache
from ..base.contract import ModelInfo, PrefixInputs
from ..base.decoding import Decision, RowState
from ..base.device import EngineModelBase
from . import grammar
from .decoding import decide
from .model import MoondreamModel
from .preprocess import PreparedImage


@dataclass
class KeptFeatures:
    """An image's features with duplicate pruning: the kept tokens and their grid indices."""

    features_TC: torch.Tensor
    keep: torch.Tensor  # long, on the device


class MoondreamEngineModel(EngineModelBase):
    causal_prefix = False  # the image part: [BOS][image tokens]
    causal_prefix_prompt = True  # a prefix prompt after it (classify's shared prompt) is text: causal
    model: MoondreamModel

    def __init__(self, model: MoondreamModel, info: ModelInfo):
        super().__init__(model, info, model.config.tokenizer.eos_id)
        self.P = model.config.prefix_len

    def state_specs(self) -> list[PagedKV]:
        t = self.model.config.text
        return [PagedKV("attn", t.n_layers, t.n_kv_heads, t.head_dim, self.dtype)]

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor] | list[KeptFeatures]:
        crops = self._upload([im.crops for im in images])
        tilings = [im.tiling for im in images]
        if images[0].keep is None:  # pruning is off (a job setting: every image alike)
            return list(self.model.vision(crops, tilings).unbind(0))
        keeps = [im.keep.to(self.device, non_blocking=True) for im in images]  # not waiting for the vision stream
        return [KeptFeatures(f, k) for f, k in zip(self.model.vision.forward_kept(crops, tilings, keeps), keeps)]

    def largest_vision_batch(self) -> list[PreparedImage]:
        s = self.model.config.vision.crop_size
        image_tokens = self.model.config.vision.n_image_tokens
        return [PreparedImage(torch.zeros(1, s, s, 3, dtype=torch.uint8), (1, 1), image_tokens)] * 128

    def prefix_inputs(self, features: list[torch.Tensor] | list[KeptFeatures],
                      prompts: list[torch.Tensor]) -> PrefixInputs:
        if isinstance(features[0], KeptFeatures):
            return self._kept_prefix_inputs(features, prompts)
        image_IPC = self.model.prefix_embeds(torch.stack(features))
        if not any(p.shape[0] for p in prompts):
            return PrefixInputs(image_IPC.reshape(len(features) * self.P, -1),
                                torch.arange(self.P, device=self.device).repeat(len(features)))
        # A prefix prompt follows its image's tokens; positions equal slot indices.
        embeds = [part for image_PC, p in zip(image_IPC, prompts) for part in (image_PC, self.model.text.wte[p])]
        positions = [torch.arange(self.P + p.shape[0], device=self.device) for p in prompts]
        return PrefixInputs(torch.cat(embeds), torch.cat(positions))

    def _kept_prefix_inputs(self, features: list[KeptFeatures], prompts: list[torch.Tensor]) -> PrefixInputs:
        """[BOS][kept tokens][prefix prompt] per image: the prompt from P (the full prefix's
        length) on."""
        embeds, positions = [], []
        for f, p in zip(features, prompts):
            image_embeds, image_positions = self.model.kept_prefix(f.features_TC, f.keep)
            embeds += [image_embeds, self.model.text.wte[p]]
            positions += [image_positions, self.P + torch.arange(p.shape[0], device=self.device)]
        return PrefixInputs(torch.cat(embeds), torch.cat(positions))

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor:
        return self.model.text.wte[ids_N]

    def embed_inputs(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        return self.model.input_embeds(kind_N, token_N, value_N2)

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: EngineCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        return self.model.text(embeds_NC, positions, batch, cache.paged["attn"])

    emit = staticmethod(grammar.emit)

    def logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        return self.model.text.logits(hidden_NC)

    def decide_rows(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
                    heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                    mask_BW: torch.Tensor | None) -> Decision:
        return decide(self.model, hidden_BC, state, sampling, heads, mask_BW)

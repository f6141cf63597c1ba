"""Florence-2's device side (base/contract.py EngineModel; docs/adding-a-family.md, encoder-decoder).

Stages and what they are shared by:
  vision     `encode`: DaViT + projector, once per image -> image tokens [I, C], shared by every
             task of the image (the engine counts images in `stats["vision_images"]`)
  encoder    a prefix segment per (image, prompt): [image tokens | <s> instruction </s>], run
             densely over the step's prefix rows (bidirectional, nothing of it is stored); its
             output becomes every decoder layer's cross-attention K/V, written into the
             prefix's CrossKV blocks and read by every sequence on that prefix
  decoder    the sequence's own tokens from the decoder start token, positions 0, 1, ... (the
             prefix gives no positions); self-attention over own tokens in paged KV.
The decoder runs on own rows only: the flat batch's prefix rows are zero-padded where an
attention call wants all N rows, and come back as zero hidden states.

Duplicate pruning (model.prune_duplicates, preprocess.py): DaViT and the projector run on the full
grid (the pooled token is the mean of every cell), then the dropped cells' image tokens are left
out. The encoder reads the kept ones at their own positions (BART's learned positions, with gaps:
the prompt still starts at position 1 + cells), so the prefix, the encoder's work and the cross
K/V it leaves are as long as the kept tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.specs import CrossKV, PagedKV, StateSpec
from ...cache.tensors import EngineCache
from ...attention import AttentionBatch, PrefixGroup, Reads, attend, plan_groups
from ..base.decoding import Decision, RowState
from ..base.device import EngineModelBase
from ..base.contract import ModelInfo, PrefixInputs
from . import decoding
from .config import GenerationSettings
from .decoding import History
from .model import Florence2Model
from .preprocess import PreparedImage


@dataclass
class ImageFeatures:
    """One image's encoder input: its image tokens, the pooled one first."""

    tokens_TC: torch.Tensor  # [1 + kept cells, C]
    positions_T: torch.Tensor | None  # pruned: each token's place among all 1 + cells (long); None: 0, 1, ...


class Florence2EngineModel(EngineModelBase):
    causal_prefix = False  # the encoder reads its (image, prompt) rows bidirectionally

    def __init__(self, model: Florence2Model, info: ModelInfo, generation: GenerationSettings, image_tokens: int,
                 image_size: tuple[int, int]):
        super().__init__(model, info, generation.eos)  # the end token ends a classify choice (host.py _choices)
        self.generation = generation
        self.image_tokens = image_tokens
        self.image_size = image_size  # (width, height) every image is resized to
        self._history: History | None = None  # no_repeat_ngram: per engine cache (its rows)
        self._history_of: EngineCache | None = None

    def state_specs(self) -> list[StateSpec]:
        t = self.model.config.text
        # One allocation for both: self-attention reads and writes own blocks only (Reads.OWN), the
        # cross K/V prefix blocks only (Reads.PREFIX)
        return [PagedKV("self", t.decoder_layers, t.decoder_heads, t.decoder_head_dim, self.dtype),
                CrossKV("cross", t.decoder_layers, t.decoder_heads, t.decoder_head_dim, self.dtype, shares="self")]

    def prefix_layout(self, image: PreparedImage, prompt: tuple[int, ...]) -> tuple[int, int]:
        return image.prefix_len + len(prompt), image.next_pos

    def encode(self, images: list[PreparedImage]) -> list[ImageFeatures]:
        pixels = self._upload([im.pixels[None] for im in images])  # uint8 [B, H, W, 3]
        m = self.model
        tokens_BTC = m.image_tokens(m.pixel_values(pixels))
        out = []
        for im, tokens_TC in zip(images, tokens_BTC.unbind(0)):
            if im.keep is None:
                out.append(ImageFeatures(tokens_TC, None))
            else:
                # the pooled token, kept cells; non_blocking: a blocking copy would wait for the vision stream's DaViT
                rows = torch.cat([im.keep.new_zeros(1), im.keep + 1]).to(self.device, non_blocking=True)
                out.append(ImageFeatures(tokens_TC[rows], rows))
        return out

    def largest_vision_batch(self) -> list[PreparedImage]:
        w, h = self.image_size
        im = PreparedImage(torch.zeros(h, w, 3, dtype=torch.uint8), self.image_tokens - 1)
        return [im] * max(1, 128 // im.cost)

    def prefix_inputs(self, features: list[ImageFeatures], prompts: list[torch.Tensor]) -> PrefixInputs:
        """Encoder positions: without pruning the encoder takes its own (0, 1, ... over each
        prefix: these, unread); `extras` True where an image was pruned, and the encoder reads these."""
        text = self.model.text
        embeds, positions = [], []
        for f, p in zip(features, prompts):
            embeds.append(torch.cat([f.tokens_TC, text.embed(p)]))
            n = f.tokens_TC.shape[0]
            image_pos = torch.arange(n, device=self.device) if f.positions_T is None else f.positions_T
            positions += [image_pos, self.image_tokens + torch.arange(p.shape[0], device=self.device)]
        pruned = any(f.positions_T is not None for f in features)
        return PrefixInputs(torch.cat(embeds), torch.cat(positions), pruned)

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor:
        return self.model.text.embed(ids_N)

    def embed_inputs(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        return self.model.text.embed(token_N)  # every input is a token

    def _encoder(self, embeds_PC: torch.Tensor, group: PrefixGroup, positions_P: torch.Tensor | None) -> torch.Tensor:
        """The step's prefix rows [P, C] -> encoder output [P, C], each prefix on its own, at
        `positions_P` (None: 0, 1, ... within each prefix)."""
        P = embeds_PC.shape[0]
        rows_IL = group.q_rows.clamp(max=P)  # padding -> a zero row P (the flat batch's pad is N)
        x_ILC = torch.cat([embeds_PC, embeds_PC.new_zeros(1, embeds_PC.shape[1])])[rows_IL]
        valid = None
        if not group.all_full:
            j = torch.arange(rows_IL.shape[1], device=rows_IL.device)
            valid = j[None, :] < group.lens[:, None]
        pos_IL = None if positions_P is None else torch.cat([positions_P, positions_P.new_zeros(1)])[rows_IL]
        out = embeds_PC.new_zeros(P + 1, embeds_PC.shape[1])
        out[rows_IL] = self.model.text.encoder(x_ILC, valid, pos_IL)  # padding lands on row P
        return out[:P]

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: EngineCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        text = self.model.text
        own, cross = cache.paged["self"], cache.paged["cross"]
        if self.generation.no_repeat_ngram and self._history_of is not cache:
            width = self.model.config.text.max_positions + 1  # the decoder's positions bound a sequence
            self._history = History(cache.n_rows + 1, width, self.generation.decoder_start, self.device)
            self._history_of = cache
        P = batch.n_prefix
        H, D = text.config.decoder_heads, text.config.decoder_head_dim
        if P:
            group = next(g for g in batch.groups if isinstance(g, PrefixGroup))
            pruned = prefix is not None and prefix.extras  # positions with gaps: the encoder reads them
            enc_PC = self._encoder(embeds_NC[:P], group, positions[:P] if pruned else None)
            cross_kv = text.decoder.cross_kv(enc_PC)  # per layer [P, H, D] each
        else:
            empty = embeds_NC.new_zeros(0, H, D)
            cross_kv = [(empty, empty)] * len(text.decoder.layers)
        # `attend` takes all N rows: own rows go below P zero rows, in buffers made once per step and
        # rewritten by every layer (attend copies what it keeps: K/V into the cache)
        full_3NHD = embeds_NC.new_zeros(3, embeds_NC.shape[0], H, D) if P else None

        def full(j: int, x: torch.Tensor) -> torch.Tensor:
            if full_3NHD is None:
                return x
            full_3NHD[j, P:] = x
            return full_3NHD[j]

        po, pc = plan_groups(batch, own), plan_groups(batch, cross)

        def self_attend(i: int, q, k, v):
            return attend(full(0, q), full(1, k), full(2, v), own.k[i], own.v[i], batch, po, Reads.OWN)[P:]

        def cross_attend(i: int, q):
            k, v = cross_kv[i]
            return attend(full(0, q), k, v, cross.k[i], cross.v[i], batch, pc, Reads.PREFIX, layer=i)[P:]

        hidden = text.decoder(embeds_NC[P:], positions[P:], self_attend, cross_attend)
        return torch.cat([embeds_NC.new_zeros(P, hidden.shape[1]), hidden]) if P else hidden

    def logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        return self.model.text.logits(hidden_NC)

    def decide_rows(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
                    heads: tuple[torch.Tensor, ...] | None, mask_BW: torch.Tensor | None) -> Decision:
        return decoding.decide(self.logits(hidden_BC), state, sampling, self.generation, self._history, mask_BW)

    emit = staticmethod(decoding.emit)

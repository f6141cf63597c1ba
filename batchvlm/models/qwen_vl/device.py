"""The device side both native Qwen families share: vision stage, image prefix inputs,
embeddings and text decoding. A family adds its state kinds and its forward.

Image prefix of an image (positions.py): [template head][gh * gw image tokens][vision_end],
causal like the rest of the sequence, with 3-D rotary positions; a sequence's own tokens get
1-D positions from the image's `next_pos` on. DeepStack features (Qwen3-VL) ride along with the
prefix inputs (`PrefixInputs.extras`) and are added to the image-token rows of the flat batch
(the prefixes come first in it) after the first text layers; decode steps and prompts never
carry them. A tower without DeepStack (Qwen3.5) passes no extras.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..base.decoding import Decision, RowState, decide_text, emit_text
from ..base.device import EngineModelBase
from ..base.contract import ModelInfo, PrefixInputs
from ..base.grammar import apply_mask_
from .model import QwenVLModel
from .positions import prefix_positions
from .preprocess import PreparedImage, Preprocessor
from .vision import DeepStack


@dataclass
class ImageFeatures:
    """One image's vision output, held on the device until its prefix is prefilled."""

    features_TC: torch.Tensor  # [image tokens, C]
    deepstack_KTC: torch.Tensor  # [n deepstack layers (maybe 0), image tokens, C]
    grid: tuple[int, int]
    keep: torch.Tensor | None = None  # duplicate pruning: the kept cells (device), as PreparedImage.keep


class QwenVLEngineModel(EngineModelBase):
    causal_prefix = True

    def __init__(self, model: QwenVLModel, info: ModelInfo, head: list[int], stop_ids: list[int],
                 pre: Preprocessor, end_id: int):
        super().__init__(model, info, end_id)  # classify: <|im_end|> ends a choice
        self.head = torch.tensor(head, dtype=torch.long, device=self.device)
        self.vision_end = torch.tensor([model.config.vision_end_id], dtype=torch.long, device=self.device)
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        self.pre = pre

    def encode(self, images: list[PreparedImage]) -> list[ImageFeatures]:
        # One pinned staging copy and one upload for the batch; images differ in size, so flat.
        flat = self._upload([im.pixels.reshape(-1) for im in images])
        pixels, at = [], 0
        for im in images:
            pixels.append(flat[at : at + im.pixels.numel()].view(im.pixels.shape))
            at += im.pixels.numel()
        keeps = [None if im.keep is None else im.keep.to(self.device, non_blocking=True) for im in images]
        out = self.model.visual(pixels, keeps)
        deepstack = torch.stack(out.deepstack) if out.deepstack else out.features_TC.new_zeros(0, *out.features_TC.shape)
        feats, at = [], 0
        for im, n, keep in zip(images, out.tokens, keeps):
            feats.append(ImageFeatures(out.features_TC[at : at + n], deepstack[:, at : at + n], im.grid, keep))
            at += n
        return feats

    def largest_vision_batch(self) -> list[PreparedImage]:
        """A batch of the largest images, as many as fill one vision batch (cost 128)."""
        side = self.pre.resized_size(10**5, 10**5)[0]
        f = self.pre.factor
        im = PreparedImage(torch.zeros(side, side, 3, dtype=torch.uint8), (side // f, side // f), len(self.head))
        return [im] * max(1, -(-128 // im.cost))

    def prefix_inputs(self, features: list[ImageFeatures], prompts: list[torch.Tensor]) -> PrefixInputs:
        h = len(self.head)
        head = self.model.embed(self.head)
        end = self.model.embed(self.vision_end)
        embeds, positions, rows = [], [], []
        at = 0
        for f, prompt in zip(features, prompts):
            n, p = f.features_TC.shape[0], prompt.shape[0]
            embeds += [head, f.features_TC.to(head.dtype), end, self.model.embed(prompt)]
            # a prefix prompt (classify's shared prompt) continues 1-D after vision_end
            image_pos = prefix_positions(h, f.grid, self.device, f.keep)
            positions += [image_pos, image_pos[:, -1:] + 1 + torch.arange(p, device=self.device)]
            rows.append(torch.arange(at + h, at + h + n, device=self.device))
            at += h + n + 1 + p
        deepstack = None
        if self.model.config.vision.deepstack_layers:
            deepstack = DeepStack(torch.cat(rows),
                                  list(torch.cat([f.deepstack_KTC for f in features], dim=1).unbind(0)))
        return PrefixInputs(torch.cat(embeds), torch.cat(positions, dim=1), deepstack)

    def own_positions(self, pos_N: torch.Tensor) -> torch.Tensor:
        return pos_N.expand(3, -1)

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids_N)

    def embed_inputs(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        return self.model.embed(token_N)  # every input is a token

    emit = staticmethod(emit_text)

    def logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden_NC)

    def decide_rows(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
                    heads: tuple[torch.Tensor, ...] | None, mask_BW: torch.Tensor | None) -> Decision:
        logits_BV = self.model.logits(hidden_BC)
        if mask_BW is not None:  # the mask step, then the batch-invariant sampler
            logits_BV = apply_mask_(logits_BV, mask_BW)
        return decide_text(logits_BV, state, self.stop_ids, sampling)

"""The device-side base of a native family (contract.EngineModel): the loaded module tree, its
provenance, pinned uploads of vision inputs, and the classify wrapper around the family's own
token decision."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from .contract import ModelInfo, Prepared
from .decoding import Decision, PromptRows, RowState, choice_scores, scores_only, with_scores
from .grammar import fill_masks, mask_threads
from .pinned import PinnedUpload


class EngineModelBase(ABC):
    """`end_id`: the token that ends a classify choice (scored after its last token, never fed).
    Defaults suit a family whose prefix is the image then the prefix prompt, with scalar
    positions; a family overrides what differs."""

    causal_prefix: bool

    def __init__(self, model: Any, info: ModelInfo, end_id: int):
        self.model, self.info = model, info
        self.device, self.dtype = model.device, model.dtype
        self.end_id = end_id
        self._upload = PinnedUpload(self.device)
        self._mask_threads = mask_threads(self.device)

    def prefix_layout(self, image: Prepared, prompt: tuple[int, ...]) -> tuple[int, int]:
        return image.prefix_len + len(prompt), image.next_pos + len(prompt)

    def own_positions(self, pos_N: torch.Tensor) -> torch.Tensor:
        return pos_N

    def fill_masks(self, states: list[Any], out_MW) -> None:
        """json (and constrained) tasks: base/grammar.py, on as many threads as the device allows."""
        fill_masks(states, out_MW, self._mask_threads)

    @abstractmethod
    def logits(self, hidden_NC: torch.Tensor) -> torch.Tensor:
        """Final hidden states -> logits [N, V] (classify scores them in float32)."""

    @abstractmethod
    def decide_rows(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
                    heads: tuple[torch.Tensor, ...] | None, mask_BW: torch.Tensor | None) -> Decision:
        """The family's decision for every row (contract.EngineModel.decide without `prompt`)."""

    def decide(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
               heads: tuple[torch.Tensor, ...] | None, prompt: PromptRows | None = None,
               mask_BW: torch.Tensor | None = None) -> Decision:
        if prompt is not None and prompt.only_scores:  # classify choices alone: nothing to sample
            return scores_only(choice_scores(self.logits, prompt, state, self.end_id))
        d = self.decide_rows(hidden_BC, state, sampling, heads, mask_BW)
        if prompt is None:
            return d
        return with_scores(d, state, choice_scores(self.logits, prompt, state, self.end_id))

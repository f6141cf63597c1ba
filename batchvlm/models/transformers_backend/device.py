"""The transformers backend's device side (base/contract.py StaticModel): the loaded model, whose
labeler runs `generate` over batches of its own."""

from __future__ import annotations

from ...job import EngineSpec
from ..base.contract import ModelInfo, TaskSequence
from .generation import StaticLabeler


class StaticModel:
    """The loaded model; the run loop asks it for a labeler instead of driving it step by step."""

    def __init__(self, model, processor, info: ModelInfo):
        self.model, self.processor, self.info = model, processor, info

    def labeler(self, seqs: list[TaskSequence], engine: EngineSpec) -> StaticLabeler:
        return StaticLabeler(self.model, self.processor, seqs, engine)

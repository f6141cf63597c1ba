"""What a job's sequences ask of an engine (prefix and own lengths, sequences per image), known
before any memory is counted: the sizes start-up sizing, the runner and the attention bounds share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..attention.backend import MaskBounds
from ..cache.specs import has_recurrent
from ..job import EngineSpec
from ..models.base.decoding import MODE_SCORE
from ..models.base.contract import EngineModel, TaskSequence


@dataclass(frozen=True)
class JobShape:
    """What a job's sequences ask of an engine, known before any memory is counted."""

    block_size: int
    n_seqs: int  # sequences per image
    max_prefix_len: int  # the image's features, then the longest prefix prompt
    max_prefix_prompt: int
    prefixes_per_image: int  # distinct prefix prompts
    seqs_per_prefix: int  # the most sequences on one prefix
    own_blocks: tuple[int, ...]  # each sequence's own blocks: its prompt and budget
    max_prompt: int
    max_own_len: int  # the most own tokens (prompt + budget) a sequence can hold
    feature_slots: int  # images encoded ahead of admission (engine.max_images_in_flight)
    # Snapshot holders: the prefixes of the images prefilled in one step (at most one feature
    # slot each; scheduler.py admits no new image while one still has waiting sequences).
    snapshots: int
    sampling: bool
    scores: bool  # classify (MODE_SCORE): the warm-up scores prompt rows
    mask_words: int  # constrained sequences (json; constrained detect / point): the width of their token masks

    @classmethod
    def of(cls, model: EngineModel, seqs: list[TaskSequence], settings: EngineSpec, max_image_prefix_len: int
           ) -> JobShape:
        bs = settings.block_size
        prompts = [s.spec.prefix_prompt for s in seqs]
        prefixes_per_image = len(set(prompts))
        feature_slots = max(settings.max_images_in_flight, 1)
        return cls(
            block_size=bs, n_seqs=len(seqs),
            max_prefix_len=max_image_prefix_len + max(len(p) for p in prompts),
            max_prefix_prompt=max(len(p) for p in prompts), prefixes_per_image=prefixes_per_image,
            seqs_per_prefix=max(prompts.count(p) for p in prompts),
            own_blocks=tuple(-(-(len(s.spec.prompt) + s.spec.budget) // bs) for s in seqs),
            max_prompt=max(len(s.spec.prompt) for s in seqs),
            max_own_len=max(len(s.spec.prompt) + s.spec.budget for s in seqs),
            feature_slots=feature_slots,
            snapshots=feature_slots * prefixes_per_image if has_recurrent(model.state_specs()) else 0,
            sampling=any(s.spec.temperature > 0 for s in seqs),
            scores=any(s.spec.mode == MODE_SCORE for s in seqs),
            mask_words=max((s.spec.grammar.words for s in seqs if s.spec.grammar is not None), default=0))

    @property
    def prefix_blocks(self) -> int:
        """Blocks of the longest prefix."""
        return -(-self.max_prefix_len // self.block_size)

    @property
    def max_own_blocks(self) -> int:
        return max(self.own_blocks)

    def images_for(self, n_rows: int) -> int:
        """Images whose sequences fill n_rows rows."""
        return math.ceil(n_rows / self.n_seqs)

    def bounds(self, n_rows: int) -> MaskBounds:
        """The maxima a fused attention backend pads every mask to (attention/fused.py)."""
        return MaskBounds(n_rows, self.max_own_blocks, self.prefix_blocks, self.max_prompt, self.seqs_per_prefix)

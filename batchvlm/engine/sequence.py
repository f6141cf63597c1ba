"""Images and their task sequences, with an explicit lifecycle.

Image:    QUEUED -> ENCODED (features on the device) -> ADMITTED (prefix + prompts planned)
          -> DONE when every sequence has finished (its result can be handed out)
Sequence: WAITING -> RUNNING (a row of the device state) -> FINISHED (host saw EOS or a limit)
          -> RETIRED once no in-flight step refers to it (row and blocks are freed then)

`inflight` counts planned-but-uncommitted steps that include the sequence: at most two in the
pipelined engine. A sequence finished at step t may still be in step t+1 (a zombie): that
step's output for it is ignored, and its row and blocks wait until that step is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..models.decoding import MODE_DETECT, MODE_POINT, RawOutput, SeqSpec
from ..models.family import Prepared


class SeqState(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    RETIRED = 3


@dataclass(eq=False)
class Image:
    ticket: Any
    prepared: Prepared | None  # dropped once encoded (its pixels are on the device then)
    key: str
    prefix_len: int  # KV slots of the image prefix
    next_pos: int  # rotary position of the first own token of every sequence on it
    prefix_blocks: list[int] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    unfinished: int = 0


@dataclass(eq=False)
class Sequence:
    image: Image
    index: int  # position in the image's sequence list
    spec: SeqSpec
    seed: int
    state: SeqState = SeqState.WAITING
    row: int = -1  # row of the device state while RUNNING / FINISHED
    blocks: list[int] = field(default_factory=list)  # own blocks (after the shared prefix)
    own_len: int = 0  # own tokens (prompt, then generated) planned into the cache so far
    decode_steps: int = 0  # decode steps planned so far
    inflight: int = 0
    output: RawOutput = field(default_factory=RawOutput.empty)

    def needs(self, k: int) -> int:
        """Heads needed after step k (0 = the prompt): a bit set of plan.NEED_* (1 token,
        2 coordinate, 4 size). Point cycles TOKEN(+x), Y; detect TOKEN(+x), Y, SIZE."""
        if self.spec.mode == MODE_POINT:
            return 3 if k % 2 == 0 else 2
        if self.spec.mode == MODE_DETECT:
            return (3, 2, 4)[k % 3]
        return 1

    @property
    def max_decode_steps(self) -> int:
        """Decode steps after the prompt can never exceed this: the last allowed token or object
        finishes the sequence without feeding it (decoding.py), so planning stops here."""
        return self.spec.budget - 1

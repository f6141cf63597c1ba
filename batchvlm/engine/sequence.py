"""Requests (one per image), their prefix segments and their task sequences, with an explicit
lifecycle.

Prefix:   a read-only segment every sequence on it attends to or forks from: the image's
          features followed by the sequences' `prefix_prompt` (empty for decoder-only families:
          the image prefix; an encoder-decoder's (image, prompt) encoding). Its blocks are
          refcounted (each running sequence holds a reference, the image one until all its
          sequences have started); its recurrent-state snapshot slot (models with a Recurrent
          spec) is held until every sequence on it has been planned to fork from it.

Request:  one image's work in the engine: the caller's sample (the engine reads its key and
          prepared image, and drops the image once encoded), its prefixes and its sequences.
          QUEUED -> ENCODED (features on the device) -> ADMITTED (prefixes + prompts planned)
          -> DONE when every sequence has finished (the sample goes back with its outputs).
Sequence: WAITING -> RUNNING (a row of the device state) -> FINISHED (host saw EOS or a limit)
          -> RETIRED once no in-flight step refers to it (row and blocks are freed then)

`inflight` counts planned-but-uncommitted steps that include the sequence: at most two in the
pipelined engine. A sequence finished at step t may still be in step t+1 (a zombie): that
step's output for it is ignored, and its row and blocks wait until that step is committed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..models.base.contract import SampleLike
from ..models.base.decoding import RawOutput, SeqSpec
from .rows import RowTable


class SeqState(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    RETIRED = 3


@dataclass(eq=False)
class Prefix:
    prompt: tuple[int, ...]  # tokens of the segment after the image's features
    length: int  # KV slots of the segment
    next_pos: int  # rotary position of the first own token of every sequence on it
    blocks: list[int] = field(default_factory=list)
    snapshot: int = -1  # snapshot slot (cache/blocks.py SnapshotSlots) while forks are pending


@dataclass(eq=False)
class Request:
    sample: SampleLike
    prefixes: list[Prefix] = field(default_factory=list)  # distinct prefix prompts, first use first
    seqs: list[Sequence] = field(default_factory=list)
    unfinished: int = 0


@dataclass(eq=False)
class Sequence:
    request: Request
    prefix: Prefix
    index: int  # position in the image's sequence list
    spec: SeqSpec
    seed: int
    state: SeqState = SeqState.WAITING
    row: int = -1  # row of the device state while RUNNING / FINISHED
    blocks: list[int] = field(default_factory=list)  # own blocks (after the shared prefix)
    output: RawOutput = field(default_factory=RawOutput.empty)
    # While it holds a row: the scheduler's row-indexed decode state (rows.py) holds its counts;
    # before and after, `kept` does (own_len, decode_steps, inflight).
    table: RowTable | None = field(default=None, repr=False)
    kept: tuple[int, int, int] = (0, 0, 0)

    @property
    def own_len(self) -> int:
        """Own tokens (prompt, then generated) planned into the cache so far."""
        return int(self.table.own[self.row]) if self.table is not None else self.kept[0]

    @property
    def decode_steps(self) -> int:
        """Decode steps planned so far."""
        return int(self.table.steps[self.row]) if self.table is not None else self.kept[1]

    @property
    def inflight(self) -> int:
        return int(self.table.inflight[self.row]) if self.table is not None else self.kept[2]

    def leave_row(self) -> None:
        """Keep its counts on retiring (its row goes to another sequence)."""
        self.kept, self.table = (self.own_len, self.decode_steps, self.inflight), None

    def needs(self, k: int) -> int:
        """Heads needed after step k (0 = the prompt): the family's schedule (SeqSpec.heads)."""
        heads = self.spec.heads
        return heads[k % len(heads)]

    @property
    def max_decode_steps(self) -> int:
        """Decode steps after the prompt can never exceed this: the last allowed item finishes the
        sequence without being fed, unless the sequence decides once more after it (SeqSpec), so
        planning stops here."""
        return self.spec.budget - (0 if self.spec.decides_after_limit else 1)

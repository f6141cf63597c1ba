"""One image's column values, task by task: the loop every family's `columns` shares.

A family writes one task's columns from a `TaskOutputs` (its sequences on the image, what each
emitted, the size the model saw the image at); `task_columns` runs it per task, merges the
columns and sums PARSE_FAILURES. classify is the same for every family and is done here: each
choice's summed log-probability is an object `(score,)` of its RawOutput, in choice order (one
output per choice on the native engine, one output with every choice in the transformers
backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...tasks import args_of, choice_values, column_of, kind_of, scores_column
from .decoding import RawOutput
from .contract import PARSE_FAILURES, TaskSequence

if TYPE_CHECKING:
    from ...tasks import Task


@dataclass(frozen=True)
class TaskOutputs:
    """One task's sequences on one image, in order, with what each emitted."""

    task: Task
    index: int  # in the job's tasks
    seqs: list[TaskSequence]
    raws: list[RawOutput]
    seen: tuple[int, int] | None  # Prepared.seen of the image

    @property
    def labels(self) -> list[str | None]:
        return [s.label for s in self.seqs]

    @property
    def cut(self) -> bool:
        """A limit ended one of its sequences: a label may be cut short."""
        return any(r.cut for r in self.raws)

    @property
    def max_objects(self) -> int:
        """Objects kept per sequence (detect / point / regions tasks)."""
        n = self.seqs[0].max_objects
        assert n is not None, f"tasks.{self.index}: a {kind_of(self.task)} sequence without max_objects"
        return n


def task_columns(tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput], seen: tuple[int, int] | None,
                 one_task: Callable[[TaskOutputs], dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t, task in enumerate(tasks):
        mine = [i for i, s in enumerate(seqs) if s.task == t]
        outputs = TaskOutputs(task, t, [seqs[i] for i in mine], [raws[i] for i in mine], seen)
        if kind_of(task) == "classify":
            scores = [o[0] for r in outputs.raws for o in r.objects]
            out[column_of(task)], out[scores_column(task)] = choice_values(list(args_of(task).choices), scores)
            continue
        for name, value in one_task(outputs).items():
            out[name] = out.get(PARSE_FAILURES, 0) + value if name == PARSE_FAILURES else value
    return out


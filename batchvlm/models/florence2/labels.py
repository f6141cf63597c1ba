"""Florence-2's generated tokens -> one image's column values, as the processor post-processes
them: captions, answers and OCR are the text without special tokens (stripped); detect and
regions read the text with its <loc_N> tokens (models/grounding.py, the processor's rules). A
detect box is labelled with the object asked for, a region with its own phrase; at most
max_objects of them, in the order the model wrote them. Detect text is `<name>_raw` too.
"""

from __future__ import annotations

from typing import Any

from ...tasks import Task, box_values, column_of, kind_of, raw_column, truncated_column
from ..decoding import RawOutput
from ..family import TaskSequence
from ..grounding import florence2_boxes, florence2_regions
from .decoding import was_cut


def column_values(tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput], tokenizer,
                  max_objects: dict[int, int]) -> dict[str, Any]:
    """`raws`: each sequence's tokens (without the start token, cut before the end token) and
    whether the token limit ended it (decoding.py `was_cut`)."""
    out: dict[str, Any] = {}
    for t, task in enumerate(tasks):
        mine = [(s, r) for s, r in zip(seqs, raws) if s.task == t]
        kind = kind_of(task)
        cut = any(was_cut(r) for _, r in mine)
        if kind in ("caption", "query", "ocr"):
            out[column_of(task)] = tokenizer.decode(mine[0][1].tokens, special=False).strip()
        elif kind == "regions":
            regions = florence2_regions(tokenizer.decode(mine[0][1].tokens, special=True))
            cut |= len(regions) > max_objects[t]
            kept = regions[: max_objects[t]]
            out[column_of(task)] = box_values([label for label, _ in kept], [[box] for _, box in kept])
        else:  # detect
            texts = [tokenizer.decode(r.tokens, special=True) for _, r in mine]
            found = [florence2_boxes(text) for text in texts]
            cut |= any(len(f) > max_objects[t] for f in found)
            labels = [s.label for s, _ in mine]
            out[column_of(task)] = box_values(labels, [f[: max_objects[t]] for f in found])
            out[raw_column(task)] = [{"label": label, "text": text} for label, text in zip(labels, texts)]
        out[truncated_column(task)] = cut
    return out

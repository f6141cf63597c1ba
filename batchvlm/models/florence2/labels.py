"""Florence-2's generated tokens -> one image's column values, as the processor post-processes
them: captions, answers and OCR are the text without special tokens (stripped); a json answer is
the text exactly as its grammar read it (every token but the forced first one, no clean-up:
nothing the grammar allowed is dropped or changed; it allows no special token); detect and
regions read the text with its <loc_N> tokens (base/grounding.py, the processor's rules). A
detect box is labelled with the object asked for, a region with its own phrase; at most
max_objects of them, in the order the model wrote them. Detect text is `<name>_raw` too.
"""

from __future__ import annotations

from typing import Any

from ...tasks import box_values, column_of, kind_of, raw_column, truncated_column
from ..base.columns import TaskOutputs
from ..base.grounding import florence2_boxes, florence2_regions


def task_values(tokenizer, forced_first: bool, o: TaskOutputs) -> dict[str, Any]:
    """One task's columns (base/columns.py). `forced_first`: every answer starts with the
    checkpoint's forced first token (not grammar text)."""
    kind, cut = kind_of(o.task), o.cut
    out: dict[str, Any] = {}
    if kind == "json":
        out[column_of(o.task)] = tokenizer.decode(o.raws[0].tokens[int(forced_first):], special=True, cleanup=False)
    elif kind in ("caption", "query", "ocr"):
        out[column_of(o.task)] = tokenizer.decode(o.raws[0].tokens, special=False).strip()
    elif kind == "regions":
        regions = florence2_regions(tokenizer.decode(o.raws[0].tokens, special=True))
        cut |= len(regions) > o.max_objects
        kept = regions[: o.max_objects]
        out[column_of(o.task)] = box_values([label for label, _ in kept], [[box] for _, box in kept])
    else:  # detect
        texts = [tokenizer.decode(r.tokens, special=True) for r in o.raws]
        found = [florence2_boxes(text) for text in texts]
        cut |= any(len(f) > o.max_objects for f in found)
        out[column_of(o.task)] = box_values(o.labels, [f[: o.max_objects] for f in found])
        out[raw_column(o.task)] = [{"label": label, "text": text} for label, text in zip(o.labels, texts)]
    out[truncated_column(o.task)] = cut
    return out

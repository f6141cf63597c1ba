"""Generated tokens -> the typed values of one image's task columns.

Captions, answers and OCR text are read by qwen_vl/prompts.py's rule (decoded without special
tokens, stripped), as the native families read them; so is the JSON of the Qwen grounding formats.
Florence-2's region captions are read with their phrases (base/grounding.py). Other detect /
point text is decoded with special tokens (Florence-2's <loc_N> and PaliGemma's <locNNNN> may be
special tokens). The text goes to the model's grounding parser and is always returned as
`<name>_raw` too; the Parquet schema has the column (and keeps the value) only with
output.raw_text.
"""

from __future__ import annotations

from typing import Any

from ...tasks import box_values, column_of, kind_of, point_values, raw_column, truncated_column
from ..base.columns import TaskOutputs
from ..base.grounding import florence2_regions
from ..qwen_vl.prompts import answer_text
from .architectures import GroundingFormat


def _objects(kind: str, fmt: GroundingFormat, text: str, seen: tuple[int, int] | None) -> list[tuple[float, ...]]:
    parse = fmt.boxes if kind == "detect" else fmt.points
    if fmt.absolute:
        return parse(text, *seen) if seen else []  # no size, no scale: nothing can be read
    return parse(text)


def _text(tokenizer, tokens: list[int], fmt: GroundingFormat | None) -> str:
    if fmt is not None and fmt.special_tokens:
        return tokenizer.decode(tokens, skip_special_tokens=False)
    return answer_text(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tokens)


def task_values(tokenizer, fmt: GroundingFormat | None, o: TaskOutputs) -> dict[str, Any]:
    """One task's columns (base/columns.py). `<name>_truncated`: a sequence ran into
    max_new_tokens, or wrote more than max_objects."""
    kind, truncated = kind_of(o.task), o.cut
    out: dict[str, Any] = {}
    first = o.raws[0]
    if kind == "json":  # compact JSON as the grammar wrote it
        out[column_of(o.task)] = tokenizer.decode(first.tokens, skip_special_tokens=True).strip()
    elif kind in ("caption", "query", "ocr"):
        out[column_of(o.task)] = _text(tokenizer, first.tokens, None)
    elif kind == "regions":  # Florence-2's: each box with its own phrase
        regions = florence2_regions(tokenizer.decode(first.tokens, skip_special_tokens=False))
        truncated |= len(regions) > o.max_objects
        out[column_of(o.task)] = box_values([label for label, _ in regions[: o.max_objects]],
                                            [[box] for _, box in regions[: o.max_objects]])
    else:
        texts, found = [], []
        for label, r in zip(o.labels, o.raws):
            text = _text(tokenizer, r.tokens, fmt)
            objects = _objects(kind, fmt, text, o.seen)
            truncated |= len(objects) > o.max_objects
            texts.append({"label": label, "text": text})
            found.append(objects[: o.max_objects])
        out[column_of(o.task)] = (box_values if kind == "detect" else point_values)(o.labels, found)
        out[raw_column(o.task)] = texts
    out[truncated_column(o.task)] = truncated
    return out

"""Generated tokens -> the typed values of one image's task columns.

Captions, answers and OCR text are read by models/qwen_prompts.py's rule (decoded without special
tokens, stripped), as the native families read them; so is the JSON of the Qwen grounding formats.
Florence-2's region captions are read with their phrases (models/grounding.py). Other detect /
point text is decoded with special tokens (Florence-2's <loc_N> and PaliGemma's <locNNNN> may be
special tokens). The text goes to the model's grounding parser and is always returned as
`<name>_raw` too; the Parquet schema has the column (and keeps the value) only with
output.raw_text.
"""

from __future__ import annotations

from typing import Any

from ...tasks import (Task, args_of, box_values, choice_values, column_of, kind_of, point_values, raw_column,
                      scores_column, truncated_column)
from ..grounding import florence2_regions
from ..qwen_prompts import answer_text
from .architectures import GroundingFormat
from .generation import Generated
from .prompts import Prompt


def _objects(kind: str, fmt: GroundingFormat, text: str, seen: tuple[int, int] | None) -> list[tuple[float, ...]]:
    parse = fmt.boxes if kind == "detect" else fmt.points
    if fmt.absolute:
        return parse(text, *seen) if seen else []  # no size, no scale: nothing can be read
    return parse(text)


def _text(tokenizer, tokens: tuple[int, ...], fmt: GroundingFormat | None) -> str:
    if fmt is not None and fmt.special_tokens:
        return tokenizer.decode(list(tokens), skip_special_tokens=False)
    return answer_text(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), tokens)


def column_values(tasks: list[Task], prompts: list[Prompt], raws: list[Generated], tokenizer,
                  fmt: GroundingFormat | None) -> dict[str, Any]:
    """`<name>_truncated`: a sequence ran into max_new_tokens, or wrote more than max_objects."""
    out: dict[str, Any] = {}
    for t, task in enumerate(tasks):
        kind = kind_of(task)
        mine = [(p, r) for p, r in zip(prompts, raws) if p.task == t]
        truncated = any(not r.stopped for _, r in mine)
        if kind == "classify":
            out[column_of(task)], out[scores_column(task)] = choice_values(args_of(task).choices, list(mine[0][1].scores))
            continue
        if kind == "json":  # compact JSON as the grammar wrote it
            out[column_of(task)] = tokenizer.decode(list(mine[0][1].tokens), skip_special_tokens=True).strip()
        elif kind in ("caption", "query", "ocr"):
            out[column_of(task)] = _text(tokenizer, mine[0][1].tokens, None)
        elif kind == "regions":  # Florence-2's: each box with its own phrase
            p, r = mine[0]
            regions = florence2_regions(tokenizer.decode(list(r.tokens), skip_special_tokens=False))
            truncated |= len(regions) > p.max_objects
            out[column_of(task)] = box_values([label for label, _ in regions[: p.max_objects]],
                                              [[box] for _, box in regions[: p.max_objects]])
        else:
            texts, found = [], []
            for p, r in mine:
                text = _text(tokenizer, r.tokens, fmt)
                objects = _objects(kind, fmt, text, r.seen)
                truncated |= len(objects) > p.max_objects
                texts.append({"label": p.label, "text": text})
                found.append(objects[: p.max_objects])
            values = box_values if kind == "detect" else point_values
            out[column_of(task)] = values([p.label for p, _ in mine], found)
            out[raw_column(task)] = texts
        out[truncated_column(task)] = truncated
    return out

"""Generated tokens -> the typed values of one image's task columns.

Captions and answers are decoded without special tokens. Detect / point text is decoded with
them (Florence-2's <loc_N> and PaliGemma's <locNNNN> may be special tokens) and handed to the
model's grounding parser. That text is always returned as `<name>_raw` too; the Parquet schema
has the column (and keeps the value) only with output.raw_text.
"""

from __future__ import annotations

from typing import Any

from ...tasks import Task, column_of, kind_of, raw_column_of
from .architectures import GroundingFormat
from .generation import Generated
from .prompts import Prompt


def _objects(kind: str, fmt: GroundingFormat, text: str, seen: tuple[int, int] | None) -> list[tuple[float, ...]]:
    parse = fmt.boxes if kind == "detect" else fmt.points
    if fmt.absolute:
        return parse(text, *seen) if seen else []  # no size, no scale: nothing can be read
    return parse(text)


def column_values(tasks: list[Task], prompts: list[Prompt], raws: list[Generated], tokenizer,
                  fmt: GroundingFormat | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t, task in enumerate(tasks):
        kind = kind_of(task)
        mine = [(p, r) for p, r in zip(prompts, raws) if p.task == t]
        if kind in ("caption", "query"):
            out[column_of(task)] = tokenizer.decode(list(mine[0][1].tokens), skip_special_tokens=True).strip()
            continue
        values, texts = [], []
        for p, r in mine:
            text = tokenizer.decode(list(r.tokens), skip_special_tokens=False)
            texts.append({"label": p.label, "text": text})
            for o in _objects(kind, fmt, text, r.seen)[: p.max_objects]:
                keys = ("x_min", "y_min", "x_max", "y_max") if kind == "detect" else ("x", "y")
                values.append({"label": p.label} | dict(zip(keys, o)))
        out[column_of(task)] = values
        out[raw_column_of(task)] = texts
    return out

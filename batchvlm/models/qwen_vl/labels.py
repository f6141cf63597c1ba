"""Qwen3-VL's generated tokens -> one image's column values.

Every answer is read by qwen_vl/prompts.py's rule (special tokens skipped, stripped), as
the transformers backend reads it. Captions and answers are that text. Detect / point
answers are JSON text; base/grounding.py reads the boxes / points (0-1000, clamped, at most
max_objects per object name, labelled with the name asked for) and the text itself becomes
`<name>_raw` (written with output.raw_text). An answer counts as a parse failure unless it is
one clean JSON value (fenced or bare) whose every item carries the coordinate key with the
right count of numbers; a truncated list still yields its complete objects.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ...tasks import box_values, column_of, kind_of, point_values, raw_column, truncated_column
from ..base.columns import TaskOutputs
from ..base.contract import PARSE_FAILURES
from ..base.grounding import qwen3_boxes, qwen3_points
from .prompts import answer_text

_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)


def parses_cleanly(text: str, key: str, n: int) -> bool:
    m = _FENCE.match(text.strip())
    try:
        value = json.loads(m.group(1) if m else text)
    except ValueError:
        return False
    items = value if isinstance(value, list) else [value]
    return all(isinstance(it, dict) and isinstance(v := it.get(key), list) and len(v) == n
               and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v)
               for it in items)


def task_values(decode, o: TaskOutputs) -> dict[str, Any]:
    """One task's columns (base/columns.py); `decode`: the tokenizer's, special tokens skipped."""
    kind = kind_of(o.task)
    texts = [answer_text(decode, r.tokens) for r in o.raws]
    if kind in ("caption", "query", "ocr", "json"):  # json: compact JSON as the grammar let it be written
        return {column_of(o.task): texts[0], truncated_column(o.task): o.cut}
    parse, values, key, n = ((qwen3_points, point_values, "point_2d", 2) if kind == "point"
                             else (qwen3_boxes, box_values, "bbox_2d", 4))
    found = [parse(text) for text in texts]
    kept = o.max_objects
    return {column_of(o.task): values(o.labels, [f[:kept] for f in found]),
            truncated_column(o.task): o.cut or any(len(f) > kept for f in found),
            raw_column(o.task): [{"label": label, "text": text} for label, text in zip(o.labels, texts)],
            PARSE_FAILURES: sum(not parses_cleanly(text, key, n) for text in texts)}

"""Qwen3-VL's generated tokens -> one image's column values.

Every answer is read by models/qwen_prompts.py's rule (special tokens skipped, stripped), as
the transformers backend reads it. Captions and answers are that text. Detect / point
answers are JSON text; models/grounding.py reads the boxes / points (0-1000, clamped, at most
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

from ...tasks import (Task, box_values, choice_values, column_of, kind_of, point_values, raw_column, scores_column,
                      truncated_column)
from ..decoding import RawOutput
from ..family import PARSE_FAILURES, TaskSequence
from ..grounding import qwen3_boxes, qwen3_points
from ..qwen_prompts import answer_text

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


def column_values(tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput], decode,
                  max_objects: dict[int, int]) -> dict[str, Any]:
    out: dict[str, Any] = {PARSE_FAILURES: 0}
    for t, task in enumerate(tasks):
        mine = [(s, r) for s, r in zip(seqs, raws) if s.task == t]
        kind = kind_of(task)
        if kind == "classify":  # each choice's score (decoding.py choice_scores)
            out[column_of(task)], out[scores_column(task)] = choice_values([s.label for s, _ in mine],
                                                                           [r.objects[0][0] for _, r in mine])
            continue
        texts = [answer_text(decode, r.tokens) for _, r in mine]
        cut = any(r.hit_limit(s.spec) for s, r in mine)  # the token limit ended an answer
        if kind in ("caption", "query", "ocr", "json"):  # json: compact JSON as the grammar let it be written
            out[column_of(task)], out[truncated_column(task)] = texts[0], cut
            continue
        parse, values, key, n = ((qwen3_points, point_values, "point_2d", 2) if kind == "point"
                                 else (qwen3_boxes, box_values, "bbox_2d", 4))
        labels = [s.label for s, _ in mine]
        found = [parse(text) for text in texts]
        out[column_of(task)] = values(labels, [f[: max_objects[t]] for f in found])
        out[truncated_column(task)] = cut or any(len(f) > max_objects[t] for f in found)
        out[raw_column(task)] = [{"label": label, "text": text} for label, text in zip(labels, texts)]
        out[PARSE_FAILURES] += sum(not parses_cleanly(text, key, n) for text in texts)
    return out

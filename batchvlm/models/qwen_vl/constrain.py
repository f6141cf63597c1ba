"""Grammars of the Qwen sequences that are constrained: `json` tasks (the task's schema) and, with
`output.constrain`, detect / point in the family's JSON grounding format, so that every answer
the token limit does not cut parses (labels.py `parses_cleanly`).

The grounding format is what the Qwen3-VL cookbook's prompts ask for, written compactly (no
whitespace, no ```json fence; the parser reads both): a list of objects in the order
`{"bbox_2d":[x1,y1,x2,y2],"label":"<object>"}` (points: `"point_2d":[x,y]`), coordinates
integers 0-1000, the label the object asked for. The list may be empty: "none here" stays
sayable. Every schema is compiled once per job for the checkpoint's vocabulary (base/grammar.py `Grammars`).
"""

from __future__ import annotations

from typing import Any

COORDINATE = {"type": "integer", "minimum": 0, "maximum": 1000}
KEYS = {"detect": ("bbox_2d", 4), "point": ("point_2d", 2)}


def grounding_schema(kind: str, obj: str) -> dict[str, Any]:
    """The JSON Schema of a detect / point answer for one object name."""
    key, n = KEYS[kind]
    item = {"type": "object", "properties": {key: {"type": "array", "items": COORDINATE, "minItems": n, "maxItems": n},
                                             "label": {"const": obj}},
            "required": [key, "label"], "additionalProperties": False}
    return {"type": "array", "items": item}

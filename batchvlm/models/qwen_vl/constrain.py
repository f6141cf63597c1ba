"""Grammars of the Qwen sequences that are constrained: `json` tasks (the task's schema) and, with
`output.constrain`, detect / point in the family's JSON grounding format, so that every answer
the token limit does not cut parses (labels.py `parses_cleanly`).

The grounding format is what the Qwen3-VL cookbook's prompts ask for, written compactly (no
whitespace, no ```json fence; the parser reads both): a list of objects in the order
`{"bbox_2d":[x1,y1,x2,y2],"label":"<object>"}` (points: `"point_2d":[x,y]`), coordinates
integers 0-1000, the label the object asked for. The list may be empty: "none here" stays
sayable. Every schema is compiled once per job for the checkpoint's vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..family import FamilyError

if TYPE_CHECKING:
    from ..grammar import JsonGrammar, Vocabulary

COORDINATE = {"type": "integer", "minimum": 0, "maximum": 1000}
KEYS = {"detect": ("bbox_2d", 4), "point": ("point_2d", 2)}


def grounding_schema(kind: str, obj: str) -> dict[str, Any]:
    """The JSON Schema of a detect / point answer for one object name."""
    key, n = KEYS[kind]
    item = {"type": "object", "properties": {key: {"type": "array", "items": COORDINATE, "minItems": n, "maxItems": n},
                                             "label": {"const": obj}},
            "required": [key, "label"], "additionalProperties": False}
    return {"type": "array", "items": item}


class Grammars:
    """Schemas compiled for one tokenizer, each once, the vocabulary built on first use (seconds
    for a 150k-token vocabulary)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._vocab: Vocabulary | None = None
        self._compiled: dict[str, JsonGrammar] = {}

    def compile(self, schema: dict[str, Any], field: str) -> JsonGrammar:
        """`field`: the job field the schema comes from, for the one-line error without xgrammar."""
        import json

        try:
            import xgrammar  # noqa: F401
        except ImportError:
            raise FamilyError(f"{field}: needs xgrammar: pip install 'batchvlm[structured]'") from None
        from ..grammar import Vocabulary

        if self._vocab is None:
            self._vocab = Vocabulary(self.tokenizer, self.vocab_size, self.stop_ids)
        key = json.dumps(schema, sort_keys=True)
        if key not in self._compiled:
            self._compiled[key] = self._vocab.compile(schema)
        return self._compiled[key]

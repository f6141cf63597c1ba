"""The JSON Schema subset a `json` task may use: what the grammar library enforces while decoding.

A keyword outside the subset would be silently ignored by constrained decoding (the answer would
not validate), so it is refused at `validate`, naming where it is inside the schema. The subset
is what both xgrammar and llguidance enforce (scripts/bench_grammar.py checks it): types,
object properties / required / additionalProperties, arrays (items, prefixItems, length bounds),
enum / const, anyOf, numeric bounds, string length bounds, pattern, and local `$ref`s into
`$defs`. Annotations (title, description, ...) are allowed and change nothing.
"""

from __future__ import annotations

import json
from typing import Any

ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id"}
KEYWORDS = {"type", "enum", "const", "anyOf", "$ref", "$defs",
            "properties", "required", "additionalProperties",
            "items", "prefixItems", "minItems", "maxItems",
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
            "minLength", "maxLength", "pattern"}
HINTS = {"oneOf": "use anyOf", "allOf": "merge the subschemas", "format": "use pattern",
         "definitions": "use $defs", "multipleOf": "not enforceable while decoding",
         "uniqueItems": "not enforceable while decoding"}
SUBSCHEMA_MAPS = ("properties", "$defs")
SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties")


class SchemaError(ValueError):
    pass


def _where(path: list[str]) -> str:
    return ".".join(p if p and p.isprintable() and not any(c in p for c in ".: ") else json.dumps(p)
                    for p in path)


def _walk(node: Any, path: list[str], defs: set[str]) -> None:
    if isinstance(node, bool):  # true / false are schemas (anything / nothing)
        return
    if not isinstance(node, dict):
        raise SchemaError(f"{_where(path) or 'schema'}: a schema is an object or a boolean")
    for key, value in node.items():
        here = path + [key]
        if key in ANNOTATIONS:
            continue
        if key not in KEYWORDS:
            hint = HINTS.get(key, "supported: " + ", ".join(sorted(KEYWORDS)))
            raise SchemaError(f"{_where(here)}: keyword {key!r} cannot be enforced while decoding ({hint})")
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#/$defs/")
                                  and value.removeprefix("#/$defs/") in defs):
            raise SchemaError(f"{_where(here)}: only local references into $defs are supported, got {value!r}")
        if key in SUBSCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                _walk(sub, here + [name], defs)
        elif key in SUBSCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _walk(sub, here + [str(i)], defs)
        elif key in SUBSCHEMAS:
            _walk(value, here, defs)


def check_schema(schema: dict[str, Any]) -> None:
    """Raises SchemaError (one line, naming the place in the schema) for a schema that is not valid
    JSON Schema or uses a keyword the grammar cannot enforce."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = _where([str(p) for p in e.absolute_path])
        raise SchemaError(f"{where + ': ' if where else ''}not valid JSON Schema: {e.message}") from None
    defs = schema.get("$defs", {})
    _walk(schema, [], set(defs) if isinstance(defs, dict) else set())

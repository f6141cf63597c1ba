"""Five JSON schemas of the kinds labelling jobs ask for, each with a valid answer and one that
breaks exactly what the schema adds. Strings are bounded: a random model's free string never ends (shared by the json tests and scripts/bench_grammar.py)."""

NESTED = {"type": "object", "properties": {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "colour": {"type": "string", "maxLength": 6}},
               "required": ["name", "colour"], "additionalProperties": False}},
    "required": ["object"], "additionalProperties": False}
ENUMS = {"type": "object", "properties": {"scene": {"enum": ["indoor", "outdoor", "studio"]},
                                          "light": {"type": "string", "enum": ["day", "night"]}},
         "required": ["scene", "light"]}
BOUNDS = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "score": {"type": "integer", "minimum": -5, "maximum": 5}},
          "required": ["count", "score"], "additionalProperties": False}
ARRAYS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "minItems": 1, "maxItems": 3}},
          "required": ["tags"], "additionalProperties": False}
REQUIRED = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}, "people": {"type": "boolean"},
                                             "year": {"anyOf": [{"type": "integer", "minimum": 1900, "maximum": 2100},
                                                                {"type": "null"}]}},
            "required": ["title", "people", "year"], "additionalProperties": False}

SCHEMAS = {
    "nested": (NESTED, {"object": {"name": "cup", "colour": "red"}}, {"object": {"name": "cup", "colour": 3}}),
    "enums": (ENUMS, {"scene": "studio", "light": "day"}, {"scene": "garden", "light": "day"}),
    "bounds": (BOUNDS, {"count": 3, "score": -2}, {"count": 12, "score": 0}),
    "arrays": (ARRAYS, {"tags": ["a", "bc"]}, {"tags": ["a", "b", "c", "d"]}),
    "required": (REQUIRED, {"title": "x", "people": True, "year": None}, {"title": "x", "people": True}),
}


def assert_finished_answers_validate(columns: list[dict]) -> None:
    """Every json column of SCHEMAS that did not run into max_new_tokens holds compact JSON that
    validates; each schema has at least one such answer."""
    import json

    import jsonschema

    for name, (schema, _, _) in SCHEMAS.items():
        finished = [c[name] for c in columns if not c[f"{name}_truncated"]]
        assert finished, f"{name}: every answer ran into max_new_tokens"
        for text in finished:
            jsonschema.validate(json.loads(text), schema)
            assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)  # compact


# The classify cases the native parity tests share: choices with shared leading tokens, a single
# choice, fifty choices.
SHARED = ["red", "red car", "reddish", "blue"]  # choices that share leading tokens
FIFTY = [f"option {i}" for i in range(50)]
CASES = [("What is it?", SHARED), ("Is it?", ["yes"]), ("Which option?", FIFTY)]


def assert_classify_columns(rows: list[dict], expected: list[list[tuple[str, list[dict]]]]) -> None:
    """Each image's CASES columns (tasks named c0, c1, c2) equal the reference (label, scores) per
    case within 2e-5 (float32: fifty rows through a MoE's linear-attention layers have come to
    1.03e-5 from transformers 5.24); the single choice has probability 1; fifty choices are not
    one flat distribution, and differ between images."""
    import pytest

    fifty = []
    for row, want in zip(rows, expected):
        for t, (label, scores) in enumerate(want):
            got = row[f"c{t}_scores"]
            assert [s["label"] for s in got] == CASES[t][1]
            assert [s["prob"] for s in got] == pytest.approx([s["prob"] for s in scores], abs=2e-5, rel=0)
            assert row[f"c{t}"] == label
        assert row["c1_scores"] == [{"label": "yes", "prob": 1.0}]
        fifty.append([s["prob"] for s in row["c2_scores"]])
    assert max(fifty[0]) > 1.5 / 50  # random weights, yet not one flat distribution
    assert len(rows) == 1 or fifty[0] != fifty[1]  # and the image matters

"""What a job file's validation error says: one line naming the field path (without pydantic's
union labels), what was expected, what YAML made of the value where that explains it
(`true`, `1e3`, `2025-06-21`), and for an unknown key the one it likely meant.
"""

from __future__ import annotations

import datetime
import difflib
import json
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError


_TYPE_LABELS = ("int", "str", "float", "bool", "none")


def _loc_parts(loc: tuple) -> list[str | int]:
    """Field path without pydantic's union-member labels (`literal['all']`, `int`, task tags)."""
    parts: list[str | int] = []
    for x in loc:
        s = str(x)
        if "[" in s or s in _TYPE_LABELS or s.startswith("constrained-") or (parts and str(parts[-1]) == s):
            continue
        parts.append(x)
    return parts


def _clean_loc(loc: tuple) -> str:
    # a hostile key ("a: b", "x.y", a newline) is quoted, so the message stays one line
    parts = [str(x) if str(x).isprintable() and str(x).strip() == str(x) and not any(c in str(x) for c in ".: ")
             else json.dumps(str(x)) for x in _loc_parts(loc)]
    return ".".join(parts) or "<root>"


def _source_text(node: yaml.Node | None, loc: tuple) -> str | None:
    """The value at `loc` as written in the YAML file (`0123`, `no`), where it is a plain scalar."""
    for part in _loc_parts(loc):
        if isinstance(node, yaml.MappingNode):
            node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(part)), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
        else:
            return None
    return node.value if isinstance(node, yaml.ScalarNode) and not node.style else None


_YAML_TYPES = ((bool, "a boolean"), (int, "a number"), (float, "a number"), (datetime.date, "a date"))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _hint(err: dict[str, Any], written: str | None = None) -> str:
    """What YAML made of an unquoted value of the wrong type (`true`, `1e3`, `2025-06-21`, `0123`),
    shown as it was written where the file is at hand."""
    value = err.get("input")
    if err["type"] in ("float_type", "int_type") and isinstance(value, str) and _is_number(value):
        # YAML 1.1 (PyYAML) reads an exponent only with a dot: 1e-3 is text, 1.0e-3 a number
        number = float(value)
        better = int(number) if err["type"] == "int_type" and number.is_integer() else repr(number)
        return f" (YAML read {value} as text; write {better})"
    kind = next((name for t, name in _YAML_TYPES if isinstance(value, t)), None)
    if kind is None or not err["type"].endswith("_type"):
        return ""
    shown = written if written is not None else str(value).lower() if isinstance(value, bool) else value
    return f" (YAML read {shown} as {kind}" + (f"; quote it: '{shown}')" if err["type"] == "string_type" else ")")


def _keys_at(root: type[BaseModel], parts: list[str | int]) -> list[str]:
    """The keys the job models accept in the mapping at `parts` (a field path), for "did you
    mean": through lists, unions and the task kinds (a part no candidate has is a union tag)."""
    types: list[Any] = [root]
    for part in parts:
        flat = _flatten(types)
        if isinstance(part, int):
            nested = [get_args(t)[0] for t in flat if get_origin(t) is list]
        else:
            nested = [f.annotation for t in flat if isinstance(t, type) and issubclass(t, BaseModel)
                      for name, f in t.model_fields.items() if part in (name, f.alias)]
        types = nested or types
    return [f.alias or name for t in _flatten(types) if isinstance(t, type) and issubclass(t, BaseModel)
            for name, f in t.model_fields.items()]


def _flatten(types: list[Any]) -> list[Any]:
    """Annotated and union types -> the types they stand for."""
    out: list[Any] = []
    for t in types:
        if get_origin(t) is Annotated:
            out += _flatten([get_args(t)[0]])
        elif get_origin(t) in (Union, UnionType):
            out += _flatten(list(get_args(t)))
        else:
            out.append(t)
    return out


def _did_you_mean(root: type[BaseModel], loc: tuple) -> str | None:
    parts = _loc_parts(loc)
    if not parts or not isinstance(parts[-1], str):
        return None
    close = difflib.get_close_matches(parts[-1], _keys_at(root, parts[:-1]), n=1, cutoff=0.6)
    return close[0] if close else None


def format_error(e: ValidationError, root: type[BaseModel], node: yaml.Node | None = None) -> str:
    """One line for a failed validation of `root`: the first field path and what it expected, the
    value as YAML read it where that explains it, and how many errors more."""
    errors = e.errors()
    # a misspelt key first: the field it misses (`taks` -> `tasks: Field required`) follows from it
    typos = {_clean_loc(err["loc"]): _did_you_mean(root, err["loc"]) for err in errors if err["type"] == "extra_forbidden"}
    explained = {_clean_loc(_loc_parts(err["loc"])[:-1] + [fix]) if _loc_parts(err["loc"])[:-1] else fix
                 for err in errors if err["type"] == "extra_forbidden" and (fix := typos[_clean_loc(err["loc"])])}
    errors = sorted((err for err in errors if not (err["type"] == "missing" and _clean_loc(err["loc"]) in explained)),
                    key=lambda err: err["type"] != "extra_forbidden")
    loc = _clean_loc(errors[0]["loc"])
    same = [err for err in errors if _clean_loc(err["loc"]) == loc]
    msgs = []
    for err in same:
        if err["type"] == "extra_forbidden":
            msg = "unknown key" + (f"; did you mean {fix}?" if (fix := typos[loc]) else "")
        else:
            msg = err["msg"].removeprefix("Value error, ")
        msg += _hint(err, _source_text(node, err["loc"]))
        if msg not in msgs:
            msgs.append(msg)
    rest = len(errors) - len(same)
    extra = f" (and {rest} more error{'s' * (rest > 1)})" if rest else ""
    where = "" if loc == "<root>" else f"{loc}: "  # checks across sections name their fields themselves
    return f"{where}{'; or '.join(msgs)}{extra}"

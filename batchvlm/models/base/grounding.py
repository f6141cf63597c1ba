"""Boxes and points from the text a VLM writes: one parser per output format.

Every parser takes the decoded text of one sequence and returns what it could read, normalized
to [0, 1] (top-left origin) and clamped; boxes come back as (x_min, y_min, x_max, y_max) with
min <= max whatever order the model wrote the corners in. A parser never raises: text cut off
by the token limit or malformed in the middle keeps every complete object and drops the rest.

    format       written as                                              scale
    qwen2.5-vl   JSON {"bbox_2d": [x1, y1, x2, y2]} / {"point_2d": [x, y]}  pixels of the resized image
    qwen3-vl     the same JSON                                             0-1000
    florence-2   label<loc_x1><loc_y1><loc_x2><loc_y2>, or label<poly>...</poly> 1000 bins, value = bin centre
    paligemma    <locY1><locX1><locY2><locX2> label ; ...  (y before x)     1024 bins
    internvl     <ref>label</ref><box>[[x1, y1, x2, y2], ...]</box>        0-1000

JSON may be fenced (```json ... ```) or bare, a list or single objects, among other text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator

Box = tuple[float, float, float, float]
Point = tuple[float, float]


def _clamp(v: float) -> float:
    return min(1.0, max(0.0, v))


def _box(x1: float, y1: float, x2: float, y2: float, sx: float, sy: float) -> Box:
    xa, xb = sorted((_clamp(x1 / sx), _clamp(x2 / sx)))
    ya, yb = sorted((_clamp(y1 / sy), _clamp(y2 / sy)))
    return xa, ya, xb, yb


def _numbers(value: object, n: int) -> list[float] | None:
    """`value` as exactly n finite numbers, else None (strings and booleans are not numbers)."""
    if not isinstance(value, list) or len(value) != n:
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value):
        return None
    return [float(v) for v in value]


def _object_end(text: str, start: int) -> int | None:
    """Index just past the JSON object opening at text[start] ('{'), or None if it never closes.
    Braces inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def json_objects(text: str) -> Iterator[dict]:
    """Every complete, valid JSON object in `text`, outermost first, left to right. An object
    that does not parse is skipped and the objects nested in it are tried instead."""
    i = text.find("{")
    while i != -1:
        end = _object_end(text, i)
        if end is not None:
            try:
                value = json.loads(text[i:end])
            except ValueError:
                value = None
            if isinstance(value, dict):
                yield value
                i = text.find("{", end)
                continue
        i = text.find("{", i + 1)


def _json_boxes(text: str, sx: float, sy: float) -> list[Box]:
    return [_box(*b, sx, sy) for obj in json_objects(text) if (b := _numbers(obj.get("bbox_2d"), 4))]


def _json_points(text: str, sx: float, sy: float) -> list[Point]:
    return [(_clamp(p[0] / sx), _clamp(p[1] / sy)) for obj in json_objects(text)
            if (p := _numbers(obj.get("point_2d"), 2))]


def qwen25_boxes(text: str, width: int, height: int) -> list[Box]:
    """Qwen2.5-VL: absolute pixels of the image as the model saw it (after its resize)."""
    return _json_boxes(text, width, height)


def qwen25_points(text: str, width: int, height: int) -> list[Point]:
    return _json_points(text, width, height)


def qwen3_boxes(text: str) -> list[Box]:
    """Qwen3-VL: coordinates relative to the image, 0-1000."""
    return _json_boxes(text, 1000, 1000)


def qwen3_points(text: str) -> list[Point]:
    return _json_points(text, 1000, 1000)


# Florence-2, as transformers' Florence2PostProcessor reads it: an object is a phrase (text
# without '<'), then a run of <loc_N> tokens, four per box; or, when the text holds a <poly>, a
# phrase then <poly>x y x y ...</poly> polygons (<sep> between several). N is one of 1000 bins per
# side and the bin's centre, (N + 0.5) / 1000, is the value (the processor scales that to pixels).
_FLORENCE_SPECIALS = ("<s>", "</s>", "<pad>")
_FLORENCE_PHRASE = re.compile(r"([^<]+(?:<loc_\d+>){4,})")
_FLORENCE_LABEL = re.compile(r"^\s*(.*?)(?=<od>|</od>|<box>|</box>|<bbox>|</bbox>|<loc_)")
_FLORENCE_BOX = re.compile(r"<loc_(\d+)><loc_(\d+)><loc_(\d+)><loc_(\d+)>")
_FLORENCE_POLY_PHRASE = re.compile(r"([^<]+(?:<loc_\d+>|<sep>|<poly>|</poly>){4,})")
_FLORENCE_POLY_LABEL = re.compile(r"^\s*(.*?)(?=<od>|</od>|<box>|</box>|<bbox>|</bbox>|<loc_|<poly>)")
_FLORENCE_POLY = re.compile(r"<poly>(.*?)</poly>")
_FLORENCE_POLY_RUN = re.compile(r"((?:<loc_\d+>)+)(?:<sep>|$)")
_FLORENCE_BIN = re.compile(r"<loc_(\d+)>")


def _florence_clean(text: str) -> str:
    for token in _FLORENCE_SPECIALS:
        text = text.replace(token, "")
    return text


def florence2_regions(text: str) -> list[tuple[str, Box]]:
    """(phrase, box) for every box of every phrase: <OD>, <DENSE_REGION_CAPTION> and
    <OPEN_VOCABULARY_DETECTION> without polygons. The phrase loses its non-ASCII characters, as
    in the processor; a phrase cut before its fourth loc token is dropped."""
    out = []
    for phrase in _FLORENCE_PHRASE.findall(_florence_clean(text)):
        phrase = phrase.replace("<ground>", "", 1).replace("<obj>", "", 1)
        label = _FLORENCE_LABEL.search(phrase)
        if label is None:
            continue
        name = label.group().strip().encode("ascii", "ignore").decode("ascii")
        for m in _FLORENCE_BOX.finditer(phrase):
            out.append((name, _box(*(int(g) + 0.5 for g in m.groups()), 1000, 1000)))
    return out


def florence2_polygons(text: str) -> list[tuple[str, list[list[Point]]]]:
    """(phrase, polygons) for every object of a text with polygons; each polygon is its points
    (a dangling last coordinate dropped), values normalized but not clamped."""
    out = []
    for phrase in _FLORENCE_POLY_PHRASE.findall(_florence_clean(text)):
        label = _FLORENCE_POLY_LABEL.search(re.sub(r"^<loc_\d+>", "", phrase, count=1))
        if label is None:
            continue
        parts = _FLORENCE_POLY.findall(phrase) if "<poly>" in phrase and "</poly>" in phrase else [phrase]
        for part in parts:
            polygons = []
            for run in _FLORENCE_POLY_RUN.finditer(part):
                v = [(int(n) + 0.5) / 1000 for n in _FLORENCE_BIN.findall(run.group(1))]
                polygons.append(list(zip(v[0::2], v[1::2])))
            if polygons:
                out.append((label.group().strip(), polygons))
    return out


def florence2_boxes(text: str) -> list[Box]:
    """Boxes of <OPEN_VOCABULARY_DETECTION> (the phrase is the object asked for, so it is not
    kept): the processor's boxes, or with a <poly> in the text, each object's polygons as their
    bounding box (an object whose polygons hold no complete point has none)."""
    if "<poly>" not in text:
        return [box for _, box in florence2_regions(text)]
    boxes = []
    for _, polygons in florence2_polygons(text):
        points = [p for poly in polygons for p in poly]
        if points:
            xs, ys = [x for x, _ in points], [y for _, y in points]
            boxes.append(_box(min(xs), min(ys), max(xs), max(ys), 1, 1))
    return boxes


_PALIGEMMA_BOX = re.compile(r"<loc(\d{4})><loc(\d{4})><loc(\d{4})><loc(\d{4})>")


def paligemma_boxes(text: str) -> list[Box]:
    """PaliGemma: four tokens <locNNNN> (1024 bins, value N / 1024) in y, x, y, x order, then
    the label; objects are separated by ' ; '."""
    return [_box(int(x1), int(y1), int(x2), int(y2), 1024, 1024)
            for y1, x1, y2, x2 in _PALIGEMMA_BOX.findall(text)]


_NUM = r"\s*(-?\d+(?:\.\d+)?)\s*"
_INTERNVL_BOX = re.compile(r"\[" + ",".join([_NUM] * 4) + r"\]")


def internvl_boxes(text: str) -> list[Box]:
    """InternVL: [[x1, y1, x2, y2], ...] (usually inside <box>...</box>), 0-1000."""
    return [_box(*map(float, m), 1000, 1000) for m in _INTERNVL_BOX.findall(text)]

"""The output row, as typed models: documents `schemas/labels.schema.json` and validates rows."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Box(BaseModel):
    label: str = Field(description="The object name that was asked for (detect), or the region's description "
                                    "(regions).")
    x_min: float = Field(ge=0, le=1, description="Left edge, fraction of the width (after EXIF orientation).")
    y_min: float = Field(ge=0, le=1, description="Top edge, fraction of the height.")
    x_max: float = Field(ge=0, le=1)
    y_max: float = Field(ge=0, le=1)


class Point(BaseModel):
    label: str
    x: float = Field(ge=0, le=1)
    y: float = Field(ge=0, le=1)


class RawText(BaseModel):
    label: str = Field(description="The object name that was asked for.")
    text: str = Field(description="The decoded text of that object's sequence, before parsing.")


class Score(BaseModel):
    label: str = Field(description="A classify task's choice.")
    prob: float = Field(ge=0, le=1, description="Its probability: a softmax over the choices' summed token "
                                                "log-probabilities (encoder-only models: over the image-text "
                                                "logits of the choices in their template); the choices' "
                                                "probabilities sum to 1.")


class TokenCount(BaseModel):
    prompt: int = Field(ge=0, description="Tokens the task's sequences read before generating: the image's tokens "
                                          "and the prompt, for each sequence (a detect task's objects and a classify "
                                          "task's choices each read the image).")
    generated: int = Field(ge=0, description="Tokens the task's sequences generated, a stop token included (0 for "
                                             "classify: its choices are scored, not generated).")


class LabelRow(BaseModel):
    """One row per input sample. Task columns are named by the task's `name` (default: its kind):
    caption / query / ocr -> string; detect / regions -> list of Box; point -> list of Point;
    classify -> string (the most probable choice) and `<name>_scores` -> list of Score (every
    choice, in choice order); embed (encoder-only models) -> fixed-size list of float32 (float16 with
    the task's dtype), the model's image embedding, L2-normalized (unit length); similarity -> float32,
    the sigmoid of the image-text logit of the image and its own text (null without a text); json -> string (compact JSON that validates against the task's schema
    unless truncated); null on error rows. Each task but classify also has `<name>_truncated`
    (boolean): its label was cut short by a limit (engine.max_new_tokens / max_objects), so a
    caption may stop mid-sentence, a json answer is incomplete, or objects may be missing; null on
    error rows. With output.raw_text, `<name>_raw` beside each detect / point
    column -> list of RawText (the decoded text of each object's sequence).
    Each task but embed and similarity has `<name>_tokens` -> TokenCount (its tokens read and
    generated on the image, as the engine counted them, for budgeting a job); null on error rows and
    where the model counts none (encoder-only models).
    Then one column per `input.keep` name, on every row (error rows too): a Parquet input's column
    with its type; a tar / folder sidecar (`json`, `txt`, ...) as a string; `path` (folder input)
    the image's path relative to input.folder. A missing sidecar is null."""

    model_config = ConfigDict(extra="allow")

    key: str = Field(description="Sample key: webdataset __key__, file name, or Parquet key / row number; "
                                 "unique within a shard (a repeated key is an error row `duplicate key`).")
    source: str = Field(description="The input file (tar, Parquet file) or directory the sample came from.")
    width: int | None = Field(description="Pixels, after EXIF orientation; null when unreadable.")
    height: int | None
    status: Literal["ok", "error"]
    error: str | None = Field(description="What went wrong (decode, too large, ...); null when ok.")


def error_kind(error: str) -> str:
    """The kind of an error message (`decode: ...`, `no image in sample (has: txt)`): the
    words before the first ':' or '(', for the stats' error counts."""
    return re.split(r"[:(]", error, maxsplit=1)[0].strip() or error


def json_schema() -> dict:
    schema = LabelRow.model_json_schema()
    schema["$defs"] = schema.get("$defs", {}) | {"Box": Box.model_json_schema(), "Point": Point.model_json_schema(),
                                                 "RawText": RawText.model_json_schema(), "Score": Score.model_json_schema(),
                                                 "TokenCount": TokenCount.model_json_schema()}
    schema["additionalProperties"] = {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"$ref": "#/$defs/Box"}},
        {"type": "array", "items": {"$ref": "#/$defs/Point"}},
        {"type": "array", "items": {"$ref": "#/$defs/RawText"}},
        {"type": "array", "items": {"$ref": "#/$defs/Score"}}, {"$ref": "#/$defs/TokenCount"}, {"type": "boolean"},
        {"type": "null"}, {"type": "number", "description": "similarity"},
        {"type": "array", "items": {"type": "number"}, "description": "embed: unit length"},
        {"description": "an input.keep column: the input column's type, or a string for sidecars and path"}]}
    schema["title"] = "batchvlm label row"
    return schema

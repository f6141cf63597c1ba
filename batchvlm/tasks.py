"""Task kinds: what a job asks of every image, and the typed values that land in the output
columns. What a task becomes for a model (prompts, sequences) is the family's business."""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from .json_schema import check_schema

if TYPE_CHECKING:
    from .models.base.contract import TaskSequence
    from .models.base.decoding import RawOutput


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CaptionArgs(Strict):
    length: Literal["short", "normal", "long"] = Field("normal", description="Caption length.")
    name: str | None = Field(None, description="Output column (default: caption).")
    max_new_tokens: int | None = Field(None, ge=1, description="Overrides engine.max_new_tokens.")


class QueryArgs(Strict):
    question: str = Field(min_length=1, description="Asked of every image.")
    name: str | None = Field(None, description="Output column (default: query).")
    max_new_tokens: int | None = Field(None, ge=1, description="Overrides engine.max_new_tokens.")


class ObjectsArgs(Strict):
    objects: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, description="Object names to find.")
    name: str | None = Field(None, description="Output column (default: the task kind).")
    max_objects: int | None = Field(None, ge=1, description="Overrides engine.max_objects.")

    @field_validator("objects")
    @classmethod
    def _distinct(cls, objects: list[str]) -> list[str]:
        if dupes := sorted(o for o, n in Counter(objects).items() if n > 1):  # linear: a job may name 60k
            raise ValueError(f"{dupes[0]!r} is named twice (each name is searched once)")
        return objects


DEFAULT_TEMPLATE = "This is a photo of {}."  # transformers' zero-shot image classification pipeline's


class ClassifyArgs(Strict):
    question: str | None = Field(None, min_length=1, description="Asked of every image, as a query would be "
                                                                 "(vision-language models: required).")
    template: str | None = Field(None, min_length=1, exclude_if=lambda v: v is None,
                                 description="Encoder-only models (SigLIP): each choice put into this text, at {}, "
                                             f"is scored against the image (default: {DEFAULT_TEMPLATE!r}).")
    choices: list[str] = Field(min_length=1, max_length=1000,
                               description="The answers to score (stripped; distinct, none empty). The column holds "
                                           "the most probable; <name>_scores every probability, in this order.")
    name: str | None = Field(None, description="Output column (default: classify).")

    @field_validator("choices")
    @classmethod
    def _distinct(cls, choices: list[str]) -> list[str]:
        stripped = [c.strip() for c in choices]
        if "" in stripped:
            raise ValueError(f"choice {stripped.index('')} is empty")
        for i, c in enumerate(stripped):
            if c in stripped[:i]:
                raise ValueError(f"choice {c!r} is given twice")
        return stripped

    @field_validator("template")
    @classmethod
    def _slot(cls, template: str | None) -> str | None:
        if template is not None and template.count("{}") != 1:
            raise ValueError("the template holds the choice at one {}")
        return template


class EmbedArgs(Strict):
    name: str | None = Field(None, description="Output column (default: embed).")
    dtype: Literal["float32", "float16"] = Field("float32", description="The column's float type (float16: half "
                                                                         "the size; the vector is normalized first).")


class SimilarityArgs(Strict):
    text_column: str = Field(min_length=1, description="The text of each image: an input.keep name (a Parquet "
                                                       "column, or a tar / folder sidecar such as txt), used as written.")
    name: str | None = Field(None, description="Output column (default: similarity).")


class JsonArgs(Strict):
    prompt: str = Field(min_length=1, description="Asked of every image, as written (the schema is not added).")
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema every answer follows "
                                        "(decoding is constrained to it; compact JSON, properties in schema order).")
    name: str | None = Field(None, description="Output column (default: json).")
    max_new_tokens: int | None = Field(None, ge=1, description="Overrides engine.max_new_tokens.")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @field_validator("json_schema")
    @classmethod
    def _supported(cls, schema: dict[str, Any]) -> dict[str, Any]:
        check_schema(schema)
        return schema


class OcrArgs(Strict):
    name: str | None = Field(None, description="Output column (default: ocr).")
    max_new_tokens: int | None = Field(None, ge=1, description="Overrides engine.max_new_tokens.")


class RegionsArgs(Strict):
    name: str | None = Field(None, description="Output column (default: regions).")
    max_new_tokens: int | None = Field(None, ge=1, description="Overrides engine.max_new_tokens (the whole answer, "
                                                               "every region).")
    max_objects: int | None = Field(None, ge=1, description="Overrides engine.max_objects: regions kept.")


class CaptionTask(Strict):
    caption: CaptionArgs = CaptionArgs()


class QueryTask(Strict):
    query: QueryArgs


class DetectTask(Strict):
    detect: ObjectsArgs


class PointTask(Strict):
    point: ObjectsArgs


class ClassifyTask(Strict):
    classify: ClassifyArgs


class JsonTask(Strict):
    json_: JsonArgs = Field(alias="json")

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class OcrTask(Strict):
    """The text in the image, as one string (families that can read text: Florence-2, Qwen3-VL)."""

    ocr: OcrArgs = OcrArgs()


class EmbedTask(Strict):
    """The model's image embedding, L2-normalized (encoder-only models: SigLIP)."""

    embed: EmbedArgs = EmbedArgs()


class SimilarityTask(Strict):
    """The sigmoid of the image-text logit of the image and its own text (SigLIP's pair probability)."""

    similarity: SimilarityArgs


class RegionsTask(Strict):
    """Dense region captions: boxes, each with a free-text description (Florence-2)."""

    regions: RegionsArgs = RegionsArgs()


def _task_kind(v: Any) -> str | None:
    if isinstance(v, dict) and len(v) == 1:
        return next(iter(v))
    if isinstance(v, BaseModel):
        return kind_of(v)
    return None


Task = Annotated[
    Annotated[CaptionTask, Tag("caption")]
    | Annotated[QueryTask, Tag("query")]
    | Annotated[DetectTask, Tag("detect")]
    | Annotated[PointTask, Tag("point")]
    | Annotated[ClassifyTask, Tag("classify")]
    | Annotated[JsonTask, Tag("json")]
    | Annotated[OcrTask, Tag("ocr")]
    | Annotated[RegionsTask, Tag("regions")]
    | Annotated[EmbedTask, Tag("embed")]
    | Annotated[SimilarityTask, Tag("similarity")],
    Discriminator(_task_kind, custom_error_type="task_kind",
                  custom_error_message="a task is one of caption, query, detect, point, ocr, regions, classify, json, "
                                       "embed, similarity (one key)"),
]


# Kinds an encoder-only model answers from its image (and text) embeddings, with no generated text.
IMAGE_LEVEL_KINDS = ("embed", "similarity")


def kind_of(task: Task) -> str:
    name, field = next(iter(type(task).model_fields.items()))
    return field.alias or name  # `json` is an alias: a field of that name would shadow BaseModel.json


def args_of(task: Task) -> Any:
    return getattr(task, next(iter(type(task).model_fields)))


def column_of(task: Task) -> str:
    return args_of(task).name or kind_of(task)


def truncated_column(task: Task) -> str | None:
    """Per task, a boolean column: the label was cut short by a limit (max_new_tokens or
    max_objects), so a caption may stop mid-sentence or objects may be missing. None for
    classify, embed and similarity, which generate nothing."""
    return None if kind_of(task) in ("classify", *IMAGE_LEVEL_KINDS) else f"{column_of(task)}_truncated"


def scores_column(task: Task) -> str | None:
    """A classify task's probability of every choice, in choice order (None for others)."""
    return f"{column_of(task)}_scores" if kind_of(task) == "classify" else None


def raw_column(task: Task) -> str | None:
    """With `output.raw_text`: the column of a detect / point task's decoded text (None for others)."""
    return f"{column_of(task)}_raw" if kind_of(task) in ("detect", "point") else None


def tokens_column(task: Task) -> str | None:
    """Per task, the tokens its sequences read and wrote on the image: {prompt, generated}, for
    budgeting a job (RawOutput's counts, summed over the task's sequences). None for embed and
    similarity: an encoder-only model's answers, no token sequences."""
    return None if kind_of(task) in IMAGE_LEVEL_KINDS else f"{column_of(task)}_tokens"


def token_columns(tasks: list[Task], seqs: list[TaskSequence],
                  raws: list[RawOutput]) -> dict[str, dict[str, int] | None]:
    """One image's `<name>_tokens` per task: the prompt and generated tokens of its sequences, as
    whatever ran them counted (RawOutput); the same for every family, so not a family's `columns`.
    Null where nothing was counted (a classify task on an encoder-only model)."""
    out: dict[str, dict[str, int] | None] = {}
    for s, r in zip(seqs, raws):
        if (col := tokens_column(tasks[s.task])) is not None:
            cell = out.setdefault(col, {"prompt": 0, "generated": 0})
            cell["prompt"] += r.prompt_tokens
            cell["generated"] += r.generated_tokens
    return {col: cell if cell["prompt"] or cell["generated"] else None for col, cell in out.items()}


def choice_values(choices: list[str], logprobs: list[float]) -> tuple[str, list[dict[str, Any]]]:
    """Summed log-probabilities of each choice -> (the most probable choice, the scores cell):
    a softmax over the choices, in float64 (the first of equal scores wins)."""
    top = max(logprobs)
    weights = [math.exp(lp - top) for lp in logprobs]
    total = sum(weights)
    best = max(range(len(choices)), key=lambda i: (logprobs[i], -i))
    return choices[best], [{"label": c, "prob": w / total} for c, w in zip(choices, weights)]


def label_columns(tasks: list[Task], raw_text: bool = False) -> list[tuple[str, int, str]]:
    """The columns the tasks add to a row, in schema order, as (column, task index, what): each
    task's column (a classify task's `<name>_scores` after it; with `raw_text`, a detect / point
    task's `<name>_raw`), then the truncation flags (none for classify), then the token counts (none for embed, similarity).
    `what` is "label", "scores", "raw", "truncated" or "tokens". Each column must be unique in the
    row (job.py checks)."""
    out = []
    for i, t in enumerate(tasks):
        out.append((column_of(t), i, "label"))
        if scores := scores_column(t):
            out.append((scores, i, "scores"))
        if raw_text and (raw := raw_column(t)):
            out.append((raw, i, "raw"))
    out += [(c, i, "truncated") for i, t in enumerate(tasks) if (c := truncated_column(t))]
    return out + [(c, i, "tokens") for i, t in enumerate(tasks) if (c := tokens_column(t))]


def _clamp(v: float) -> float:
    return min(1.0, max(0.0, v))


def point_values(labels: list[str | None], objects: list[list[tuple[float, ...]]]) -> list[dict[str, Any]]:
    """Points (x, y) found for each object label -> the point column's cell, clamped to [0, 1]."""
    return [{"label": lab, "x": _clamp(o[0]), "y": _clamp(o[1])} for lab, objs in zip(labels, objects) for o in objs]


def box_values(labels: list[str | None], objects: list[list[tuple[float, ...]]]) -> list[dict[str, Any]]:
    """Boxes (x_min, y_min, x_max, y_max) for each object label -> the detect column's cell."""
    return [{"label": lab, "x_min": _clamp(o[0]), "y_min": _clamp(o[1]), "x_max": _clamp(o[2]),
             "y_max": _clamp(o[3])} for lab, objs in zip(labels, objects) for o in objs]

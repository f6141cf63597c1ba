"""Task kinds: what a job asks of every image, the sequences each becomes, and the typed
values that land in the output columns."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from .models.moondream.decoding import MODE_DETECT, MODE_POINT, MODE_TEXT, RawOutput
from .models.moondream.generate import SeqSpec


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


class CaptionTask(Strict):
    caption: CaptionArgs = CaptionArgs()


class QueryTask(Strict):
    query: QueryArgs


class DetectTask(Strict):
    detect: ObjectsArgs


class PointTask(Strict):
    point: ObjectsArgs


def _task_kind(v: Any) -> str | None:
    if isinstance(v, dict) and len(v) == 1:
        return next(iter(v))
    if isinstance(v, BaseModel):
        return next(iter(type(v).model_fields))
    return None


Task = Annotated[
    Annotated[CaptionTask, Tag("caption")]
    | Annotated[QueryTask, Tag("query")]
    | Annotated[DetectTask, Tag("detect")]
    | Annotated[PointTask, Tag("point")],
    Discriminator(_task_kind, custom_error_type="task_kind",
                  custom_error_message="a task is one of caption, query, detect, point (one key)"),
]


def kind_of(task: Task) -> str:
    return next(iter(type(task).model_fields))


def args_of(task: Task) -> Any:
    return getattr(task, kind_of(task))


def column_of(task: Task) -> str:
    return args_of(task).name or kind_of(task)


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def sequences_for(
    task: Task, templates: dict[str, Any], tokenizer: Tokenizer, max_new_tokens: int,
    max_objects: int, temperature: float, top_p: float,
) -> list[tuple[str | None, SeqSpec]]:
    """(object label or None, sequence) for each sequence the task runs on an image."""
    kind, a = kind_of(task), args_of(task)
    tpl = templates.get(kind)
    if tpl is None:
        raise ValueError(f"the model has no {kind} template")
    if kind == "caption":
        return [(None, SeqSpec(MODE_TEXT, tuple(tpl[a.length]), a.max_new_tokens or max_new_tokens, temperature, top_p))]
    if kind == "query":
        # The doubled suffix (answer id twice) is what the model was trained on.
        prompt = tpl["prefix"] + tokenizer.encode(a.question) + tpl["suffix"] + tpl["suffix"]
        return [(None, SeqSpec(MODE_TEXT, tuple(prompt), a.max_new_tokens or max_new_tokens, temperature, top_p))]
    mode = MODE_DETECT if kind == "detect" else MODE_POINT
    return [
        (obj, SeqSpec(mode, tuple(tpl["prefix"] + tokenizer.encode(" " + obj) + tpl["suffix"]),
                      a.max_objects or max_objects))
        for obj in a.objects
    ]


def _clamp(v: float) -> float:
    return min(1.0, max(0.0, v))


def column_value(task: Task, labels: list[str | None], raws: list[RawOutput], tokenizer: Tokenizer) -> Any:
    """The output cell of one task on one image. Boxes and points are clamped to [0, 1]."""
    kind = kind_of(task)
    if kind in ("caption", "query"):
        return tokenizer.decode(raws[0].tokens).strip()
    if kind == "point":
        return [{"label": lab, "x": _clamp(o[0]), "y": _clamp(o[1])} for lab, r in zip(labels, raws) for o in r.objects]
    return [
        {"label": lab, "x_min": _clamp(o[0]), "y_min": _clamp(o[1]), "x_max": _clamp(o[2]), "y_max": _clamp(o[3])}
        for lab, r in zip(labels, raws) for o in r.objects
    ]

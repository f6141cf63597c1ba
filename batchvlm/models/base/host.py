"""The host-side base every family builds on: its checkpoint folder, the one `load()`, and the
checks a family makes of a job's tasks (a classify task's choices as tokens among them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...tasks import IMAGE_LEVEL_KINDS, args_of, kind_of
from .budget import Budget
from .contract import ModelInfo, TaskSequence
from .errors import FamilyError, ModelLoadError
from .hub import resolve_device, resolve_dtype, weight_files, weights_sha256

if TYPE_CHECKING:
    from ...job import ModelSpec
    from ...tasks import Task
    from .contract import EngineModel, StaticModel


class FamilyBase(ABC):
    """A family's host side (contract.Family) with its checkpoint: a subclass sets `name`,
    `folder`, `model_name` and `revision` and says how to build, fill and wrap its model."""

    name: str
    backend = "native"
    embed_dim: int | None = None  # an encoder-only family's embedding width (the embed column's)
    folder: Path
    model_name: str
    revision: str | None

    @classmethod
    @abstractmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> FamilyBase:
        """The host side of the checkpoint in `folder` (what registry.open_family calls); raises
        ModelLoadError naming the file or the job field."""

    def load(self, dtype: str = "auto", device: str = "auto") -> EngineModel | StaticModel:
        """device / dtype -> weight files -> build -> load weights -> ModelInfo -> device side."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        files = weight_files(self.folder)  # before building: a folder without weights fails first
        model = self.build(dev, dt)
        self.load_weights(model, files)
        info = ModelInfo(self.model_name, self.revision, str(self.folder), weights_sha256(files),
                         str(dt).removeprefix("torch."), str(dev), self.name, self.backend)
        return self.device_side(model, info)

    def budget(self) -> Budget | None:
        """The family's visual-budget knob at this job's setting (None: images have one fixed cost)."""
        return None

    def can_prune(self) -> bool:
        """Whether the family drops duplicate visual tokens (model.prune_duplicates)."""
        return False

    @abstractmethod
    def build(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The module tree on `device` in `dtype`, its weights not yet read."""

    @abstractmethod
    def load_weights(self, model: Any, files: list[Path]) -> None:
        """Fill `model` from the checkpoint's safetensors `files`."""

    @abstractmethod
    def device_side(self, model: Any, info: ModelInfo) -> EngineModel | StaticModel:
        """The loaded model as the run drives it."""


def check_kinds(tasks: list[Task], supported: tuple[str, ...], model: str) -> None:
    """A vision-language model's check: refuse, naming the field, the first task whose kind the
    model cannot do, or that is not put as a vision-language model needs it (`check_generative`)."""
    for i, task in enumerate(tasks):
        check_generative(i, task, model)
        if (kind := kind_of(task)) not in supported:
            raise FamilyError(f"tasks.{i}.{kind}: {model} cannot do {kind} tasks (it can: {', '.join(supported)})")


def check_generative(i: int, task: Task, model: str) -> None:
    """Refuse what only an encoder-only model (SigLIP) answers: embed / similarity, and a classify
    task with a template rather than a question."""
    kind = kind_of(task)
    if kind in IMAGE_LEVEL_KINDS:
        raise FamilyError(f"tasks.{i}.{kind}: {model} generates text; {kind} needs an encoder-only model (SigLIP)")
    if kind == "classify" and (args := args_of(task)).question is None:
        raise FamilyError(f"tasks.{i}.classify.question: {model} answers a question; give one (a template "
                          "without a question is for encoder-only models such as SigLIP)")
    if kind == "classify" and args.template is not None:
        raise FamilyError(f"tasks.{i}.classify.template: {model} scores the choices as answers to the question; "
                          "a template is for encoder-only models such as SigLIP")


def refuse_size_settings(spec: ModelSpec, model: str, why: str) -> None:
    """The image-size knobs (Moondream's max_crops, the Qwens' min / max_pixels) on a family whose
    checkpoint fixes how images are sized: one line naming the field."""
    for field in ("max_crops", "min_pixels", "max_pixels"):
        if getattr(spec, field) is not None:
            raise ModelLoadError(f"model.{field}: not a {model} setting ({why})")


def refuse_constrain(tasks: list[Task], constrain: bool, model: str) -> None:
    """output.constrain is for the native Qwen families' detect / point (their JSON grounding)."""
    if constrain and any(kind_of(t) in ("detect", "point") for t in tasks):
        raise FamilyError(f"output.constrain: {model} cannot constrain detect / point answers (native Qwen3-VL and "
                          "Qwen3.5 can; Moondream's always follow its grammar)")


def check_context(seqs: list[TaskSequence], prefix_len: int, n_ctx: int, prefix: str, fix: str) -> None:
    """Refuse a sequence whose prefix, prompt and generated tokens cannot fit the model's context
    of `n_ctx` (`prefix`: how the message names the image prefix; `fix`: what to change)."""
    for s in seqs:
        n_prompt = len(s.spec.prefix_prompt) + len(s.spec.prompt)
        if prefix_len + n_prompt + s.spec.budget > n_ctx:
            raise FamilyError(f"tasks.{s.task}: a {n_prompt}-token prompt and up to {s.spec.budget} generated "
                              f"tokens after {prefix} exceed the model's context of {n_ctx}; {fix}")


def choice_tokens(t: int, choices: Sequence[str], tokens_of: Callable[[str], tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Each of task t's classify choices as its own tokens, `tokens_of(choice)`, in order; refuses,
    naming the field, a choice with the same tokens as an earlier one (no score tells them apart)."""
    out: list[tuple[int, ...]] = []
    for c in choices:
        own = tokens_of(c)
        if own in out:
            raise FamilyError(f"tasks.{t}.classify.choices: {choices[out.index(own)]!r} and {c!r} are the same tokens "
                              "for this model")
        out.append(own)
    return out


def tokens_after(encode: Callable[[str], list[int]], text: str, base: list[int], choice: str,
                 t: int) -> tuple[int, ...]:
    """A choice's tokens in context: what encoding `text + choice` adds to `base` (= encode(text)).
    Refuses a choice that merges with the prompt's last token (changes it, or adds no token)."""
    full = encode(text + choice)
    if full[: len(base)] != base or len(full) == len(base):
        raise FamilyError(f"tasks.{t}.classify.choices: {choice!r} merges with the prompt's last token")
    return tuple(full[len(base):])

"""Moondream 2's host side (base/contract.py Family): config + tokenizer, task prompts from the
templates in the config; its device side: device.py, its columns: labels.py."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...tasks import args_of, kind_of
from ..base.budget import Budget, halvings
from ..base.columns import task_columns
from ..base.contract import ModelInfo, TaskSequence
from ..base.decoding import MODE_SCORE, MODE_TEXT, RawOutput, SeqSpec
from ..base.errors import FamilyError, ModelLoadError
from ..base.grammar import Grammars
from ..base.host import FamilyBase, check_context, check_kinds, choice_tokens
from ..base.hub import TokenizerAdapter, load_tokenizer
from . import grammar
from .config import MoondreamConfig
from .device import MoondreamEngineModel
from .grammar import MODE_DETECT, MODE_POINT
from .labels import task_values
from .model import MoondreamModel
from .preprocess import Preprocessor
from .weights import TOKENIZER_REPO, build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import EngineSpec, ModelSpec
    from ...tasks import Task

KINDS = ("caption", "query", "point", "detect", "classify", "json")


class Moondream(FamilyBase):
    name = "moondream"

    def __init__(self, config: MoondreamConfig, tokenizer, folder: Path, model_name: str, revision: str | None,
                 max_crops: int | None = None, prune: float | None = None):
        self.config = config
        self.tokenizer = TokenizerAdapter(tokenizer)
        self.folder, self.model_name, self.revision = folder, model_name, revision
        self.max_crops = max_crops or config.vision.max_crops
        self.prune = prune  # model.prune_duplicates (vision.py forward_kept)
        # json answers: the logits are config.text.vocab_size wide (may exceed the tokenizer); EOS ends them
        self.grammars = Grammars(tokenizer, config.text.vocab_size, [config.tokenizer.eos_id])

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> Moondream:
        if given := [f for f in ("min_pixels", "max_pixels") if getattr(spec, f)]:
            raise ModelLoadError(f"model.{given[0]}: a Qwen3-VL setting; Moondream sees fixed-size crops "
                                 "(fewer: model.max_crops)")
        return cls(read_config(folder), load_tokenizer(folder, TOKENIZER_REPO), folder, spec.name, revision,
                   spec.max_crops, spec.prune_duplicates)

    def preprocessor(self) -> Preprocessor:
        return Preprocessor(self.config.vision, self.max_crops, self.prune)

    def max_prefix_len(self) -> int:
        return self.config.prefix_len

    def budget(self) -> Budget:
        """max_crops: vision work (the prefix is the same size whatever the crops)."""
        return Budget("max_crops", 1, self.max_crops, halvings(self.max_crops, 1))

    def can_prune(self) -> bool:
        return True

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        """`constrain` changes nothing: point / detect are always decoded by the grammar (grammar.py)."""
        check_kinds(tasks, KINDS, "Moondream")
        seqs = [TaskSequence(t, label, spec) for t, task in enumerate(tasks)
                for label, spec in self._task_sequences(t, task, engine)]
        P = self.config.prefix_len
        check_context(seqs, P, self.config.text.max_context, f"the {P}-token image prefix",
                      "shorten it or lower engine.max_new_tokens / engine.max_objects")
        return seqs

    def _task_sequences(self, t: int, task: Task, e: EngineSpec) -> list[tuple[str | None, SeqSpec]]:
        """(object label or None, sequence) for each sequence the task runs on an image."""
        kind, a = kind_of(task), args_of(task)
        if kind == "classify":
            return self._choices(t, a)
        tpl = self.config.tokenizer.templates.get("query" if kind == "json" else kind)
        if tpl is None:
            raise FamilyError(f"tasks: the model has no {kind} template")
        if kind == "caption":
            return [(None, SeqSpec(MODE_TEXT, tuple(tpl[a.length]), a.max_new_tokens or e.max_new_tokens,
                                   e.temperature, e.top_p))]
        if kind == "query":
            # The doubled suffix (answer id twice) is what the model was trained on.
            prompt = tpl["prefix"] + self.tokenizer.encode(a.question) + tpl["suffix"] + tpl["suffix"]
            return [(None, SeqSpec(MODE_TEXT, tuple(prompt), a.max_new_tokens or e.max_new_tokens, e.temperature,
                                   e.top_p))]
        if kind == "json":  # the prompt asked as a query, the answer held to the schema
            prompt = tpl["prefix"] + self.tokenizer.encode(a.prompt) + tpl["suffix"] + tpl["suffix"]
            return [(None, SeqSpec(MODE_TEXT, tuple(prompt), a.max_new_tokens or e.max_new_tokens, e.temperature,
                                   e.top_p, grammar=self.grammars.compile(a.json_schema, f"tasks.{t}.json")))]
        mode = MODE_DETECT if kind == "detect" else MODE_POINT
        return [(obj, grammar.spec(mode, tuple(tpl["prefix"] + self.tokenizer.encode(" " + obj) + tpl["suffix"]),
                                   a.max_objects or e.max_objects))
                for obj in a.objects]

    def _choices(self, t: int, a) -> list[tuple[str, SeqSpec]]:
        """One sequence per choice: the query's prompt minus its last token is the shared prefix
        prompt (after the image, read causally: docs/adding-a-family.md, classify); own tokens
        are that last token and the choice's tokens (after the answer ids: the same alone as in
        context), all scored, then the end token."""
        tpl = self.config.tokenizer.templates.get("query")
        if tpl is None:
            raise FamilyError("tasks: the model has no query template")
        prompt = tuple(tpl["prefix"] + self.tokenizer.encode(a.question) + tpl["suffix"] + tpl["suffix"])
        owns = choice_tokens(t, a.choices, lambda c: (prompt[-1], *self.tokenizer.encode(c)))
        return [(c, SeqSpec(MODE_SCORE, own, len(own), prefix_prompt=prompt[:-1])) for c, own in zip(a.choices, owns)]

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, partial(task_values, self.tokenizer.decode))

    def build(self, device: torch.device, dtype: torch.dtype) -> MoondreamModel:
        return build_model(self.config, device, dtype)

    def load_weights(self, model: MoondreamModel, files: list[Path]) -> None:
        load_weights(model, files)

    def device_side(self, model: MoondreamModel, info: ModelInfo) -> MoondreamEngineModel:
        return MoondreamEngineModel(model, info)

"""The host side both native Qwen families share (base/contract.py Family): tokenizer, chat
template, the sequences a task becomes (their words: prompts.py, shared with the transformers
backend) and their columns.

Every task is one user turn [image, text] in the checkpoint's chat template with the generation
prompt; the image prefix (template head, image tokens, vision_end) is shared by every task on
the image, and each sequence's prompt is the rest of the rendered turn. All sequences are plain
text: boxes and points are parsed from the JSON the model writes (labels.py). `open` reads the
folder with the family's config class, `load` builds the family's module tree and device side:
a family names its classes (dense and MoE model types alike: the config says which MLP).
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import torch

from ...tasks import args_of, kind_of
from ..base.budget import Budget, halvings
from ..base.columns import task_columns
from ..base.contract import ModelInfo, TaskSequence
from ..base.decoding import MODE_SCORE, MODE_TEXT, RawOutput, SeqSpec
from ..base.errors import ConfigError, ModelLoadError
from ..base.grammar import Grammars
from ..base.host import FamilyBase, check_context, check_kinds, choice_tokens, tokens_after
from ..base.hub import TokenizerAdapter, load_tokenizer
from .chat import ChatTemplate, read_template, special_tokens
from .config import QwenVLConfig, VisionConfig
from .constrain import grounding_schema
from .labels import task_values
from .preprocess import PixelSettings, Preprocessor
from .prompts import QWEN3, refuse_thinking_only
from .weights import build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import EngineSpec, ModelSpec
    from ...tasks import Task
    from .device import QwenVLEngineModel
    from .model import QwenVLModel

KINDS = ("caption", "query", "point", "detect", "ocr", "classify", "json")
H = TypeVar("H", bound="QwenVLHost")


def stop_ids(folder: Path, tokenizer: TokenizerAdapter) -> list[int]:
    """<|im_end|>, the tokenizer's eos_token and generation_config.json's eos_token_id."""
    ids = {tokenizer.id_of("<|im_end|>")}
    eos = special_tokens(folder).get("eos_token")
    if eos:
        ids.add(tokenizer.id_of(eos))
    gen = folder / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e])
    return sorted(i for i in ids if isinstance(i, int))


def _token(tokenizer: TokenizerAdapter, id_: int) -> str:
    token = tokenizer.token_of(id_)
    if token is None:
        raise ConfigError(f"token id {id_} is not in the tokenizer")
    return token


class QwenConfig(Protocol):
    """What the host side reads of a family's config."""

    vision: VisionConfig
    image_token_id: int
    vision_end_id: int

    @property
    def max_context(self) -> int: ...

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (json masks are that wide)."""


class QwenVLHost(FamilyBase):
    title: str  # in messages: "Qwen3-VL"
    kinds: tuple[str, ...] = KINDS  # the task kinds the family runs
    config_class: ClassVar[type[QwenVLConfig]]
    model_class: ClassVar[type[QwenVLModel]]
    device_class: ClassVar[type[QwenVLEngineModel]]
    skip_prefixes: ClassVar[tuple[str, ...]] = ()  # checkpoint tensors the family does not run

    def __init__(self, config: QwenConfig, settings: PixelSettings, tokenizer, folder: Path, model_name: str,
                 revision: str | None, min_pixels: int | None = None, max_pixels: int | None = None,
                 prune: float | None = None):
        self.config, self.folder, self.model_name, self.revision = config, folder, model_name, revision
        # named by its config's model_type, as model.family, the log line and job.json say it: a MoE
        # checkpoint is a qwen3_vl_moe / qwen3_5_moe model (model_types: dense, then MoE)
        self.name = self.config_class.model_types[config.text.moe is not None]
        self.settings = settings
        self.tokenizer = TokenizerAdapter(tokenizer, skip_special=True)
        self.template = ChatTemplate(*read_template(folder), special_tokens(folder),
                                     _token(self.tokenizer, config.image_token_id),
                                     _token(self.tokenizer, config.vision_end_id))
        refuse_thinking_only(self.template.render("a"), model_name)
        self.head = self.tokenizer.encode(self.template.head())
        self.stop_ids = stop_ids(folder, self.tokenizer)
        self.pre = Preprocessor.create(config.vision, settings, len(self.head), min_pixels, max_pixels, prune)
        self.grammars = Grammars(tokenizer, config.vocab_size, self.stop_ids)

    @classmethod
    def open(cls: type[H], folder: Path, spec: ModelSpec, revision: str | None) -> H:
        if spec.max_crops is not None:
            raise ModelLoadError(f"model.max_crops is Moondream's; {cls.title} sizes images by model.min_pixels / "
                                 "model.max_pixels")
        try:
            return cls(read_config(folder, cls.config_class), PixelSettings.read(folder), load_tokenizer(folder),
                       folder, spec.name, revision, spec.min_pixels, spec.max_pixels, spec.prune_duplicates)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from e

    def build(self, device: torch.device, dtype: torch.dtype) -> QwenVLModel:
        return build_model(self.model_class, self.config, torch.from_numpy(self.settings.lookup_table()), device, dtype)

    def load_weights(self, model: QwenVLModel, files: list[Path]) -> None:
        load_weights(model, files, self.skip_prefixes)

    def device_side(self, model: QwenVLModel, info: ModelInfo) -> QwenVLEngineModel:
        return self.device_class(model, info, self.head, self.stop_ids, self.pre, self.tokenizer.id_of("<|im_end|>"))

    def preprocessor(self) -> Preprocessor:
        return self.pre

    def max_prefix_len(self) -> int:
        return len(self.head) + self.pre.max_tokens() + 1

    def budget(self) -> Budget:
        """max_pixels: image tokens follow the area (one per factor^2 pixels)."""
        lo, full = self.pre.settings.min_pixels, self.pre.settings.max_pixels
        return Budget("max_pixels", lo, full, halvings(full, lo))

    def can_prune(self) -> bool:
        return True

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        """`constrain` (output.constrain): detect / point answers follow the JSON grounding format
        (constrain.py)."""
        check_kinds(tasks, self.kinds, self.title)
        seqs = []
        for t, task in enumerate(tasks):
            kind, a = kind_of(task), args_of(task)
            if kind == "classify":
                seqs += self._choices(t, a)
                continue
            if kind == "json":  # the prompt as written, the answer held to the schema
                pairs, kept = [(None, a.prompt, a.max_new_tokens or engine.max_new_tokens,
                                self.grammars.compile(a.json_schema, f"tasks.{t}.json"))], None
            elif kind in ("caption", "query", "ocr"):
                pairs, kept = [(None, QWEN3.words(kind, a), a.max_new_tokens or engine.max_new_tokens, None)], None
            else:
                pairs = [(obj, QWEN3.words(kind, a, obj), engine.max_new_tokens,
                          self.grammars.compile(grounding_schema(kind, obj), "output.constrain") if constrain else None)
                         for obj in a.objects]
                kept = a.max_objects or engine.max_objects
            for label, text, limit, grammar in pairs:
                prompt = tuple(self.tokenizer.encode(self.template.split(text)[1]))
                seqs.append(TaskSequence(t, label, SeqSpec(MODE_TEXT, prompt, limit, engine.temperature,
                                                           engine.top_p, grammar=grammar), kept))
        P = self.max_prefix_len()
        check_context(seqs, P, self.config.max_context, f"an image prefix of up to {P} tokens",
                      "lower model.max_pixels or engine.max_new_tokens")
        return seqs

    def _choices(self, t: int, a) -> list[TaskSequence]:
        """One sequence per choice: the query's prompt minus its last token is the shared prefix
        prompt; own tokens are that last token and the choice's tokens encoded in context, all
        scored, then <|im_end|> (docs/adding-a-family.md, classify)."""
        text = self.template.split(QWEN3.words("query", a))[1]
        base = self.tokenizer.encode(text)
        owns = choice_tokens(t, a.choices, lambda c: (base[-1], *tokens_after(self.tokenizer.encode, text, base, c, t)))
        return [TaskSequence(t, c, SeqSpec(MODE_SCORE, own, len(own), prefix_prompt=tuple(base[:-1])))
                for c, own in zip(a.choices, owns)]

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, partial(task_values, self.tokenizer.decode))

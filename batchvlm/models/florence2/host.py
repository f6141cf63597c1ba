"""Florence-2's host side (base/contract.py Family); its device side: device.py.

Every sequence is one (image, prompt) pair: the prompt (`<s>` instruction `</s>`, prompts.py) is
read by the encoder after the image tokens (`SeqSpec.prefix_prompt`: the contract's prefix
segment), and the decoder writes the answer from the decoder start token (`SeqSpec.prompt`), its
own tokens at positions 0, 1, ... for every sequence.

classify and json are asked as a query is (the question / prompt verbatim: Florence-2 has no chat
template). A classify choice is a decoder row on the (image, question) prefix: its own tokens are
what greedy `generate` feeds before an answer (the decoder start token, then the forced first
token if the checkpoint forces one) and the choice's tokens, scored from the first choice token
on, then the end token (docs/adding-a-family.md, classify). A json answer is decoded under its schema's grammar
(base/grammar.py) over this tokenizer; how the grammar meets the forced tokens and the n-gram
ban: decoding.py.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...tasks import args_of, kind_of
from ..base.columns import task_columns
from ..base.decoding import MODE_SCORE, MODE_TEXT, RawOutput, SeqSpec
from ..base.errors import FamilyError, ModelLoadError
from ..base.contract import ModelInfo, TaskSequence
from ..base.host import FamilyBase, check_kinds, choice_tokens, refuse_constrain, refuse_size_settings
from ..base.grammar import Grammars
from ..base.hub import load_tokenizer, read_json
from ..base.errors import ConfigError
from .config import Florence2Config, GenerationSettings
from .device import Florence2EngineModel
from .labels import task_values
from .model import Florence2Model
from .preprocess import Footprint, PixelSettings, Preprocessor
from .prompts import KINDS, instruction, task_text
from .weights import build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import EngineSpec, ModelSpec
    from ...tasks import Task

# transformers' clean_up_tokenization, applied to text when the tokenizer config asks for it
_CLEANUP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]


class Tokenizer:
    """The checkpoint's tokenizer.json, with its special tokens (<s>, </s>, the image token)."""

    def __init__(self, tok, folder: Path):
        self._tok = tok
        path = folder / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        self.cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        # a token may be written as {"content": "<s>", ...} (an AddedToken)
        self.bos, self.eos = (t["content"] if isinstance(t, dict) else t
                              for t in (config.get("bos_token", "<s>"), config.get("eos_token", "</s>")))

    @property
    def raw(self):
        """The `tokenizers.Tokenizer` itself (the grammar library reads its vocabulary)."""
        return self._tok

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: tuple[int, ...], special: bool, cleanup: bool = True) -> str:
        """`special`: keep special tokens (the <loc_N> text the post-processor reads); `cleanup`:
        the tokenizer config's clean-up of spaces, if it asks for it."""
        text = self._tok.decode(list(ids), skip_special_tokens=not special)
        if cleanup and self.cleanup:
            for a, b in _CLEANUP:
                text = text.replace(a, b)
        return text


class Florence2(FamilyBase):
    name = "florence2"

    def __init__(self, config: Florence2Config, settings: PixelSettings, generation: GenerationSettings,
                 tokenizer: Tokenizer, folder: Path, model_name: str, revision: str | None, prune: float | None = None):
        self.config, self.settings, self.generation, self.tokenizer = config, settings, generation, tokenizer
        self.folder, self.model_name, self.revision = folder, model_name, revision
        self.pre = Preprocessor(settings, Footprint.of(config.vision, settings.height, settings.width), prune)
        self.image_tokens = 1 + self.pre.footprint.cells  # the pooled token, then the last stage's cells
        # json answers: the logits are config.text.vocab_size wide; the end token ends them
        self.grammars = Grammars(tokenizer.raw, config.text.vocab_size, [generation.eos])
        if self.image_tokens != settings.image_tokens:
            raise ConfigError(f"{folder}: preprocessor_config.json image_seq_length {settings.image_tokens}, but a "
                              f"{settings.width}x{settings.height} image makes {self.image_tokens} image tokens")

    @classmethod
    def open(cls, folder: Path, spec: ModelSpec, revision: str | None) -> Florence2:
        refuse_size_settings(spec, "Florence-2",
                             "images are resized to the size in the checkpoint's preprocessor_config.json")
        try:
            text = read_json(folder / "config.json").get("text_config") or {}
            return cls(read_config(folder), PixelSettings.read(folder), GenerationSettings.read(folder, text),
                       Tokenizer(load_tokenizer(folder), folder), folder, spec.name, revision, spec.prune_duplicates)
        except ConfigError as e:
            raise ModelLoadError(str(e)) from e

    def preprocessor(self) -> Preprocessor:
        return self.pre

    def max_prefix_len(self) -> int:
        return self.image_tokens

    def can_prune(self) -> bool:
        """After DaViT (its convs and window attention need the full grid): the encoder and the
        decoder's cross-attention read the kept image tokens only."""
        return True

    def prompt(self, text: str) -> tuple[int, ...]:
        """The encoder's prompt tokens for a task text, as the processor writes them."""
        return self.tokenizer.encode(self.tokenizer.bos + instruction(text) + self.tokenizer.eos)

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        check_kinds(tasks, KINDS, "Florence-2")
        refuse_constrain(tasks, constrain, "Florence-2")
        seqs = []
        for t, task in enumerate(tasks):
            kind, a = kind_of(task), args_of(task)
            if kind == "classify":
                seqs += self._choices(t, a.choices, self._prefix(t, kind, task_text(kind, a)))
                continue
            limit = getattr(a, "max_new_tokens", None) or engine.max_new_tokens
            kept = (a.max_objects or engine.max_objects) if kind in ("detect", "regions") else None
            grammar = self.grammars.compile(a.json_schema, f"tasks.{t}.json") if kind == "json" else None
            for obj in (a.objects if kind == "detect" else [None]):
                spec = SeqSpec(MODE_TEXT, (self.generation.decoder_start,), limit, engine.temperature, engine.top_p,
                               prefix_prompt=self._prefix(t, kind, task_text(kind, a, obj)), grammar=grammar)
                seqs.append(TaskSequence(t, obj, spec, kept))
        n_pos = self.config.text.max_positions
        for s in seqs:
            if self.image_tokens + (n := len(s.spec.prefix_prompt)) > n_pos:
                raise FamilyError(f"tasks.{s.task}: {self.image_tokens} image tokens and a {n}-token "
                                  f"prompt exceed the encoder's {n_pos} positions; shorten it")
            if s.spec.mode == MODE_SCORE and len(s.spec.prompt) > n_pos:
                raise FamilyError(f"tasks.{s.task}.classify.choices: {s.label!r} is {len(s.spec.prompt)} decoder "
                                  f"tokens, more than the decoder's {n_pos} positions; shorten it")
            if s.spec.mode != MODE_SCORE and 1 + s.spec.limit > n_pos:
                raise FamilyError(f"tasks.{s.task}: up to {s.spec.limit} generated tokens exceed the decoder's {n_pos} "
                                  "positions; lower engine.max_new_tokens (or the task's max_new_tokens)")
        return seqs

    def _prefix(self, t: int, kind: str, text: str) -> tuple[int, ...]:
        """The encoder prompt of task t's text; a task token inside free text is an error naming the field."""
        try:
            return self.prompt(text)
        except ValueError as e:
            field = {"query": "question", "classify": "question", "json": "prompt", "detect": "objects"}.get(kind)
            raise FamilyError(f"tasks.{t}.{kind}{'.' + field if field else ''}: {e}") from None

    def _choices(self, t: int, choices: list[str], prefix: tuple[int, ...]) -> list[TaskSequence]:
        """One decoder row per choice on the question's (image, prompt) prefix: the decoder start
        token, the forced first token (if any), the choice's tokens. Its last `limit` = choice
        tokens + 1 rows are scored: each predicts the next choice token, the last one the end token
        (a forced token is not scored). After the special start / forced tokens a choice encodes as
        it does alone."""
        g = self.generation
        start = (g.decoder_start,) if g.forced_bos is None else (g.decoder_start, g.forced_bos)
        ids = choice_tokens(t, choices, self.tokenizer.encode)
        return [TaskSequence(t, c, SeqSpec(MODE_SCORE, start + own, len(own) + 1, prefix_prompt=prefix))
                for c, own in zip(choices, ids)]

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        forced_first = self.generation.forced_bos is not None
        return task_columns(tasks, seqs, raws, seen, partial(task_values, self.tokenizer, forced_first))

    def build(self, device: torch.device, dtype: torch.dtype) -> Florence2Model:
        return build_model(self.config, torch.from_numpy(self.settings.lookup_table()), device, dtype)

    def load_weights(self, model: Florence2Model, files: list[Path]) -> None:
        load_weights(model, files)

    def device_side(self, model: Florence2Model, info: ModelInfo) -> Florence2EngineModel:
        return Florence2EngineModel(model, info, self.generation, self.image_tokens,
                                    (self.settings.width, self.settings.height))

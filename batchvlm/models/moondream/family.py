"""Moondream 2 behind the family interface (models/family.py).

Host side (`Moondream`): config + tokenizer, task prompts from the templates in the config,
labels from raw outputs. Device side (`MoondreamEngineModel`): what the engine drives. Every image
prefix is `[BOS][729 image tokens]`, attended bidirectionally; positions equal slot indices.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...tasks import args_of, box_values, column_of, kind_of, point_values, truncated_column
from ...cache.specs import PagedKV, bytes_per_slot
from ...cache.tensors import EngineCache
from ...attention import AttentionBatch, KVCache
from ..decoding import (MODE_SCORE, MODE_TEXT, Decision, PromptRows, RawOutput, RowState, SeqSpec, choice_scores,
                        scores_only, with_scores)
from ..columns import TaskOutputs, task_columns
from ..grammar import Grammars, fill_masks
from . import grammar
from .grammar import MODE_DETECT, MODE_POINT
from ..family import FamilyError, ModelInfo, PrefixInputs, TaskSequence, check_kinds
from ..hub import TokenizerAdapter, load_tokenizer, resolve_device, resolve_dtype, weight_files, weights_sha256
from ..pinned import PinnedUpload
from .config import MoondreamConfig
from .decoding import decide
from .model import MoondreamModel
from .preprocess import PreparedImage, Preprocessor
from .weights import TOKENIZER_REPO, build_model, load_weights, read_config

if TYPE_CHECKING:
    from ...job import EngineSpec
    from ...tasks import Task

KINDS = ("caption", "query", "point", "detect", "classify", "json")


class Moondream:
    name = "moondream"
    backend = "native"

    def __init__(self, config: MoondreamConfig, tokenizer, folder: Path, model_name: str, revision: str | None,
                 max_crops: int | None = None):
        self.config = config
        self.tokenizer = TokenizerAdapter(tokenizer)
        self.folder, self.model_name, self.revision = folder, model_name, revision
        self.max_crops = max_crops or config.vision.max_crops
        # json answers: the logits are config.text.vocab_size wide (may exceed the tokenizer); EOS ends them
        self.grammars = Grammars(tokenizer, config.text.vocab_size, [config.tokenizer.eos_id])

    @classmethod
    def open(cls, folder: Path, model_name: str, revision: str | None, max_crops: int | None = None) -> Moondream:
        return cls(read_config(folder), load_tokenizer(folder, TOKENIZER_REPO), folder, model_name, revision, max_crops)

    def preprocessor(self) -> Preprocessor:
        return Preprocessor(self.config.vision, self.max_crops)

    def max_prefix_len(self) -> int:
        return self.config.prefix_len

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        """`constrain` changes nothing: point / detect are always decoded by the grammar (grammar.py)."""
        check_kinds(tasks, KINDS, "Moondream")
        seqs = [TaskSequence(t, label, spec) for t, task in enumerate(tasks)
                for label, spec in self._task_sequences(t, task, engine)]
        P, n_ctx = self.config.prefix_len, self.config.text.max_context
        for s in seqs:
            n_prompt = len(s.spec.prefix_prompt) + len(s.spec.prompt)
            if P + n_prompt + s.spec.budget > n_ctx:
                raise FamilyError(
                    f"tasks.{s.task}: a {n_prompt}-token prompt and up to {s.spec.budget} generated "
                    f"tokens after the {P}-token image prefix exceed the model's context of {n_ctx}; shorten it "
                    "or lower engine.max_new_tokens / engine.max_objects")
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
        prompt (after the image, read causally: models/family.py (c)); own tokens are that last
        token and the choice's tokens (after the answer ids: the same alone as in context), all
        scored, then the end token."""
        tpl = self.config.tokenizer.templates.get("query")
        if tpl is None:
            raise FamilyError("tasks: the model has no query template")
        prompt = tuple(tpl["prefix"] + self.tokenizer.encode(a.question) + tpl["suffix"] + tpl["suffix"])
        out: list[tuple[str, SeqSpec]] = []
        for c in a.choices:
            own = (prompt[-1], *self.tokenizer.encode(c))
            for label, s in out:
                if s.prompt == own:
                    raise FamilyError(f"tasks.{t}.classify.choices: {label!r} and {c!r} are the same tokens for "
                                      "this model")
            out.append((c, SeqSpec(MODE_SCORE, own, len(own), prefix_prompt=prompt[:-1])))
        return out

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        return task_columns(tasks, seqs, raws, seen, self._task_columns)

    def _task_columns(self, o: TaskOutputs) -> dict[str, Any]:
        kind = kind_of(o.task)
        if kind in ("caption", "query"):
            value = self.tokenizer.decode(o.raws[0].tokens).strip()
        elif kind == "json":  # compact JSON as the grammar let it be written
            value = self.tokenizer.decode(o.raws[0].tokens)
        else:
            value = (point_values if kind == "point" else box_values)(o.labels, [r.objects for r in o.raws])
        return {column_of(o.task): value, truncated_column(o.task): o.cut}

    def load(self, dtype: str = "auto", device: str = "auto") -> MoondreamEngineModel:
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        files = weight_files(self.folder)  # before building the model
        model = build_model(self.config, dev, dt)
        load_weights(model, files)
        info = ModelInfo(self.model_name, self.revision, str(self.folder), weights_sha256(files),
                         str(dt).removeprefix("torch."), str(dev), self.name, self.backend)
        return MoondreamEngineModel(model, info)


class MoondreamEngineModel:
    """The engine's view of a loaded Moondream (models/family.py EngineModel)."""

    causal_prefix = False  # the image part: [BOS][image tokens]
    causal_prefix_prompt = True  # a prefix prompt after it (classify's shared prompt) is text: causal

    def __init__(self, model: MoondreamModel, info: ModelInfo):
        self.model, self.info = model, info
        self.device, self.dtype = model.device, model.dtype
        self.P = model.config.prefix_len
        self._upload = PinnedUpload(self.device)

    def state_specs(self) -> list[PagedKV]:
        t = self.model.config.text
        return [PagedKV("attn", t.n_layers, t.n_kv_heads, t.head_dim, self.dtype)]

    def new_kv_cache(self, n_blocks: int, block_size: int) -> KVCache:
        return self.model.new_kv_cache(n_blocks, block_size)

    def kv_bytes_per_token(self) -> int:
        return bytes_per_slot(self.state_specs())

    def prefix_layout(self, image: PreparedImage, prompt: tuple[int, ...]) -> tuple[int, int]:
        return image.prefix_len + len(prompt), image.next_pos + len(prompt)

    def encode(self, images: list[PreparedImage]) -> list[torch.Tensor]:
        crops = self._upload([im.crops for im in images])
        return list(self.model.vision(crops, [im.tiling for im in images]).unbind(0))

    def largest_vision_batch(self) -> list[PreparedImage]:
        s = self.model.config.vision.crop_size
        return [PreparedImage(torch.zeros(1, s, s, 3, dtype=torch.uint8), (1, 1), self.P)] * 128

    def prefix_inputs(self, features: list[torch.Tensor], prompts: list[torch.Tensor]) -> PrefixInputs:
        image_IPC = self.model.prefix_embeds(torch.stack(features))
        if not any(p.shape[0] for p in prompts):
            return PrefixInputs(image_IPC.reshape(len(features) * self.P, -1),
                                torch.arange(self.P, device=self.device).repeat(len(features)))
        # A prefix prompt follows its image's tokens; positions equal slot indices.
        embeds = [part for image_PC, p in zip(image_IPC, prompts) for part in (image_PC, self.model.text.wte[p])]
        positions = [torch.arange(self.P + p.shape[0], device=self.device) for p in prompts]
        return PrefixInputs(torch.cat(embeds), torch.cat(positions))

    def own_positions(self, pos_N: torch.Tensor) -> torch.Tensor:
        return pos_N

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor:
        return self.model.text.wte[ids_N]

    def embed_inputs(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        return self.model.input_embeds(kind_N, token_N, value_N2)

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: EngineCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        return self.model.text(embeds_NC, positions, batch, cache.paged["attn"])

    emit = staticmethod(grammar.emit)
    fill_masks = staticmethod(fill_masks)  # json tasks (models/grammar.py)

    def decide(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
               heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
               prompt: PromptRows | None = None, mask_BW: torch.Tensor | None = None) -> Decision:
        if prompt is None:
            return decide(self.model, hidden_BC, state, sampling, heads, mask_BW)
        scores = choice_scores(self.model.text.logits, prompt, state, self.model.config.tokenizer.eos_id)
        if prompt.only_scores:  # classify choices alone: nothing to sample
            return scores_only(scores)
        return with_scores(decide(self.model, hidden_BC, state, sampling, heads, mask_BW), state, scores)

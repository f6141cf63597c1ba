"""The model-family boundary: everything the pipeline and the engine may know about a model.

A family has two halves:

  Family       host side, built from config.json + tokenizer without weights (cheap: `validate`
               builds it). Preprocessing for the loader workers, the sequences each task
               becomes, raw outputs -> typed column values, and `load()` for the weights.
  EngineModel  device side of a native family, driven by batchvlm's engine (engine/): vision
               stage, the image prefix (its length, positions and attention), embeddings, one
               forward over a flat token batch with paged KV, and per-row decoding.
  StaticModel  device side of a family that brings its own batching (the transformers
               backend): it labels work items itself.

Flat token batches are laid out [image prefixes | prompt tokens | decode tokens]. Positions are
the family's rotary positions, `[..., N]` long tensors (`[N]` for 1-D rotary, `[3, N]` for
multimodal rotary); they need not equal KV slot indices. A sequence's own tokens (its prompt,
then what it generates) have scalar positions `prefix.next_pos + own index`; the family expands
them with `own_positions`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from PIL import Image

from ..tasks import kind_of
from .decoding import Decision, RowState, SeqSpec

if TYPE_CHECKING:
    from ..engine.labeler import WorkItem
    from ..job import EngineSpec
    from ..tasks import Task
    from .attention import AttentionBatch, KVCache


PARSE_FAILURES = "_parse_failures"  # see Family.columns


class ModelLoadError(RuntimeError):
    """The model cannot be found, read or built: one line for the user."""


class FamilyError(ValueError):
    """The job asks something of the model that it cannot do (names the job field)."""


def check_kinds(tasks: list[Task], supported: tuple[str, ...], model: str) -> None:
    """Refuse, naming the field, the first task whose kind the model cannot do."""
    for i, task in enumerate(tasks):
        if (kind := kind_of(task)) not in supported:
            raise FamilyError(f"tasks.{i}.{kind}: {model} cannot do {kind} tasks (it can: {', '.join(supported)})")


@dataclass(frozen=True)
class ModelInfo:
    """Provenance: lands in the job record and every Parquet file's metadata."""

    name: str
    revision: str | None
    path: str
    weights_sha256: str
    dtype: str
    device: str
    family: str
    backend: str  # native | transformers

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TaskSequence:
    """One sequence of a task on every image: task index, object label, what to run."""

    task: int
    label: str | None
    spec: SeqSpec


class Prepared(Protocol):
    """One image ready for the device, made in a loader worker. Tensors inside travel to the
    main process through shared memory."""

    @property
    def prefix_len(self) -> int:
        """KV slots of the image prefix."""

    @property
    def next_pos(self) -> int:
        """Rotary position of the first token after the prefix."""

    @property
    def cost(self) -> int:
        """Vision work (crops, patches): bounds the size of one vision batch."""


class Preprocessor(Protocol):
    """Picklable: runs in loader workers before the weights are loaded."""

    def __call__(self, image: Image.Image, width: int | None = None, height: int | None = None) -> Prepared:
        """`width` / `height`: the full size when `image` was decoded at reduced size."""

    def largest_size(self, width: int, height: int) -> tuple[int, int]:
        """The largest size the model reads of a width x height image (JPEG draft decoding may
        decode at any size at least this large)."""


@dataclass
class PrefixInputs:
    """Inputs of the image prefixes prefilled in one step, in image order."""

    embeds_NC: torch.Tensor  # [sum of prefix lengths, C]
    positions: torch.Tensor  # [..., sum of prefix lengths] rotary positions
    extras: Any = None  # family-private (e.g. DeepStack features): passed back to forward


class Family(Protocol):
    name: str  # e.g. "moondream"
    backend: str  # native | transformers

    def preprocessor(self) -> Preprocessor: ...

    def sequences(self, tasks: list[Task], engine: EngineSpec) -> list[TaskSequence]:
        """The sequences every image runs, in task order. Raises FamilyError naming the field."""

    def max_prefix_len(self) -> int:
        """An upper bound of any image's prefix length under this job's preprocessing."""

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[Any]) -> dict[str, Any]:
        """One image's raw sequence outputs -> {column: value}. A family that parses text may add
        PARSE_FAILURES: how many of the image's answers did not parse cleanly (the shard's stats
        sum them; it is not a column)."""

    def load(self, dtype: str, device: str) -> EngineModel | StaticModel: ...


@runtime_checkable
class StaticModel(Protocol):
    info: ModelInfo

    def labeler(self, seqs: list[TaskSequence], engine: EngineSpec) -> Labeler: ...


class Labeler(Protocol):
    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[Any]]]:
        """-> (ticket, raw output per sequence) for each item, in any order."""


class EngineModel(Protocol):
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    causal_prefix: bool  # False: the image prefix attends to itself bidirectionally

    def new_kv_cache(self, n_blocks: int, block_size: int) -> KVCache: ...

    def kv_bytes_per_token(self) -> int: ...

    def encode(self, images: list[Prepared]) -> list[Any]:
        """Vision stage for a batch of images -> one opaque features object per image."""

    def largest_vision_batch(self) -> list[Prepared]:
        """Images of the largest vision batch the engine may run (sizes memory at start-up)."""

    def prefix_inputs(self, features: list[Any]) -> PrefixInputs: ...

    def own_positions(self, pos_N: torch.Tensor) -> torch.Tensor:
        """Scalar positions of own tokens -> the family's `[..., N]` positions."""

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor: ...

    def embed_inputs(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        """Embeddings of decode inputs (INPUT_* kinds), computed for every row (fixed shapes)."""

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: KVCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        """Flat tokens -> hidden states [N, C]; writes every token's K/V into `cache`."""

    def decide(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
               heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> Decision:
        """One step of every row's decoding; updates `state` in place. `heads` = (token rows,
        coordinate rows, size rows) that need each output head (None: every row, every head)."""

"""The family contract: what the pipeline and the engine may know about a model.

A family has two halves. The host side (`Family`) is built from config.json and the tokenizer
without weights (`validate` builds it): preprocessing for the loader workers, the sequences each
task becomes, raw outputs -> column values, and `load()`. Its device side is an `EngineModel`
(a native family, driven step by step by engine/) or a `StaticModel` (a backend that batches by
itself). The long form, with the state kinds, prefixes, classify and json masks:
docs/adding-a-family.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

import torch
from PIL import Image

from .budget import Budget
from .decoding import Decision, PromptRows, RawOutput, RowState, SeqSpec

if TYPE_CHECKING:
    from ...cache.specs import StateSpec
    from ...cache.tensors import EngineCache
    from ...job import EngineSpec
    from ...tasks import Task
    from ...attention import AttentionBatch


PARSE_FAILURES = "_parse_failures"  # see Family.columns


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
    """One sequence of a task on every image, the one family-side description of it: which task,
    which object (or choice), what the task keeps of its output, and what the backend runs (`spec`:
    a SeqSpec for the native engine; the transformers backend's own prompt for `generate`)."""

    task: int  # index in the job's tasks
    label: str | None  # the object of a detect / point sequence, the choice of a classify one
    spec: Any  # SeqSpec (native engine) or the static backend's prompt
    max_objects: int | None = None  # detect / point / regions: objects kept, in the order the model wrote them


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

    @property
    def seen(self) -> tuple[int, int] | None:
        """(width, height) the model reads the image at, where it reads it at one size (after its
        resize); None for multi-crop models. Kept (without the pixels) for `columns`: absolute
        coordinates are pixels of this size."""


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
    embed_dim: int | None  # an encoder-only family's embedding width (an embed column's); None for others

    def preprocessor(self) -> Preprocessor: ...

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        """The sequences every image runs, in task order. Raises FamilyError naming the field.
        `constrain` (output.constrain): detect / point answers follow the family's format."""

    def max_prefix_len(self) -> int:
        """An upper bound of any image's prefix length under this job's preprocessing."""

    def budget(self) -> Budget | None:
        """The visual-budget knob `batchvlm tune` varies, at this job's setting; None: none."""

    def can_prune(self) -> bool:
        """Whether the family drops duplicate visual tokens (model.prune_duplicates)."""

    def columns(self, tasks: list[Task], seqs: list[TaskSequence], raws: list[RawOutput],
                seen: tuple[int, int] | None = None) -> dict[str, Any]:
        """One image's raw sequence outputs -> {column: value}; `seen` is its Prepared.seen (None:
        unknown). Families build it with `task_columns`. A family that parses text may add
        PARSE_FAILURES: how many of the image's answers did not parse cleanly (the shard's stats
        sum them; it is not a column)."""

    def load(self, dtype: str, device: str) -> EngineModel | StaticModel: ...


@runtime_checkable
class StaticModel(Protocol):
    info: ModelInfo

    def labeler(self, seqs: list[TaskSequence], engine: EngineSpec) -> Labeler: ...


class SampleLike(Protocol):
    """What a labeler reads of the run's image (data/loader.py `Sample`, which the loader and the
    Ray UDF make): models/ declares it here rather than import data/. A labeler hands the same
    objects back, so the caller keeps its own fields (shard, index, size, kept input fields)."""

    key: str  # sample key: with the job seed it seeds sampling, whatever the batch
    meta: dict[str, Any] | None  # the input.keep values (a similarity task's text is one)
    # The image ready for the device. A labeler may set it to None once the pixels are on the
    # device (the engine does after encoding): nothing then keeps them alive.
    prepared: Prepared | None


SampleT = TypeVar("SampleT", bound=SampleLike)  # a labeler gives back the samples it was given


class Labeler(Protocol):
    def label(self, samples: Iterable[SampleT]) -> Iterator[tuple[SampleT, list[RawOutput]]]:
        """-> (sample, raw output per sequence) for each sample, in any order."""


@runtime_checkable
class ImageModel(Protocol):
    """The device side of an encoder-only family (SigLIP): no sequences and no decode, each image's
    outputs from one batched forward (engine/images.py drives it: the image-level output path)."""

    info: ModelInfo
    device: torch.device

    def start(self, seqs: list[TaskSequence]) -> None:
        """The job's sequences, before the first batch (what is the same for every image, such as
        a classify task's choice texts, is computed here, once)."""

    def bucket(self, image: Prepared) -> int:
        """The padded length an image runs at: images of one bucket share a batch."""

    def run(self, samples: list[SampleLike], length: int) -> Any:
        """Launch one batch of samples (their images padded to `length`, their `meta` for texts);
        -> a handle `collect` reads (on CUDA the forward runs on while the host prepares the next)."""

    def collect(self, handle: Any) -> list[list[RawOutput]]:
        """-> each image's raw output per sequence, in order (waits for that batch only)."""


class EngineModel(Protocol):
    info: ModelInfo
    device: torch.device
    dtype: torch.dtype
    causal_prefix: bool  # False: the image prefix attends to itself bidirectionally
    # Read when causal_prefix is False, optional (default False): True, a prefix prompt after the
    # image is read causally (Moondream's shared classify prompt); False, the whole prefix is
    # bidirectional (an encoder).
    causal_prefix_prompt: bool

    def state_specs(self) -> list[StateSpec]:
        """The state kinds of the model's layers (cache/specs.py); the engine sizes, allocates and
        accounts them, and passes them to `forward` as an EngineCache keyed by spec name."""

    def prefix_layout(self, image: Prepared, prompt: tuple[int, ...]) -> tuple[int, int]:
        """-> (KV slots, rotary position of own token 0) of the prefix segment made of the image
        and a prefix prompt (SeqSpec.prefix_prompt)."""

    def encode(self, images: list[Prepared]) -> list[Any]:
        """Vision stage for a batch of images -> one opaque features object per image."""

    def largest_vision_batch(self) -> list[Prepared]:
        """Images of the largest vision batch the engine may run (sizes memory at start-up)."""

    def prefix_inputs(self, features: list[Any], prompts: list[torch.Tensor]) -> PrefixInputs:
        """The step's prefixes in plan order: one image's features (the same object for every
        prefix of that image: encoded once) and each prefix's prompt ids ([T] long, device)."""

    def own_positions(self, pos_N: torch.Tensor) -> torch.Tensor:
        """Scalar positions of own tokens -> the family's `[..., N]` positions."""

    def embed_tokens(self, ids_N: torch.Tensor) -> torch.Tensor: ...

    def embed_inputs(self, kind_N: torch.Tensor, token_N: torch.Tensor, value_N2: torch.Tensor) -> torch.Tensor:
        """Embeddings of decode inputs (INPUT_* kinds), computed for every row (fixed shapes)."""

    def forward(self, embeds_NC: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, cache: EngineCache,
                prefix: PrefixInputs | None = None) -> torch.Tensor:
        """Flat tokens -> hidden states [N, C]; writes every token's state into `cache` (K/V by
        `attend`, recurrent states by the family's scan over `batch.states`)."""

    def decide(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
               heads: tuple[torch.Tensor, ...] | None, prompt: PromptRows | None = None) -> Decision:
        """One step of every row's decoding; updates `state` in place. `heads[b]`: the rows whose
        head schedule (SeqSpec.heads) needs head b this step (None: every row, every head).
        `prompt`: the scored prompt rows, in a step with MODE_SCORE sequences (docs/adding-a-family.md, classify)."""

    def emit(self, out: RawOutput, spec: SeqSpec, code: int, token: int, v0: float, v1: float) -> None:
        """The host half of the grammar: apply one emission of a sequence (one step behind)."""

    # A family whose sequences may carry a SeqSpec.grammar also has
    #   fill_masks(states: list[Any], out_MW: np.ndarray) -> None
    # (the next-token masks of those grammar states into out_MW's first rows, int32) and its
    # `decide` takes `mask_BW` (docs/adding-a-family.md, json masks).

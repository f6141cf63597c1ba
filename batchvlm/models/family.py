"""The model-family boundary: everything the pipeline and the engine may know about a model.

A family has two halves:

  Family       host side, built from config.json + tokenizer without weights (cheap: `validate`
               builds it). Preprocessing for the loader workers, the sequences each task
               becomes, raw outputs -> typed column values, and `load()` for the weights.
  EngineModel  device side of a native family, driven by batchvlm's engine (engine/): vision
               stage, prefix segments (their length, positions and inputs), embeddings, one
               forward over a flat token batch, and its grammar (per-row `decide` on the device,
               `emit` on the host).
  StaticModel  device side of a family that brings its own batching (the transformers
               backend): it labels work items itself.

Flat token batches are laid out [prefixes | prompt tokens | decode tokens]. Positions are the
family's rotary positions, `[..., N]` long tensors (`[N]` for 1-D rotary, `[3, N]` for
multimodal rotary); they need not equal KV slot indices. A sequence's own tokens (its prompt,
then what it generates) have scalar positions `next_pos + own index`, `next_pos` from
`prefix_layout`; the family expands them with `own_positions`.

Engine contract v2: how each kind of model plugs in.

  State kinds. `state_specs()` declares what the layers keep (cache/specs.py): PagedKV (full
  attention), CrossKV (read-only K/V of a prefix), Recurrent (a fixed-size state per sequence).
  The engine sizes memory for all of them, allocates an EngineCache and hands it to `forward`;
  `attend(..., reads=...)` (attention/reference.py) reads and writes paged kinds, `run_recurrent`
  (models/recurrent.py) runs the family's scan over recurrent ones.

  Prefixes. A prefix segment is an image's features followed by a prefix prompt
  (`SeqSpec.prefix_prompt`): sequences of an image with equal prefix prompts share it. It is
  prefilled once (`prefix_inputs` gets each prefix's features, encoded once per image, and its
  prompt ids), read-only afterwards, refcounted by the sequences on it.

  (a) Hybrid linear attention (Qwen3.5). Full layers use PagedKV; Gated DeltaNet layers declare
      Recurrent({"conv": (layers, channels, kernel-1), "ssm": (layers, heads, key_dim,
      value_dim)}). In `forward`, `batch.states` (StateSpans) says where each prefix and prompt
      span sits and which state index it starts from and writes: a prefix from zero into its
      snapshot, each prompt from its prefix's snapshot (a copy) into its row, decode tokens one
      per row in place. The family's chunked scan runs per span (`cu_seqlens` / `read` / `write`
      are on the device for a varlen kernel). tests/toy_states.py HybridToy is the worked example.
  (b) Encoder-decoder (Florence-2). `prefix_layout` gives (image tokens + prompt tokens, 0): the
      decoder's positions start at 0. `prefix_inputs` embeds features + prompt; in `forward` the
      family runs its encoder densely over rows [0, batch.n_prefix) (`prefix_self_attention`,
      nothing stored), computes every decoder layer's cross K/V from the encoder output and
      passes it to `attend(..., Reads.PREFIX)` (written into the prefix's CrossKV blocks, read by
      own tokens); decoder self-attention is `attend(..., Reads.OWN)`. Features are encoded once
      per image (`stats["vision_images"]`); each (image, prompt) gets its own encoder K/V.
      tests/toy_states.py EncDecToy is the worked example, models/florence2/engine.py the real
      one (its `decide` keeps a token history per engine row, indexed by `RowState.row`, for
      the n-gram ban).
  (c) Classify (choices). The shared prompt minus its last token is the prefix prompt (one
      prefix segment per image and prompt, prefilled once; after a bidirectional image prefix it is
      read causally, `causal_prefix_prompt`); each choice is a sequence whose own prompt is [last
      prompt token] + the choice's tokens, with limit 1 (it finishes at its first decision: one
      prefill step, no decode loop). Its score, the sum of the choice tokens' log-probs, needs the
      logits of its own prompt rows, where `decide` sees the last row only: in a step with
      MODE_SCORE sequences, `decide` gets their scored rows as well (`PromptRows`: hidden states
      [U, C], one per distinct context among the scored rows (the choices' shared last prompt
      token and shared leading tokens once), the token each scored row predicts, its context
      and its emitting row, chosen on the host, already on the device; no other prompt row's
      logits are computed) and reduces them per row into
      `Decision.value` (decoding.py `choice_scores`). MODE_SCORE rows score their last `limit` rows
      and write nothing after their prompt (budget 1). An encoder-decoder (Florence-2) has the
      whole prompt in its encoder prefix instead: a choice's own tokens are the decoder's start
      tokens (start, forced first token) and the choice's tokens, its last `limit` rows scored.
  (d) JSON / constrained decoding (json tasks, output.constrain). The family compiles a grammar
      per schema once per job (models/grammar.py) and puts it in `SeqSpec.grammar`; the engine
      knows only its mask width. The grammar state of a sequence is on the host
      (`RawOutput.grammar`, fed by `emit`); the family's `fill_masks` turns the states of a
      step's constrained rows into int32 bitmasks, which the scheduler computes one step behind
      (only for sequences none of whose steps is in flight, engine/scheduler.py) and the runner
      writes into a row-indexed table on the device; `decide` gets `mask_BW` (every row: free
      rows allow everything) and applies it to the logits before the batch-invariant sampler.
      No launch waits for a mask. A grammar small enough to tabulate could instead keep a state
      id in `RowState.phase` and a [n_states, W] mask table on the device (Moondream's point /
      detect grammar is of that kind, with its own heads).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from PIL import Image

from ..tasks import kind_of
from .decoding import Decision, PromptRows, RawOutput, RowState, SeqSpec

if TYPE_CHECKING:
    from ..cache.specs import StateSpec
    from ..cache.tensors import EngineCache
    from ..job import EngineSpec
    from ..tasks import Task
    from ..attention import AttentionBatch


PARSE_FAILURES = "_parse_failures"  # see Family.columns


class ModelLoadError(RuntimeError):
    """The model cannot be found, read or built: one line for the user."""


class ModelFetchError(ModelLoadError):
    """The hub could not be reached or refused for now (network, rate limit, server error): a
    later try may succeed, unlike a repo or revision that does not exist."""


class FamilyError(ValueError):
    """The job asks something of the model that it cannot do (names the job field)."""


def check_kinds(tasks: list[Task], supported: tuple[str, ...], model: str) -> None:
    """Refuse, naming the field, the first task whose kind the model cannot do."""
    for i, task in enumerate(tasks):
        if (kind := kind_of(task)) not in supported:
            raise FamilyError(f"tasks.{i}.{kind}: {model} cannot do {kind} tasks (it can: {', '.join(supported)})")


def refuse_constrain(tasks: list[Task], constrain: bool, model: str) -> None:
    """output.constrain is for the native Qwen families' detect / point (their JSON grounding)."""
    if constrain and any(kind_of(t) in ("detect", "point") for t in tasks):
        raise FamilyError(f"output.constrain: {model} cannot constrain detect / point answers (native Qwen3-VL and "
                          "Qwen3.5 can; Moondream's always follow its grammar)")


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

    def preprocessor(self) -> Preprocessor: ...

    def sequences(self, tasks: list[Task], engine: EngineSpec, constrain: bool = False) -> list[TaskSequence]:
        """The sequences every image runs, in task order. Raises FamilyError naming the field.
        `constrain` (output.constrain): detect / point answers follow the family's format."""

    def max_prefix_len(self) -> int:
        """An upper bound of any image's prefix length under this job's preprocessing."""

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


@dataclass
class WorkItem:
    """What the run loop hands a labeler: one image to label, with a handle to get it back."""

    ticket: Any  # the caller's handle, returned with the result
    image: Prepared
    key: str  # sample key: with the job seed it seeds sampling, whatever the batch


class Labeler(Protocol):
    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[Any]]]:
        """-> (ticket, raw output per sequence) for each item, in any order."""


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
        `attend`, recurrent states by `run_recurrent`)."""

    def decide(self, hidden_BC: torch.Tensor, state: RowState, sampling: bool,
               heads: tuple[torch.Tensor, ...] | None, prompt: PromptRows | None = None) -> Decision:
        """One step of every row's decoding; updates `state` in place. `heads[b]`: the rows whose
        head schedule (SeqSpec.heads) needs head b this step (None: every row, every head).
        `prompt`: the scored prompt rows, in a step with MODE_SCORE sequences (note (c))."""

    def emit(self, out: RawOutput, spec: SeqSpec, code: int, token: int, v0: float, v1: float) -> None:
        """The host half of the grammar: apply one emission of a sequence (one step behind)."""

    # A family whose sequences may carry a SeqSpec.grammar also has
    #   fill_masks(states: list[Any], out_MW: np.ndarray) -> None
    # (the next-token masks of those grammar states into out_MW's first rows, int32) and its
    # `decide` takes `mask_BW` (note (d)).

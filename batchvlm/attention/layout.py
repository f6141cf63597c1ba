"""The batch layout of one attention step: a flat batch of tokens from many sequences over a
paged KV cache, grouped by what they read. Every backend reads these; none of them is here.

The KV cache is one tensor of slots: `[n_layers, n_blocks * block_size, n_kv_heads, head_dim]`.
Block 0 is the null block: padding tokens write there and padded keys read from there.

Every sequence is a prefix segment (an image prefix, shared by all tasks on that image; or an
(image, prompt) encoding) then the task's own tokens (its prompt, then what it generates). The
two live in separate blocks: a prefix's blocks hold its L prefix tokens (index j < L, the tail
of the last block unused) and a sequence's own blocks hold own token o at index o. So prefix
blocks are shared copy-free by every sequence on the prefix (cache/blocks.py refcounts them),
and L may differ per prefix (it may be 0).

Visibility:
  prefix token j   sees prefix keys j' < L: all of them (bidirectional prefix), j' <= j (causal), or
                   (a bidirectional image part of B tokens before a causal prefix prompt) j' < B or
                   j' <= j
  own token o      sees every prefix key of its image, and own keys o' <= o

Two kinds of group:
  PrefixGroup  image prefixes being prefilled, one padded row per image.
  TaskGroup    own tokens of sequences (prompts, or one decode token each). The image prefix is
               read once per *image*, not once per sequence: every image's queries attend
               together to its prefix, each sequence to its own tokens, and the two partial
               softmaxes are merged exactly by their log-sum-exps (cascade attention). With
               several tasks per image this divides the dominant memory traffic by their number.
Rotary positions are applied before attention and play no part here.

What a call reads and writes (`reads`, a family's choice per layer):
  PREFIX_AND_OWN  decoder-only layers: prefix and own keys in one softmax (cascade), every row of
                  the step writes its K/V (prefix rows into the prefix's blocks).
  OWN             an encoder-decoder's decoder self-attention: own keys only; own rows write.
                  Prefix groups are not queried (their rows come back as zeros).
  PREFIX          cross-attention: prefix keys only, read-only for own tokens. `k`/`v` hold the
                  step's prefix rows only ([n_prefix, ...], what the family computed from its
                  encoder output); they are written into the prefix's blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import torch

from ..cache.spans import StateSpans

PAD = 2**30  # own index of a padding query: later than any real token


def bucket(n: int) -> int:
    """Smallest power of two >= n (>= 1): the padded sizes of compiled kernels and CUDA graphs."""
    return 1 << max(n - 1, 0).bit_length()


class Reads(Enum):
    PREFIX_AND_OWN = "prefix+own"
    OWN = "own"
    PREFIX = "prefix"


@dataclass
class PrefixGroup:
    q_rows: torch.Tensor  # [I, L] long: flat rows of each image's prefix tokens; padding -> row N
    table: torch.Tensor  # [I, n_prefix_blocks] long: prefix blocks; padding -> 0 (null block)
    lens: torch.Tensor  # [I] long: prefix length L of each image
    causal: bool
    all_full: bool = False  # known on the host: every prefix is L long (a bidirectional one needs no key mask)
    # With `causal`: [I] long, keys j' < bidir_lens[i] are seen by every query of prefix i (Moondream's
    # bidirectional image part before a causal prefix prompt); None: plain causal.
    bidir_lens: torch.Tensor | None = None


@dataclass
class SharedPrefix:
    tables: torch.Tensor  # [I, n_prefix_blocks] long: each image's prefix blocks
    lens: torch.Tensor  # [I] long: each image's prefix length
    q_rows: torch.Tensor  # [I, M] long: flat query rows on each image; padding -> row N
    q_slot: torch.Tensor  # [B, Tq] long: where each group query sits in [I * M]; padding -> I * M
    # Known on the host, where the caller has it: the longest prefix (keys past it are never
    # read) and whether every image's prefix is that long (then no mask is needed at all).
    max_len: int | None = None
    all_full: bool = False
    # Dense copies of these prefixes' K/V that later steps may reuse (PrefixView); None: gather.
    view: PrefixView | None = None


class PrefixView:
    """Dense copies of a decode group's prefix K/V, [I, H, Lp, D] per (reads, layer), made on the
    first read of a layer and reused by later steps that decode against the same prefixes, so a
    read-only prefix (cross-attention K/V above all) is not gathered from its blocks every step.

    Correct by construction, not by lookup: the engine (engine/runner.py) owns the view and hands
    a step the previous step's view only when no prefix has been written since the view was made
    and the step's prefix tables and lengths (host arrays of its plan) are the previous step's.
    Prefix K/V are written only when a prefix is prefilled, so the copies are then exactly what
    a gather would read. Keyed by (reads, layer): only CrossKV kinds are viewed (`attend`), one
    per (reads, layer). Its size is cache/specs.py `prefix_view_bytes`, which the engine's
    memory sizing reserves. A backend that reads the cache in place never fills a view."""

    def __init__(self) -> None:
        self._kv: dict[tuple[Reads, int], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for kv in self._kv.values() for t in kv)

    def read(self, key: tuple[Reads, int], gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        if key not in self._kv:
            self._kv[key] = gather()
        return self._kv[key]


@dataclass
class TaskGroup:
    q_rows: torch.Tensor  # [B, Tq] long: rows of the flat token batch; padding -> row N (scratch)
    q_own: torch.Tensor  # [B, Tq] long: own index of each query; padding -> PAD
    table: torch.Tensor  # [B, n_own_blocks] long: own blocks; padding -> 0 (null block)
    own_len: torch.Tensor  # [B] long: own tokens in the cache after this step's writes
    prefix: SharedPrefix


@dataclass
class AttentionBatch:
    write_slots: torch.Tensor  # [N] long: cache slot of each token's k/v; padding -> null slot
    groups: list[PrefixGroup | TaskGroup]
    block_size: int
    n_prefix: int = 0  # flat rows [0, n_prefix) are prefix tokens (host int)
    states: StateSpans | None = None  # where each sequence's tokens sit, for recurrent layers


def slot_of(table: torch.Tensor, index: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of the token at `index` in a sequence of blocks `table`: table [..., nb] with
    index [...] (one per row) or [..., T]."""
    if index.dim() == table.dim() - 1:
        block = table.gather(-1, (index // block_size)[..., None])[..., 0]
    else:
        block = table.gather(-1, index // block_size)
    return block * block_size + index % block_size


def write_kv(k_NHD: torch.Tensor, v_NHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             batch: AttentionBatch, reads: Reads) -> None:
    """The writes of one attention call (see `Reads`)."""
    slots = batch.write_slots
    if reads is Reads.OWN:
        slots, k_NHD, v_NHD = slots[batch.n_prefix:], k_NHD[batch.n_prefix:], v_NHD[batch.n_prefix:]
    elif reads is Reads.PREFIX:
        slots = slots[: batch.n_prefix]
    k_cache.index_copy_(0, slots, k_NHD.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v_NHD.to(v_cache.dtype))

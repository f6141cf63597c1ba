"""StepPlan: the only contract between the scheduler (host bookkeeping) and the runner (device),
and Emissions, the runner's answer to one.

Host arrays only; the runner turns them into one forward. Emissions come back in the order
`new_rows` then `decode_rows`. Block tables of sequences list only their own blocks: a prefix
is attended once per prefix (attention/layout.py, TaskGroup). Prefix tables are padded with the
null block to the widest prefix of the step; `*_lens` say how many slots are real.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sequence import Sequence

PREFILL_TOKENS_PER_STEP = 4096  # image-prefix tokens prefilled per step (at least one image): CPU and unknown GPUs (prefill.py)


@dataclass
class StepPlan:
    step: int
    # Prefixes prefilled in this step: their image's feature slot (prefixes of one image share
    # it), lengths, blocks, prefix prompts and recurrent-state snapshot slot (-1: none).
    prefix_features: np.ndarray  # [I] int64
    prefix_lens: np.ndarray  # [I] int64
    prefix_tables: np.ndarray  # [I, n_prefix_blocks] int64
    prefix_tokens: np.ndarray  # [sum of prefix prompt lengths] int64
    prefix_prompt_lens: np.ndarray  # [I] int64
    prefix_snapshot: np.ndarray  # [I] int64
    # Sequences admitted in this step: device-state rows, initial state, prompt and own blocks.
    new_rows: np.ndarray  # [S] int64
    new_int: np.ndarray  # [S, 3] int64: mode, limit, seed
    new_float: np.ndarray  # [S, 2] float32: temperature, top_p
    prompt_tokens: np.ndarray  # [sum of prompt lengths] int64
    prompt_lens: np.ndarray  # [S] int64
    prompt_pos0: np.ndarray  # [S] int64: rotary position of each prompt's first token
    prompt_tables: np.ndarray  # [S, n_own_blocks] int64
    prompt_fork: np.ndarray  # [S] int64: snapshot slot each prompt's recurrent state forks from (-1: none)
    prompt_image: np.ndarray  # [S] int64: index into prompt_image_tables (its prefix)
    prompt_image_tables: np.ndarray  # [I_p, n_prefix_blocks] int64: prefixes the prompts attend to
    prompt_image_lens: np.ndarray  # [I_p] int64
    # Running sequences decoding one token each; their inputs are already on the device.
    decode_rows: np.ndarray  # [D] int64
    decode_own: np.ndarray  # [D] int64: own index of the token being fed
    decode_pos: np.ndarray  # [D] int64: its rotary position
    decode_tables: np.ndarray  # [D, n_own_blocks] int64
    decode_image: np.ndarray  # [D] int64: index into decode_image_tables (its prefix)
    decode_image_tables: np.ndarray  # [I_d, n_prefix_blocks] int64
    decode_image_lens: np.ndarray  # [I_d] int64
    # Which output heads each emitting row needs (bit b: head b; SeqSpec.heads), known from its grammar phase:
    # the host can predict it because a sequence that leaves the cycle has finished.
    needs: np.ndarray  # [S + D] int64
    # Host bookkeeping (the runner ignores it): who each emission belongs to.
    seqs: list[Sequence] = field(default_factory=list)
    # Token masks (models/base/grammar.py) the runner writes into its row-indexed mask table before
    # the step's forward: each constrained emitting row's mask, computed on the host from every
    # token the row has emitted (scheduler.py), and all-allowed for a free row that a constrained
    # sequence held before. Rows not listed keep their table entry (all-allowed or unused).
    mask_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # [M] int64
    masks: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))  # [M, W] int32

    @property
    def is_decode_only(self) -> bool:
        """Only these steps may replay a captured CUDA graph (fixed shapes)."""
        return len(self.new_rows) == 0 and len(self.prefix_features) == 0

    @property
    def n_out(self) -> int:
        return len(self.new_rows) + len(self.decode_rows)


@dataclass
class Emissions:
    """One step's output per emitting row (StepPlan.n_out of them), on the host."""

    code: np.ndarray
    token: np.ndarray
    finished: np.ndarray
    value: np.ndarray  # [n, 2]

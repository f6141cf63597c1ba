"""The largest step the engine can plan, as a real StepPlan: what KV sizing warms up on.

The scheduler prefills at most the engine's prefill budget of prefix tokens (sizing.py, prefill.py;
at least one image) per step, starts every sequence of those images, and decodes every other row. So the worst step
is: as many maximal prefixes as the budget allows, their prompts (the longest prompt for every
sequence), and the remaining rows decoding at their longest own length, spread over as many
images as they can be (each image's prefix is read once per step), with every output head.
Every block table points at block 1 of a two-block scratch cache: attention's shapes (and so
its memory) follow the tables' widths and lengths, not which blocks they name.
"""

from __future__ import annotations

import numpy as np

from ..models.base.decoding import MODE_SCORE, MODE_TEXT, N_HEADS
from .plan import PREFILL_TOKENS_PER_STEP, StepPlan


def largest_step(n_rows: int, seqs_per_image: int, max_prefix_len: int, max_prompt: int, max_own_len: int,
                 block_size: int, prefill_tokens: int = PREFILL_TOKENS_PER_STEP, prefix_prompt: int = 0,
                 recurrent: bool = False, scores: bool = False) -> StepPlan:
    """max_own_len: the most own tokens (prompt + budget) a sequence of the job can hold;
    prefix_prompt: the longest prefix prompt (part of max_prefix_len); recurrent: every prefix
    writes (and every prompt forks from) snapshot slot 0; scores: every prompt row is scored
    (MODE_SCORE sequences: the most logits a step of classify choices computes; the sequences of
    an image begin with different tokens, so no two scored rows share a context and none is
    computed once for several: engine/inputs.py score_contexts; the first sequence is plain text,
    so the step also runs the token decision over every row, which a step of choices alone skips)."""
    P, bs = max_prefix_len, block_size
    nbp = -(-P // bs)
    I = max(1, prefill_tokens // P)
    S = min(n_rows, I * seqs_per_image)
    I = -(-S // seqs_per_image)
    D = n_rows - S
    I_d = -(-D // seqs_per_image) if D else 0
    own = max_own_len - 1  # own index of the last token a decode row can feed
    max_own_blocks = -(-max_own_len // bs)
    ones = lambda *shape: np.ones(shape, dtype=np.int64)  # noqa: E731
    new_int = np.tile(np.array([[MODE_SCORE, max_prompt, 0] if scores else [MODE_TEXT, 1, 0]], dtype=np.int64), (S, 1))
    new_int[0] = [MODE_TEXT, 1, 0]
    return StepPlan(
        step=0,
        prefix_features=np.arange(I, dtype=np.int64), prefix_lens=np.full(I, P, dtype=np.int64),
        prefix_tables=ones(I, nbp), prefix_tokens=np.zeros(I * prefix_prompt, dtype=np.int64),
        prefix_prompt_lens=np.full(I, prefix_prompt, dtype=np.int64),
        prefix_snapshot=np.full(I, 0 if recurrent else -1, dtype=np.int64),
        prompt_fork=np.full(S, 0 if recurrent else -1, dtype=np.int64),
        new_rows=np.arange(S, dtype=np.int64),
        new_int=new_int,
        new_float=np.tile(np.array([[0.0, 1.0]], dtype=np.float32), (S, 1)),
        prompt_tokens=np.repeat(np.arange(S, dtype=np.int64) % seqs_per_image if scores else np.zeros(S, np.int64),
                                max_prompt), prompt_lens=np.full(S, max_prompt, dtype=np.int64),
        prompt_pos0=np.full(S, P, dtype=np.int64), prompt_tables=ones(S, -(-max_prompt // bs)),
        prompt_image=np.arange(S, dtype=np.int64) // seqs_per_image,
        prompt_image_tables=ones(I, nbp), prompt_image_lens=np.full(I, P, dtype=np.int64),
        decode_rows=np.arange(S, n_rows, dtype=np.int64), decode_own=np.full(D, own, dtype=np.int64),
        decode_pos=np.full(D, P + own, dtype=np.int64), decode_tables=ones(D, max_own_blocks),
        decode_image=np.arange(D, dtype=np.int64) // seqs_per_image,
        decode_image_tables=ones(I_d, nbp), decode_image_lens=np.full(I_d, P, dtype=np.int64),
        needs=np.full(n_rows, (1 << N_HEADS) - 1, dtype=np.int64),
    )

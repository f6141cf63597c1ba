"""Splitting a StepPlan in two, in order: how a step that ran out of memory is still run whole,
and how an admission step runs its decode rows by a CUDA graph (`admission_parts`).

A plan's work is a sequence of units: its image prefixes, then its new sequences (prompts),
then its decode rows. Running the two halves of that sequence one after the other computes the
same thing as the whole plan: every prompt comes after every prefix it attends to (in an
earlier part, whose K/V are already in the cache, or in the same part), and emissions come out
in the plan's order (new rows, then decode rows) when the parts' emissions are concatenated.
Image tables (prompt_image_tables, decode_image_tables) are kept whole; a part just does not
query the images it has no rows of.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .plan import StepPlan


def units(plan: StepPlan) -> int:
    return len(plan.prefix_features) + len(plan.new_rows) + len(plan.decode_rows)


def split_plan(plan: StepPlan) -> tuple[StepPlan, StepPlan]:
    """-> (first half, second half) of the plan's units. Needs at least two units."""
    I, S, D = len(plan.prefix_features), len(plan.new_rows), len(plan.decode_rows)
    mid = (I + S + D) // 2
    if mid == 0:
        raise ValueError("a plan of one unit cannot be split")

    def cut(lo: int, hi: int, n: int) -> slice:  # the part of [lo, hi) that falls in a block of n units
        return slice(min(max(lo, 0), n), min(max(hi, 0), n))

    return (_part(plan, cut(0, mid, I), cut(-I, mid - I, S), cut(-I - S, mid - I - S, D)),
            _part(plan, cut(mid, I + S + D, I), cut(mid - I, S + D, S), cut(mid - I - S, D, D)))


def admission_parts(plan: StepPlan) -> tuple[StepPlan, StepPlan]:
    """-> (its prefixes and new sequences, its decode rows): an admission step's two forwards
    (runner.py `_split`), the same units in the same order as `split_plan`'s halves."""
    I, S, D = len(plan.prefix_features), len(plan.new_rows), len(plan.decode_rows)
    return _part(plan, slice(0, I), slice(0, S), slice(0, 0)), _part(plan, slice(0, 0), slice(0, 0), slice(0, D))


def _part(plan: StepPlan, im: slice, new: slice, dec: slice) -> StepPlan:
    starts = np.concatenate([[0], np.cumsum(plan.prompt_lens)])
    pre_starts = np.concatenate([[0], np.cumsum(plan.prefix_prompt_lens)])
    S = len(plan.new_rows)
    return replace(
        plan,
        prefix_features=plan.prefix_features[im], prefix_lens=plan.prefix_lens[im], prefix_tables=plan.prefix_tables[im],
        prefix_tokens=plan.prefix_tokens[pre_starts[im.start]:pre_starts[im.stop]],
        prefix_prompt_lens=plan.prefix_prompt_lens[im], prefix_snapshot=plan.prefix_snapshot[im],
        prompt_fork=plan.prompt_fork[new],
        new_rows=plan.new_rows[new], new_int=plan.new_int[new], new_float=plan.new_float[new],
        prompt_tokens=plan.prompt_tokens[starts[new.start]:starts[new.stop]], prompt_lens=plan.prompt_lens[new],
        prompt_pos0=plan.prompt_pos0[new], prompt_tables=plan.prompt_tables[new], prompt_image=plan.prompt_image[new],
        decode_rows=plan.decode_rows[dec], decode_own=plan.decode_own[dec], decode_pos=plan.decode_pos[dec],
        decode_tables=plan.decode_tables[dec], decode_image=plan.decode_image[dec],
        needs=np.concatenate([plan.needs[:S][new], plan.needs[S:][dec]]),
        seqs=plan.seqs[:S][new] + plan.seqs[S:][dec],
    )

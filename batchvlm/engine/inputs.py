"""StepInputs: one step's device inputs as named fields, written once by the host from a StepPlan
straight into the step's pinned staging slot and uploaded in one copy per dtype (staging.py
`Staging.write` / `upload`). The eager path reads all of them; the CUDA-graph path reads
`DecodeInputs` only, padded to the captured bucket and written into the slot's fixed views
(`pad_decode`, `Staging.views` / `send`). Fields are numpy arrays (views of the slot) on the
host and device tensors (same shapes) after the upload.

Flat token layout of one step: [prefixes (ragged) | prompts (ragged) | decode tokens]; a query
row that pads a group points at flat row N (a zero scratch row the backends append).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..cache.spans import ZERO
from ..attention import PAD
from ..models.base.decoding import MODE_SCORE, N_HEADS, SCORE_END
from .plan import StepPlan
from .staging import SlotWriter, image_ranks, rows_by_image

Array = np.ndarray  # on the host; torch.Tensor of the same shape on the device after upload


@dataclass
class DecodeInputs:
    rows: Array  # [D] device-state rows; padding -> the scratch row
    own: Array  # [D] own index of the token each row feeds
    pos: Array  # [D] its rotary position
    tables: Array  # [D, n_own_blocks] own blocks; padding -> 0 (null block)
    image_tables: Array  # [I_d, n_prefix_blocks] blocks of each prefix decoded against
    image_lens: Array  # [I_d]
    by_image: Array  # [I_d, M] flat rows of each prefix's queries; padding -> the scratch flat row
    slot: Array  # [D, 1] where each query sits in [I_d * M]


@dataclass
class StepInputs:
    # Prefixes prefilled: token j of prefix i at flat row pre_start[i] + j.
    prefix_tokens: Array  # [sum of prefix prompt lengths] prefix prompt ids
    prefix_lens: Array  # [I]
    prefix_bidir: Array  # [I] leading keys every prefix query sees (the image part before a prefix prompt)
    prefix_tables: Array  # [I, n_prefix_blocks]
    q_pre: Array  # [I, L] flat rows of each prefix's tokens
    pre_img: Array  # [n_pre] prefix of each prefix token
    pre_j: Array  # [n_pre] its index in the prefix
    # Sequences admitted: own prompt token j of sequence s at flat row n_pre + prompt_start[s] + j.
    new_rows: Array  # [S]
    new_int: Array  # [S, 3] mode, limit, seed
    new_float: Array  # [S, 2] temperature, top_p
    prompt_tokens: Array  # [n_prompt]
    prompt_lens: Array  # [S]
    prompt_tables: Array  # [S, n_own_blocks]
    prompt_image_tables: Array  # [I_p, n_prefix_blocks]
    prompt_image_lens: Array  # [I_p]
    q_prompt: Array  # [S, T] flat rows of each prompt's tokens
    own_prompt: Array  # [S, T] their own indices; padding -> PAD
    prompt_by_image: Array  # [I_p, M] flat rows of each prefix's prompt queries
    prompt_slot: Array  # [S, T] where each prompt query sits in [I_p * M]
    flat_seq: Array  # [n_prompt] sequence of each prompt token
    flat_own: Array  # [n_prompt] its own index
    flat_pos: Array  # [n_prompt] its rotary position
    decode: DecodeInputs
    last: Array  # [S + D] flat row of each emitting row's last token
    # Prompt rows that MODE_SCORE sequences score (their last `limit` rows). Logits are computed
    # once per distinct context among them and for no other row (models/base/decoding.py choice_scores):
    # the choices of one classify repeat the prompt's last token, and choices that begin alike
    # repeat their shared tokens, at the same positions after the same prefix (score_contexts).
    score_rows: Array  # [U] flat rows, one per distinct context
    score_pick: Array  # [n_scored] index into score_rows of each scored row's context
    score_target: Array  # [n_scored] the token each predicts: the next prompt token, SCORE_END at a prompt's last
    score_seq: Array  # [n_scored] emitting row (new sequence) of each
    heads: tuple[Array, ...]  # N_HEADS x [rows needing head b], indices into the emitting rows
    # Recurrent layers (cache/spans.py): per span (prefixes, then prompts).
    span_read: Array  # [K]
    span_write: Array  # [K]
    cu_seqlens: Array  # [K + 1]


@dataclass
class StepLayout:
    """Host facts of a step that the forward needs besides its uploaded inputs."""

    n_pre: int
    n_prompt: int
    n_scored: int
    span_start: list[int]
    span_len: list[int]
    span_read: list[int]
    span_write: list[int]


def decode_inputs(plan: StepPlan, first_row: int, pad_row: int, w: SlotWriter) -> DecodeInputs:
    """The decode rows' inputs, unpadded: queries at flat rows first_row ..."""
    put = w.put
    q = (first_row + np.arange(len(plan.decode_rows), dtype=np.int64))[:, None]
    by_image, slot = rows_by_image(plan.decode_image, q, len(plan.decode_image_tables), pad_row, w)
    return DecodeInputs(put(plan.decode_rows), put(plan.decode_own), put(plan.decode_pos), put(plan.decode_tables),
                        put(plan.decode_image_tables), put(plan.decode_image_lens), by_image, slot)


def decode_shapes(n_rows: int, n_images: int, per_image: int, own_blocks: int, prefix_blocks: int
                  ) -> list[tuple[int, ...]]:
    """The shape of each DecodeInputs field (in field order) in a CUDA graph's fixed shapes (graphs.py)."""
    return [(n_rows,), (n_rows,), (n_rows,), (n_rows, own_blocks), (n_images, prefix_blocks), (n_images,),
            (n_images, per_image), (n_rows, 1)]


def pad_decode(plan: StepPlan | None, d: DecodeInputs, scratch_row: int) -> None:
    """Write a plan's decode inputs into `d`, host arrays in a CUDA graph's fixed shapes
    (`decode_shapes`; plan None: all padding): n_rows queries at flat rows 0..n_rows-1, padding
    rows on the scratch state row and the null block, padding images with a one-slot prefix in
    the null block and no queries (their `by_image` entries point at flat row n_rows)."""
    n_rows, (n_images, per_image) = len(d.rows), d.by_image.shape
    D = 0 if plan is None else len(plan.decode_rows)
    I = 0 if plan is None else len(plan.decode_image_tables)
    d.rows[D:], d.own[D:], d.pos[D:], d.image_lens[I:] = scratch_row, 0, 0, 1
    d.tables.fill(0)
    d.image_tables.fill(0)
    d.by_image.fill(n_rows)
    d.slot.fill(n_images * per_image)
    if plan is None:
        return
    d.rows[:D], d.own[:D], d.pos[:D], d.image_lens[:I] = (plan.decode_rows, plan.decode_own, plan.decode_pos,
                                                          plan.decode_image_lens)
    d.tables[:D, : plan.decode_tables.shape[1]] = plan.decode_tables
    d.image_tables[:I, : plan.decode_image_tables.shape[1]] = plan.decode_image_tables
    rank, _ = image_ranks(plan.decode_image, I)
    d.by_image[plan.decode_image, rank] = np.arange(D)
    d.slot[:, 0][:D] = plan.decode_image * per_image + rank


def score_contexts(plan: StepPlan, flat_seq: Array, flat_own: Array, scored: Array) -> tuple[Array, Array]:
    """-> (the scored rows that are first of their context, each scored row's index among those).

    A row's hidden state is a function of its context alone: its prefix (attended keys and, for
    recurrent layers, the snapshot it forks from), its first position and its own tokens up to and
    including it. Rows agreeing on all of these have the same logits: one computes them. Contexts
    are the nodes of a trie over the scoring sequences' own tokens, numbered level by level (a node
    is its parent and its token), so equal contexts get equal numbers without hashing."""
    if not len(scored):
        return scored, scored
    seqs = np.unique(flat_seq[scored])  # the scoring sequences
    lens = plan.prompt_lens[seqs]
    starts = (np.cumsum(plan.prompt_lens) - plan.prompt_lens)[seqs]
    where = np.full(len(plan.prompt_lens), -1, dtype=np.int64)
    where[seqs] = np.arange(len(seqs))
    root = np.stack([plan.prompt_image[seqs], plan.prompt_fork[seqs], plan.prompt_pos0[seqs]], 1)
    parent = np.unique(root, axis=0, return_inverse=True)[1].reshape(-1)
    node = np.full((len(seqs), int(lens.max())), -1, dtype=np.int64)  # [scoring seqs, own index]
    numbered = 0
    for j in range(node.shape[1]):
        live = np.flatnonzero(lens > j)
        tokens = plan.prompt_tokens[starts[live] + j]
        pairs = parent[live] * (int(tokens.max()) + 1) + tokens  # (parent, token) as one integer
        level = np.unique(pairs, return_inverse=True)[1].reshape(-1)
        node[live, j] = numbered + level
        parent = np.zeros(len(seqs), dtype=np.int64)
        parent[live] = level
        numbered += int(level.max()) + 1
    context = node[where[flat_seq[scored]], flat_own[scored]]
    _, first, pick = np.unique(context, return_index=True, return_inverse=True)
    return scored[first], pick.reshape(-1).astype(np.int64)


def step_inputs(plan: StepPlan, recurrent: bool, snapshot_index, w: SlotWriter) -> tuple[StepInputs, StepLayout]:
    """The step's inputs, every array written in place in the slot writer's buffers."""
    put = w.put
    I, S, D = len(plan.prefix_features), len(plan.new_rows), len(plan.decode_rows)
    n_pre, n_prompt = int(plan.prefix_lens.sum()), int(plan.prompt_lens.sum())
    L = int(plan.prefix_lens.max()) if I else 0
    T = int(plan.prompt_lens.max()) if S else 0
    N = n_pre + n_prompt + D
    pre_start = np.cumsum(plan.prefix_lens) - plan.prefix_lens
    pre_img = put(np.repeat(np.arange(I), plan.prefix_lens))
    pre_j = w.empty(n_pre)
    np.subtract(np.arange(n_pre), pre_start[pre_img], out=pre_j)
    q_pre = w.full((I, L), N)
    q_pre[pre_img, pre_j] = np.arange(n_pre)
    prefix_bidir = w.empty(I)
    np.subtract(plan.prefix_lens, plan.prefix_prompt_lens, out=prefix_bidir)
    prompt_start = np.cumsum(plan.prompt_lens) - plan.prompt_lens
    flat_seq = put(np.repeat(np.arange(S), plan.prompt_lens))
    flat_own = w.empty(n_prompt)
    np.subtract(np.arange(n_prompt), prompt_start[flat_seq], out=flat_own)
    flat_pos = w.empty(n_prompt)
    np.add(plan.prompt_pos0[flat_seq], flat_own, out=flat_pos)
    q_prompt = w.full((S, T), N)
    q_prompt[flat_seq, flat_own] = n_pre + np.arange(n_prompt)
    own_prompt = w.full((S, T), PAD)
    own_prompt[flat_seq, flat_own] = flat_own
    prompt_by_image, prompt_slot = rows_by_image(plan.prompt_image, q_prompt, len(plan.prompt_image_tables), N, w)
    decode = decode_inputs(plan, n_pre + n_prompt, N, w)
    last = w.empty(S + D)
    last[:S] = q_prompt[np.arange(S), plan.prompt_lens - 1]
    last[S:] = n_pre + n_prompt + np.arange(D)
    seq_len, seq_limit = plan.prompt_lens[flat_seq], plan.new_int[flat_seq, 1]
    scored = np.flatnonzero((plan.new_int[flat_seq, 0] == MODE_SCORE) & (flat_own >= seq_len - seq_limit))
    following = plan.prompt_tokens[np.minimum(scored + 1, max(n_prompt - 1, 0))]
    score_target = np.where(flat_own[scored] == seq_len[scored] - 1, SCORE_END, following)
    score_rows, score_pick = score_contexts(plan, flat_seq, flat_own, scored)
    layout = StepLayout(n_pre, n_prompt, len(scored), [], [], [], [])
    if recurrent:  # prefixes from a zero state into their snapshots, prompts from those into their rows
        layout.span_start = pre_start.tolist() + (n_pre + prompt_start).tolist()
        layout.span_len = plan.prefix_lens.tolist() + plan.prompt_lens.tolist()
        layout.span_read = [ZERO] * I + [snapshot_index(f) for f in plan.prompt_fork.tolist()]
        layout.span_write = [snapshot_index(s) for s in plan.prefix_snapshot.tolist()] + plan.new_rows.tolist()
    cu_seqlens = w.empty(len(layout.span_len) + 1)
    cu_seqlens[0] = 0
    np.cumsum(layout.span_len, out=cu_seqlens[1:])
    inputs = StepInputs(
        put(plan.prefix_tokens), put(plan.prefix_lens), prefix_bidir, put(plan.prefix_tables), q_pre, pre_img, pre_j,
        put(plan.new_rows), put(plan.new_int), put(plan.new_float), put(plan.prompt_tokens), put(plan.prompt_lens),
        put(plan.prompt_tables), put(plan.prompt_image_tables), put(plan.prompt_image_lens), q_prompt, own_prompt,
        prompt_by_image, prompt_slot, flat_seq, flat_own, flat_pos, decode, last,
        put(n_pre + score_rows), put(score_pick), put(score_target), put(flat_seq[scored]),
        tuple(put(np.flatnonzero(plan.needs & (1 << b))) for b in range(N_HEADS)),
        put(np.asarray(layout.span_read, dtype=np.int64)), put(np.asarray(layout.span_write, dtype=np.int64)),
        cu_seqlens)
    return inputs, layout

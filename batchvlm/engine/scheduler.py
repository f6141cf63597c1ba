"""The scheduler: admits work by KV capacity and free rows, plans each step, commits results.

It never touches tensors: it turns host bookkeeping into a StepPlan and a step's Emissions back
into bookkeeping.

Admission is per image, then per sequence. An image is admitted when the blocks of its prefixes
(by their own lengths, which may differ from image to image), their snapshot slots (models
with recurrent state) and at least one sequence fit; its prefixes are prefilled once, in that
step. Its sequences start as rows
and blocks allow (waiting sequences of admitted images go before new images, oldest first),
each reserving its prompt + budget at once, so a running sequence never waits for memory and
nothing is preempted. Capacity is whatever the block manager has left.

Two knobs bound a step's rows beyond the free rows:
  admit_rows  admission waits until this many rows are free (unless nothing decodes). A step
              that admits runs eagerly; with CUDA graphs, admitting in batches keeps most
              steps decode-only, so most steps replay a graph.
  row_cap     at most this many sequences per step (the engine halves it after running out of
              memory). Running sequences beyond it wait, oldest first served, and keep their
              rows and blocks.

Constrained sequences (SeqSpec.grammar: json, constrained detect / point) get a token mask per
step, computed here on the host from every token the sequence has emitted, and uploaded with the
step. Their tokens stay on the device like everyone's, but their masks cannot: so a constrained
sequence is planned only when none of its steps is in flight (`inflight == 0`: its last token has
been committed and fed to its grammar). In the synchronous engine that is every step. In the
pipelined engine, where step t+1 is launched before step t is committed, it is every other step:
its mask for step t+2 is computed after step t's commit, while the device runs step t+1, so no
launch ever waits for a mask (one step behind, as kestrel's masks, but off the device's path).
To keep the device busy while half of them wait, at most half of the constrained sequences
(rounded up) decode in one pipelined step, oldest first: they settle into two cohorts that take
turns. Labels do not change: a sequence's tokens depend on its own tokens only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..cache.blocks import BlockManager, SnapshotSlots
from ..models.base.decoding import MODE_SCORE, RawOutput, SeqSpec, emit_text
from .emit_buffer import EmitBuffer
from .plan import PREFILL_TOKENS_PER_STEP, Emissions, StepPlan
from .rows import PrefixTable, RowTable
from .sequence import Prefix, Request, SeqState, Sequence


Emit = Callable[[RawOutput, SeqSpec, int, int, float, float], None]
FillMasks = Callable[[list[Any], np.ndarray], None]  # (grammar states, out [M, W] int32)


def _lens(prefixes: list[Prefix]) -> np.ndarray:
    return np.array([p.length for p in prefixes], dtype=np.int64)


def _ints(values) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _first_use(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys in first-use order, and each key's index into them."""
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return uniq[order], rank[inverse.reshape(-1)]


def _by_prefix(seqs: list[Sequence]) -> tuple[list[Prefix], np.ndarray]:
    """The sequences' prefixes, each once (first use first), and each sequence's index into them."""
    index: dict[Prefix, int] = {}  # a Prefix hashes by identity (eq=False)
    at = [index.setdefault(s.prefix, len(index)) for s in seqs]
    return list(index), _ints(at)


class Scheduler:
    def __init__(self, blocks: BlockManager, n_rows: int, n_feature_slots: int, admit_rows: int = 1,
                 snapshots: SnapshotSlots | None = None, emit: Emit = emit_text,
                 fill_masks: FillMasks | None = None, mask_words: int = 0, pipelined: bool = False,
                 prefill_tokens: int = PREFILL_TOKENS_PER_STEP):
        self.blocks = blocks
        self.prefill_tokens = prefill_tokens  # prefix tokens admitted per step (at least one image)
        self.emit = emit  # the family's host half of its grammar
        self.fill_masks, self.mask_words = fill_masks, mask_words  # constrained sequences' masks
        self.pipelined = pipelined  # constrained sequences take turns (module docstring)
        self._masked_rows: set[int] = set()  # rows whose mask-table entry is not all-allowed
        self.snapshots = snapshots  # None: the model keeps no recurrent state
        self.admit_rows = admit_rows
        self.row_cap = n_rows
        self._rows_left = n_rows  # rows this step may still start (set per schedule())
        self.free_rows = list(range(n_rows - 1, -1, -1))
        self.rows = RowTable(n_rows)  # running sequences' decode state by row (rows.py)
        self.pending = EmitBuffer(n_rows)  # unconstrained rows' emissions until they finish
        self._seq_at = np.empty(n_rows, dtype=object)  # row -> its sequence
        # Admitted prefixes' blocks by slot (RowTable.prefix), until their image is done (no later
        # step plans a sequence on it then)
        self.prefixes = PrefixTable()
        self._slot: dict[Prefix, int] = {}
        self._row_blocks = np.zeros((n_rows, 0), dtype=np.int64)  # [row, j]: own block j of the row's sequence
        self.free_feature_slots = list(range(n_feature_slots - 1, -1, -1))
        self.encoded: deque[Request] = deque()  # features ready, prefix not yet admitted
        self.admitted: deque[Request] = deque()  # prefix admitted, some sequences still waiting
        self.running: list[Sequence] = []  # started, not yet retired
        self.feature_of: dict[int, int] = {}  # id(request) -> feature slot, until its prefill is committed
        self._forked: list[Request] = []  # admitted earlier, every sequence started in this step
        self.step = 0

    # ------------------------------------------------------------------ images in

    # Feature slots: where an encoded image's features wait for its prefill. The scheduler is
    # their one owner: a slot is taken before its image is encoded and free again once the step
    # that prefills it is committed; the runner's vision stage holds the tensors (vision.py) and
    # learns which slots a step prefills from its plan (StepPlan.prefix_features).

    @property
    def has_feature_slot(self) -> bool:
        return bool(self.free_feature_slots)

    def take_feature_slot(self) -> int | None:
        return self.free_feature_slots.pop() if self.free_feature_slots else None

    def add_encoded(self, request: Request, slot: int) -> None:
        self.feature_of[id(request)] = slot
        self.encoded.append(request)

    def shrink(self, rows: int) -> int:
        """After a step ran out of memory: at most `rows` sequences per step from now. -> the cap."""
        self.row_cap = max(1, min(self.row_cap, rows))
        self.admit_rows = min(self.admit_rows, max(1, self.row_cap // 8))
        return self.row_cap

    def _seq_blocks(self, s: Sequence) -> int:
        return self.blocks.blocks_for(len(s.spec.prompt) + s.spec.budget)

    def _fits(self, s: Sequence, extra_blocks: int = 0) -> bool:
        return (bool(self.free_rows) and self._rows_left > 0
                and self.blocks.free >= self._seq_blocks(s) + extra_blocks)

    def _request_fits(self, request: Request) -> bool:
        if self.snapshots is not None and self.snapshots.free < len(request.prefixes):
            return False
        return self._fits(request.seqs[0], sum(self.blocks.blocks_for(p.length) for p in request.prefixes))

    # ------------------------------------------------------------------ plan

    def schedule(self) -> StepPlan | None:
        # Every sequence started earlier decodes, unless its limit says it must be finished.
        rows = self.rows.decoding()
        decoding = self._seq_at[rows].tolist()
        if self.mask_words:
            turns = self._constrained_turns(decoding)
            if len(turns) < len(decoding):
                decoding, rows = turns, _ints([s.row for s in turns])
        decoding, rows = decoding[: self.row_cap], rows[: self.row_cap]
        self._rows_left = self.row_cap - len(decoding)
        new: list[Sequence] = []
        prefilled: list[Request] = []
        if not decoding or min(len(self.free_rows), self._rows_left) >= self.admit_rows:
            self._admit(new, prefilled)
            self._start_rows(new)
        if not new and not decoding:
            return None
        plan = self._plan(new, decoding, rows, prefilled)
        if self.mask_words:
            plan.mask_rows, plan.masks = self._masks(new, decoding)
        self.rows.own[plan.new_rows] = plan.prompt_lens
        self.rows.inflight[plan.new_rows] += 1
        for im in prefilled:  # their snapshots are freed after the last fork was planned (above)
            if im not in self.admitted:
                self._drop_snapshots(im)
        for im in self._forked:
            self._drop_snapshots(im)
        self._forked.clear()
        self.rows.own[rows] += 1
        self.rows.steps[rows] += 1
        self.rows.inflight[rows] += 1
        self.step += 1
        return plan

    def _plan(self, new: list[Sequence], decoding: list[Sequence], decode_rows: np.ndarray,
              prefilled: list[Request]) -> StepPlan:
        """The step's plan from what it prefills, starts and decodes (bookkeeping is the caller's).
        Decode rows are read from the row table: no pass over the decoding sequences."""
        prompt_prefixes, prompt_image = _by_prefix(new)
        r = self.rows
        decode_slots, decode_image = _first_use(r.prefix[decode_rows])
        pre = [(self.feature_of[id(im)], p) for im in prefilled for p in im.prefixes]
        new_rows, prompt_lens = _ints([s.row for s in new]), _ints([len(s.spec.prompt) for s in new])
        decode_own = r.own[decode_rows]
        return StepPlan(
            step=self.step,
            prefix_features=_ints([slot for slot, _ in pre]),
            prefix_lens=_lens([p for _, p in pre]),
            prefix_tables=self._prefix_tables([p for _, p in pre]),
            prefix_tokens=_ints([t for _, p in pre for t in p.prompt]),
            prefix_prompt_lens=_ints([len(p.prompt) for _, p in pre]),
            prefix_snapshot=_ints([p.snapshot for _, p in pre]),
            new_rows=new_rows,
            new_int=np.array([[s.spec.mode, s.spec.limit, s.seed] for s in new], dtype=np.int64).reshape(-1, 3),
            new_float=np.array([[s.spec.temperature, s.spec.top_p] for s in new], dtype=np.float32).reshape(-1, 2),
            prompt_tokens=np.array([t for s in new for t in s.spec.prompt], dtype=np.int64),
            prompt_lens=prompt_lens,
            prompt_pos0=np.array([s.prefix.next_pos for s in new], dtype=np.int64),
            prompt_tables=self._own_tables(new_rows, prompt_lens),
            prompt_fork=_ints([s.prefix.snapshot for s in new]),
            prompt_image=prompt_image,
            prompt_image_tables=self._prefix_tables(prompt_prefixes),
            prompt_image_lens=_lens(prompt_prefixes),
            decode_rows=decode_rows,
            decode_own=decode_own,
            decode_pos=r.pos0[decode_rows] + decode_own,
            decode_tables=self._own_tables(decode_rows, decode_own + 1),
            decode_image=decode_image,
            decode_image_tables=self.prefixes.tables(decode_slots),
            decode_image_lens=self.prefixes.lens[decode_slots],
            needs=np.concatenate([_ints([s.needs(0) for s in new]), r.needs(decode_rows, r.steps[decode_rows] + 1)]),
            seqs=new + decoding,
        )

    def _start_rows(self, new: list[Sequence]) -> None:
        """The row-indexed state of the sequences started in this step, in one write per field."""
        if not new:
            return
        rows = _ints([s.row for s in new])
        self.rows.start(rows, _ints([s.max_decode_steps for s in new]), _ints([s.prefix.next_pos for s in new]),
                        _ints([self._slot[s.prefix] for s in new]), [s.spec.heads for s in new],
                        np.array([s.spec.grammar is None for s in new], dtype=bool))
        self._seq_at[rows] = new
        self.pending.count[rows] = 0

    def _constrained_turns(self, decoding: list[Sequence]) -> list[Sequence]:
        """Constrained sequences whose last step is committed, at most half of them in a pipelined
        step (module docstring); free sequences all."""
        held = [s for s in decoding if s.spec.grammar is not None]
        if not held:
            return decoding
        turn = (len(held) + 1) // 2 if self.pipelined else len(held)
        ready = {id(s) for s in [s for s in held if s.inflight == 0][:turn]}
        return [s for s in decoding if s.spec.grammar is None or id(s) in ready]

    def _masks(self, new: list[Sequence], decoding: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
        """-> (rows, [rows, W] int32 masks) of this step: each constrained row's mask after all its
        tokens, then all-allowed for each new free row on a row whose table entry a constrained
        sequence wrote."""
        held = [s for s in new + decoding if s.spec.grammar is not None]
        freed = [s.row for s in new if s.spec.grammar is None and s.row in self._masked_rows]
        masks = np.empty((len(held) + len(freed), self.mask_words), dtype=np.int32)
        if held:
            for s in held:
                if s.output.grammar is None:
                    s.output.grammar = s.spec.grammar.answer()
            self.fill_masks([s.output.grammar for s in held], masks)
        masks[len(held):] = -1  # every bit: nothing masked
        self._masked_rows.difference_update(freed)
        self._masked_rows.update(s.row for s in held)
        return _ints([s.row for s in held] + freed), masks

    def _admit(self, new: list[Sequence], prefilled: list[Request]) -> None:
        while self.admitted and self._start_waiting(self.admitted[0], new):
            self._forked.append(self.admitted.popleft())
        budget = self.prefill_tokens
        while (not self.admitted and self.encoded
               and (not prefilled or budget >= sum(p.length for p in self.encoded[0].prefixes))
               and self._request_fits(self.encoded[0])):
            request = self.encoded.popleft()
            for p in request.prefixes:
                p.blocks = self.blocks.allocate(self.blocks.blocks_for(p.length))
                self._slot[p] = self.prefixes.add(p.blocks, p.length)
                if self.snapshots is not None:
                    p.snapshot = self.snapshots.take()
            request.unfinished = len(request.seqs)
            prefilled.append(request)
            budget -= sum(p.length for p in request.prefixes)
            if not self._start_waiting(request, new):
                self.admitted.append(request)

    def _start_waiting(self, request: Request, new: list[Sequence]) -> bool:
        """Start the image's waiting sequences while they fit. -> True when none is left waiting;
        the image then drops its own reference to its prefixes (its sequences hold the rest)."""
        for s in request.seqs:
            if s.state is not SeqState.WAITING:
                continue
            if not self._fits(s):
                return False
            s.blocks = self.blocks.allocate(self._seq_blocks(s))
            self.blocks.share(s.prefix.blocks)
            s.row = self.free_rows.pop()
            self._hold_row_blocks(s)
            s.table = self.rows  # its row's decode state is written once per step for all (_start_rows)
            self._rows_left -= 1
            s.state = SeqState.RUNNING
            self.running.append(s)
            new.append(s)
        for p in request.prefixes:
            self.blocks.release(p.blocks)
        return True

    def _hold_row_blocks(self, s: Sequence) -> None:
        """Copy a starting sequence's own blocks (all it will ever use: reserved at its start) into
        its row of `_row_blocks`. A row's columns past its sequence's blocks keep an earlier
        sequence's, never read: a table is only as wide as the blocks its tokens use."""
        n = len(s.blocks)
        if n > self._row_blocks.shape[1]:
            grown = np.zeros((self._row_blocks.shape[0], max(n, 2 * self._row_blocks.shape[1])), dtype=np.int64)
            grown[:, : self._row_blocks.shape[1]] = self._row_blocks
            self._row_blocks = grown
        self._row_blocks[s.row, :n] = s.blocks

    def _drop_snapshots(self, request: Request) -> None:
        for p in request.prefixes:
            if p.snapshot >= 0:
                self.snapshots.give(p.snapshot)
                p.snapshot = -1

    def _prefix_tables(self, prefixes: list[Prefix]) -> np.ndarray:
        """Blocks of each prefix, padded with the null block to the widest (PrefixTable)."""
        return self.prefixes.tables(_ints([self._slot[p] for p in prefixes]))

    def _own_tables(self, rows: np.ndarray, used: np.ndarray) -> np.ndarray:
        """Own blocks holding tokens after this step's writes (`used` tokens) of the sequences on
        `rows`, padded with the null block to the widest row: read from the row-indexed copy of
        their blocks (`_row_blocks`), no Python per row."""
        widths = -(-used // self.blocks.block_size)  # BlockManager.blocks_for
        table = self._row_blocks[rows, : int(widths.max()) if len(widths) else 0]  # a copy (fancy index)
        table[np.arange(table.shape[1]) >= widths[:, None]] = 0
        return table

    # ------------------------------------------------------------------ commit

    def commit(self, plan: StepPlan, em: Emissions) -> list[Request]:
        """Apply one step's emissions (oldest step first). -> images whose labels are complete."""
        done: list[Request] = []
        r = self.rows
        rows = np.concatenate([plan.new_rows, plan.decode_rows])
        r.inflight[rows] -= 1
        # A running unconstrained row's emission waits in the buffer (emit_buffer.py) until the
        # row finishes; a zombie's (already finished) is ignored. Python sees only the rows that
        # finish, constrained rows and zombies, with ints and floats made once per step (float32
        # -> float is exact).
        finished_all = np.asarray(em.finished, dtype=bool)
        live = r.live[rows]
        held = live & r.buffered[rows] & ~finished_all
        r.live[rows[live & finished_all]] = False
        self.pending.put(rows[held], em.code[held], em.token[held], em.value[held])
        at = np.flatnonzero(~held)
        values = zip(at.tolist(), em.code[at].tolist(), em.token[at].tolist(), em.value[at].tolist(),
                     finished_all[at].tolist(), r.inflight[rows[at]].tolist())
        for i, code, token, (v0, v1), finished, inflight in values:
            s = plan.seqs[i]
            if s.state is SeqState.RUNNING:
                if finished:  # what it held first (a classify choice, finished at once, holds nothing)
                    self.pending.flush(s.row, s.output, s.spec, self.emit)
                self.emit(s.output, s.spec, code, token, v0, v1)
                if finished:
                    s.state = SeqState.FINISHED
                    s.output.prompt_tokens = s.prefix.length + len(s.spec.prompt)
                    # one decided position per committed step: the prompt's, then each decode step
                    # but those still in flight (zombies); a scored choice generates nothing
                    s.output.generated_tokens = 0 if s.spec.mode == MODE_SCORE else s.decode_steps - inflight + 1
                    # or the family's emit saw a cut the count cannot show (a forced end token)
                    s.output.cut = s.output.cut or s.output.hit_limit(s.spec)
                    s.request.unfinished -= 1
                    if s.request.unfinished == 0:
                        done.append(s.request)
                        for p in s.request.prefixes:
                            self.prefixes.drop(self._slot.pop(p))
            if s.state is SeqState.FINISHED and inflight == 0:
                self._retire(s)
        for slot in dict.fromkeys(plan.prefix_features.tolist()):  # an image's prefixes share its slot
            self.free_feature_slots.append(int(slot))
        return done

    def _retire(self, s: Sequence) -> None:
        s.state = SeqState.RETIRED
        s.leave_row()
        self._seq_at[s.row] = None
        self.blocks.release(s.blocks + s.prefix.blocks)
        self.free_rows.append(s.row)
        self.running.remove(s)

    @property
    def idle(self) -> bool:
        return not self.running and not self.encoded and not self.admitted

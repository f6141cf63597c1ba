"""The scheduler: admits work by KV capacity and free rows, plans each step, commits results.

It never touches tensors: it turns host bookkeeping into a StepPlan and a step's Emissions back
into bookkeeping.

Admission is per image, then per sequence. An image is admitted when its prefix blocks (by
its own prefix length, which may differ from image to image) and at least one sequence fit; its prefix is prefilled once, in that step. Its sequences start as rows
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
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .kv_cache import BlockManager
from .plan import PREFILL_TOKENS_PER_STEP, StepPlan
from .staging import Emissions
from .sequence import Image, SeqState, Sequence


def _lens(images: list[Image]) -> np.ndarray:
    return np.array([im.prefix_len for im in images], dtype=np.int64)


class Scheduler:
    def __init__(self, blocks: BlockManager, n_rows: int, n_image_slots: int, admit_rows: int = 1):
        self.blocks = blocks
        self.admit_rows = admit_rows
        self.row_cap = n_rows
        self._rows_left = n_rows  # rows this step may still start (set per schedule())
        self.free_rows = list(range(n_rows - 1, -1, -1))
        self.free_image_slots = list(range(n_image_slots - 1, -1, -1))
        self.encoded: deque[Image] = deque()  # features ready, prefix not yet admitted
        self.admitted: deque[Image] = deque()  # prefix admitted, some sequences still waiting
        self.running: list[Sequence] = []  # started, not yet retired
        self.slot_of: dict[int, int] = {}  # id(image) -> feature slot, until its prefill is committed
        self.step = 0

    # ------------------------------------------------------------------ images in

    def take_image_slot(self) -> int | None:
        return self.free_image_slots.pop() if self.free_image_slots else None

    def add_encoded(self, image: Image, slot: int) -> None:
        self.slot_of[id(image)] = slot
        self.encoded.append(image)

    def _seq_blocks(self, s: Sequence) -> int:
        return self.blocks.blocks_for(len(s.spec.prompt) + s.spec.budget)

    def _fits(self, s: Sequence, extra_blocks: int = 0) -> bool:
        return (bool(self.free_rows) and self._rows_left > 0
                and self.blocks.free >= self._seq_blocks(s) + extra_blocks)

    # ------------------------------------------------------------------ plan

    def schedule(self) -> StepPlan | None:
        # Every sequence started earlier decodes, unless its limit says it must be finished.
        decoding = [s for s in self.running if s.state is SeqState.RUNNING and s.decode_steps < s.max_decode_steps]
        decoding = decoding[: self.row_cap]
        self._rows_left = self.row_cap - len(decoding)
        new: list[Sequence] = []
        prefilled: list[Image] = []
        if not decoding or min(len(self.free_rows), self._rows_left) >= self.admit_rows:
            self._admit(new, prefilled)
        if not new and not decoding:
            return None
        prompt_images: dict[int, Image] = {}
        for s in new:
            prompt_images.setdefault(id(s.image), s.image)
        decode_images: dict[int, Image] = {}
        for s in decoding:
            decode_images.setdefault(id(s.image), s.image)
        prompt_index = {k: i for i, k in enumerate(prompt_images)}
        decode_index = {k: i for i, k in enumerate(decode_images)}
        plan = StepPlan(
            step=self.step,
            prefix_slots=np.array([self.slot_of[id(im)] for im in prefilled], dtype=np.int64),
            prefix_lens=_lens(prefilled),
            prefix_tables=self._prefix_tables(prefilled),
            new_rows=np.array([s.row for s in new], dtype=np.int64),
            new_int=np.array([[s.spec.mode, s.spec.limit, s.seed] for s in new], dtype=np.int64).reshape(-1, 3),
            new_float=np.array([[s.spec.temperature, s.spec.top_p] for s in new], dtype=np.float32).reshape(-1, 2),
            prompt_tokens=np.array([t for s in new for t in s.spec.prompt], dtype=np.int64),
            prompt_lens=np.array([len(s.spec.prompt) for s in new], dtype=np.int64),
            prompt_pos0=np.array([s.image.next_pos for s in new], dtype=np.int64),
            prompt_tables=self._own_tables(new, [len(s.spec.prompt) for s in new]),
            prompt_image=np.array([prompt_index[id(s.image)] for s in new], dtype=np.int64),
            prompt_image_tables=self._prefix_tables(list(prompt_images.values())),
            prompt_image_lens=_lens(list(prompt_images.values())),
            decode_rows=np.array([s.row for s in decoding], dtype=np.int64),
            decode_own=np.array([s.own_len for s in decoding], dtype=np.int64),
            decode_pos=np.array([s.image.next_pos + s.own_len for s in decoding], dtype=np.int64),
            decode_tables=self._own_tables(decoding, [s.own_len + 1 for s in decoding]),
            decode_image=np.array([decode_index[id(s.image)] for s in decoding], dtype=np.int64),
            decode_image_tables=self._prefix_tables(list(decode_images.values())),
            decode_image_lens=_lens(list(decode_images.values())),
            needs=np.array([s.needs(0) for s in new] + [s.needs(s.decode_steps + 1) for s in decoding],
                           dtype=np.int64),
            seqs=new + decoding,
        )
        for s in new:
            s.own_len = len(s.spec.prompt)
        for s in decoding:
            s.own_len += 1
            s.decode_steps += 1
        for s in plan.seqs:
            s.inflight += 1
        self.step += 1
        return plan

    def _admit(self, new: list[Sequence], prefilled: list[Image]) -> None:
        while self.admitted and self._start_waiting(self.admitted[0], new):
            self.admitted.popleft()
        budget = PREFILL_TOKENS_PER_STEP
        while (not self.admitted and self.encoded and (not prefilled or budget >= self.encoded[0].prefix_len)
               and self._fits(self.encoded[0].seqs[0], self.blocks.blocks_for(self.encoded[0].prefix_len))):
            image = self.encoded.popleft()
            image.prefix_blocks = self.blocks.allocate(self.blocks.blocks_for(image.prefix_len))
            image.unfinished = len(image.seqs)
            prefilled.append(image)
            budget -= image.prefix_len
            if not self._start_waiting(image, new):
                self.admitted.append(image)

    def _start_waiting(self, image: Image, new: list[Sequence]) -> bool:
        """Start the image's waiting sequences while they fit. -> True when none is left waiting;
        the image then drops its own reference to the prefix (its sequences hold the rest)."""
        for s in image.seqs:
            if s.state is not SeqState.WAITING:
                continue
            if not self._fits(s):
                return False
            s.blocks = self.blocks.allocate(self._seq_blocks(s))
            self.blocks.share(image.prefix_blocks)
            s.row = self.free_rows.pop()
            self._rows_left -= 1
            s.state = SeqState.RUNNING
            self.running.append(s)
            new.append(s)
        self.blocks.release(image.prefix_blocks)
        return True

    @staticmethod
    def _prefix_tables(images: list[Image]) -> np.ndarray:
        """Prefix blocks of each image, padded with the null block to the widest."""
        table = np.zeros((len(images), max((len(im.prefix_blocks) for im in images), default=0)), dtype=np.int64)
        for i, im in enumerate(images):
            table[i, : len(im.prefix_blocks)] = im.prefix_blocks
        return table

    def _own_tables(self, seqs: list[Sequence], used: list[int]) -> np.ndarray:
        """Own blocks holding tokens after this step's writes, padded to the widest row."""
        widths = [self.blocks.blocks_for(n) for n in used]
        table = np.zeros((len(seqs), max(widths, default=0)), dtype=np.int64)
        for i, (s, w) in enumerate(zip(seqs, widths)):
            table[i, :w] = s.blocks[:w]
        return table

    # ------------------------------------------------------------------ commit

    def commit(self, plan: StepPlan, em: Emissions) -> list[Image]:
        """Apply one step's emissions (oldest step first). -> images whose labels are complete."""
        done: list[Image] = []
        for i, s in enumerate(plan.seqs):
            if s.state is SeqState.RUNNING:  # a zombie's emission (already finished) is ignored
                s.output.apply(s.spec.mode, int(em.code[i]), int(em.token[i]), float(em.value[i, 0]),
                               float(em.value[i, 1]))
                if em.finished[i]:
                    s.state = SeqState.FINISHED
                    s.image.unfinished -= 1
                    if s.image.unfinished == 0:
                        done.append(s.image)
            s.inflight -= 1
            if s.state is SeqState.FINISHED and s.inflight == 0:
                self._retire(s)
        for slot in plan.prefix_slots.tolist():
            self.free_image_slots.append(int(slot))
        return done

    def _retire(self, s: Sequence) -> None:
        s.state = SeqState.RETIRED
        self.blocks.release(s.blocks + s.image.prefix_blocks)
        self.free_rows.append(s.row)
        self.running.remove(s)

    @property
    def idle(self) -> bool:
        return not self.running and not self.encoded and not self.admitted

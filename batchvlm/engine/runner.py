"""The device side of the engine: vision stage, one forward per StepPlan, device-side decoding.

Invariants (the pipelined engine depends on them):
  * One compute stream runs every step in plan order, so a step always sees the KV writes and
    the next-input buffers of the steps before it.
  * Inputs and emissions go through two ping-pong pinned slots (staging.py); the copy stream
    waits on each step's own event only.
  * Next-step inputs (token id, coordinate or size) stay in row-indexed device buffers written
    by the family's `decide`; the host never needs a token to launch the next step.
  * Vision batches run on their own stream, each with its own event; a step waits only for
    the events of the images it prefills.
  * Decode-only steps replay CUDA graphs captured at start-up per padded batch size (CUDA
    only); padding rows use a scratch state row and the null KV block.
  * An eager step that runs out of memory is run as two half plans (split.py), recursively:
    every row is still written, in the plan's order.
On CPU the same code runs with synchronous copies and no graphs.

Flat token layout of one step: [image prefixes (ragged) | prompts (ragged) | decode tokens].
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import torch

from ..models.attention import PAD, AttentionBatch, KVCache, PrefixGroup, SharedPrefix, TaskGroup, slot_of
from ..models.decoding import Decision, RowState
from ..models.family import EngineModel, Prepared
from ..models.fused_attention import FusedAttention, MaskBounds
from .graphs import DecodeGraphs
from .plan import NEED_COORD, NEED_SIZE, NEED_TOKEN, PREFILL_TOKENS_PER_STEP, StepPlan
from .split import split_plan, units
from .staging import Emissions, InFlight, Slot, rows_by_image

STATE_INT = ("mode", "phase", "count", "limit", "seed")


def _extent(lens: np.ndarray) -> tuple[int, bool]:
    """(longest prefix, every prefix that long) of a step's images, from the host's plan."""
    n = int(lens.max())
    return n, bool((lens == n).all())
STATE_FLOAT = ("temperature", "top_p")


class HostEvent:
    """A vision batch's mark on CPU, where encoding has finished when `encode` returns: nothing
    to wait for, but the per-batch bookkeeping is the same as CUDA's."""


class Runner:
    def __init__(self, model: EngineModel, cache: KVCache, n_rows: int, n_image_slots: int, max_prefix_len: int,
                 max_own_blocks: int, max_prompt: int, seqs_per_image: int, cuda_graphs: bool, sampling: bool):
        self.model = model
        self.cache = cache
        self.device = dev = model.device
        self.bs = cache.block_size
        self.n_rows = n_rows
        self.sampling = sampling
        R = n_rows + 1  # the last row is scratch for padding
        self.state_int = {f: torch.zeros(R, dtype=torch.long, device=dev) for f in STATE_INT}
        self.state_float = {f: torch.zeros(R, dtype=torch.float32, device=dev) for f in STATE_FLOAT}
        self.after_prompt = torch.zeros(R, dtype=torch.bool, device=dev)
        self.next_kind = torch.zeros(R, dtype=torch.long, device=dev)
        self.next_token = torch.zeros(R, dtype=torch.long, device=dev)
        self.next_value = torch.zeros(R, 2, dtype=torch.float32, device=dev)
        # Per image slot: the family's features until the prefill step is collected.
        self.features: list[Any] = [None] * n_image_slots
        nbp = -(-max_prefix_len // self.bs)
        if isinstance(cache.backend, FusedAttention):  # every step's masks padded to these: fixed compiled shapes
            cache.backend.bounds = MaskBounds(n_rows, max_own_blocks, nbp, max_prompt, seqs_per_image)
        # Staging ints of the largest step: per row, per image slot (its padded prefix row
        # included) and per prefill token (at most one step's budget, or one whole image).
        capacity = (64 + n_rows * (28 + 2 * max_own_blocks + 5 * max_prompt + 2 * nbp + seqs_per_image)
                    + n_image_slots * (3 + nbp + max_prefix_len) + 2 * max(PREFILL_TOKENS_PER_STEP, max_prefix_len))
        self.slots = [Slot(dev, capacity, n_rows), Slot(dev, capacity, n_rows)]
        self._next_slot = 0
        cuda = dev.type == "cuda"
        self.compute = torch.cuda.current_stream(dev) if cuda else None
        self.copy_stream = torch.cuda.Stream(dev) if cuda else None
        self.vision_stream = torch.cuda.Stream(dev) if cuda else None
        self.vision_events: list[torch.cuda.Event | HostEvent | None] = [None] * n_image_slots
        self.graph_steps = 0  # steps that replayed a graph (or ran its fixed-shape body)
        self.oom_rows: list[int] = []  # rows of each step that ran out of memory (then split)
        self.graphs = DecodeGraphs(self, nbp, max_own_blocks, seqs_per_image) \
            if (cuda and cuda_graphs) else None

    # ------------------------------------------------------------------ vision stage

    @torch.inference_mode()
    def encode(self, images: list[Prepared], slots: list[int]) -> None:
        """Encode images into feature slots. On CUDA this runs on its own stream, overlapping
        decode steps; a step that prefills these images waits for this batch's event."""
        if self.vision_stream is None:
            event, feats = HostEvent(), self._encode_fitting(images)
        else:
            event = torch.cuda.Event()
            with torch.cuda.stream(self.vision_stream):
                feats = self._encode_fitting(images)
                event.record(self.vision_stream)
        for slot, f in zip(slots, feats):
            self.features[slot], self.vision_events[slot] = f, event

    def _encode_fitting(self, images: list[Prepared]) -> list[Any]:
        """The vision batch; on out-of-memory, its two halves, recursively (rare: the warm-up
        measured a maximal batch, but other allocations may have grown since)."""
        try:
            return self.model.encode(images)
        except torch.OutOfMemoryError:
            if len(images) < 2:
                raise
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(images) // 2
        return self._encode_fitting(images[:half]) + self._encode_fitting(images[half:])

    def vision_waits(self, prefix_slots: np.ndarray) -> list[torch.cuda.Event | HostEvent]:
        """The events of the vision batches holding these images, each once: a prefill waits for
        its own images only, never for a newer batch still encoding."""
        events = {id(e): e for e in (self.vision_events[s] for s in prefix_slots.tolist()) if e is not None}
        return list(events.values())

    # ------------------------------------------------------------------ steps

    def launch(self, plan: StepPlan) -> InFlight:
        slot = self.slots[self._next_slot]
        self._next_slot ^= 1
        for event in self.vision_waits(plan.prefix_slots):
            if self.compute is not None:
                self.compute.wait_event(event)
        with torch.inference_mode():
            if plan.is_decode_only and self.graphs is not None:
                self.graph_steps += 1
                decision = self.graphs.run(plan, slot)
            else:
                decision = self._eager_fitting(plan, slot)
            self._download(decision, plan.n_out, slot)
        return InFlight(plan, slot)

    def _eager_fitting(self, plan: StepPlan, slot: Slot) -> Decision:
        """The eager step; on out-of-memory, the same work as two half plans, recursively, so no
        row is lost (split.py). Records the failed plan's rows in `oom_rows` for the engine.

        Rare and off the hot path, so it synchronizes: the device must be done with the failed
        attempt (and each part's upload) before the slot's pinned inputs are overwritten. A
        retried part rewrites what the failed attempt may have written (initial row state, K/V
        at the same slots): the row state that carries over between steps is written only after
        the whole forward has succeeded (`decide`).
        """
        try:
            return self._eager(plan, slot)
        except torch.OutOfMemoryError:
            if units(plan) < 2:
                raise
        self.oom_rows.append(plan.n_out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        parts = []
        for part in split_plan(plan):
            parts.append(self._eager_fitting(part, slot))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return Decision(*(torch.cat([getattr(d, f.name) for d in parts]) for f in fields(Decision)))

    def collect(self, inflight: InFlight) -> Emissions:
        slot = inflight.slot
        if slot.done is not None:
            slot.done.synchronize()
        for s in inflight.plan.prefix_slots.tolist():  # that step has run: its features are spent
            self.features[s] = self.vision_events[s] = None
        n = inflight.plan.n_out
        ints, floats = (t.numpy() for t in slot.out_views(n))
        return Emissions(ints[0].copy(), ints[1].copy(), ints[2].astype(bool), floats.copy())

    def _download(self, d: Decision, n: int, slot: Slot) -> None:
        packed_i = torch.stack([d.code[:n], d.token[:n], d.finished[:n].long()])
        packed_f = d.value[:n].float()
        out_i, out_f = slot.out_views(n)
        if self.copy_stream is None:
            out_i.copy_(packed_i)
            out_f.copy_(packed_f)
            return
        event = torch.cuda.Event()
        event.record(self.compute)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(event)  # this step only; never the next step's uploads
            out_i.copy_(packed_i, non_blocking=True)
            out_f.copy_(packed_f, non_blocking=True)
            packed_i.record_stream(self.copy_stream)
            packed_f.record_stream(self.copy_stream)
            slot.done = torch.cuda.Event()
            slot.done.record(self.copy_stream)

    def _eager(self, plan: StepPlan, slot: Slot) -> Decision:
        m, bs, dev = self.model, self.bs, self.device
        I, S, D = len(plan.prefix_slots), len(plan.new_rows), len(plan.decode_rows)
        n_pre = int(plan.prefix_lens.sum())
        L = int(plan.prefix_lens.max()) if I else 0
        T = int(plan.prompt_lens.max()) if S else 0
        n_prompt = int(plan.prompt_lens.sum())
        N = n_pre + n_prompt + D
        # Prefix tokens: image i's token j sits at flat row pre_start[i] + j.
        pre_start = np.cumsum(plan.prefix_lens) - plan.prefix_lens
        pre_img = np.repeat(np.arange(I), plan.prefix_lens)
        pre_j = np.arange(n_pre) - pre_start[pre_img]
        q_pre = np.full((I, L), N, dtype=np.int64)
        q_pre[pre_img, pre_j] = np.arange(n_pre)
        # Prompt tokens: sequence s's own token j at flat row n_pre + prompt_start[s] + j.
        prompt_start = np.cumsum(plan.prompt_lens) - plan.prompt_lens
        flat_seq = np.repeat(np.arange(S), plan.prompt_lens)
        flat_own = np.arange(n_prompt) - prompt_start[flat_seq]
        flat_pos = plan.prompt_pos0[flat_seq] + flat_own
        q_prompt = np.full((S, T), N, dtype=np.int64)
        q_prompt[flat_seq, flat_own] = n_pre + np.arange(n_prompt)
        own_prompt = np.full((S, T), PAD, dtype=np.int64)
        own_prompt[flat_seq, flat_own] = flat_own
        prompt_by_image, prompt_slot = rows_by_image(plan.prompt_image, q_prompt, len(plan.prompt_image_tables), N)
        decode_flat = np.arange(n_pre + n_prompt, N, dtype=np.int64)[:, None]
        decode_by_image, decode_slot = rows_by_image(plan.decode_image, decode_flat, len(plan.decode_image_tables), N)
        last = np.concatenate([q_prompt[np.arange(S), plan.prompt_lens - 1], decode_flat[:, 0]])
        lm, co, sz = (np.flatnonzero(plan.needs & bit) for bit in (NEED_TOKEN, NEED_COORD, NEED_SIZE))
        ints, floats = slot.upload(
            [plan.prefix_lens, plan.prefix_tables, q_pre, pre_img, pre_j,
             plan.new_rows, plan.new_int, plan.prompt_tokens, plan.prompt_lens, plan.prompt_tables,
             plan.prompt_image_tables, plan.prompt_image_lens, q_prompt, own_prompt, prompt_by_image, prompt_slot,
             flat_seq, flat_own, flat_pos,
             plan.decode_rows, plan.decode_own, plan.decode_pos, plan.decode_tables, plan.decode_image_tables,
             plan.decode_image_lens, decode_by_image, decode_slot, last, lm, co, sz],
            [plan.new_float], dev, self.compute)
        (prefix_lens, prefix_tables, q_pre_t, pre_img_t, pre_j_t,
         new_rows, new_int, prompt_tokens, prompt_lens, prompt_tables,
         prompt_image_tables, prompt_image_lens, q_prompt_t, own_prompt_t, prompt_by_image_t, prompt_slot_t,
         flat_seq_t, flat_own_t, flat_pos_t,
         decode_rows, decode_own, decode_pos, decode_tables, decode_image_tables,
         decode_image_lens, decode_by_image_t, decode_slot_t, last_t, lm_t, co_t, sz_t) = ints
        (new_float,) = floats

        if S:
            self._init_rows(new_rows, new_int, new_float)
        embeds, own_pos, groups, write_slots = [], [], [], []
        prefix = None
        if I:
            prefix = m.prefix_inputs([self.features[s] for s in plan.prefix_slots.tolist()])
            embeds.append(prefix.embeds_NC)
            write_slots.append(slot_of(prefix_tables[pre_img_t], pre_j_t, bs))
            groups.append(PrefixGroup(q_pre_t, prefix_tables, prefix_lens, m.causal_prefix, _extent(plan.prefix_lens)[1]))
        if S:
            embeds.append(m.embed_tokens(prompt_tokens))
            own_pos.append(flat_pos_t)
            write_slots.append(slot_of(prompt_tables[flat_seq_t], flat_own_t, bs))
            groups.append(TaskGroup(q_prompt_t, own_prompt_t, prompt_tables, prompt_lens,
                                    SharedPrefix(prompt_image_tables, prompt_image_lens, prompt_by_image_t,
                                                 prompt_slot_t, *_extent(plan.prompt_image_lens))))
        if D:
            self.decode_group(decode_rows, decode_own, decode_pos, decode_tables, decode_image_tables,
                              decode_image_lens, decode_by_image_t, decode_slot_t, n_pre + n_prompt,
                              embeds, own_pos, write_slots, groups, _extent(plan.decode_image_lens))
        positions = m.own_positions(torch.cat(own_pos)) if own_pos else None
        if prefix is not None:
            positions = prefix.positions if positions is None else torch.cat([prefix.positions, positions], dim=-1)
        batch = AttentionBatch(torch.cat(write_slots), groups, bs)
        hidden = m.forward(torch.cat(embeds), positions, batch, self.cache, prefix)
        rows = torch.cat([new_rows, decode_rows])
        return self.decide(rows, hidden[last_t], (lm_t, co_t, sz_t))

    def decode_group(self, rows, own, pos, tables, image_tables, image_lens, by_image, slot, first_row,
                     embeds, own_pos, write_slots, groups, extent: tuple[int | None, bool] = (None, False)) -> None:
        """Append the decode tokens (inputs read from the device buffers) at flat rows first_row...
        `extent`: the host's (longest prefix, all prefixes that long), when it knows them."""
        D = rows.shape[0]
        embeds.append(self.model.embed_inputs(self.next_kind[rows], self.next_token[rows], self.next_value[rows]))
        own_pos.append(pos)
        write_slots.append(slot_of(tables, own, self.bs))
        flat = torch.arange(first_row, first_row + D, device=self.device)
        groups.append(TaskGroup(flat[:, None], own[:, None], tables, own + 1,
                                SharedPrefix(image_tables, image_lens, by_image, slot, *extent)))

    def _init_rows(self, rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        self.state_int["mode"][rows] = ints[:, 0]
        self.state_int["limit"][rows] = ints[:, 1]
        self.state_int["seed"][rows] = ints[:, 2]
        self.state_int["phase"][rows] = 0
        self.state_int["count"][rows] = 0
        self.after_prompt[rows] = True
        self.state_float["temperature"][rows] = floats[:, 0]
        self.state_float["top_p"][rows] = floats[:, 1]

    def decide(self, rows: torch.Tensor, hidden_BC: torch.Tensor, heads) -> Decision:
        st = RowState(mode=self.state_int["mode"][rows], phase=self.state_int["phase"][rows],
                      count=self.state_int["count"][rows], limit=self.state_int["limit"][rows],
                      after_prompt=self.after_prompt[rows], temperature=self.state_float["temperature"][rows],
                      top_p=self.state_float["top_p"][rows], seed=self.state_int["seed"][rows])
        d = self.model.decide(hidden_BC, st, self.sampling, heads)
        self.state_int["phase"][rows] = st.phase
        self.state_int["count"][rows] = st.count
        self.after_prompt[rows] = st.after_prompt
        self.next_kind[rows] = d.next_kind
        self.next_token[rows] = d.next_token
        self.next_value[rows] = d.next_value
        return d

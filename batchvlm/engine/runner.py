"""The device side of the engine: one forward per StepPlan, device-side decoding.

Invariants (the pipelined engine depends on them):
  * One compute stream runs every step in plan order, so a step always sees the KV writes and
    the next-input buffers of the steps before it.
  * Inputs and emissions go through two ping-pong pinned slots (staging.py): the host writes a
    step's inputs in place there and they go up in one copy per buffer; the copy stream waits on
    each step's own event only.
  * Next-step inputs (token id, coordinate or size) stay in row-indexed device buffers written
    by the family's `decide`; the host never needs a token to launch the next step.
  * Vision batches (vision.py) run on their own stream, each with its own event; a step waits
    only for the events of the images it prefills.
  * Decode-only steps replay CUDA graphs captured at start-up per padded batch size (CUDA
    only); padding rows use a scratch state row and the null KV block. A replay owns its static
    inputs, its intermediates and its outputs (the Decision it returns): the next replay rewrites
    them while the copy stream may still be reading this step's. So a step's emissions are first
    copied into tensors of its own (`emitted`), on the compute stream, before anything else is
    launched; the row buffers below (state, next inputs, masks) are the runner's, written in
    plan order by every step, graph or eager.
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

from ..cache.spans import StateSpans
from ..cache.tensors import EngineCache
from ..attention import AttentionBatch, PrefixGroup, PrefixView, SharedPrefix, TaskGroup, slot_of
from ..models.base.decoding import MODE_SCORE, Decision, PromptRows, RowState
from ..models.base.contract import EngineModel
from .graphs import DecodeGraphs, DecodePadding
from .inputs import DecodeInputs, step_inputs
from .plan import Emissions, StepPlan
from .shape import JobShape
from .split import admission_parts, split_plan, units
from .staging import InFlight, Staging
from .vision import VisionStage

STATE_INT = ("mode", "phase", "count", "limit", "seed")
STATE_FLOAT = ("temperature", "top_p")


def _extent(lens: np.ndarray) -> tuple[int, bool]:
    """(longest prefix, every prefix that long) of a step's prefixes, from the host's plan."""
    n = int(lens.max())
    return n, bool((lens == n).all())


def emitted(d: Decision, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n rows' emissions as ([3, n] long: code, token, finished; [n, 2] float32 values),
    in new tensors: never views of `d`, which may be a graph's outputs (`.float()` of a float32
    value would be one)."""
    return (torch.stack([d.code[:n], d.token[:n], d.finished[:n].long()]),
            d.value[:n].to(torch.float32, copy=True))


class Runner:
    def __init__(self, model: EngineModel, cache: EngineCache, n_rows: int, n_feature_slots: int, max_prefix_len: int,
                 max_own_blocks: int, seqs_per_image: int, cuda_graphs: bool, sampling: bool,
                 mask_words: int = 0):
        self.model = model
        self.cache = cache
        self.device = dev = model.device
        self.bs = cache.block_size
        self.n_rows = n_rows
        self.sampling = sampling
        self.recurrent = bool(cache.recurrent)
        R = n_rows + 1  # the last row is scratch for padding
        self.state_int = {f: torch.zeros(R, dtype=torch.long, device=dev) for f in STATE_INT}
        self.state_float = {f: torch.zeros(R, dtype=torch.float32, device=dev) for f in STATE_FLOAT}
        self.after_prompt = torch.zeros(R, dtype=torch.bool, device=dev)
        self.next_kind = torch.zeros(R, dtype=torch.long, device=dev)
        self.next_token = torch.zeros(R, dtype=torch.long, device=dev)
        self.next_value = torch.zeros(R, 2, dtype=torch.float32, device=dev)
        # Constrained jobs: each row's token mask for its next decision, int32 words (bit v % 32 of
        # word v // 32: token v allowed), written by `launch` from the step's StepPlan.masks; a row
        # never listed there (a free row) keeps all bits, and so does the scratch row.
        self.mask_RW = torch.full((R, mask_words), -1, dtype=torch.int32, device=dev) if mask_words else None
        self.vision = VisionStage(model, n_feature_slots)
        self.padding = DecodePadding(n_rows, -(-max_prefix_len // self.bs), max_own_blocks, seqs_per_image)
        # Staging grows on demand (staging.py); this is room for a few hundred rows' steps.
        self.staging = [Staging(dev, 1 << 16, n_rows), Staging(dev, 1 << 16, n_rows)]
        self._next_slot = 0
        cuda = dev.type == "cuda"
        self.compute = torch.cuda.current_stream(dev) if cuda else None
        self.copy_stream = torch.cuda.Stream(dev) if cuda else None
        self.graph_steps = 0  # steps that replayed a graph (or ran its fixed-shape body)
        # Admission steps with decode rows: those rows by their graph, beside an eager forward of
        # the prefixes and prompts (`_split`), where graphs exist; False: one mixed eager forward.
        self.split_admission = True
        self.split_steps = 0
        # The decode group's PrefixView and the (tables, lengths) of the prefixes it copies.
        self._view: PrefixView | None = None
        self._view_of: tuple[tuple[int, ...], bytes, bytes] | None = None
        self.graphs = self.decode_graphs() if (cuda and cuda_graphs) else None

    @classmethod
    def for_shape(cls, model: EngineModel, cache: EngineCache, shape: JobShape, n_rows: int, n_feature_slots: int,
                  cuda_graphs: bool) -> Runner:
        return cls(model, cache, n_rows, n_feature_slots, shape.max_prefix_len, shape.max_own_blocks,
                   shape.seqs_per_prefix, cuda_graphs, shape.sampling, shape.mask_words)

    def decode_graphs(self, capture: bool = True) -> DecodeGraphs:
        """A graph of `fixed_decode` per decode bucket, captured now (capture=False: the same body,
        run eagerly at replay: tests run it on CPU)."""
        return DecodeGraphs(self.fixed_decode, self.padding, self.device, self.compute, capture)

    # ------------------------------------------------------------------ steps

    def launch(self, plan: StepPlan) -> InFlight:
        """Start one step. InFlight.oom_rows: the rows of the step if it ran out of memory (it
        still ran whole, in parts), else 0."""
        slot = self.staging[self._next_slot]
        oom: list[int] = []
        self._next_slot ^= 1
        for event in self.vision.waits(plan.prefix_features):
            if self.compute is not None:
                self.compute.wait_event(event)
        with torch.inference_mode():
            if len(plan.mask_rows):  # before the forward, on its stream: the step's decisions read them
                rows, words = slot.upload_masks(plan.mask_rows, plan.masks, self.device, self.compute)
                self.mask_RW[rows] = words
            if plan.is_decode_only and self.graphs is not None:
                self.graph_steps += 1
                packed = emitted(self.graphs.run(plan, slot), plan.n_out)
            elif self.split_admission and self.graphs is not None and len(plan.decode_rows):
                packed = self._split(plan, slot, oom)
            else:
                packed = emitted(self._eager_fitting(plan, slot, oom), plan.n_out)
            self._download(*packed, slot)
        return InFlight(plan, slot, oom[0] if oom else 0)

    @torch.inference_mode()
    def warm_up(self, plan: StepPlan, features: list[Any]) -> Decision:
        """Run a plan eagerly with the given features per prefix slot (start-up sizing only)."""
        for slot in plan.prefix_features.tolist():
            self.vision.features[slot] = features[slot % len(features)]
        return self._eager(plan, self.staging[0])

    def _eager_fitting(self, plan: StepPlan, slot: Staging, oom: list[int]) -> Decision:
        """The eager step; on out-of-memory, the same work as two half plans, recursively, so no
        row is lost (split.py). Appends the failed plan's rows to `oom`.

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
        oom.append(plan.n_out)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        parts = []
        for part in split_plan(plan):
            parts.append(self._eager_fitting(part, slot, oom))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        return Decision(*(torch.cat([getattr(d, f.name) for d in parts]) for f in fields(Decision)))

    def _split(self, plan: StepPlan, slot: Staging, oom: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """An admission step as two forwards on the compute stream: its prefixes and prompts
        eagerly, then its decode rows by their graph; emissions in the plan's order (new rows,
        then decode rows). The same as the one mixed forward: the two write disjoint cache blocks,
        state rows and snapshot slots, and the decode rows read only prefixes prefilled by earlier
        steps (the same argument as split.py's halves). What it buys and costs: docs/engine.md."""
        self.split_steps += 1
        admit, decode = admission_parts(plan)
        new_i, new_f = emitted(self._eager_fitting(admit, slot, oom), admit.n_out)
        dec_i, dec_f = emitted(self.graphs.run(decode, slot), decode.n_out)
        return torch.cat([new_i, dec_i], dim=1), torch.cat([new_f, dec_f])

    def collect(self, inflight: InFlight) -> Emissions:
        slot = inflight.slot
        if slot.done is not None:
            slot.done.synchronize()
        self.vision.spent(inflight.plan.prefix_features)
        n = inflight.plan.n_out
        ints, floats = (t.numpy() for t in slot.out_views(n))
        return Emissions(ints[0].copy(), ints[1].copy(), ints[2].astype(bool), floats.copy())

    def _download(self, packed_i: torch.Tensor, packed_f: torch.Tensor, slot: Staging) -> None:
        out_i, out_f = slot.out_views(packed_f.shape[0])
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

    def _eager(self, plan: StepPlan, slot: Staging) -> Decision:
        m, bs = self.model, self.bs
        x, layout = slot.write(lambda w: step_inputs(plan, self.recurrent, self.cache.snapshot_index, w))
        x = slot.upload(x, self.device, self.compute)
        I, S, D = len(plan.prefix_features), len(plan.new_rows), len(plan.decode_rows)
        view = self._prefix_view(plan)
        if S:
            self._init_rows(x.new_rows, x.new_int, x.new_float)
        embeds, own_pos, groups, write_slots = [], [], [], []
        prefix = None
        if I:
            prefix = m.prefix_inputs(self.vision.read(plan.prefix_features),
                                     list(x.prefix_tokens.split(plan.prefix_prompt_lens.tolist())))
            embeds.append(prefix.embeds_NC)
            write_slots.append(slot_of(x.prefix_tables[x.pre_img], x.pre_j, bs))
            # A bidirectional image part, then a prefix prompt that the family reads causally
            # (an optional attribute: a family without it, an encoder, reads the prompt bidirectionally).
            mixed = (not m.causal_prefix and getattr(m, "causal_prefix_prompt", False)
                     and bool(plan.prefix_prompt_lens.any()))
            groups.append(PrefixGroup(x.q_pre, x.prefix_tables, x.prefix_lens, m.causal_prefix or mixed,
                                      _extent(plan.prefix_lens)[1], x.prefix_bidir if mixed else None))
        if S:
            embeds.append(m.embed_tokens(x.prompt_tokens))
            own_pos.append(x.flat_pos)
            write_slots.append(slot_of(x.prompt_tables[x.flat_seq], x.flat_own, bs))
            groups.append(TaskGroup(x.q_prompt, x.own_prompt, x.prompt_tables, x.prompt_lens,
                                    SharedPrefix(x.prompt_image_tables, x.prompt_image_lens, x.prompt_by_image,
                                                 x.prompt_slot, *_extent(plan.prompt_image_lens))))
        first_decode = layout.n_pre + layout.n_prompt
        if D:
            self.decode_group(x.decode, first_decode, embeds, own_pos, write_slots, groups,
                              _extent(plan.decode_image_lens), view)
        positions = m.own_positions(torch.cat(own_pos)) if own_pos else None
        if prefix is not None:
            positions = prefix.positions if positions is None else torch.cat([prefix.positions, positions], dim=-1)
        states = None
        if self.recurrent:
            states = StateSpans(layout.span_start, layout.span_len, layout.span_read, layout.span_write,
                                x.decode.rows, first_decode, x.cu_seqlens, x.span_read, x.span_write)
        batch = AttentionBatch(torch.cat(write_slots), groups, bs, layout.n_pre, states)
        hidden = m.forward(torch.cat(embeds), positions, batch, self.cache, prefix)
        prompt = None
        if layout.n_scored:  # a step of classify choices (MODE_SCORE): decide gets their scored rows
            only = D == 0 and bool((plan.new_int[:, 0] == MODE_SCORE).all())  # no row has a token to decide
            prompt = PromptRows(hidden[x.score_rows], x.score_pick, x.score_target, x.score_seq, only)
        return self.decide(torch.cat([x.new_rows, x.decode.rows]), hidden[x.last], x.heads, prompt)

    def _prefix_view(self, plan: StepPlan) -> PrefixView | None:
        """The decode group's PrefixView (attention/layout.py): the previous step's when this
        step decodes against the same prefixes (tables and lengths, host arrays) and no prefix has
        been written since that view was made, else a new one. Prefix K/V are written only by
        steps that prefill prefixes, and a block listed in both steps' tables is held by its
        prefix throughout (freed blocks are reused only by a later prefill, into the same block
        ids as often as not). So every eager step comes here: one that prefills, with decode rows
        or without, gets no view (it gathers) and ends the current one; a step with neither keeps
        it. Graph-replayed steps decode only and gather. Steps run in plan order, so the previous
        step here is the one before on the device too."""
        if len(plan.prefix_features):
            self._view = self._view_of = None
            return None
        if not len(plan.decode_rows):
            return None
        key = (plan.decode_image_tables.shape, plan.decode_image_tables.tobytes(), plan.decode_image_lens.tobytes())
        if key != self._view_of:
            self._view, self._view_of = PrefixView(), key
        return self._view

    def fixed_decode(self, d: DecodeInputs) -> Decision:
        """A decode-only step over padded device inputs (graphs.py): what a CUDA graph records."""
        embeds, own_pos, groups, write_slots = [], [], [], []
        self.decode_group(d, 0, embeds, own_pos, write_slots, groups)
        states = StateSpans([], [], [], [], d.rows, 0) if self.recurrent else None
        batch = AttentionBatch(write_slots[0], groups, self.bs, 0, states)
        hidden = self.model.forward(embeds[0], self.model.own_positions(own_pos[0]), batch, self.cache)
        return self.decide(d.rows, hidden, None)

    def decode_group(self, d: DecodeInputs, first_row: int, embeds, own_pos, write_slots, groups,
                     extent: tuple[int | None, bool] = (None, False), view: PrefixView | None = None) -> None:
        """Append the decode tokens (inputs read from the device buffers) at flat rows first_row...
        `extent`: the host's (longest prefix, all prefixes that long), when it knows them; `view`:
        the prefixes' PrefixView, if the step may reuse one."""
        rows = d.rows
        embeds.append(self.model.embed_inputs(self.next_kind[rows], self.next_token[rows], self.next_value[rows]))
        own_pos.append(d.pos)
        write_slots.append(slot_of(d.tables, d.own, self.bs))
        flat = torch.arange(first_row, first_row + rows.shape[0], device=self.device)
        groups.append(TaskGroup(flat[:, None], d.own[:, None], d.tables, d.own + 1,
                                SharedPrefix(d.image_tables, d.image_lens, d.by_image, d.slot, *extent, view)))

    def _init_rows(self, rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        self.state_int["mode"][rows] = ints[:, 0]
        self.state_int["limit"][rows] = ints[:, 1]
        self.state_int["seed"][rows] = ints[:, 2]
        self.state_int["phase"][rows] = 0
        self.state_int["count"][rows] = 0
        self.after_prompt[rows] = True
        self.state_float["temperature"][rows] = floats[:, 0]
        self.state_float["top_p"][rows] = floats[:, 1]

    def decide(self, rows: torch.Tensor, hidden_BC: torch.Tensor, heads, prompt: PromptRows | None = None) -> Decision:
        st = RowState(mode=self.state_int["mode"][rows], phase=self.state_int["phase"][rows],
                      count=self.state_int["count"][rows], limit=self.state_int["limit"][rows],
                      after_prompt=self.after_prompt[rows], temperature=self.state_float["temperature"][rows],
                      top_p=self.state_float["top_p"][rows], seed=self.state_int["seed"][rows], row=rows)
        extra = {} if prompt is None else {"prompt": prompt}
        if self.mask_RW is not None:  # constrained jobs only: every row masked (free rows allow all)
            extra["mask_BW"] = self.mask_RW[rows]
        d = self.model.decide(hidden_BC, st, self.sampling, heads, **extra)
        self.state_int["phase"][rows] = st.phase
        self.state_int["count"][rows] = st.count
        self.after_prompt[rows] = st.after_prompt
        self.next_kind[rows] = d.next_kind
        self.next_token[rows] = d.next_token
        self.next_value[rows] = d.next_value
        return d

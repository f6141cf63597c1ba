"""The device side of the engine: vision stage, one forward per StepPlan, device-side decoding.

Invariants (the pipelined engine depends on them):
  * One compute stream runs every step in plan order, so a step always sees the KV writes and
    the next-input buffers of the steps before it.
  * A step's inputs arrive through its slot's pinned staging buffer (one H2D copy per dtype)
    and its emissions leave through its slot's pinned output buffer (one D2H copy on the copy
    stream, which waits on that step's own event only). Two slots ping-pong: a slot is reused
    only after its previous step was collected, so the CPU never overwrites memory a DMA
    still reads.
  * Next-step inputs (token id, coordinate or size) stay in row-indexed device buffers written
    by `decide`; the host never needs a token to launch the next step.
  * Decode-only steps replay CUDA graphs captured per padded batch size (CUDA only); padding
    rows use a scratch state row and the null KV block.
On CPU the same code runs with synchronous copies and no graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.attention import PAD_POS, AttentionBatch, AttentionGroup, KVCache, SharedPrefix, own_slots_of, slots_of
from ..models.moondream.decoding import Decision, RowState, decide
from ..models.moondream.model import MoondreamModel
from .plan import NEED_COORD, NEED_SIZE, NEED_TOKEN, StepPlan

STATE_INT = ("mode", "phase", "count", "limit", "seed")
STATE_FLOAT = ("temperature", "top_p")


@dataclass
class Emissions:
    """One step's output per emitting row, on the host."""

    code: np.ndarray
    token: np.ndarray
    finished: np.ndarray
    value: np.ndarray  # [n, 2]


class Slot:
    """Pinned staging for one in-flight step (inputs up, emissions down)."""

    def __init__(self, device: torch.device, capacity: int):
        self.pinned = device.type == "cuda"
        self.ints = torch.empty(capacity, dtype=torch.int64, pin_memory=self.pinned)
        self.floats = torch.empty(capacity, dtype=torch.float32, pin_memory=self.pinned)
        self.out_ints: torch.Tensor | None = None
        self.out_floats: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None

    def upload(self, ints: list[np.ndarray], floats: list[np.ndarray], device: torch.device,
               stream) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Pack arrays into the slot's pinned buffers, copy up once per dtype, return device views."""
        return self._up(ints, self.ints, device, stream), self._up(floats, self.floats, device, stream)

    @staticmethod
    def _up(arrays: list[np.ndarray], buf: torch.Tensor, device: torch.device, stream) -> list[torch.Tensor]:
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if total > buf.numel():
            raise ValueError(f"staging capacity {buf.numel()} < {total}")
        if total:
            np.concatenate([a.reshape(-1) for a in arrays], out=buf.numpy()[:total])
        if device.type == "cpu":
            flat = buf[:total].clone()
        else:
            with torch.cuda.stream(stream):
                flat = buf[:total].to(device, non_blocking=True)
        out, at = [], 0
        for a in arrays:
            out.append(flat[at : at + a.size].view(a.shape))
            at += a.size
        return out


@dataclass
class InFlight:
    plan: StepPlan
    slot: Slot


class Runner:
    def __init__(self, model: MoondreamModel, cache: KVCache, n_rows: int, n_image_slots: int,
                 max_own_blocks: int, max_prompt: int, seqs_per_image: int, cuda_graphs: bool, sampling: bool):
        self.model = model
        self.cache = cache
        self.device = model.device
        self.P = model.config.prefix_len
        self.bs = cache.block_size
        self.n_rows = n_rows
        self.sampling = sampling
        dev = self.device
        R = n_rows + 1  # the last row is scratch for padding
        self.state_int = {f: torch.zeros(R, dtype=torch.long, device=dev) for f in STATE_INT}
        self.state_float = {f: torch.zeros(R, dtype=torch.float32, device=dev) for f in STATE_FLOAT}
        self.after_prompt = torch.zeros(R, dtype=torch.bool, device=dev)
        self.next_kind = torch.zeros(R, dtype=torch.long, device=dev)
        self.next_token = torch.zeros(R, dtype=torch.long, device=dev)
        self.next_value = torch.zeros(R, 2, dtype=torch.float32, device=dev)
        c = model.config
        self.features = torch.zeros(n_image_slots, c.vision.n_image_tokens, c.vision.proj_out_dim,
                                    dtype=model.dtype, device=dev)
        nbp = -(-self.P // self.bs)
        capacity = 64 + n_rows * (24 + 2 * max_own_blocks + 4 * max_prompt + nbp) + n_image_slots * (2 + nbp)
        self.slots = [Slot(dev, capacity), Slot(dev, capacity)]
        self._next_slot = 0
        cuda = dev.type == "cuda"
        self.compute = torch.cuda.current_stream(dev) if cuda else None
        self.copy_stream = torch.cuda.Stream(dev) if cuda else None
        self.vision_stream = torch.cuda.Stream(dev) if cuda else None
        self.vision_done = torch.cuda.Event() if cuda else None
        self.graphs = DecodeGraphs(self, max_own_blocks, seqs_per_image) if (cuda and cuda_graphs) else None

    # ------------------------------------------------------------------ vision stage

    @torch.inference_mode()
    def encode(self, crops: list[np.ndarray], tilings: list[tuple[int, int]], slots: list[int]) -> None:
        """Encode images into feature slots. On CUDA this runs on its own stream, overlapping
        decode steps; the next step that prefills these images waits for it."""
        stacked = np.concatenate(crops)
        host = torch.from_numpy(stacked)
        if self.vision_stream is None:
            self.features[slots] = self.model.vision(host, tilings).to(self.features.dtype)
            return
        host = host.pin_memory()
        with torch.cuda.stream(self.vision_stream):
            feats = self.model.vision(host.to(self.device, non_blocking=True), tilings)
            index = torch.tensor(slots).pin_memory().to(self.device, non_blocking=True)
            self.features[index] = feats.to(self.features.dtype)
            self.vision_done.record(self.vision_stream)

    # ------------------------------------------------------------------ steps

    def launch(self, plan: StepPlan) -> InFlight:
        slot = self.slots[self._next_slot]
        self._next_slot ^= 1
        if self.vision_done is not None and len(plan.prefix_slots):
            self.compute.wait_event(self.vision_done)
        with torch.inference_mode():
            if plan.is_decode_only and self.graphs is not None:
                decision = self.graphs.run(plan, slot)
            else:
                decision = self._eager(plan, slot)
            self._download(decision, plan.n_out, slot)
        return InFlight(plan, slot)

    def collect(self, inflight: InFlight) -> Emissions:
        slot = inflight.slot
        if slot.done is not None:
            slot.done.synchronize()
        n = inflight.plan.n_out
        ints, floats = slot.out_ints.numpy(), slot.out_floats.numpy()
        return Emissions(ints[0, :n].copy(), ints[1, :n].copy(), ints[2, :n].astype(bool),
                         floats[:n].copy())

    def _download(self, d: Decision, n: int, slot: Slot) -> None:
        packed_i = torch.stack([d.code[:n], d.token[:n], d.finished[:n].long()])
        packed_f = d.value[:n].float()
        if self.copy_stream is None:
            slot.out_ints, slot.out_floats = packed_i, packed_f
            return
        event = torch.cuda.Event()
        event.record(self.compute)
        if slot.out_ints is None or slot.out_ints.shape[1] < n:
            slot.out_ints = torch.empty(3, self.n_rows, dtype=torch.int64, pin_memory=True)
            slot.out_floats = torch.empty(self.n_rows, 2, dtype=torch.float32, pin_memory=True)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(event)  # this step only; never the next step's uploads
            slot.out_ints[:, :n].copy_(packed_i, non_blocking=True)
            slot.out_floats[:n].copy_(packed_f, non_blocking=True)
            packed_i.record_stream(self.copy_stream)
            packed_f.record_stream(self.copy_stream)
            slot.done = torch.cuda.Event()
            slot.done.record(self.copy_stream)

    def _eager(self, plan: StepPlan, slot: Slot) -> Decision:
        m, P, bs, dev = self.model, self.P, self.bs, self.device
        I, S, D = len(plan.prefix_slots), len(plan.new_rows), len(plan.decode_rows)
        T = int(plan.prompt_lens.max()) if S else 0
        # Flat token layout: [image prefixes | prompts (ragged) | decode tokens].
        q_prompt = np.full((S, T), -1, dtype=np.int64)
        pos_prompt = np.full((S, T), PAD_POS, dtype=np.int64)
        at = I * P
        for s, n in enumerate(plan.prompt_lens):
            q_prompt[s, :n] = np.arange(at, at + n)
            pos_prompt[s, :n] = np.arange(P, P + n)
            at += n
        # Per prompt token (flat order): its position and its sequence, so no boolean masks
        # (a device sync on CUDA) are needed to pick the real tokens.
        flat_pos = np.concatenate([np.arange(P, P + n) for n in plan.prompt_lens]) if S else np.zeros(0, np.int64)
        flat_seq = np.repeat(np.arange(S), plan.prompt_lens)
        N = at + D
        q_prompt[q_prompt < 0] = N
        prompt_by_image, prompt_slot = _rows_by_image(plan.prompt_image, q_prompt, len(plan.prompt_image_tables), N)
        decode_flat = np.arange(at, N, dtype=np.int64)[:, None]
        decode_by_image, decode_slot = _rows_by_image(plan.decode_image, decode_flat, len(plan.decode_image_tables), N)
        lm, co, sz = (np.flatnonzero(plan.needs & bit) for bit in (NEED_TOKEN, NEED_COORD, NEED_SIZE))
        ints, floats = slot.upload(
            [plan.prefix_slots, plan.prefix_tables, plan.new_rows, plan.new_int, plan.prompt_tokens,
             plan.prompt_lens, plan.prompt_tables, plan.prompt_image_tables, q_prompt, pos_prompt, prompt_by_image,
             prompt_slot, flat_pos, flat_seq, plan.decode_rows, plan.decode_pos, plan.decode_tables,
             plan.decode_image_tables, decode_by_image, decode_slot, lm, co, sz],
            [plan.new_float], dev, self.compute)
        (prefix_slots, prefix_tables, new_rows, new_int, prompt_tokens, prompt_lens, prompt_tables,
         prompt_image_tables, q_prompt_t, pos_prompt_t, prompt_by_image_t, prompt_slot_t, flat_pos_t, flat_seq_t,
         decode_rows, decode_pos, decode_tables, decode_image_tables, decode_by_image_t, decode_slot_t, lm_t, co_t,
         sz_t) = ints
        (new_float,) = floats

        if S:
            self._init_rows(new_rows, new_int, new_float)
        embeds, positions, groups, write_slots = [], [], [], []
        if I:
            pos_IP = torch.arange(P, device=dev).expand(I, P)
            embeds.append(m.prefix_embeds(self.features[prefix_slots]).reshape(I * P, -1))
            positions.append(pos_IP.reshape(-1))
            write_slots.append(slots_of(prefix_tables, pos_IP, bs, P).reshape(-1))
            groups.append(AttentionGroup(torch.arange(I * P, device=dev).view(I, P), pos_IP, prefix_tables,
                                         torch.full((I,), P, device=dev)))
        if S:
            embeds.append(m.text.wte[prompt_tokens])
            positions.append(flat_pos_t)
            write_slots.append(own_slots_of(prompt_tables[flat_seq_t], flat_pos_t, bs, P))
            groups.append(AttentionGroup(q_prompt_t, pos_prompt_t, prompt_tables, prompt_lens,
                                         SharedPrefix(prompt_image_tables, prompt_by_image_t, prompt_slot_t)))
        last = [q_prompt_t.gather(1, (prompt_lens - 1)[:, None])[:, 0]] if S else []
        if D:
            last.append(self._decode_group(decode_rows, decode_pos, decode_tables, decode_image_tables,
                                           decode_by_image_t, decode_slot_t, N - D, embeds, positions, write_slots,
                                           groups))
        batch = AttentionBatch(torch.cat(write_slots), groups, bs, P)
        hidden = m.forward_tokens(torch.cat(embeds), torch.cat(positions), batch, self.cache)
        rows = torch.cat([new_rows, decode_rows])
        return self._decide(rows, hidden[torch.cat(last)], (lm_t, co_t, sz_t))

    def _decode_group(self, rows, pos, tables, image_tables, by_image, slot, first_row, embeds, positions,
                      write_slots, groups) -> torch.Tensor:
        """Append the decode tokens (inputs read from the device buffers). -> their flat rows."""
        D = rows.shape[0]
        embeds.append(self.model.input_embeds(self.next_kind[rows], self.next_token[rows], self.next_value[rows]))
        positions.append(pos)
        write_slots.append(own_slots_of(tables, pos, self.bs, self.P))
        flat = torch.arange(first_row, first_row + D, device=self.device)
        groups.append(AttentionGroup(flat[:, None], pos[:, None], tables, pos - self.P + 1,
                                     SharedPrefix(image_tables, by_image, slot)))
        return flat

    def _init_rows(self, rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        self.state_int["mode"][rows] = ints[:, 0]
        self.state_int["limit"][rows] = ints[:, 1]
        self.state_int["seed"][rows] = ints[:, 2]
        self.state_int["phase"][rows] = 0
        self.state_int["count"][rows] = 0
        self.after_prompt[rows] = True
        self.state_float["temperature"][rows] = floats[:, 0]
        self.state_float["top_p"][rows] = floats[:, 1]

    def _decide(self, rows: torch.Tensor, hidden_BC: torch.Tensor, heads) -> Decision:
        st = RowState(mode=self.state_int["mode"][rows], phase=self.state_int["phase"][rows],
                      count=self.state_int["count"][rows], limit=self.state_int["limit"][rows],
                      after_prompt=self.after_prompt[rows], temperature=self.state_float["temperature"][rows],
                      top_p=self.state_float["top_p"][rows], seed=self.state_int["seed"][rows])
        d = decide(self.model, hidden_BC, st, self.sampling, heads)
        self.state_int["phase"][rows] = st.phase
        self.state_int["count"][rows] = st.count
        self.after_prompt[rows] = st.after_prompt
        self.next_kind[rows] = d.next_kind
        self.next_token[rows] = d.next_token
        self.next_value[rows] = d.next_value
        return d


def _rows_by_image(image_of_row: np.ndarray, q_rows: np.ndarray, n_images: int, pad: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Group a [B, T] block of query rows (pads == pad) by image, keeping their order.
    -> ([n_images, M] rows of each image's queries, [B, T] slot of each query in [n_images * M])."""
    valid = q_rows != pad
    image = np.broadcast_to(image_of_row[:, None], q_rows.shape)[valid]  # row-major order
    counts = np.bincount(image, minlength=n_images)
    M = int(counts.max()) if image.size else 0
    order = np.argsort(image, kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size) - (np.cumsum(counts) - counts)[image[order]]
    rows = np.full((n_images, M), pad, dtype=np.int64)
    rows[image, rank] = q_rows[valid]
    slots = np.full(q_rows.shape, n_images * M, dtype=np.int64)
    slots[valid] = image * M + rank
    return rows, slots


def _bucket(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


class DecodeGraphs:
    """CUDA graphs of decode-only steps, keyed by padded (rows, images) counts (powers of two).

    A graph reads rows, positions and block tables from static buffers. Padding rows point at
    the scratch state row and the null block (they write only there); padding images have no
    query rows. Every output head is computed for every row here (fixed shapes).
    """

    def __init__(self, runner: Runner, max_own_blocks: int, seqs_per_image: int, capture: bool = True):
        self.r = runner
        self.own = max_own_blocks
        self.per_image = seqs_per_image
        self.capture = capture  # False: run the same fixed-shape body eagerly (tests it on CPU)
        self.graphs: dict[tuple[int, int], tuple] = {}  # (graph | None, static inputs, outputs | body)
        self.pool = None

    def _capture(self, n_rows: int, n_images: int):
        r = self.r
        dev = r.device
        nbp = -(-r.P // r.bs)
        static = {"rows": torch.full((n_rows,), r.n_rows, dtype=torch.long, device=dev),
                  "pos": torch.full((n_rows,), r.P, dtype=torch.long, device=dev),
                  "tables": torch.zeros(n_rows, self.own, dtype=torch.long, device=dev),
                  "image_tables": torch.zeros(n_images, nbp, dtype=torch.long, device=dev),
                  "by_image": torch.full((n_images, self.per_image), n_rows, dtype=torch.long, device=dev),
                  "slot": torch.full((n_rows, 1), n_images * self.per_image, dtype=torch.long, device=dev)}

        def body() -> Decision:
            embeds, positions, groups, write_slots = [], [], [], []
            flat = r._decode_group(static["rows"], static["pos"], static["tables"], static["image_tables"],
                                   static["by_image"], static["slot"], 0, embeds, positions, write_slots, groups)
            batch = AttentionBatch(write_slots[0], groups, r.bs, r.P)
            hidden = r.model.forward_tokens(embeds[0], positions[0], batch, r.cache)
            return r._decide(static["rows"], hidden[flat], None)

        if not self.capture:
            self.graphs[(n_rows, n_images)] = (None, static, body)
            return
        # Warm-up and capture run the body for real: on the scratch row and the null block only.
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = body()
        self.pool = graph.pool()
        self.graphs[(n_rows, n_images)] = (graph, static, out)

    def run(self, plan: StepPlan, slot: Slot) -> Decision:
        r = self.r
        D, I = len(plan.decode_rows), len(plan.decode_image_tables)
        key = (min(_bucket(D), r.n_rows), min(_bucket(I), r.n_rows))
        if key not in self.graphs:
            self._capture(*key)
        graph, static, out = self.graphs[key]
        n_rows, n_images = key
        rows = np.full(n_rows, r.n_rows, dtype=np.int64)
        rows[:D] = plan.decode_rows
        pos = np.full(n_rows, r.P, dtype=np.int64)
        pos[:D] = plan.decode_pos
        tables = np.zeros((n_rows, self.own), dtype=np.int64)
        tables[:D, : plan.decode_tables.shape[1]] = plan.decode_tables
        image_tables = np.zeros((n_images, static["image_tables"].shape[1]), dtype=np.int64)
        image_tables[:I] = plan.decode_image_tables
        grouped, slot_actual = _rows_by_image(plan.decode_image, np.arange(D, dtype=np.int64)[:, None], I, n_rows)
        by_image = np.full((n_images, self.per_image), n_rows, dtype=np.int64)
        by_image[:I, : grouped.shape[1]] = grouped
        # The same slots, in the graph's fixed [n_images, per_image] layout.
        M = max(grouped.shape[1], 1)
        q_slot = np.full((n_rows, 1), n_images * self.per_image, dtype=np.int64)
        q_slot[:D, 0] = slot_actual[:, 0] // M * self.per_image + slot_actual[:, 0] % M
        arrays = [rows, pos, tables, image_tables, by_image, q_slot]
        uploaded, _ = slot.upload(arrays, [], r.device, r.compute)
        for k, v in zip(("rows", "pos", "tables", "image_tables", "by_image", "slot"), uploaded):
            static[k].copy_(v)
        if graph is None:
            return out()  # the uncaptured body
        graph.replay()
        return out

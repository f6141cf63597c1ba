"""The engine: continuous batching over images, one step = schedule -> run -> commit.

Two step functions share one scheduler and one runner, chosen at start-up:
  synchronous  schedule(t), launch(t), collect+commit(t)
  pipelined    schedule(t+1), launch(t+1), then collect+commit(t) while the device runs t+1
Both produce identical labels: the device never needs the host's commit to compute the next
step (tokens, grammar state and limits live on the device), so the pipelined engine only
changes *when* the host looks at results, never what they are.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..job import EngineSpec
from ..models.attention import AttentionBatch, PrefixGroup
from ..models.decoding import RawOutput, RowState
from ..models.family import EngineModel, TaskSequence
from .kv_cache import BlockManager
from .labeler import WorkItem, sequence_seed
from .plan import PREFILL_TOKENS_PER_STEP
from .runner import Runner
from .scheduler import Scheduler
from .sequence import Image, Sequence
from .staging import InFlight

MAX_VISION_COST = 128  # vision work (crops, patches / 1024) per batch: bounds its activation memory


class Engine:
    def __init__(self, model: EngineModel, seqs: list[TaskSequence], settings: EngineSpec, max_prefix_len: int):
        # the device's default batch size where the job gives none
        settings = settings.model_copy(update={"max_batch_size": settings.batch_size_for(model.device.type)})
        self.model, self.seqs, self.settings = model, seqs, settings
        bs = settings.block_size
        n_rows = settings.max_batch_size
        blocks_for = lambda n: -(-n // bs)  # noqa: E731
        n_prefix = blocks_for(max_prefix_len)
        self.own_blocks = [blocks_for(len(s.spec.prompt) + s.spec.budget) for s in seqs]
        self.images_to_fill = math.ceil(n_rows / len(seqs))
        n_slots = max(settings.max_images_in_flight, 1)
        n_blocks = self._kv_blocks(n_rows, n_prefix, max(self.own_blocks), bs)
        cache = model.new_kv_cache(n_blocks, bs)
        sampling = any(s.spec.temperature > 0 for s in seqs)
        self.runner = Runner(model, cache, n_rows, n_slots, max_prefix_len, max(self.own_blocks),
                             max(len(s.spec.prompt) for s in seqs), len(seqs), settings.cuda_graphs, sampling)
        self.scheduler = Scheduler(BlockManager(n_blocks, bs), n_rows, n_slots)
        self.inflight: deque[InFlight] = deque()
        # On CPU a launch runs the whole forward before returning: pipelining would only add a
        # zombie row per finish and a step of admission lag.
        self.pipelined = model.device.type == "cuda" if settings.pipelined == "auto" else settings.pipelined
        self.step = self._step_pipelined if self.pipelined else self._step_sync
        self.stats = {"steps": 0, "kv_blocks": n_blocks}

    # ------------------------------------------------------------------ sizing

    def _kv_blocks(self, n_rows: int, n_prefix: int, max_own: int, bs: int) -> int:
        """Enough blocks to fill every row (with twice the images that needs, at their largest),
        and on CUDA no more than free memory allows after a warm-up of the largest step."""
        wanted = 1 + 2 * self.images_to_fill * n_prefix + n_rows * max_own + sum(self.own_blocks)
        model = self.model
        if model.device.type != "cuda":
            return wanted
        per_block = model.kv_bytes_per_token() * bs
        reserve = self._warmup_peak_bytes()
        free, _ = torch.cuda.mem_get_info(model.device)
        fits = int((free - reserve) * self.settings.kv_memory_fraction) // per_block
        if fits < 1 + n_prefix + max_own:
            raise RuntimeError("not enough accelerator memory for one image's KV cache")
        return max(2, min(wanted, fits))

    @torch.inference_mode()
    def _warmup_peak_bytes(self) -> int:
        """Peak activation memory of a maximal vision batch and a maximal mixed forward."""
        model, dev = self.model, self.model.device
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        feats = model.encode(model.largest_vision_batch())
        prefix = model.prefix_inputs(feats[:1])
        n_rows, bs = self.settings.max_batch_size, self.settings.block_size
        n = PREFILL_TOKENS_PER_STEP + n_rows * 16
        scratch = model.new_kv_cache(3, bs)
        embeds = torch.cat([prefix.embeds_NC, prefix.embeds_NC.new_zeros(n, prefix.embeds_NC.shape[1])])
        positions = torch.cat([prefix.positions, model.own_positions(torch.zeros(n, dtype=torch.long, device=dev))],
                              dim=-1)
        N = embeds.shape[0]
        table = torch.tensor([[1, 2]], device=dev)
        batch = AttentionBatch(torch.zeros(N, dtype=torch.long, device=dev),
                               [PrefixGroup(torch.arange(N, device=dev)[None], table,
                                            torch.tensor([2 * bs], device=dev), causal=False)], bs)
        hidden = model.forward(embeds, positions, batch, scratch, prefix)
        zeros = torch.zeros(n_rows, dtype=torch.long, device=dev)
        state = RowState(zeros, zeros, zeros, zeros + 1, zeros.bool(), zeros.float(), zeros.float() + 1, zeros)
        model.decide(hidden[:n_rows], state, True, None)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del scratch, hidden, feats, prefix
        torch.cuda.empty_cache()
        return int(peak * 1.2)

    # ------------------------------------------------------------------ the loop

    def _step_sync(self) -> list[Image] | None:
        """-> images completed by this step, or None when there was nothing to do."""
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        self.stats["steps"] += 1
        return self.scheduler.commit(plan, self.runner.collect(self.runner.launch(plan)))

    def _step_pipelined(self) -> list[Image] | None:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.stats["steps"] += 1
            self.inflight.append(self.runner.launch(plan))
        if self.inflight and (len(self.inflight) == 2 or plan is None):
            oldest = self.inflight.popleft()
            return self.scheduler.commit(oldest.plan, self.runner.collect(oldest))
        return None if plan is None else []

    def _feed(self, items: Iterator[WorkItem]) -> bool:
        """Encode more images when the admission queue runs short. -> False once input is exhausted."""
        sched = self.scheduler
        batch: list[tuple[Image, int]] = []
        cost = 0
        while len(sched.encoded) + len(batch) < self.images_to_fill and cost < MAX_VISION_COST:
            slot = sched.take_image_slot()
            if slot is None:
                break
            item = next(items, None)
            if item is None:
                sched.free_image_slots.append(slot)
                self._encode(batch)
                return False
            image = Image(item.ticket, item.image, item.key, item.image.prefix_len, item.image.next_pos)
            image.seqs = [Sequence(image, j, s.spec, sequence_seed(self.settings.seed, item.key, j))
                          for j, s in enumerate(self.seqs)]
            batch.append((image, slot))
            cost += item.image.cost
        self._encode(batch)
        return True

    def _encode(self, batch: list[tuple[Image, int]]) -> None:
        if not batch:
            return
        self.runner.encode([im.prepared for im, _ in batch], [slot for _, slot in batch])
        for image, slot in batch:
            image.prepared = None  # crops are on the device now
            self.scheduler.add_encoded(image, slot)

    def run(self, items: Iterable[WorkItem]) -> Iterator[Image]:
        it = iter(items)
        more = True
        while True:
            if more:
                more = self._feed(it)
            done = self.step()
            if done is None and not self.scheduler.idle:
                raise RuntimeError("engine stalled: queued images cannot be admitted")
            yield from done or []
            if not more and self.scheduler.idle and not self.inflight:
                return


class EngineLabeler:
    def __init__(self, model: EngineModel, seqs: list[TaskSequence], settings: EngineSpec, max_prefix_len: int):
        self.engine = Engine(model, seqs, settings, max_prefix_len)

    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]:
        for image in self.engine.run(items):
            yield image.ticket, [s.output for s in image.seqs]

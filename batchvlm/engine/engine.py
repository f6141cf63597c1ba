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
from ..models.moondream.decoding import RawOutput
from ..models.moondream.family import Moondream
from ..models.moondream.family import Sequence as TaskSequence
from ..models.moondream.vision import n_crops
from .kv_cache import BlockManager
from .labeler import WorkItem, sequence_seed
from .runner import InFlight, Runner
from .scheduler import PREFILL_TOKENS_PER_STEP, Scheduler
from .sequence import Image, Sequence

MAX_VISION_CROPS = 128  # crops per vision batch: bounds the vision stage's activation memory


class Engine:
    def __init__(self, md: Moondream, seqs: list[TaskSequence], settings: EngineSpec):
        self.md, self.seqs, self.settings = md, seqs, settings
        model = md.model
        self.P = model.config.prefix_len
        bs = settings.block_size
        n_rows = settings.max_batch_size
        blocks_for = lambda n: -(-n // bs)  # noqa: E731
        n_prefix = blocks_for(self.P)
        self.own_blocks = [blocks_for(len(s.spec.prompt) + s.spec.budget) for s in seqs]
        self.images_to_fill = math.ceil(n_rows / len(seqs))
        n_slots = max(settings.max_images_in_flight, 1)
        n_blocks = self._kv_blocks(n_rows, n_prefix, max(self.own_blocks), bs)
        cache = model.new_kv_cache(n_blocks, bs)
        sampling = any(s.spec.temperature > 0 for s in seqs)
        self.runner = Runner(model, cache, n_rows, n_slots, max(self.own_blocks), max(len(s.spec.prompt) for s in seqs),
                             len(seqs), settings.cuda_graphs, sampling)
        self.scheduler = Scheduler(BlockManager(n_blocks, bs), n_rows, self.P, n_slots)
        self.inflight: deque[InFlight] = deque()
        # On CPU a launch runs the whole forward before returning: pipelining would only add a
        # zombie row per finish and a step of admission lag.
        self.pipelined = model.device.type == "cuda" if settings.pipelined == "auto" else settings.pipelined
        self.step = self._step_pipelined if self.pipelined else self._step_sync
        self.stats = {"steps": 0, "kv_blocks": n_blocks}

    # ------------------------------------------------------------------ sizing

    def _kv_blocks(self, n_rows: int, n_prefix: int, max_own: int, bs: int) -> int:
        """Enough blocks to fill every row (with twice the images that needs), and on CUDA no
        more than free memory allows after a warm-up of the largest step."""
        wanted = 1 + 2 * self.images_to_fill * n_prefix + n_rows * max_own + sum(self.own_blocks)
        model = self.md.model
        if model.device.type != "cuda":
            return wanted
        t = model.config.text
        per_block = 2 * t.n_layers * bs * t.n_kv_heads * t.head_dim * model.dtype.itemsize
        reserve = self._warmup_peak_bytes()
        free, _ = torch.cuda.mem_get_info(model.device)
        fits = int((free - reserve) * self.settings.kv_memory_fraction) // per_block
        if fits < 1 + n_prefix + max_own:
            raise RuntimeError("not enough accelerator memory for one image's KV cache")
        return max(2, min(wanted, fits))

    @torch.inference_mode()
    def _warmup_peak_bytes(self) -> int:
        """Peak activation memory of a maximal vision batch and a maximal mixed forward."""
        from ..models.attention import AttentionBatch, AttentionGroup

        model, dev = self.md.model, self.md.model.device
        c = model.config
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        s = c.vision.crop_size
        crops = torch.zeros(MAX_VISION_CROPS, s, s, 3, dtype=torch.uint8, device=dev)
        model.vision(crops, [(1, 1)] * MAX_VISION_CROPS)
        n = PREFILL_TOKENS_PER_STEP + self.settings.max_batch_size * 16
        scratch = model.new_kv_cache(2, self.settings.block_size)
        pos = torch.full((1, n), self.P, device=dev)
        batch = AttentionBatch(torch.zeros(n, dtype=torch.long, device=dev),
                               [AttentionGroup(torch.arange(n, device=dev)[None], pos,
                                               torch.zeros(1, 1, dtype=torch.long, device=dev),
                                               torch.ones(1, dtype=torch.long, device=dev))],
                               self.settings.block_size, self.P)
        hidden = model.forward_tokens(torch.zeros(n, c.text.dim, dtype=model.dtype, device=dev), pos[0], batch, scratch)
        model.text.logits(hidden[: self.settings.max_batch_size])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del scratch, hidden, crops
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
        crops = 0
        while len(sched.encoded) + len(batch) < self.images_to_fill and crops < MAX_VISION_CROPS:
            slot = sched.take_image_slot()
            if slot is None:
                break
            item = next(items, None)
            if item is None:
                sched.free_image_slots.append(slot)
                self._encode(batch)
                return False
            image = Image(item.ticket, item.image, item.key)
            image.seqs = [Sequence(image, j, s.spec, sequence_seed(self.settings.seed, item.key, j))
                          for j, s in enumerate(self.seqs)]
            batch.append((image, slot))
            crops += n_crops(item.image.tiling)
        self._encode(batch)
        return True

    def _encode(self, batch: list[tuple[Image, int]]) -> None:
        if not batch:
            return
        self.runner.encode([im.prepared.crops for im, _ in batch], [im.prepared.tiling for im, _ in batch],
                           [slot for _, slot in batch])
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
    def __init__(self, md: Moondream, seqs: list[TaskSequence], settings: EngineSpec):
        self.engine = Engine(md, seqs, settings)

    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]:
        for image in self.engine.run(items):
            yield image.ticket, [s.output for s in image.seqs]

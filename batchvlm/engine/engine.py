"""The engine: continuous batching over images, one step = schedule -> run -> commit.

Two step functions share one scheduler and one runner, chosen at start-up:
  synchronous  schedule(t), launch(t), collect+commit(t)
  pipelined    schedule(t+1), launch(t+1), then collect+commit(t) while the device runs t+1
Both produce identical labels: the device never needs the host's commit to compute the next
step (tokens, grammar state and limits live on the device), so the pipelined engine only
changes *when* the host looks at results, never what they are. The one host-made input, the
token mask of a constrained sequence (json), is planned only once the sequence's last step is
committed, so it never holds a launch back (scheduler.py: such sequences take turns).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..cache.blocks import BlockManager, SnapshotSlots
from ..cache.specs import bytes_per_slot, bytes_per_state, has_recurrent, prefix_view_bytes
from ..cache.tensors import EngineCache
from ..job import EngineSpec
from ..models.base.decoding import MODE_SCORE, Decision, RawOutput, sequence_seed
from ..models.base.contract import EngineModel, TaskSequence, WorkItem
from ..attention import reference as attention
from ..attention.fused import COMPILED, FusedAttention, MaskBounds
from .memory import available_bytes
from .plan import PREFILL_TOKENS_PER_STEP, StepPlan
from .runner import Runner
from .scheduler import Scheduler
from .sequence import ImageWork, Prefix, Sequence
from .staging import InFlight
from .warmup import largest_step


def print_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


MAX_VISION_COST = 128  # vision work (crops, patches / 1024) per batch: bounds its activation memory


class Engine:
    def __init__(self, model: EngineModel, seqs: list[TaskSequence], settings: EngineSpec, max_prefix_len: int,
                 log: Callable[[str], None] = print_stderr):
        # the device's default batch size where the job gives none
        settings = settings.model_copy(update={"max_batch_size": settings.batch_size_for(model.device.type)})
        self.model, self.seqs, self.settings = model, seqs, settings
        # A prefix is the image's features then its sequences' prefix prompt.
        self.max_prefix_len = max_prefix_len = max_prefix_len + max(len(s.spec.prefix_prompt) for s in seqs)
        self.log = log
        if model.device.type == "cuda":  # graph capture and side streams use the current device
            torch.cuda.set_device(model.device)
        self._compiled_before = (COMPILED.shapes, COMPILED.seconds)  # flex compiles are process-wide
        self.sampling = any(s.spec.temperature > 0 for s in seqs)
        self.scores = any(s.spec.mode == MODE_SCORE for s in seqs)  # classify: the warm-up scores prompt rows
        # Constrained sequences (json; constrained detect / point): the width of their token masks.
        self.mask_words = max((s.spec.grammar.words for s in seqs if s.spec.grammar is not None), default=0)
        self.specs = model.state_specs()
        bs = settings.block_size
        n_rows = settings.max_batch_size
        blocks_for = lambda n: -(-n // bs)  # noqa: E731
        prompts = [s.spec.prefix_prompt for s in seqs]
        self.prefixes_per_image = len(set(prompts))
        self.seqs_per_prefix = max(prompts.count(p) for p in prompts)
        n_prefix = blocks_for(max_prefix_len) * self.prefixes_per_image
        self.own_blocks = [blocks_for(len(s.spec.prompt) + s.spec.budget) for s in seqs]
        n_slots = max(settings.max_images_in_flight, 1)
        # Snapshot holders: the prefixes of the images prefilled in one step (at most one feature
        # slot each; scheduler.py admits no new image while one still has waiting sequences).
        self.n_snapshots = n_slots * self.prefixes_per_image if has_recurrent(self.specs) else 0
        n_blocks, n_rows, view_bytes = self._kv_blocks(n_rows, n_prefix, max(self.own_blocks), bs)
        # Rows beyond what the blocks can hold at once would never run: their staging is waste.
        n_rows = max(1, min(n_rows, (n_blocks - 1 - n_prefix) // min(self.own_blocks)))
        self.images_to_fill = math.ceil(n_rows / len(seqs))
        cache = EngineCache.allocate(self.specs, n_blocks, bs, n_rows, self.n_snapshots, model.device)
        self._bound_attention(cache, n_rows)
        runner_args = (model, cache, n_rows, n_slots * self.prefixes_per_image, max_prefix_len,
                       max(self.own_blocks), self.seqs_per_prefix)
        try:
            self.runner = Runner(*runner_args, settings.cuda_graphs, self.sampling, self.mask_words)
        except torch.OutOfMemoryError:  # capturing the graphs: run every step eagerly instead
            if not settings.cuda_graphs:
                raise
            torch.cuda.empty_cache()
            log("batchvlm: out of accelerator memory capturing CUDA graphs; every step runs eagerly "
                "(engine.cuda_graphs: false skips the capture; a smaller engine.kv_memory_fraction leaves room for it)")
            self.runner = Runner(*runner_args, False, self.sampling, self.mask_words)
        graphs = self.runner.graphs
        # On CPU a launch runs the whole forward before returning: pipelining would only add a
        # zombie row per finish and a step of admission lag.
        self.pipelined = model.device.type == "cuda" if settings.pipelined == "auto" else settings.pipelined
        # With graphs, admit once an eighth of the rows is free: steps that admit run eagerly.
        self.scheduler = Scheduler(BlockManager(n_blocks, bs), n_rows, n_slots,
                                   admit_rows=max(1, n_rows // 8) if graphs is not None else 1,
                                   snapshots=SnapshotSlots(self.n_snapshots) if self.n_snapshots else None,
                                   emit=model.emit, fill_masks=model.fill_masks if self.mask_words else None,
                                   mask_words=self.mask_words, pipelined=self.pipelined)
        self.inflight: deque[InFlight] = deque()
        self._held: WorkItem | None = None  # the next image, when it did not fit in the last vision batch
        self.step = self._step_pipelined if self.pipelined else self._step_sync
        self.stats = {"steps": 0, "graph_steps": 0, "vision_images": 0, "kv_blocks": n_blocks, "rows": n_rows,
                      "prefix_view_bytes": view_bytes,
                      "graph_capture_s": round(graphs.capture_s, 2) if graphs is not None else 0.0}
        self._count_compiles()

    def _bound_attention(self, cache: EngineCache, n_rows: int) -> None:
        """Pick each paged cache's attention backend now (else on first use) and give a fused one
        this engine's maxima: every mask it builds, graph captures included, is padded to them, so
        its compiled kernel shapes are fixed (attention/fused.py)."""
        bs = self.settings.block_size
        bounds = MaskBounds(n_rows, max(self.own_blocks), -(-self.max_prefix_len // bs),
                            max(len(s.spec.prompt) for s in self.seqs), self.seqs_per_prefix)
        for kv in cache.paged.values():
            if kv.backend is None:
                kv.backend = attention.backend_for(kv.k.device)
            if isinstance(kv.backend, FusedAttention):
                kv.backend.bounds = bounds

    def _count_compiles(self) -> None:
        """flex_attention shapes compiled since this engine began (warm-up and graph capture included)."""
        shapes, seconds = self._compiled_before
        self.stats["compiled_shapes"] = COMPILED.shapes - shapes
        self.stats["compile_s"] = round(COMPILED.seconds - seconds, 2)

    # ------------------------------------------------------------------ sizing

    def _kv_blocks(self, n_rows: int, n_prefix: int, max_own: int, bs: int) -> tuple[int, int, int]:
        """-> (blocks, rows, PrefixView bytes reserved). Enough blocks to fill every row (with
        twice the images that needs, at their largest), and no more than free memory allows:
        accelerator memory after a warm-up of the largest step on CUDA (rows halve until that
        step fits), available host memory on CPU; either less the largest PrefixView the rows
        can hold (rows halve until one image's cache fits beside it)."""
        model = self.model
        reserve = 0
        if model.device.type == "cuda":
            reserve, n_rows = self._warmup_peak_bytes(n_rows)
        available = available_bytes(model.device)
        per_block = bytes_per_slot(self.specs) * bs
        one_image = 1 + n_prefix + max_own
        while True:
            view_bytes = self._prefix_view_bytes(n_rows)
            room = int((available - reserve - view_bytes) * self.settings.kv_memory_fraction)
            room -= bytes_per_state(self.specs) * (n_rows + 1 + self.n_snapshots)  # recurrent kinds: fixed
            fits = room // per_block
            if fits >= one_image or n_rows == 1 or not view_bytes:
                break
            n_rows //= 2
            self.log(f"batchvlm: the attention's prefix copies for every row leave no {model.device.type} memory "
                     f"for one image's KV cache; trying {n_rows} rows "
                     f"(engine.max_batch_size={self.settings.max_batch_size})")
        if fits < one_image:
            raise RuntimeError(
                f"not enough {model.device.type} memory for one image's KV cache: it needs "
                f"{one_image * per_block / 2**20:.0f} MiB, {max(room, 0) / 2**20:.0f} MiB is free for it "
                f"(engine.kv_memory_fraction={self.settings.kv_memory_fraction})")
        images_to_fill = math.ceil(n_rows / len(self.seqs))
        wanted = 1 + 2 * images_to_fill * n_prefix + n_rows * max_own + sum(self.own_blocks)
        return max(2, min(wanted, fits)), n_rows, view_bytes

    def _prefix_view_bytes(self, n_rows: int) -> int:
        """The most the runner's PrefixView holds, outside the cache (the reference attention
        backend only): a decode group reads at most one prefix per row, each at most
        max_prefix_len long. No warm-up measures it: the CPU has none, and its largest step
        prefills, which ends a view (runner.py `_prefix_view`)."""
        if isinstance(attention.backend_for(self.model.device), FusedAttention):
            return 0
        return prefix_view_bytes(self.specs, n_rows, self.max_prefix_len)

    def _warmup_peak_bytes(self, n_rows: int) -> tuple[int, int]:
        """-> (peak activation memory of a maximal vision batch and of the largest step the
        scheduler can plan with n_rows rows (warmup.py), rows). Run for real through the runner's
        eager path on a scratch cache; out of memory, the rows halve until it fits."""
        dev = self.model.device
        while True:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            try:
                self._run_largest_step(n_rows)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                if n_rows == 1:
                    raise RuntimeError("not enough accelerator memory for the largest vision batch and a "
                                       "one-sequence step") from None
                n_rows //= 2
                self.log(f"batchvlm: the largest step does not fit in accelerator memory; trying "
                         f"{n_rows} rows (engine.max_batch_size={self.settings.max_batch_size})")
                continue
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev) - base
            torch.cuda.empty_cache()
            return int(peak * 1.2), n_rows

    @torch.inference_mode()
    def _run_largest_step(self, n_rows: int, prefill_tokens: int = PREFILL_TOKENS_PER_STEP) -> Decision:
        """A maximal vision batch, then the largest step (warmup.py) on a scratch cache and runner."""
        model, seqs, bs = self.model, self.seqs, self.settings.block_size
        feats = model.encode(model.largest_vision_batch())
        max_prompt = max(len(s.spec.prompt) for s in seqs)
        plan = largest_step(n_rows, self.seqs_per_prefix, self.max_prefix_len, max_prompt,
                            max(len(s.spec.prompt) + s.spec.budget for s in seqs), bs, prefill_tokens,
                            max(len(s.spec.prefix_prompt) for s in seqs), bool(self.n_snapshots), self.scores)
        scratch = EngineCache.allocate(self.specs, 2, bs, n_rows, max(self.n_snapshots, 1), model.device)
        self._bound_attention(scratch, n_rows)
        runner = Runner(model, scratch, n_rows, max(len(plan.prefix_features), 1),
                        self.max_prefix_len, max(self.own_blocks), self.seqs_per_prefix, False, self.sampling,
                        self.mask_words)
        return runner.warm_up(plan, feats)

    # ------------------------------------------------------------------ the loop

    def _step_sync(self) -> list[ImageWork] | None:
        """-> images completed by this step, or None when there was nothing to do."""
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        return self.scheduler.commit(plan, self.runner.collect(self._launch(plan)))

    def _step_pipelined(self) -> list[ImageWork] | None:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.inflight.append(self._launch(plan))
        if self.inflight and (len(self.inflight) == 2 or plan is None):
            oldest = self.inflight.popleft()
            return self.scheduler.commit(oldest.plan, self.runner.collect(oldest))
        return None if plan is None else []

    def _launch(self, plan: StepPlan) -> InFlight:
        inflight = self.runner.launch(plan)
        stats = self.stats
        stats["steps"] += 1
        stats["graph_steps"] = self.runner.graph_steps
        self._count_compiles()
        if inflight.oom_rows:  # the step still ran whole, in parts; later steps get half its rows
            cap = self.scheduler.shrink(inflight.oom_rows // 2)
            stats["oom_halvings"] = stats.get("oom_halvings", 0) + 1
            self.log(f"batchvlm: out of accelerator memory in a step of {inflight.oom_rows} sequences; it ran "
                     f"in parts, and steps now hold at most {cap} sequences")
        return inflight

    def summary(self) -> str:
        s = self.stats
        share = s["graph_steps"] / s["steps"] if s["steps"] else 0.0
        return (f"{s['steps']} steps, {share:.0%} replayed a CUDA graph ({s['graph_capture_s']:.1f} s to capture), "
                f"{s['rows']} rows, {s['kv_blocks']} KV blocks, flex_attention compiled {s['compiled_shapes']} shapes "
                f"in {s['compile_s']:.1f} s")

    def _feed(self, items: Iterator[WorkItem]) -> bool:
        """Encode more images when the admission queue runs short. -> False once input is exhausted."""
        sched = self.scheduler
        batch: list[tuple[ImageWork, int]] = []
        cost = 0
        while len(sched.encoded) + len(batch) < self.images_to_fill and cost < MAX_VISION_COST:
            slot = sched.take_feature_slot()
            if slot is None:
                break
            item, self._held = self._held or next(items, None), None
            if item is None:
                sched.free_feature_slots.append(slot)
                self._encode(batch)
                return False
            if batch and cost + item.image.cost > MAX_VISION_COST:  # the warm-up measured at most this
                self._held = item
                sched.free_feature_slots.append(slot)
                break
            image = ImageWork(item.ticket, item.image, item.key)
            by_prompt: dict[tuple[int, ...], Prefix] = {}
            for s in self.seqs:
                if s.spec.prefix_prompt not in by_prompt:
                    by_prompt[s.spec.prefix_prompt] = Prefix(s.spec.prefix_prompt,
                                                             *self.model.prefix_layout(item.image, s.spec.prefix_prompt))
            image.prefixes = list(by_prompt.values())
            image.seqs = [Sequence(image, by_prompt[s.spec.prefix_prompt], j, s.spec,
                                   sequence_seed(self.settings.seed, item.key, j)) for j, s in enumerate(self.seqs)]
            batch.append((image, slot))
            cost += item.image.cost
        self._encode(batch)
        return True

    def _encode(self, batch: list[tuple[ImageWork, int]]) -> None:
        if not batch:
            return
        self.runner.encode([im.prepared for im, _ in batch], [slot for _, slot in batch])
        self.stats["vision_images"] += len(batch)
        for image, slot in batch:
            image.prepared = None  # crops are on the device now
            self.scheduler.add_encoded(image, slot)

    def run(self, items: Iterable[WorkItem]) -> Iterator[ImageWork]:
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
    def __init__(self, model: EngineModel, seqs: list[TaskSequence], settings: EngineSpec, max_prefix_len: int,
                 log: Callable[[str], None] = print_stderr):
        self.engine = Engine(model, seqs, settings, max_prefix_len, log)

    def label(self, items: Iterable[WorkItem]) -> Iterator[tuple[Any, list[RawOutput]]]:
        for image in self.engine.run(items):
            yield image.ticket, [s.output for s in image.seqs]

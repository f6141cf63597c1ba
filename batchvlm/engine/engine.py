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

import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from ..attention import dispatch
from ..attention.backend import COMPILED
from ..cache.blocks import BlockManager, SnapshotSlots
from ..cache.tensors import EngineCache
from ..job import EngineSpec
from ..models.base.decoding import RawOutput, sequence_seed
from ..models.base.contract import EngineModel, SampleLike, SampleT, TaskSequence
from .plan import StepPlan
from .runner import Runner
from .scheduler import Scheduler
from .sequence import Prefix, Request, Sequence
from .shape import JobShape
from .sizing import Sizer
from .staging import InFlight


def print_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


MAX_VISION_COST = 128  # vision work (crops, patches / 1024) per batch: bounds its activation memory


class Engine:
    def __init__(self, model: EngineModel, seqs: list[TaskSequence], settings: EngineSpec, max_prefix_len: int,
                 log: Callable[[str], None] = print_stderr):
        # the device's default batch size where the job gives none
        settings = settings.model_copy(update={"max_batch_size": settings.batch_size_for(model.device.type)})
        self.model, self.seqs, self.settings, self.log = model, seqs, settings, log
        if model.device.type == "cuda":  # graph capture and side streams use the current device
            torch.cuda.set_device(model.device)
        self._compiled_before = (COMPILED.shapes, COMPILED.seconds)  # flex compiles are process-wide

        # Size: what the job asks, then what memory gives (the warm-up on CUDA runs here).
        self.shape = shape = JobShape.of(model, seqs, settings, max_prefix_len)
        sizer = Sizer(model, shape, settings, log)
        sizing = sizer.size()
        n_rows = sizing.rows
        self.images_to_fill = shape.images_for(n_rows)
        # Allocate: the cache, and each paged kind's attention backend with this engine's maxima
        # (a fused one pads every mask to them, graph captures included: fixed compiled shapes).
        cache = EngineCache.allocate(sizer.specs, sizing.kv_blocks, shape.block_size, n_rows, shape.snapshots,
                                     model.device)
        dispatch.fix_shapes(cache.paged.values(), shape.bounds(n_rows))
        # Build the runner (graph capture) and the scheduler.
        self.runner = self._runner(cache, n_rows)
        graphs = self.runner.graphs
        # On CPU a launch runs the whole forward before returning: pipelining would only add a
        # zombie row per finish and a step of admission lag.
        self.pipelined = model.device.type == "cuda" if settings.pipelined == "auto" else settings.pipelined
        # With graphs, admit once an eighth of the rows is free: steps that admit run eagerly.
        self.scheduler = Scheduler(BlockManager(sizing.kv_blocks, shape.block_size), n_rows, shape.feature_slots,
                                   admit_rows=max(1, n_rows // 8) if graphs is not None else 1,
                                   snapshots=SnapshotSlots(shape.snapshots) if shape.snapshots else None,
                                   emit=model.emit, fill_masks=model.fill_masks if shape.mask_words else None,
                                   mask_words=shape.mask_words, pipelined=self.pipelined,
                                   prefill_tokens=sizing.prefill_tokens)
        self.inflight: deque[InFlight] = deque()
        self._held: SampleLike | None = None  # the next sample, when it did not fit in the last vision batch
        self.step = self._step_pipelined if self.pipelined else self._step_sync
        self.stats = {"steps": 0, "graph_steps": 0, "split_steps": 0, "vision_images": 0, "kv_blocks": sizing.kv_blocks,
                      "kv_mib": round(sizing.kv_bytes / 2**20, 1), "kv_sized_by": "job" if sizing.by_job else "memory",
                      "rows": n_rows, "prefix_view_bytes": sizing.view_bytes, "prefill_tokens": sizing.prefill_tokens,
                      "graph_capture_s": round(graphs.capture_s, 2) if graphs is not None else 0.0}
        self._count_compiles()

    def _runner(self, cache: EngineCache, n_rows: int) -> Runner:
        cuda_graphs = self.settings.cuda_graphs
        try:
            return Runner.for_shape(self.model, cache, self.shape, n_rows, self.shape.feature_slots, cuda_graphs)
        except torch.OutOfMemoryError:  # capturing the graphs: run every step eagerly instead
            if not cuda_graphs:
                raise
            torch.cuda.empty_cache()
            self.log("batchvlm: out of accelerator memory capturing CUDA graphs; every step runs eagerly "
                     "(engine.cuda_graphs: false skips the capture; a smaller engine.kv_memory_fraction leaves room "
                     "for it)")
            return Runner.for_shape(self.model, cache, self.shape, n_rows, self.shape.feature_slots, False)

    def _count_compiles(self) -> None:
        """flex_attention shapes compiled since this engine began (warm-up and graph capture included)."""
        shapes, seconds = self._compiled_before
        self.stats["compiled_shapes"] = COMPILED.shapes - shapes
        self.stats["compile_s"] = round(COMPILED.seconds - seconds, 2)

    # ------------------------------------------------------------------ the loop

    def _step_sync(self) -> list[Request] | None:
        """-> requests completed by this step, or None when there was nothing to do."""
        plan = self.scheduler.schedule()
        if plan is None:
            return None
        return self.scheduler.commit(plan, self.runner.collect(self._launch(plan)))

    def _step_pipelined(self) -> list[Request] | None:
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
        stats["split_steps"] = self.runner.split_steps
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
        return (f"{s['steps']} steps, {share:.0%} replayed a CUDA graph ({s['graph_capture_s']:.1f} s to capture; "
                f"{s['split_steps']} admission steps decoded by one), "
                f"{s['rows']} rows, {s['kv_blocks']} KV blocks, flex_attention compiled {s['compiled_shapes']} shapes "
                f"in {s['compile_s']:.1f} s")

    def _feed(self, samples: Iterator[SampleLike]) -> bool:
        """Encode more images when the admission queue runs short, each into a feature slot the
        scheduler hands out. -> False once input is exhausted."""
        sched = self.scheduler
        batch: list[tuple[Request, int]] = []
        cost = 0
        while len(sched.encoded) + len(batch) < self.images_to_fill and cost < MAX_VISION_COST \
                and sched.has_feature_slot:
            sample, self._held = self._held or next(samples, None), None
            if sample is None:
                self._encode(batch)
                return False
            if batch and cost + sample.prepared.cost > MAX_VISION_COST:  # the warm-up measured at most this
                self._held = sample
                break
            batch.append((self._request(sample), sched.take_feature_slot()))
            cost += sample.prepared.cost
        self._encode(batch)
        return True

    def _request(self, sample: SampleLike) -> Request:
        """A sample, its prefixes (one per distinct prefix prompt) and its task sequences."""
        request = Request(sample)
        by_prompt: dict[tuple[int, ...], Prefix] = {}
        for s in self.seqs:
            if s.spec.prefix_prompt not in by_prompt:
                by_prompt[s.spec.prefix_prompt] = Prefix(s.spec.prefix_prompt,
                                                         *self.model.prefix_layout(sample.prepared, s.spec.prefix_prompt))
        request.prefixes = list(by_prompt.values())
        request.seqs = [Sequence(request, by_prompt[s.spec.prefix_prompt], j, s.spec,
                                 sequence_seed(self.settings.seed, sample.key, j)) for j, s in enumerate(self.seqs)]
        return request

    def _encode(self, batch: list[tuple[Request, int]]) -> None:
        if not batch:
            return
        self.runner.vision.encode([r.sample.prepared for r, _ in batch], [slot for _, slot in batch])
        self.stats["vision_images"] += len(batch)
        for request, slot in batch:
            request.sample.prepared = None  # crops are on the device now: nothing keeps the pixels
            self.scheduler.add_encoded(request, slot)

    def run(self, samples: Iterable[SampleLike]) -> Iterator[Request]:
        it = iter(samples)
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

    def summary(self) -> str:
        return self.engine.summary()

    def label(self, samples: Iterable[SampleT]) -> Iterator[tuple[SampleT, list[RawOutput]]]:
        for request in self.engine.run(samples):
            yield request.sample, [s.output for s in request.seqs]

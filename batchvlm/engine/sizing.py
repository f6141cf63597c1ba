"""Start-up sizing: the rows, KV blocks and snapshot slots of an engine, decided before it steps.

What an engine gets (`Sizing`) for what its job asks (shape.py `JobShape`) depends on memory:
enough KV blocks for what the job can use at once, and no more than free memory allows:
accelerator memory after a real warm-up of the largest step on CUDA (rows halve until that step
fits), available host memory on CPU; either less the largest PrefixView the rows can hold
(reference attention only; rows halve until one image's cache fits beside it). Rows beyond what
the blocks can hold at once would never run, so they go too.

What the job can use at once (`wanted_blocks`): every row's sequence at its longest own length,
and the prefixes of the images those rows hold, each at the longest prefix the model can make
(its largest image). On CUDA twice the images, so that a pipelined step admits the next ones
while the last ones finish, plus one whole image's sequences. On a CPU, where steps are not
pipelined, one image more than the rows hold: the one admitted as rows turn over. A cache
smaller than the worst case only makes admission wait (the scheduler admits what the free
blocks hold), so no bound here changes a label; on a shared host a cache sized from memory is
memory taken from others, and zeroing it is start-up time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention import dispatch
from ..cache.specs import bytes_per_slot, bytes_per_state, prefix_view_bytes
from ..cache.tensors import EngineCache
from ..job import EngineSpec
from ..models.base.decoding import Decision
from ..models.base.contract import EngineModel
from .memory import available_bytes
from .plan import PREFILL_TOKENS_PER_STEP
from .prefill import prefill_budget
from .runner import Runner
from .shape import JobShape
from .warmup import largest_step


@dataclass(frozen=True)
class Sizing:
    """What start-up decided."""

    rows: int
    kv_blocks: int
    view_bytes: int  # the largest PrefixView, reserved beside the cache (reference attention only)
    kv_bytes: int  # the paged cache's tensors
    by_job: bool  # True: kv_blocks is what the job can use at once; False: what memory allows
    prefill_tokens: int  # image-prefix tokens an admission step prefills at most (at least one image)


class Sizer:
    def __init__(self, model: EngineModel, shape: JobShape, settings: EngineSpec, log: Callable[[str], None]):
        self.model, self.shape, self.settings, self.log = model, shape, settings, log
        self.specs = model.state_specs()
        self.prefill_tokens = PREFILL_TOKENS_PER_STEP  # decided first in size(): the warm-up runs it

    def size(self) -> Sizing:
        shape = self.shape
        self.prefill_tokens = self.prefill_budget(self.settings.max_batch_size)
        n_prefix = shape.prefix_blocks * shape.prefixes_per_image
        n_blocks, n_rows, view_bytes, by_job = self._kv_blocks(self.settings.max_batch_size, n_prefix)
        # Rows beyond what the blocks can hold at once would never run: their staging is waste.
        n_rows = max(1, min(n_rows, (n_blocks - 1 - n_prefix) // min(shape.own_blocks)))
        return Sizing(n_rows, n_blocks, view_bytes, n_blocks * self.per_block, by_job, self.prefill_tokens)

    def prefill_budget(self, n_rows: int) -> int:
        """engine.prefill_tokens_per_step, else the device's budget (prefill.py): on CUDA from the
        weights on the device (all that is allocated before the cache) and what a decode step of
        n_rows rows reads besides them (the prefixes of the images they hold, their own K/V at
        its longest, their recurrent state)."""
        if self.settings.prefill_tokens_per_step is not None:
            return self.settings.prefill_tokens_per_step
        dev, shape = self.model.device, self.shape
        if dev.type != "cuda":
            return PREFILL_TOKENS_PER_STEP
        read = (bytes_per_slot(self.specs) * (shape.images_for(n_rows) * shape.max_prefix_len + n_rows * shape.max_own_len)
                + bytes_per_state(self.specs) * n_rows)
        return prefill_budget(torch.cuda.get_device_name(dev), self.model.dtype, torch.cuda.memory_allocated(dev), read)

    @property
    def per_block(self) -> int:
        return bytes_per_slot(self.specs) * self.shape.block_size

    def wanted_blocks(self, n_rows: int, n_prefix: int) -> int:
        """What the job can use at once with n_rows rows (the module docstring), the null block included."""
        shape = self.shape
        own = n_rows * shape.max_own_blocks
        if self.model.device.type == "cuda":
            return 1 + 2 * shape.images_for(n_rows) * n_prefix + own + sum(shape.own_blocks)
        return 1 + (shape.images_for(n_rows) + 1) * n_prefix + own

    def _kv_blocks(self, n_rows: int, n_prefix: int) -> tuple[int, int, int, bool]:
        """-> (blocks, rows, PrefixView bytes reserved, whether the job bounds the blocks): see the
        module docstring."""
        model, shape, settings = self.model, self.shape, self.settings
        reserve = 0
        if model.device.type == "cuda":
            reserve, n_rows = self.warmup_peak_bytes(n_rows)
        available = available_bytes(model.device)
        per_block = self.per_block
        one_image = 1 + n_prefix + shape.max_own_blocks
        while True:
            view_bytes = self._prefix_view_bytes(n_rows)
            room = int((available - reserve - view_bytes) * settings.kv_memory_fraction)
            room -= bytes_per_state(self.specs) * (n_rows + 1 + shape.snapshots)  # recurrent kinds: fixed
            fits = room // per_block
            if fits >= one_image or n_rows == 1 or not view_bytes:
                break
            n_rows //= 2
            self.log(f"batchvlm: the attention's prefix copies for every row leave no {model.device.type} memory "
                     f"for one image's KV cache; trying {n_rows} rows "
                     f"(engine.max_batch_size={settings.max_batch_size})")
        if fits < one_image:
            raise RuntimeError(
                f"not enough {model.device.type} memory for one image's KV cache: it needs "
                f"{one_image * per_block / 2**20:.0f} MiB, {max(room, 0) / 2**20:.0f} MiB is free for it "
                f"(engine.kv_memory_fraction={settings.kv_memory_fraction})")
        wanted = self.wanted_blocks(n_rows, n_prefix)
        return max(2, min(wanted, fits)), n_rows, view_bytes, wanted <= fits

    def _prefix_view_bytes(self, n_rows: int) -> int:
        """The most the runner's PrefixView holds, outside the cache (a backend that does not read
        the cache in place): a decode group reads at most one prefix per row, each at most
        max_prefix_len long. No warm-up measures it: the CPU has none, and its largest step
        prefills, which ends a view (runner.py `_prefix_view`)."""
        if dispatch.backend_for(self.model.device).reads_in_place:
            return 0
        return prefix_view_bytes(self.specs, n_rows, self.shape.max_prefix_len)

    def warmup_peak_bytes(self, n_rows: int) -> tuple[int, int]:
        """-> (peak activation memory of a maximal vision batch and of the largest step the
        scheduler can plan with n_rows rows (warmup.py), rows). Run for real through the runner's
        eager path on a scratch cache; out of memory, the rows halve until it fits."""
        dev = self.model.device
        while True:
            torch.cuda.synchronize(dev)
            base = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            try:
                self.run_largest_step(n_rows)
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
    def run_largest_step(self, n_rows: int, prefill_tokens: int | None = None) -> Decision:
        """A maximal vision batch, then the largest step (warmup.py) on a scratch cache and runner
        (prefill_tokens: the engine's budget unless given)."""
        model, shape, bs = self.model, self.shape, self.shape.block_size
        prefill_tokens = self.prefill_tokens if prefill_tokens is None else prefill_tokens
        feats = model.encode(model.largest_vision_batch())
        plan = largest_step(n_rows, shape.seqs_per_prefix, shape.max_prefix_len, shape.max_prompt,
                            shape.max_own_len, bs, prefill_tokens, shape.max_prefix_prompt, bool(shape.snapshots),
                            shape.scores)
        scratch = EngineCache.allocate(self.specs, 2, bs, n_rows, max(shape.snapshots, 1), model.device)
        dispatch.fix_shapes(scratch.paged.values(), shape.bounds(n_rows))
        runner = Runner.for_shape(model, scratch, shape, n_rows, max(len(plan.prefix_features), 1), False)
        return runner.warm_up(plan, feats)

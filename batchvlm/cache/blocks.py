"""Host-side accounting of the engine cache (no tensors here): refcounted KV blocks and
recurrent-state snapshot slots.

Block 0 is the null block (padding writes land there) and is never handed out. A prefix's
blocks are shared by every sequence on that prefix: each holder takes a reference, and the
blocks return to the free list when the last reference is dropped.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    def __init__(self, n_blocks: int, block_size: int):
        if n_blocks < 2:
            raise ValueError("the KV cache needs at least one block beside the null block")
        self.block_size = block_size
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, 0, -1))  # pop() hands out low ids first
        self._refs = [0] * n_blocks

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.n_blocks - 1 - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} released more often than taken")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def refs(self, block: int) -> int:
        return self._refs[block]


class SnapshotSlots:
    """Free list of recurrent-state snapshot slots (EngineCache.snapshot_index). A prefix holds
    one from its prefill until every sequence on it has been planned to fork from it; device
    steps run in plan order, so a slot freed at planning time is rewritten only after the forks."""

    def __init__(self, n: int):
        self.n = n
        self._free = list(range(n - 1, -1, -1))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        return self._free.pop()

    def give(self, s: int) -> None:
        self._free.append(s)

"""Progress: a tqdm bar for people, JSON lines for a parent launcher (run/launch.py, run/ray.py).

The bar's total is the images of the pending shards: exact where the container says (Parquet
row counts, folder listings), else estimated from the shards finished so far (tar shards, in
this run or earlier ones), so rate, ETA and errors show from the first finished shard on. The
last line is drawn after the writer has finished: it is the true final state.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .data.sources import ShardRef, count_samples
from .output.layout import Layout
from .output.manifest import read_stats

PROGRESS_ENV = "BATCHVLM_PROGRESS"  # "json": progress as JSON lines on stdout, for the launcher


def shard_sizes(layout: Layout, mine: list[ShardRef], pending: list[ShardRef]) -> tuple[list[int | None], list[int]]:
    """(samples of each pending shard where known, samples of this rank's finished shards)."""
    pending_stems = {s.stem for s in pending}
    done = [(read_stats(layout, s.stem) or {}).get("rows") for s in mine if s.stem not in pending_stems]
    return [count_samples(s) for s in pending], [n for n in done if isinstance(n, int)]


class Progress:
    def __init__(self, name: str, total_shards: int,
                 sizes: tuple[list[int | None], list[int]] | None = None, enabled: bool = True):
        self.json = os.environ.get(PROGRESS_ENV) == "json"
        self.images = self.errors = 0
        self._pending = [0, 0]
        self._last = time.monotonic()
        self.total_shards = total_shards
        self.sizes, self.finished = (list(sizes[0]), list(sizes[1])) if sizes else (None, [])
        self.total = self._total()
        self._sent_total: int | None = None
        self.bar = None
        if enabled and not self.json:
            from tqdm import tqdm

            self.bar = tqdm(unit="img", desc=name, total=self.total, dynamic_ncols=True, file=sys.stderr)

    def _total(self) -> int | None:
        if self.sizes is None:
            return None
        known = [n for n in self.sizes if n is not None]
        unknown = len(self.sizes) - len(known)
        if unknown and not self.finished:
            return None
        return sum(known) + (round(unknown * sum(self.finished) / len(self.finished)) if unknown else 0)

    def shard_size(self, index: int, n: int) -> None:
        """Pending shard `index` turned out to hold `n` samples (finished or failed)."""
        if self.sizes is None:
            return
        if self.sizes[index] is None:
            self.finished.append(n)
        self.sizes[index] = n
        total = self._total()
        if total is not None and total != self.total:
            self.total = total
            if self.bar is not None:
                self.bar.total = total
                self.bar.refresh()

    def add(self, error: bool, shards_done: int) -> None:
        self.images += 1
        self.errors += error
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(errors=self.errors, shards=f"{shards_done}/{self.total_shards}", refresh=False)
        elif self.json:
            self._pending[0] += 1
            self._pending[1] += error
            if time.monotonic() - self._last > 0.5:
                self.flush()

    def flush(self) -> None:
        if self.json and (self._pending[0] or self.total != self._sent_total):
            msg = {"images": self._pending[0], "errors": self._pending[1]}
            if self.total != self._sent_total:
                msg["total"] = self._sent_total = self.total
            print(json.dumps(msg), flush=True)
            self._pending = [0, 0]
            self._last = time.monotonic()

    def close(self, shards_done: int) -> None:
        self.flush()
        if self.bar is not None:
            self.bar.set_postfix(errors=self.errors, shards=f"{shards_done}/{self.total_shards}", refresh=False)
            self.bar.refresh()
            self.bar.close()

"""Progress: a tqdm bar for people, JSON lines for a parent launcher (launch.py)."""

from __future__ import annotations

import json
import os
import sys
import time


class Progress:
    def __init__(self, name: str, total_shards: int, enabled: bool = True):
        self.json = os.environ.get("BATCHVLM_PROGRESS") == "json"
        self.images = self.errors = 0
        self._pending = [0, 0]
        self._last = time.monotonic()
        self.bar = None
        if enabled and not self.json:
            from tqdm import tqdm

            self.bar = tqdm(unit="img", desc=name, dynamic_ncols=True, file=sys.stderr)
        self.total_shards = total_shards

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
        if self.json and self._pending[0]:
            print(json.dumps({"images": self._pending[0], "errors": self._pending[1]}), flush=True)
            self._pending = [0, 0]
            self._last = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self.bar is not None:
            self.bar.close()

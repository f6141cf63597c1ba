"""Lines for the person watching a run: on stderr, flushed at once (stdout may carry a parent
launcher's JSON progress protocol)."""

from __future__ import annotations

import sys


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

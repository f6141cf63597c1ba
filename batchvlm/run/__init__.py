"""One run path, from a checked job to its Parquet files:

    preflight.py   the one check before a run (validate, --dry-run, run, the launchers)
    launch.py      `batchvlm run` on one node: this process, or one worker process per GPU
    ray.py         `batchvlm run --ray`: the ranks as Ray actors across a cluster
    worker.py      the run loop of one rank (labelling.py: its rows, gathered by shard)
    summary.py     what a run did, its line, and its exit code, decided once
    stop.py        signals: stop after the images in flight, or at once
"""

from __future__ import annotations

import importlib

_PUBLIC = {"RunSummary": "summary", "StopFlag": "stop", "run_job": "worker"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """`from batchvlm.run import run_job` loads the run loop (the engine, torch) when asked for:
    validate and --dry-run import preflight alone."""
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_PUBLIC[name]}"), name)

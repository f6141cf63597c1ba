"""Progress of a job, read from its output folder alone (any number of ranks wrote it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data.sources import list_shards
from .job import Job
from .output.manifest import read_stats


def collect(job: Job) -> dict[str, Any]:
    """Shards done / partial (cut short by --limit or a stop) / failed (unreadable) / pending."""
    out = Path(job.output.dir)
    shards = list_shards(job.input)
    done, partial, failed, rows, errors = [], [], [], 0, 0
    for s in shards:
        stats = read_stats(out, s.stem)
        if stats is None:
            continue
        if stats.get("failed"):
            failed.append(f"{s.stem}: {stats['failed']}")
        elif (out / f"{s.stem}.parquet").exists():
            (done if stats.get("complete") else partial).append(s.stem)
            if stats.get("complete"):
                rows += stats.get("rows", 0)
                errors += stats.get("errors", 0)
    return {"job": job.name, "output": str(out), "shards": len(shards), "done": len(done), "partial": len(partial),
            "failed": len(failed), "pending": len(shards) - len(done) - len(partial) - len(failed), "rows": rows,
            "errors": errors, "partial_shards": partial, "failed_shards": failed}

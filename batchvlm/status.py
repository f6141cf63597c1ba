"""Progress of a job, read from its output folder alone (any number of ranks wrote it).

Where the inputs cannot be listed (gone, or not mounted here), the shards are those the
folder has stats for, and how many are pending is unknown: said, not failed on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data.sources import SourceError, list_shards
from .job import Job
from .output.manifest import is_our_stats, read_stats


def collect(job: Job) -> dict[str, Any]:
    """Shards done / partial (cut short by --limit or a stop) / failed (unreadable) / pending."""
    out = Path(job.output.dir)
    try:
        stems, inputs_missing = [s.stem for s in list_shards(job.input)], None
    except SourceError as e:
        stems = sorted(p.name.removesuffix(".stats.json") for p in out.glob("*.stats.json") if is_our_stats(p))
        inputs_missing = str(e)
    done, partial, failed, rows, errors = [], [], [], 0, 0
    for stem in stems:
        stats = read_stats(out, stem)
        if stats is None:
            continue
        if stats.get("failed"):
            failed.append(f"{stem}: {stats['failed']}")
        elif (out / f"{stem}.parquet").exists():
            (done if stats.get("complete") else partial).append(stem)
            if stats.get("complete"):
                rows += stats.get("rows", 0)
                errors += stats.get("errors", 0)
    pending = None if inputs_missing else len(stems) - len(done) - len(partial) - len(failed)
    return {"job": job.name, "output": str(out), "shards": None if inputs_missing else len(stems),
            "done": len(done), "partial": len(partial), "failed": len(failed), "pending": pending, "rows": rows,
            "errors": errors, "partial_shards": partial, "failed_shards": failed, "inputs_missing": inputs_missing}

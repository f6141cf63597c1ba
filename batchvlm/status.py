"""Progress of a job, read from its output folder alone (any number of ranks wrote it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .data.shardlist import plan
from .job import Job
from .output.layout import Layout
from .output.manifest import damaged_note, done_stats, read_stats


def collect(job: Job) -> dict[str, Any]:
    """Shards done / partial (cut short by --limit or a stop) / failed (unreadable) / pending, and
    which of the done ones are damaged (a tar that broke: the samples before the break were kept).
    A shard whose input file changed since it was labelled is pending again."""
    layout = Layout(Path(job.output.dir))
    layout.check()
    shards = plan(job.input, layout)
    done, partial, failed, damaged, rows, errors = [], [], [], [], 0, 0
    for s in shards:
        if (stats := done_stats(layout, s)) is not None:
            done.append(s.stem)
            rows += stats.get("rows", 0)
            errors += stats.get("errors", 0)
            if stats.get("damaged"):
                damaged.append(f"{damaged_note(s.stem, stats.get('rows', 0))} ({stats['damaged']})")
        elif (stats := read_stats(layout, s.stem)) is not None:
            if stats.get("failed"):
                failed.append(f"{s.stem}: {stats['failed']}")
            elif not stats.get("complete") and layout.parquet(s.stem).exists():
                partial.append(s.stem)
    return {"job": job.name, "output": str(layout.dir), "shards": len(shards), "done": len(done),
            "partial": len(partial), "failed": len(failed),
            "pending": len(shards) - len(done) - len(partial) - len(failed), "damaged": len(damaged),
            "rows": rows, "errors": errors, "partial_shards": partial, "failed_shards": failed,
            "damaged_shards": damaged}

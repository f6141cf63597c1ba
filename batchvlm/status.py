"""Progress of a job, read from its output folder alone (any number of ranks wrote it).

Where the inputs cannot be listed (gone, or not mounted here), the shards are those the
folder has stats for, and how many are pending is unknown: said, not failed on.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .output.shardlist import plan, skipped_note
from .data.sources import SourceError
from .job import Job
from .output.layout import Layout
from .output.manifest import (damaged_note, done_stats, has_output, images_in, inputs_gone, is_our_stats,
                              read_stats)


def collect(job: Job) -> dict[str, Any]:
    """Shards done / partial (cut short by --limit or a stop) / failed (unreadable) / pending, and
    which of the done ones are damaged (a tar that broke: the samples before the break were kept)
    or hold no image (an empty tar, one of text members only; `no_images`: every shard is such).
    A shard whose input file changed since it was labelled is pending again; one whose input files
    are gone (an unmounted mount point) is `kept`: its rows count, a run does not relabel it. Where the inputs
    cannot be found (moved, deleted), the shards are those with stats and `pending` is unknown.
    Skipped files: a folder's (listed now), and the members of the done tars (from their stats)."""
    layout = Layout.at(job.output.dir)
    layout.check()
    try:
        shards, inputs_missing = plan(job.input, layout), None
    except SourceError as e:
        shards, inputs_missing = None, str(e)
    done, partial, failed, damaged, no_images, rows, errors = [], [], [], [], [], 0, 0
    tokens = {"prompt": 0, "generated": 0}  # of the rows counted (stats written before counts had none)
    kept = []  # done before, input files gone now (unmounted?): the labels stand, a run keeps them
    skipped = Counter(shards.skipped if shards is not None else {})  # a folder's, and the done tars' members

    def count(stem: str, stats: dict[str, Any], into: list[str] = done) -> None:
        nonlocal rows, errors
        into.append(stem)
        rows += stats.get("rows", 0)
        errors += stats.get("errors", 0)
        for kind in tokens:
            tokens[kind] += (stats.get("tokens") or {}).get(kind, 0)
        skipped.update(stats.get("skipped") or {})
        if images_in(stats) == 0 and not stats.get("damaged"):
            no_images.append(stem)
        if stats.get("damaged"):
            damaged.append(f"{damaged_note(stem, stats.get('rows', 0))} ({stats['damaged']})")

    if shards is not None:
        stems = [s.stem for s in shards]
        for s in shards:
            if (stats := done_stats(layout, s)) is not None:
                count(s.stem, stats)
            elif note := inputs_gone(layout, s):
                count(s.stem, read_stats(layout, s.stem) or {}, kept)
                kept[-1] = note
            elif (stats := read_stats(layout, s.stem)) is not None:
                if stats.get("failed"):
                    failed.append(f"{s.stem}: {stats['failed']}")
                elif not stats.get("complete") and has_output(layout, stats):
                    partial.append(s.stem)
    else:
        stems = sorted(p.name.removesuffix(".stats.json") for p in layout.meta.glob("*.stats.json")
                       if is_our_stats(p))
        for stem in stems:
            stats = read_stats(layout, stem) or {}
            if stats.get("failed"):
                failed.append(f"{stem}: {stats['failed']}")
            elif has_output(layout, stats):
                if stats.get("complete"):
                    count(stem, stats)
                else:
                    partial.append(stem)
    pending = None if inputs_missing else len(stems) - len(done) - len(kept) - len(partial) - len(failed)
    return {"job": job.name, "output": str(layout.dir), "shards": None if inputs_missing else len(stems),
            "done": len(done), "partial": len(partial), "failed": len(failed), "pending": pending,
            "damaged": len(damaged), "rows": rows, "errors": errors, "tokens": tokens, "partial_shards": partial,
            "failed_shards": failed, "kept": len(kept), "kept_shards": kept, "damaged_shards": damaged,
            "no_image_shards": no_images,
            "no_images": bool(stems) and pending == 0 and not partial and not failed and len(no_images) == len(done),
            "inputs_missing": inputs_missing,
            "skipped": skipped_note(skipped), "skipped_files": dict(skipped)}

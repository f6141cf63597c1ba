"""Progress of a job, read from its output folder alone (any number of ranks wrote it).

Where the inputs cannot be listed (gone, or not mounted here), the shards are those the
folder has stats for, and how many are pending is unknown: said, not failed on.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .data.sources import ShardRef, SourceError
from .dist import Rank, my_shards
from .job import Job
from .output.claims import Claims
from .output.layout import Layout
from .output.lock import held_ranks
from .output.manifest import (damaged_note, done_stats, has_output, images_in, inputs_gone, is_our_stats,
                              prior_output, read_stats)
from .output.shardlist import plan, skipped_note


def running(layout: Layout, shards: list[ShardRef]) -> set[str]:
    """The stems a live run holds: claimed (work stealing) and the claim not expired nor its holder
    dead, or among the shards of a rank whose run lock a live process holds."""
    claims = Claims(layout.meta)
    out = {s.stem for s in shards if claims.path(s.stem).exists() and not claims.is_free(s.stem)}
    for rank, world in held_ranks(layout):
        out |= {s.stem for s in my_shards(shards, Rank(rank, world, 0))}
    return out


def collect(job: Job) -> dict[str, Any]:
    """Shards done / partial (cut short by --limit or a stop) / failed (unreadable) / pending, and
    which of the done ones are damaged (a tar that broke: the samples before the break were kept)
    or hold no image (an empty tar, one of text members only; `no_images`: every shard is such).
    A shard held by a live run (its claim, or its rank's run lock) and not done is `running`. A
    shard whose input file changed (or was touched) since it was labelled is `changed`: its rows
    are on disk and count, the next run relabels it. One whose input files
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
    changed = []  # done before, input changed since: the labels stand until a run relabels them
    live: list[str] = []  # held by a live run, not done
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
        held = running(layout, shards)
        for s in shards:
            if (stats := done_stats(layout, s)) is not None:
                count(s.stem, stats)
            elif note := inputs_gone(layout, s):
                count(s.stem, read_stats(layout, s.stem) or {}, kept)
                kept[-1] = note
            elif s.stem in held:
                live.append(s.stem)
            elif (stats := prior_output(layout, s.stem)) is not None:
                count(s.stem, stats, changed)
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
    pending = None if inputs_missing else (len(stems) - len(done) - len(kept) - len(partial) - len(failed)
                                           - len(live) - len(changed))
    return {"job": job.name, "output": str(layout.dir), "shards": None if inputs_missing else len(stems),
            "done": len(done), "partial": len(partial), "failed": len(failed), "pending": pending,
            "damaged": len(damaged), "rows": rows, "errors": errors, "tokens": tokens, "partial_shards": partial,
            "failed_shards": failed, "kept": len(kept), "kept_shards": kept, "running": len(live),
            "running_shards": live, "changed": len(changed), "changed_shards": changed, "damaged_shards": damaged,
            "no_image_shards": no_images,
            "no_images": (bool(stems) and pending == 0 and not partial and not failed and not live and not changed
                          and len(no_images) == len(done)),
            "inputs_missing": inputs_missing,
            "skipped": skipped_note(skipped), "skipped_files": dict(skipped)}

"""Progress of a job, read from its output folder alone (any number of ranks wrote it).

Where the inputs cannot be listed (gone, or not mounted here), the shards are those the
folder has stats for, and how many are pending is unknown: said, not failed on.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
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
    dead, or among the shards of a rank whose run lock a live process holds. (Not asked of an
    object store's output: its claims are leases of another kind, output/store.py.)"""
    if layout.in_store:
        return set()
    claims = Claims(layout.meta)
    out = {s.stem for s in shards if claims.path(s.stem).exists() and not claims.is_free(s.stem)}
    for rank, world in held_ranks(layout):
        out |= {s.stem for s in my_shards(shards, Rank(rank, world, 0))}
    return out


@dataclass
class _Tally:
    """The shards of a job by state, and the rows of those whose labels are on disk."""

    skipped: Counter[str]  # a folder's, and the done tars' members
    done: list[str] = field(default_factory=list)
    partial: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # done before, input files gone now: the labels stand
    changed: list[str] = field(default_factory=list)  # done before, input changed since: until a run relabels them
    running: list[str] = field(default_factory=list)  # held by a live run, not done
    damaged: list[str] = field(default_factory=list)
    no_images: list[str] = field(default_factory=list)
    rows: int = 0
    errors: int = 0
    tokens: dict[str, int] = field(default_factory=lambda: {"prompt": 0, "generated": 0})  # stats before: none

    def count(self, stem: str, stats: dict[str, Any], into: list[str] | None = None) -> None:
        """A shard whose labels are on disk (`into`: done by default)."""
        (self.done if into is None else into).append(stem)
        self.rows += stats.get("rows", 0)
        self.errors += stats.get("errors", 0)
        for kind in self.tokens:
            self.tokens[kind] += (stats.get("tokens") or {}).get(kind, 0)
        self.skipped.update(stats.get("skipped") or {})
        if images_in(stats) == 0 and not stats.get("damaged"):
            self.no_images.append(stem)
        if stats.get("damaged"):
            self.damaged.append(f"{damaged_note(stem, stats.get('rows', 0))} ({stats['damaged']})")

    def unfinished(self, stem: str, stats: dict[str, Any]) -> None:
        """A shard with stats but no labels that stand: failed, or partial (its rows in partial/)."""
        if stats.get("failed"):
            self.failed.append(f"{stem}: {stats['failed']}")
        elif not stats.get("complete"):
            self.partial.append(stem)


def collect(job: Job) -> dict[str, Any]:
    """What `status` reports (_collect)."""
    layout = Layout.at(job.output.dir)
    with layout.listed():  # a store: which markers and objects exist, from one listing of each level
        return _collect(job, layout)


def _collect(job: Job, layout: Layout) -> dict[str, Any]:
    """Shards done / partial (cut short by --limit or a stop) / failed (unreadable) / pending, and
    which of the done ones are damaged (a tar that broke: the samples before the break were kept)
    or hold no image (an empty tar, one of text members only; `no_images`: every shard is such).
    A shard held by a live run (its claim, or its rank's run lock) and not done is `running`. A
    shard whose input file changed (or was touched) since it was labelled is `changed`: its rows
    are on disk and count, the next run relabels it. One whose input files
    are gone (an unmounted mount point) is `kept`: its rows count, a run does not relabel it. Where the inputs
    cannot be found (moved, deleted), the shards are those with stats and `pending` is unknown.
    Skipped files: a folder's (listed now), and the members of the done tars (from their stats)."""
    layout.check()
    try:
        shards, inputs_missing = plan(job.input, layout), None
    except SourceError as e:
        shards, inputs_missing = None, str(e)
    t = _Tally(Counter(shards.skipped if shards is not None else {}))
    if shards is not None:
        stems = [s.stem for s in shards]
        held = running(layout, shards)
        for s in shards:
            if (stats := done_stats(layout, s)) is not None:
                t.count(s.stem, stats)
            elif note := inputs_gone(layout, s):
                t.count(s.stem, read_stats(layout, s.stem) or {}, t.kept)
                t.kept[-1] = note
            elif s.stem in held:
                t.running.append(s.stem)
            elif (stats := prior_output(layout, s.stem)) is not None:
                t.count(s.stem, stats, t.changed)
            elif (stats := read_stats(layout, s.stem)) is not None and (stats.get("failed") or has_output(layout, stats)):
                t.unfinished(s.stem, stats)
    else:
        stems = sorted(p.name.removesuffix(".stats.json") for p in layout.meta.glob("*.stats.json")
                       if is_our_stats(p))
        for stem in stems:
            stats = read_stats(layout, stem) or {}
            if not stats.get("failed") and stats.get("complete") and has_output(layout, stats):
                t.count(stem, stats)
            elif stats.get("failed") or has_output(layout, stats):
                t.unfinished(stem, stats)
    pending = None if inputs_missing else (len(stems) - len(t.done) - len(t.kept) - len(t.partial) - len(t.failed)
                                           - len(t.running) - len(t.changed))
    return {"job": job.name, "output": str(layout.dir), "shards": None if inputs_missing else len(stems),
            "done": len(t.done), "partial": len(t.partial), "failed": len(t.failed), "pending": pending,
            "damaged": len(t.damaged), "rows": t.rows, "errors": t.errors, "tokens": t.tokens,
            "partial_shards": t.partial, "failed_shards": t.failed, "kept": len(t.kept), "kept_shards": t.kept,
            "running": len(t.running), "running_shards": t.running, "changed": len(t.changed),
            "changed_shards": t.changed, "damaged_shards": t.damaged, "no_image_shards": t.no_images,
            "no_images": (bool(stems) and pending == 0 and not t.partial and not t.failed and not t.running
                          and not t.changed and len(t.no_images) == len(t.done)),
            "inputs_missing": inputs_missing,
            "skipped": skipped_note(t.skipped), "skipped_files": dict(t.skipped)}

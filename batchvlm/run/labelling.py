"""One pass over the loader's stream: the rows of each image gathered by shard, each complete
shard handed to the writer (ShardAssembly: its rows and its stats, the done marker)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from .. import __version__
from ..data.loader import Sample, ShardEnd
from ..data.sources import ShardRef, shown
from ..job import Job
from ..models.base.contract import PARSE_FAILURES, Family, TaskSequence
from ..output import manifest
from ..output.claims import Claims
from ..output.layout import Layout
from ..output.rows import error_kind
from ..output.writer import ShardOutput, WriterThread
from ..progress import Progress
from ..tasks import token_columns
from .log import log
from .metrics import Meter
from .stop import Interrupted, StopFlag
from .summary import RunSummary


def now() -> str:
    """UTC, to the millisecond: a run's `started` names it in provenance (columns_by_run), and two
    runs of a small job can start within one second."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


@dataclass
class ShardAssembly:
    ref: ShardRef
    started: float = field(default_factory=time.time)
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    expected: int | None = None  # known once the loader has read the whole shard
    damaged: str | None = None
    failed: str | None = None
    skipped: dict[str, int] | None = None  # a tar's members that are no sample's: reason -> count
    prompt_tokens: int = 0  # of its rows' sequences (RawOutput's counts)
    generated_tokens: int = 0

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.rows) == self.expected

    def output(self, complete: bool) -> ShardOutput:
        rows = [self.rows[i] for i in sorted(self.rows)]
        errors = Counter(error_kind(r["error"]) for r in rows if r["error"])
        seconds = time.time() - self.started
        stats = {"shard": self.ref.stem, "source": self.ref.url, "input": manifest.input_stat(self.ref),
                 "complete": complete, "rows": len(rows),
                 "ok": len(rows) - sum(errors.values()), "errors": sum(errors.values()),
                 "error_kinds": dict(errors), "parse_failures": sum(r.get(PARSE_FAILURES, 0) for r in rows),
                 "tokens": {"prompt": self.prompt_tokens, "generated": self.generated_tokens},
                 "damaged": self.damaged, "skipped": self.skipped or {}, "seconds": round(seconds, 3),
                 "images_per_s": round(len(rows) / seconds, 2) if seconds > 0 else None,
                 "finished": now(), "batchvlm": __version__}
        return ShardOutput(self.ref.stem, rows, stats)


def row_for(ref: ShardRef, s: Sample, columns: dict[str, Any] | None = None) -> dict[str, Any]:
    """A labelled sample's row (its columns), or an error sample's."""
    row = {"key": s.key, "source": shown(ref.url), "width": s.width or None, "height": s.height or None,
           "status": "error" if s.error else "ok", "error": s.error}
    return row | (columns or {}) | (s.meta or {})


class Labelling:
    """One pass over the loader's stream: rows gathered by shard, each complete shard handed to
    the writer. The summary counts the rows of shards handed over (complete, or partial under
    --limit) as images, those labelled in shards a stop or a failure left unfinished as dropped:
    together they are what the progress bar counted."""

    def __init__(self, layout: Layout, pending: list[ShardRef], summary: RunSummary, writer: WriterThread,
                 bar: Progress, claims: Claims | None, stop: StopFlag, limit: int | None,
                 replacing: set[str] | None = None, meter: Meter | None = None):
        self.layout, self.summary, self.writer, self.bar = layout, summary, writer, bar
        # stems of shards done before whose input changed: replaced only by a complete new shard
        self.replacing = replacing or set()
        self.claims, self.stop, self.limit = claims, stop, limit
        self.meter = meter
        self.done_before = summary.shards_done_before + len(summary.shards_written)  # for the meter
        self.assemblies = {i: ShardAssembly(ref) for i, ref in enumerate(pending)}
        self.claimed: set[str] = set()  # stems this rank holds claims on (work stealing)
        self.beat_stop = threading.Event()
        self.taken = 0
        self.abandoned = False  # a third Ctrl-C: the finished shards not written yet are left

    def run(self, stream, labeler, family: Family, job: Job, seqs: list[TaskSequence]) -> None:
        if self.claims:
            self.claims.keep_alive(self.claimed, self.beat_stop)
        try:
            self.label(stream, labeler, family, job, seqs)
            self.writer.close()  # the last shards are written (a second Ctrl-C may come meanwhile)
        except KeyboardInterrupt:
            raise self.interrupted() from None
        finally:
            self.close()
        self.summary.shards_written += [s for s in self.writer.written if s not in self.summary.shards_partial]

    def label(self, stream, labeler, family: Family, job: Job, seqs: list[TaskSequence]) -> None:
        for sample, raws in labeler.label(self.samples(stream)):
            self.add_row(sample, family.columns(job.tasks, seqs, raws, sample.seen) | token_columns(job.tasks, seqs, raws),
                         sum(r.prompt_tokens for r in raws), sum(r.generated_tokens for r in raws))
        if self.limit is not None and not self.stop.event.is_set():
            # --limit: keep what was labelled, marked incomplete so the next run redoes it whole.
            for i, a in list(self.assemblies.items()):
                if a.rows and not a.failed and a.ref.stem not in self.replacing:
                    self.hand_over(i, complete=False)
                    self.summary.shards_partial.append(a.ref.stem)
        self.summary.dropped += sum(len(a.rows) for a in self.assemblies.values())

    def interrupted(self) -> Interrupted:
        """The second Ctrl-C: the shards whose rows are all in are written before the run ends (a
        few atomic writes), those the writer holds and any not handed over yet; a third Ctrl-C
        leaves them. -> the exception that names those left unwritten."""
        finished = [a for a in self.assemblies.values() if a.complete and not self.writer.holds(a.ref.stem)]
        waiting = self.writer.unwritten + [a.ref.stem for a in finished]
        try:
            if waiting:
                log(f"\nbatchvlm: interrupted: writing {len(waiting)} finished shard(s) first ({', '.join(waiting[:3])}"
                    f"{', ...' if len(waiting) > 3 else ''}); Ctrl-C again leaves them")
            for a in finished:
                self.writer.put(a.output(complete=True))
            self.writer.close()
        except KeyboardInterrupt:
            self.abandoned = True
            busy = self.writer.abandon()
            return Interrupted([s for s in waiting if s not in self.writer.written and s != busy], busy)
        return Interrupted([], None)

    def close(self) -> None:
        try:
            if not self.abandoned:
                self.writer.close()
        finally:  # the bar's last line is the true final state, also after a failed write
            self.bar.close(len(self.writer.written) - len(self.summary.shards_partial))
            if self.meter:
                self.count_done()
            self.beat_stop.set()
            if self.claims:
                for stem in self.claimed - set(self.writer.written):
                    self.claims.release(stem)

    def hand_over(self, i: int, complete: bool) -> ShardOutput:
        """Shard `i` to the writer; what stays in `assemblies` is never written (but by interrupted())."""
        a = self.assemblies[i]
        out = a.output(complete=complete)
        self.summary.images += out.stats["rows"]
        self.summary.errors += out.stats["errors"]
        self.summary.prompt_tokens += out.stats["tokens"]["prompt"]
        self.summary.generated_tokens += out.stats["tokens"]["generated"]
        self.summary.found += manifest.images_in(out.stats)
        if complete:
            self.summary.skipped.update(out.stats["skipped"])
        self.writer.put(out)  # a second Ctrl-C in its wait: the writer holds the shard already
        del self.assemblies[i]
        return out

    def finish(self, i: int) -> None:
        a = self.assemblies[i]
        if a.damaged and a.ref.stem in self.replacing:
            self.keep_old(i, f"its input is damaged now: {a.damaged}")
            return
        if a.damaged:
            log(f"batchvlm: shard {a.ref.stem} is damaged ({a.damaged}); {len(a.rows)} sample(s) kept")
            self.summary.shards_damaged.append(manifest.damaged_note(a.ref.stem, len(a.rows)))
        self.bar.shard_size(i, len(a.rows))
        if not manifest.images_in(self.hand_over(i, complete=True).stats) and not a.damaged:
            self.summary.shards_no_images.append(a.ref.stem)

    def keep_old(self, i: int, why: str) -> None:
        """A shard done before whose new input did not give a complete shard: its labels stay, the
        rows made now are dropped, and the run says so (exit 1)."""
        a = self.assemblies.pop(i)
        self.bar.shard_size(i, len(a.rows))
        self.summary.dropped += len(a.rows)
        self.summary.shards_kept.append(note := manifest.kept_note(a.ref.stem, why))
        log(f"batchvlm: shard {note}")

    def count_done(self) -> None:
        self.meter.shards_done = self.done_before + len(self.writer.written) - len(self.summary.shards_partial)

    def add_row(self, s: Sample, columns: dict[str, Any] | None = None, prompt_tokens: int = 0,
                generated_tokens: int = 0) -> None:
        a = self.assemblies[s.shard]
        a.rows[s.index] = row_for(a.ref, s, columns)
        a.prompt_tokens += prompt_tokens
        a.generated_tokens += generated_tokens
        self.bar.add(bool(s.error), len(self.writer.written))
        if self.meter:
            self.meter.add_row(bool(s.error), prompt_tokens, generated_tokens)
            self.count_done()
        if a.complete:
            self.finish(s.shard)

    def shard_end(self, item: ShardEnd) -> None:
        a = self.assemblies[item.shard]
        a.expected, a.damaged, a.failed, a.skipped = item.n_samples, item.damaged, item.failed, item.skipped
        if a.failed:  # recorded (not done) so `status` shows it; the next run retries it
            self.bar.shard_size(item.shard, len(a.rows))
            log(f"batchvlm: shard {a.ref.stem} failed: {a.failed}")
            self.summary.shards_failed.append(a.ref.stem)
            if a.ref.stem in self.replacing:  # its done marker stays: the labels from before are kept
                log(f"batchvlm: shard {manifest.kept_note(a.ref.stem, 'its input is unreadable now')}")
            else:
                manifest.record_failure(self.layout, a.ref, a.failed)
            a.expected = None
        elif a.complete:
            self.finish(item.shard)

    def samples(self, stream) -> Iterator[Sample]:
        """The images to label; error samples and shard ends are taken care of on the way."""
        try:
            for item in stream:
                if self.claims:
                    self.claimed.add(self.assemblies[item.shard].ref.stem)
                if isinstance(item, ShardEnd):
                    self.shard_end(item)
                    continue
                if (self.limit is not None and self.taken >= self.limit) or self.stop.event.is_set():
                    return
                self.taken += 1
                if item.error is not None:
                    self.add_row(item)
                else:
                    yield item
        except Exception:
            if not self.stop.event.is_set():  # loader workers dying during a shutdown is expected
                raise

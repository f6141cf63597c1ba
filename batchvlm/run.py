"""The run loop of one worker: its pending shards -> loader -> engine -> one Parquet per shard.

    run_job(job) ─ open folder ─ plan shards ─ take mine ─ skip done ─ start loader ─ load model ─┐
                   (checks, lock)                       freeze the shard list once nothing refuses ◀┘
                                                                                   ▼
      loader (Sample | ShardEnd) ──▶ images() ──▶ labeler.label() ──▶ results
             error rows, shard ends ─────────────────────────────┐     │
                                                                 ▼     ▼
                                                    ShardAssembly (rows by shard)
                                                                 │ complete shard
                                                                 ▼
                                                    WriterThread (tmp -> rename -> stats)

A stop request (SIGTERM / SIGUSR1 / SIGINT, e.g. preemption) stops taking images; images in
flight are finished, completed shards are written, and unfinished shards are dropped whole
(never written, never marked done) for the next run. A second SIGINT ends the run at once, once
the shards whose rows are all in are written (Labelling.interrupted).

A run that is refused (other settings, other weights) changes nothing in the folder: the shard
list is frozen only after the weights were checked.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import __version__
from .data.loader import Sample, ShardEnd, Stealing, load
from .output.shardlist import ShardList, plan, skipped_note
from .data.sources import ShardRef, check_first_parquet, keep_fields, list_files, shown
from .device import for_device
from .dist import Rank, my_shards
from .engine.engine import EngineLabeler
from .job import Job
from .models import registry
from .models.base.contract import PARSE_FAILURES, EngineModel, Family, StaticModel, TaskSequence, WorkItem
from .output import manifest
from .output.claims import Claims
from .output.layout import Layout
from .output.lock import RunLock
from .output.placement import check_apart_from_inputs, check_writable
from .output.rows import error_kind
from .output.writer import ShardOutput, WriterThread, schema
from .progress import Progress, shard_sizes


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class ShardAssembly:
    ref: ShardRef
    started: float = field(default_factory=time.time)
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    expected: int | None = None  # known once the loader has read the whole shard
    damaged: str | None = None
    failed: str | None = None
    skipped: dict[str, int] | None = None  # a tar's members that are no sample's: reason -> count

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
                 "damaged": self.damaged, "skipped": self.skipped or {}, "seconds": round(seconds, 3),
                 "images_per_s": round(len(rows) / seconds, 2) if seconds > 0 else None,
                 "finished": now(), "batchvlm": __version__}
        return ShardOutput(self.ref.stem, rows, stats)


@dataclass
class RunSummary:
    shards_total: int
    shards_done_before: int
    shards_written: list[str] = field(default_factory=list)  # complete: their done marker is down
    shards_partial: list[str] = field(default_factory=list)  # cut short by --limit: redone next run
    shards_failed: list[str] = field(default_factory=list)
    shards_damaged: list[str] = field(default_factory=list)  # "<stem>: N samples kept", done now or before
    shards_no_images: list[str] = field(default_factory=list)  # written now, holding no image (an empty tar)
    images: int = 0  # rows of the shards handed to the writer
    found: int = 0  # rows from an image (not a sample that held none) in this rank's shards written now or before
    no_images: bool = False  # every shard of the job is done and none holds an image: the input has none to label
    dropped: int = 0  # images labelled in shards left unfinished (stop) or failed: not kept, labelled again
    errors: int = 0
    seconds: float = 0.0
    stopped_by_signal: bool = False
    # files of the input that are no images to label, by reason: a folder's, and the members of the
    # tars done now or before
    skipped: Counter[str] = field(default_factory=Counter)

    def line(self, out_dir: str) -> str:
        rate = self.images / self.seconds if self.seconds > 0 else 0.0
        parts = [f"{len(self.shards_written)} shard(s) written", f"{self.shards_done_before} already done"]
        if self.shards_partial:
            parts.append(f"{len(self.shards_partial)} partial (cut short by --limit; redone by the next run)")
        parts.append(f"{self.images} images")
        if self.dropped:  # the progress bar counted them: say where they went
            parts.append(f"{self.dropped} more labelled in unfinished or failed shards (not kept; the next run "
                         "labels them again)")
        parts += [f"{self.errors} errors", f"{rate:.1f} images/s"]
        if self.shards_failed:
            parts.append(f"{len(self.shards_failed)} FAILED ({', '.join(self.shards_failed[:3])})")
        if self.shards_damaged:
            parts.append(f"{len(self.shards_damaged)} DAMAGED ({', '.join(sorted(self.shards_damaged)[:3])})")
        if self.shards_no_images:
            parts.append(f"{len(self.shards_no_images)} with no images ({', '.join(self.shards_no_images[:3])})")
        if self.stopped_by_signal:
            parts.append("stopped by signal: unfinished shards left for the next run")
        if self.skipped:
            parts.append(skipped_note(self.skipped))
        return f"batchvlm: {', '.join(parts)} -> {out_dir}"


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C ended the run once the finished shards were written; `unwritten`: those a
    third one left, `busy`: the one being written then (kept if its write finished)."""

    def __init__(self, unwritten: list[str], busy: str | None):
        super().__init__()
        self.unwritten, self.busy = unwritten, busy


class StopFlag:
    """Set by SIGTERM / SIGUSR1 / SIGINT: stop taking new images, finish those in flight.
    A second SIGINT interrupts at once."""

    def __init__(self):
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = not self.event.is_set()
        self.event.set()  # before the message: a second signal may run its handler inside this one
        if first:  # say so at once: the images in flight may take a while
            again = ("; Ctrl-C again stops at once, dropping them (finished shards are still written)"
                     if signum == signal.SIGINT else "")
            log(f"\nbatchvlm: {signal.Signals(signum).name}: stopping after the images in flight{again}")


@dataclass(frozen=True)
class Ticket:
    """What the row of a sample in the engine needs, without its pixels (the engine drops those
    once the image is encoded): identity, size, kept input fields, the size the model saw."""

    shard: int
    index: int
    key: str
    width: int
    height: int
    meta: dict[str, Any] | None
    seen: tuple[int, int] | None  # Prepared.seen: the family's columns read it

    @classmethod
    def of(cls, s: Sample) -> Ticket:
        return cls(s.shard, s.index, s.key, s.width, s.height, s.meta, s.prepared.seen)


def row_for(ref: ShardRef, s: Sample | Ticket, columns: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    row = {"key": s.key, "source": shown(ref.url), "width": s.width or None, "height": s.height or None,
           "status": "error" if error else "ok", "error": error}
    return row | (columns or {}) | (s.meta or {})



def run_job(job: Job, limit: int | None = None, overwrite: bool = False, rank: Rank | None = None,
            progress: bool = True, stop: StopFlag | None = None) -> RunSummary:
    rank = rank or Rank(0, 1, 0)
    job = for_device(job, rank)  # dtype resolved before any settings are compared
    layout = Layout(Path(job.output.dir))
    clear = overwrite or job.output.mode == "overwrite"
    check_writable(layout.dir)
    check_apart_from_inputs(layout.dir, job.input, [])
    registry.check_tasks(job.model, job.tasks, job.engine, job.output.constrain)  # a refused model or task writes nothing
    if job.input.kind == "parquet":
        manifest.check_not_input(layout, list_files(job.input))
    if not clear:
        layout.check()  # a folder of the first layout is refused before anything is written in it
    created_dir = not layout.dir.exists()
    lock = None if job.runtime.work_stealing else RunLock(layout, rank.rank, rank.world)
    if lock:
        lock.acquire()  # in __batchvlm__/; before anything is cleared or labelled; released when the process ends
    try:
        return _run(job, layout, limit, clear, rank, progress, stop or StopFlag())
    except Exception:
        if lock:
            lock.release()
        layout.remove_if_unused(created_dir)  # a refused run leaves no folder behind
        raise
    finally:
        if lock:
            lock.release()


def _run(job: Job, layout: Layout, limit: int | None, clear: bool, rank: Rank, progress: bool,
         stop: StopFlag) -> RunSummary:
    t0 = time.time()
    shards = _open_folder(job, layout, clear, rank)
    claims = Claims(layout.meta) if job.runtime.work_stealing else None
    mine = shards if claims else my_shards(shards, rank)  # with claims every rank may take any shard
    summary = RunSummary(len(shards), 0, skipped=Counter(shards.skipped))
    pending = _skip_done(layout, mine, summary)
    if not pending:
        plan(job.input, layout, freeze=True)
        summary.no_images = _no_images(layout, shards, summary)
        summary.seconds = time.time() - t0
        return summary

    family = registry.open_family(job.model)
    seqs = family.sequences(job.tasks, job.engine, job.output.constrain)
    stealing = (Stealing(partial(claims.take_pending, layout), offset=rank.rank * max(1, len(shards) // rank.world))
                if claims else None)
    stream = load(pending, job.input, job.loader, family.preprocessor(), stealing)  # workers decode while the model loads
    try:
        t_load = time.time()
        model = family.load(job.model.dtype, job.model.device)
        t_load = time.time() - t_load
        manifest.check_weights(layout, model.info.weights_sha256)
        _freeze(job, layout, pending)  # nothing refuses the run from here on
        writer = _start_output(job, layout, rank, model, shards, claims)
        t_engine = time.time()
        labeler, how = _labeler(family, model, seqs, job)
        info = model.info
        log(f"batchvlm: rank {rank.rank}/{rank.world}: {len(pending)} shard(s) to label; model {info.name} "
            f"({info.family}, {info.backend}, {info.dtype}, {info.device}) loaded in {t_load:.1f} s; labeler ready in "
            f"{time.time() - t_engine:.1f} s ({how}, {len(seqs)} sequences per image)")
        # with work stealing this rank's share is not known in advance: no total
        bar = Progress(job.name, len(pending), None if claims else shard_sizes(layout, mine, pending), enabled=progress)
        labelling = Labelling(layout, pending, summary, writer, bar, claims, stop, limit)
        labelling.run(stream, labeler, family, job, seqs)
        if isinstance(labeler, EngineLabeler):
            log(f"batchvlm: rank {rank.rank}/{rank.world}: engine: {labeler.engine.summary()}")
        if claims and not stop.event.is_set() and limit is None:
            _report_held(layout, pending, writer.written, summary, claims)
        summary.stopped_by_signal = stop.event.is_set()
        summary.no_images = _no_images(layout, shards, summary)
        summary.seconds = time.time() - t0
        return summary
    finally:
        stream.close()  # on every way out: the workers ignore SIGTERM, so exit would wait on them


def _open_folder(job: Job, layout: Layout, clear: bool, rank: Rank) -> ShardList:
    """Clear the folder (overwrite) or check that its labels were made with these settings;
    -> the shards to label: the frozen list plus what is new, not written back yet."""
    if clear and rank.world > 1:
        raise manifest.OutputConflict("--overwrite with several ranks would let one rank delete another's "
                                      "output; clear the output folder once before launching")
    if not clear:
        layout.check()
        manifest.check_settings(layout, job.label_fingerprint(), job.label_settings())
    shards = plan(job.input, None if clear else layout)
    check_first_parquet(shards, job.input)  # a wrong image column is refused before the model loads
    if clear:
        manifest.clear_outputs(layout)
    layout.meta.mkdir(parents=True, exist_ok=True)
    manifest.sweep_temporaries(layout)
    return shards


def _skip_done(layout: Layout, mine: list[ShardRef], summary: RunSummary) -> list[ShardRef]:
    """-> the shards of `mine` still to label; the done ones are counted (damaged ones noted)."""
    pending = []
    for s in mine:
        if (stats := manifest.done_stats(layout, s)) is None:
            pending.append(s)
            continue
        summary.shards_done_before += 1
        summary.found += manifest.images_in(stats)
        summary.skipped.update(stats.get("skipped") or {})
        if stats.get("damaged"):  # reported by every run until the input is replaced
            summary.shards_damaged.append(manifest.damaged_note(s.stem, stats.get("rows", 0)))
    return pending


def _no_images(layout: Layout, shards: list[ShardRef], summary: RunSummary) -> bool:
    """Every shard of the job is done and none holds an image. Read from the done markers (other
    ranks' shards too) only where this rank's hold none."""
    return summary.found == 0 and all((stats := manifest.done_stats(layout, s)) is not None
                                      and manifest.images_in(stats) == 0 for s in shards)


def _freeze(job: Job, layout: Layout, pending: list[ShardRef]) -> None:
    """Write the shard list back. Another rank may have extended it meanwhile (new images
    appear last, which leaves every planned shard as it was); a shard this run is labelling
    that the list now holds differently means the input changed under the launch."""
    frozen = {s.stem: s for s in plan(job.input, layout, freeze=True)}
    if changed := [s.stem for s in pending if s.planned and s.stem in frozen and not s.same_images(frozen[s.stem])]:
        raise manifest.OutputConflict(f"input: shard {changed[0]} changed while this run started (another rank "
                                      "planned it differently); run again")


def _start_output(job: Job, layout: Layout, rank: Rank, model: EngineModel | StaticModel, shards: ShardList,
                  claims: Claims | None) -> WriterThread:
    """The job record (rank 0, or whoever comes first) and the writer of finished shards."""
    info = model.info
    meta = {"batchvlm": __version__, "job": job.name, "model": info.to_dict(),
            "tasks": [t.model_dump() for t in job.tasks], "engine": job.engine.model_dump(), "started": now()}
    if rank.rank == 0 or not layout.job_file.exists():
        manifest.write_job_record(layout, meta | {"label_fingerprint": job.label_fingerprint(),
                                                   "label_settings": job.label_settings(),
                                                   "job_spec": job.model_dump(), "world_size": rank.world,
                                                   "skipped_files": shards.skipped})
    return WriterThread(layout, schema(job.tasks, meta, keep_fields(job.input, shards), job.output.raw_text),
                        job.output.compression, on_written=claims.release if claims else None)


def _labeler(family: Family, model: EngineModel | StaticModel, seqs: list[TaskSequence], job: Job):
    """-> (the labeler, how it batches, for the log)."""
    if isinstance(model, StaticModel):
        return model.labeler(seqs, job.engine), "static batches"
    labeler = EngineLabeler(model, seqs, job.engine, family.max_prefix_len(), log)
    e = labeler.engine
    return labeler, (f"batch {e.settings.max_batch_size}, {e.stats['kv_blocks']} KV blocks of {job.engine.block_size}, "
                     f"{e.stats['rows']} rows, {'pipelined' if e.pipelined else 'synchronous'}"
                     + (f", CUDA graphs captured in {e.stats['graph_capture_s']:.1f} s" if e.runner.graphs else "")
                     + (f", flex_attention compiled {e.stats['compiled_shapes']} shapes in {e.stats['compile_s']:.1f} s"
                        if e.stats["compiled_shapes"] else ""))


def _report_held(layout: Layout, pending: list[ShardRef], written: list[str], summary: RunSummary,
                 claims: Claims) -> None:
    held = [s.stem for s in pending if s.stem not in written and not manifest.is_done(layout, s)
            and s.stem not in summary.shards_failed]
    if held:
        log(f"batchvlm: {len(held)} shard(s) are still claimed by other ranks ({', '.join(held[:3])}): they "
            f"finish them, or, if a rank on another host died, its claims expire after "
            f"{claims.lease_s:.0f} s and a re-run takes them")


class Labelling:
    """One pass over the loader's stream: rows gathered by shard, each complete shard handed to
    the writer. The summary counts the rows of shards handed over (complete, or partial under
    --limit) as images, those labelled in shards a stop or a failure left unfinished as dropped:
    together they are what the progress bar counted."""

    def __init__(self, layout: Layout, pending: list[ShardRef], summary: RunSummary, writer: WriterThread,
                 bar: Progress, claims: Claims | None, stop: StopFlag, limit: int | None):
        self.layout, self.summary, self.writer, self.bar = layout, summary, writer, bar
        self.claims, self.stop, self.limit = claims, stop, limit
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
        self.summary.shards_written = [s for s in self.writer.written if s not in self.summary.shards_partial]

    def label(self, stream, labeler, family: Family, job: Job, seqs: list[TaskSequence]) -> None:
        for ticket, raws in labeler.label(self.items(stream)):
            columns = family.columns(job.tasks, seqs, raws, ticket.seen)
            self.add_row(ticket.shard, ticket.index, row_for(self.assemblies[ticket.shard].ref, ticket, columns, None))
        if self.limit is not None and not self.stop.event.is_set():
            # --limit: keep what was labelled, marked incomplete so the next run redoes it whole.
            for i, a in list(self.assemblies.items()):
                if a.rows and not a.failed:
                    self.hand_over(i, complete=False)
                    self.summary.shards_partial.append(a.ref.stem)
        self.summary.dropped = sum(len(a.rows) for a in self.assemblies.values())

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
        self.summary.found += manifest.images_in(out.stats)
        if complete:
            self.summary.skipped.update(out.stats["skipped"])
        self.writer.put(out)  # a second Ctrl-C in its wait: the writer holds the shard already
        del self.assemblies[i]
        return out

    def finish(self, i: int) -> None:
        a = self.assemblies[i]
        if a.damaged:
            log(f"batchvlm: shard {a.ref.stem} is damaged ({a.damaged}); {len(a.rows)} sample(s) kept")
            self.summary.shards_damaged.append(manifest.damaged_note(a.ref.stem, len(a.rows)))
        self.bar.shard_size(i, len(a.rows))
        if not manifest.images_in(self.hand_over(i, complete=True).stats) and not a.damaged:
            self.summary.shards_no_images.append(a.ref.stem)

    def add_row(self, i: int, index: int, row: dict[str, Any]) -> None:
        a = self.assemblies[i]
        a.rows[index] = row
        self.bar.add(row["status"] == "error", len(self.writer.written))
        if a.complete:
            self.finish(i)

    def shard_end(self, item: ShardEnd) -> None:
        a = self.assemblies[item.shard]
        a.expected, a.damaged, a.failed, a.skipped = item.n_samples, item.damaged, item.failed, item.skipped
        if a.failed:  # recorded (not done) so `status` shows it; the next run retries it
            self.bar.shard_size(item.shard, len(a.rows))
            log(f"batchvlm: shard {a.ref.stem} failed: {a.failed}")
            self.summary.shards_failed.append(a.ref.stem)
            manifest.record_failure(self.layout, a.ref, a.failed)
            a.expected = None
        elif a.complete:
            self.finish(item.shard)

    def items(self, stream) -> Iterator[WorkItem]:
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
                    self.add_row(item.shard, item.index, row_for(self.assemblies[item.shard].ref, item, None, item.error))
                else:
                    yield WorkItem(Ticket.of(item), item.prepared, item.key)
        except Exception:
            if not self.stop.event.is_set():  # loader workers dying during a shutdown is expected
                raise

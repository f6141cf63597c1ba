"""The run loop: pending shards -> loader workers -> labeler -> rows -> one Parquet per shard.

    run_job(job) ─ list shards ─ skip done ─ start loader ─ load model ─┐
                                                                       ▼
      loader (Sample | ShardEnd) ──▶ images() ──▶ labeler.label() ──▶ results
             error rows, shard ends ─────────────────────────────┐     │
                                                                 ▼     ▼
                                                    ShardAssembly (rows by shard)
                                                                 │ complete shard
                                                                 ▼
                                                    WriterThread (tmp -> rename -> stats)
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import __version__
from .data.loader import Sample, ShardEnd, load
from .data.sources import ShardRef, list_shards
from .dist import Rank, my_shards
from .engine.engine import EngineLabeler
from .engine.labeler import Labeler, WorkItem
from .job import Job
from .models import registry
from .models.moondream.preprocess import PreparedImage
from .output import manifest
from .output.writer import ShardOutput, WriterThread, schema


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

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.rows) == self.expected

    def stats(self, complete: bool) -> dict[str, Any]:
        rows = [self.rows[i] for i in sorted(self.rows)]
        errors = Counter(r["error"].split(":")[0] for r in rows if r["error"])
        seconds = time.time() - self.started
        return {"shard": self.ref.stem, "source": self.ref.url, "complete": complete, "rows": len(rows),
                "ok": len(rows) - sum(errors.values()), "errors": sum(errors.values()), "error_kinds": dict(errors),
                "damaged": self.damaged, "seconds": round(seconds, 3),
                "images_per_s": round(len(rows) / seconds, 2) if seconds > 0 else None,
                "finished": now(), "batchvlm": __version__}


@dataclass
class RunSummary:
    shards_total: int
    shards_done_before: int
    shards_written: list[str]
    shards_failed: list[str]
    images: int
    errors: int
    seconds: float
    stopped_by_signal: bool = False

    def line(self, out_dir: str) -> str:
        rate = self.images / self.seconds if self.seconds > 0 else 0.0
        parts = [f"{len(self.shards_written)} shard(s) written", f"{self.shards_done_before} already done",
                 f"{self.images} images", f"{self.errors} errors", f"{rate:.1f} images/s"]
        if self.shards_failed:
            parts.append(f"{len(self.shards_failed)} FAILED ({', '.join(self.shards_failed[:3])})")
        if self.stopped_by_signal:
            parts.append("stopped by signal: unfinished shards left for the next run")
        return f"batchvlm: {', '.join(parts)} -> {out_dir}"


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (preemption): stop taking new images, finish in-flight ones."""

    def __init__(self):
        self.event = threading.Event()
        self.signal: int | None = None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signum
        self.event.set()


def make_labeler(md, job: Job, seqs) -> Labeler:
    return EngineLabeler(md, seqs, job.engine)


def row_for(ref: ShardRef, s: Sample, columns: dict[str, Any] | None, error: str | None) -> dict[str, Any]:
    row = {"key": s.key, "source": ref.url, "width": s.width or None, "height": s.height or None,
           "status": "error" if error else "ok", "error": error}
    return row | (columns or {})


def run_job(job: Job, limit: int | None = None, overwrite: bool = False, rank: Rank | None = None,
            progress: bool = True, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
            stop: StopFlag | None = None) -> RunSummary:
    t0 = time.time()
    rank = rank or Rank(0, 1, 0)
    out_dir = Path(job.output.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = list_shards(job.input)
    if overwrite or job.output.mode == "overwrite":
        if rank.rank == 0:
            manifest.clear_outputs(out_dir)
    else:
        manifest.check_settings(out_dir, job.label_fingerprint())
    manifest.sweep_temporaries(out_dir)
    mine = my_shards(shards, rank)
    pending = [s for s in mine if not manifest.is_done(out_dir, s.stem)]
    done_before = len(mine) - len(pending)
    summary = RunSummary(len(shards), done_before, [], [], 0, 0, 0.0)
    if not pending:
        summary.seconds = time.time() - t0
        return summary

    folder, revision = registry.locate(job.model)
    pre = registry.preprocessor(folder, job.model)
    stream = load(pending, job.input, job.loader, pre)  # workers decode while the model loads
    md = registry.load(job.model, folder, revision)
    manifest.check_weights(out_dir, md.info.weights_sha256)
    seqs = md.sequences(job.tasks, job.engine.max_new_tokens, job.engine.max_objects,
                        job.engine.temperature, job.engine.top_p)
    meta = {"batchvlm": __version__, "job": job.name, "model": md.info.to_dict(),
            "tasks": [t.model_dump() for t in job.tasks], "engine": job.engine.model_dump(), "started": now()}
    if rank.rank == 0 or not (out_dir / manifest.JOB_FILE).exists():
        manifest.write_job_record(out_dir, meta | {"label_fingerprint": job.label_fingerprint(),
                                                   "job_spec": job.model_dump(), "world_size": rank.world})
    writer = WriterThread(out_dir, schema(job.tasks, meta), job.output.compression)
    labeler = make_labeler(md, job, seqs)
    assemblies = {i: ShardAssembly(ref) for i, ref in enumerate(pending)}
    stop = stop or StopFlag()
    taken = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(unit="img", desc=job.name, dynamic_ncols=True, file=sys.stderr)

    def finish(i: int) -> None:
        a = assemblies.pop(i)
        writer.put(ShardOutput(a.ref.stem, [a.rows[k] for k in sorted(a.rows)], a.stats(complete=True)))

    def add_row(i: int, index: int, row: dict[str, Any]) -> None:
        a = assemblies[i]
        a.rows[index] = row
        summary.images += 1
        summary.errors += row["status"] == "error"
        if bar is not None:
            bar.update(1)
            bar.set_postfix(errors=summary.errors, shards=f"{len(writer.written)}/{len(pending)}", refresh=False)
        if a.complete:
            finish(i)

    def images() -> Iterator[WorkItem]:
        nonlocal taken
        for item in stream:
            if isinstance(item, ShardEnd):
                a = assemblies[item.shard]
                a.expected, a.damaged, a.failed = item.n_samples, item.damaged, item.failed
                if a.failed:
                    log(f"batchvlm: shard {a.ref.stem} failed to read ({a.failed}); left for the next run")
                    summary.shards_failed.append(a.ref.stem)
                    a.expected = None
                elif a.complete:
                    finish(item.shard)
                continue
            if (limit is not None and taken >= limit) or stop.event.is_set():
                break
            taken += 1
            ref = assemblies[item.shard].ref
            if item.error is not None:
                add_row(item.shard, item.index, row_for(ref, item, None, item.error))
            else:
                yield WorkItem((item.shard, item.index, item), PreparedImage(item.crops.numpy(), item.tiling), item.key)

    try:
        for (i, index, sample), raws in labeler.label(images()):
            add_row(i, index, row_for(assemblies[i].ref, sample, md.columns(job.tasks, seqs, raws), None))
        # Stopped early (--limit or a signal): keep what was labelled, marked incomplete so
        # the next run redoes those shards in full.
        for i in list(assemblies):
            a = assemblies.pop(i)
            if a.rows and not a.failed and limit is not None and not stop.event.is_set():
                writer.put(ShardOutput(a.ref.stem, [a.rows[k] for k in sorted(a.rows)], a.stats(complete=False)))
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    summary.shards_written = list(writer.written)
    summary.stopped_by_signal = stop.event.is_set()
    summary.seconds = time.time() - t0
    return summary

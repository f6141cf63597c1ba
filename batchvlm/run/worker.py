"""The run loop of one rank: its pending shards -> loader -> engine -> one Parquet per shard.

    run_job(job) ─ preflight ─ lock ─ clear / sweep ─ take mine ─ skip done ─ start loader ─ load model ─┐
                                               freeze the shard list once nothing refuses ◀┘
                                                                                   ▼
      loader (Sample | ShardEnd) ──▶ samples() ──▶ labeler.label() ──▶ (Sample, raws)
             error rows, shard ends ───────────────────────────────┐     │
                                                                   ▼     ▼
                                                    ShardAssembly (rows by shard, labelling.py)
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

import json
import os
import time
from collections import Counter
from functools import partial

import pyarrow as pa

from .. import __version__
from ..data.loader import Stealing, load
from ..data.sources import ShardRef
from ..dist import Rank, my_shards
from ..engine.engine import EngineLabeler
from ..engine.images import ImageLabeler
from ..job import Job
from ..models import registry
from ..models.base.contract import EngineModel, Family, ImageModel, StaticModel, TaskSequence
from ..output import manifest
from ..output.claims import Claims
from ..output.claims_store import LEASE_ENV, StoreClaims
from ..output.layout import Layout
from ..output.lock import RunLock
from ..output.shardlist import ShardList, plan
from ..output.writer import WriterThread, schema
from ..progress import Progress, shard_sizes
from ..tasks import label_columns
from .extending import extend_done, to_extend
from .labelling import Labelling, now
from .log import log
from .metrics import Meter, MetricsFile, rank_path
from .preflight import Preflight, clears, preflight
from .stop import StopFlag
from .summary import RunSummary


def run_job(job: Job, limit: int | None = None, overwrite: bool = False, rank: Rank | None = None,
            progress: bool = True, stop: StopFlag | None = None, await_held: bool = True) -> RunSummary:
    """`await_held` (work stealing): wait for the shards other ranks hold before returning, taking
    those whose holder died; a launcher that frees its dead ranks' claims itself (Ray) says False."""
    t0 = time.time()
    rank = rank or Rank(0, 1, 0)
    pre = preflight(job, clears(job, overwrite), rank)  # a refused job writes nothing
    if pre.clear and rank.world > 1:
        raise manifest.OutputConflict("--overwrite with several ranks would let one rank delete another's "
                                      "output; clear the output folder once before launching")
    created_dir = not pre.layout.dir.exists()
    # in an object store, claims (always on there) keep runs apart: it has no flock
    lock = None if job.runtime.work_stealing or pre.layout.in_store else RunLock(pre.layout, rank.rank, rank.world)
    if lock:
        lock.acquire()  # in __batchvlm__/; before anything is cleared or labelled; released when the process ends
    meter = Meter(len(pre.shards))  # _run counts this rank's shards
    metrics = _metrics_file(job, rank, meter)
    try:
        return _run(pre, limit, rank, progress, stop or StopFlag(), t0, await_held, meter)
    except Exception:
        if lock:
            lock.release()
        pre.layout.remove_if_unused(created_dir)  # a refused run leaves no folder behind
        raise
    finally:
        if lock:
            lock.release()
        if metrics:
            metrics.close()


def _metrics_file(job: Job, rank: Rank, meter: Meter) -> MetricsFile | None:
    """runtime.metrics_file, written while the run lasts and once more at its end (close)."""
    if job.runtime.metrics_file is None:
        return None
    return MetricsFile(rank_path(job.runtime.metrics_file, rank.rank, rank.world), meter, job.name, rank.rank)


def _run(pre: Preflight, limit: int | None, rank: Rank, progress: bool, stop: StopFlag, t0: float,
         await_held: bool, meter: Meter) -> RunSummary:
    job, layout, shards = pre.job, pre.layout, pre.shards
    _open_folder(layout, pre.clear)
    claims = _claims(job, layout)
    mine = shards if claims else my_shards(shards, rank)  # with claims every rank may take any shard
    summary = RunSummary(len(shards), 0, skipped=Counter(shards.skipped))
    with layout.listed():  # a store: one listing says which markers exist, not a request per shard
        pending, done, replacing = _skip_done(layout, mine, summary)
    meter.shards_total, meter.shards_done = len(mine), summary.shards_done_before
    # done shards whose files lack the columns of tasks the job gained (not under --limit; with
    # work stealing rank 0 adds them; not in an object store, where preflight refuses new tasks)
    extending = limit is None and not layout.in_store and (not claims or rank.rank == 0)
    extend = to_extend(layout, done, job) if extending else {}
    if not pending and not extend:
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
        writer = _start_output(job, layout, rank, model, shards, claims, pre.keep_columns, family.embed_dim)
        t_engine, labelled, info = time.time(), bool(pending), model.info
        if labelled:
            labeler, how = _labeler(family, model, seqs, job)
            ready = f"labeler ready in {time.time() - t_engine:.1f} s ({how}, {len(seqs)} sequences per image)"
        else:  # only done shards gaining columns (extending.py)
            writer.close()
            ready = "no shard to label with every task"
        log(f"batchvlm: rank {rank.rank}/{rank.world}: {len(pending)} shard(s) to label; model {info.name} "
            f"({info.family}, {info.backend}, {info.dtype}, {info.device}) loaded in {t_load:.1f} s; {ready}")
        handled: set[str] = set()  # with claims: the shards this rank took, whatever came of them
        while pending:
            # with work stealing this rank's share is not known in advance: no total
            bar = Progress(job.name, len(pending), None if claims else shard_sizes(layout, mine, pending),
                           enabled=progress)
            labelling = Labelling(layout, pending, summary, writer, bar, claims, stop, limit, replacing, meter)
            labelling.run(stream, labeler, family, job, seqs)
            if not claims or not await_held or stop.event.is_set() or limit is not None:
                break
            handled |= labelling.claimed
            if not (pending := _await_held(layout, pending, handled, claims, stop)):
                break
            log(f"batchvlm: rank {rank.rank}/{rank.world}: {len(pending)} shard(s) whose holder died "
                f"({', '.join(s.stem for s in pending[:3])}): labelling them")
            stream.close()
            stream = load(pending, job.input, job.loader, family.preprocessor(), stealing)
            writer = WriterThread(layout, writer.schema, job.output.compression, on_written=claims.release,
                                  confirm=writer.confirm)
        if labelled and isinstance(labeler, (EngineLabeler, ImageLabeler)):
            log(f"batchvlm: rank {rank.rank}/{rank.world}: engine: {labeler.summary()}")
        if extend:
            extend_done(extend, job, layout, family, model, writer.schema, writer_started(writer), summary, stop,
                        progress, partial(_labeler, family, model))
        summary.stopped_by_signal = stop.event.is_set()
        summary.no_images = _no_images(layout, shards, summary)
        summary.seconds = time.time() - t0
        return summary
    finally:
        stream.close()  # on every way out: the workers ignore SIGTERM, so exit would wait on them
        if isinstance(claims, StoreClaims):
            claims.release_unused()  # taken by loader workers ahead of the labelling: no lease to wait out


def _open_folder(layout: Layout, clear: bool) -> None:
    """Under this rank's lock: clear the folder (overwrite), or sweep what dead writers left."""
    if clear:
        manifest.clear_outputs(layout)
    layout.meta.mkdir(parents=True, exist_ok=True)
    manifest.sweep_temporaries(layout)


def _skip_done(layout: Layout, mine: list[ShardRef], summary: RunSummary
               ) -> tuple[list[ShardRef], list[ShardRef], set[str]]:
    """-> (the shards of `mine` still to label, the done ones, the pending ones that replace a
    done output: their input changed); the done ones are counted (damaged ones noted). Each
    marker is read once. A shard done before whose input files are gone now (an unmounted mount
    point) is not relabelled into "file not found" rows: its labels are kept, and the run says so
    (exit 1)."""
    pending, done, replacing = [], [], set()
    for s in mine:
        stats = manifest.read_stats(layout, s.stem)
        if not manifest.still_done(layout, s, stats):
            if note := manifest.inputs_gone(layout, s):
                summary.shards_kept.append(note)
                log(f"batchvlm: shard {note}")
            else:
                pending.append(s)
                if manifest.was_done(layout, stats):
                    replacing.add(s.stem)
            continue
        summary.shards_done_before += 1
        done.append(s)
        summary.found += manifest.images_in(stats)
        summary.skipped.update(stats.get("skipped") or {})
        if stats.get("damaged"):  # reported by every run until the input is replaced
            summary.shards_damaged.append(manifest.damaged_note(s.stem, stats.get("rows", 0)))
    return pending, done, replacing


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


def _start_output(job: Job, layout: Layout, rank: Rank, model: EngineModel | StaticModel | ImageModel,
                  shards: ShardList, claims: Claims | None, kept: list[pa.Field],
                  embed_dim: int | None = None) -> WriterThread:
    """The job record (rank 0, or whoever comes first) and the writer of finished shards; `kept`:
    the input.keep columns preflight unified (Preflight.keep_columns)."""
    info = model.info
    started = now()
    meta = {"batchvlm": __version__, "job": job.name, "model": info.to_dict(),
            "tasks": [t.model_dump() for t in job.tasks], "engine": job.engine.model_dump(), "started": started,
            # provenance: every label column was made by this run (extend.py rewrites it where a
            # done shard gains columns)
            "columns_by_run": {col: started for col, _, _ in label_columns(job.tasks, job.output.raw_text)}}
    if rank.rank == 0 or not layout.job_file.exists():
        manifest.write_job_record(layout, meta | {"label_fingerprint": job.label_fingerprint(),
                                                   "label_settings": job.label_settings(),
                                                   "job_spec": job.model_dump(), "world_size": rank.world,
                                                   "skipped_files": shards.skipped,
                                                   "runs": manifest.runs(layout, started, len(job.tasks))})
    return WriterThread(layout, schema(job.tasks, meta, kept, job.output.raw_text, embed_dim),
                        job.output.compression, on_written=claims.release if claims else None,
                        confirm=claims.confirm if isinstance(claims, StoreClaims) else None)


def _claims(job: Job, layout: Layout) -> Claims | None:
    """Work stealing's claims: files in a folder, leases in an object store (where they are
    always on: they also keep two runs of one rank apart, which a store cannot flock)."""
    if layout.in_store:
        return StoreClaims(layout.meta, lease_s := float(os.environ.get(LEASE_ENV, 300)), lease_s / 10)
    return Claims(layout.meta) if job.runtime.work_stealing else None


def writer_started(writer: WriterThread) -> str:
    """This run's start time, as its job record and the files' metadata say it."""
    return json.loads(writer.schema.metadata[b"batchvlm"])["started"]


def _labeler(family: Family, model: EngineModel | StaticModel | ImageModel, seqs: list[TaskSequence], job: Job):
    """-> (the labeler, how it batches, for the log)."""
    if isinstance(model, StaticModel):
        return model.labeler(seqs, job.engine), "static batches"
    if isinstance(model, ImageModel):  # an encoder-only model: image batches, no decode
        labeler = ImageLabeler(model, seqs, job.engine)
        return labeler, f"image batches of up to {labeler.batch}, no decode"
    labeler = EngineLabeler(model, seqs, job.engine, family.max_prefix_len(), log)
    e = labeler.engine
    sized_by = ("what the job can use at once" if e.stats["kv_sized_by"] == "job"
                else f"what {e.model.device.type} memory allows")
    return labeler, (f"batch {e.settings.max_batch_size}, {e.stats['kv_blocks']} KV blocks of {job.engine.block_size} "
                     f"({e.stats['kv_mib']:.0f} MiB: {sized_by}), "
                     f"{e.stats['rows']} rows, {'pipelined' if e.pipelined else 'synchronous'}"
                     + (f", CUDA graphs captured in {e.stats['graph_capture_s']:.1f} s" if e.runner.graphs else "")
                     + (f", flex_attention compiled {e.stats['compiled_shapes']} shapes in {e.stats['compile_s']:.1f} s"
                        if e.stats["compiled_shapes"] else ""))


def _await_held(layout: Layout, pending: list[ShardRef], handled: set[str], claims: Claims,
                stop: StopFlag) -> list[ShardRef]:
    """Work stealing, after this rank's pass: wait until the shards of `pending` other ranks hold
    are done (a rank exits 0 only when every shard is done); -> those whose holder died (its
    claim gone, expired, or its process dead on this host), for this rank to take. [] once all
    are done, or on a stop request (the run then exits as stopped)."""
    said = False
    while not stop.event.is_set():
        # key by key, not a listing: few shards are held, and the output may be large
        held = [s for s in pending if s.stem not in handled and not manifest.is_done(layout, s)]
        if not held:
            return []
        if free := [s for s in held if claims.is_free(s.stem)]:
            return free
        if not said:
            log(f"batchvlm: waiting for {len(held)} shard(s) claimed by other ranks "
                f"({', '.join(s.stem for s in held[:3])}): they finish them, or, if a rank died, its claims "
                f"expire after {claims.lease_s:.0f} s and this rank takes them")
            said = True
        stop.event.wait(1.0)
    return []

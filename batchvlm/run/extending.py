"""The pass that gives done shards the columns of tasks the job gained (output/extend.py): their
images are labelled with those tasks only, and each shard's file is written again with the new
columns beside its old ones.

It runs after the pass over pending shards (which are labelled with every task), with the model
already loaded: one labeler per set of missing tasks (normally one set: the tasks appended last).
Not under --limit (a shard gains its columns whole or not at all), and with work stealing only on
rank 0 (claims hold whole shards to label, not shards to extend).
"""

from __future__ import annotations

from collections import defaultdict

from ..data.loader import load
from ..data.sources import ShardRef
from ..job import Job
from ..models.base.contract import EngineModel, Family, StaticModel
from ..output.extend import ShardExtender, missing_tasks
from ..output.layout import Layout
from ..output.writer import WriterThread
from ..progress import Progress
from .labelling import Labelling
from .log import log
from .stop import StopFlag
from .summary import RunSummary


def to_extend(layout: Layout, done: list[ShardRef], job: Job) -> dict[tuple[int, ...], list[ShardRef]]:
    """Done shards whose files lack some task's columns, grouped by the tasks they lack."""
    groups: dict[tuple[int, ...], list[ShardRef]] = defaultdict(list)
    if layout.in_store:  # an output in a store gains no tasks (preflight refuses it): no schema to read
        return {}
    for s in done:
        if missing := missing_tasks(layout, s.stem, job.tasks, job.output.raw_text):
            groups[tuple(missing)].append(s)
    return dict(groups)


def extend_done(groups: dict[tuple[int, ...], list[ShardRef]], job: Job, layout: Layout, family: Family,
                model: EngineModel | StaticModel, writer_schema, started: str, summary: RunSummary,
                stop: StopFlag, progress: bool, labeler_for) -> None:
    """Label each group's images with the tasks it lacks, and add their columns to its files.
    `labeler_for(seqs, job)` -> (labeler, how) builds a labeler for the model already loaded."""
    extender = ShardExtender(job.tasks, job.output.raw_text, started)
    for missing, shards in groups.items():
        if stop.event.is_set():
            return
        tasks = [job.tasks[i] for i in missing]
        sub = job.model_copy(update={"tasks": tasks})
        seqs = family.sequences(tasks, job.engine, job.output.constrain)
        labeler, how = labeler_for(seqs, sub)
        names = ", ".join(f"tasks.{i}" for i in missing)
        log(f"batchvlm: {len(shards)} done shard(s) gain the columns of {names} ({how})")
        stream = load(shards, job.input, job.loader, family.preprocessor())
        try:
            writer = WriterThread(layout, writer_schema, job.output.compression, write=extender)
            part = RunSummary(len(shards), 0)
            bar = Progress(f"{job.name} (new tasks)", len(shards), None, enabled=progress)
            # as `replacing`: a shard that cannot be read, or is damaged now, keeps its done marker and labels
            done = {s.stem for s in shards}
            Labelling(layout, shards, part, writer, bar, None, stop, None, done).run(stream, labeler, family, sub, seqs)
        finally:
            stream.close()
        summary.shards_extended += part.shards_written
        summary.images += part.images  # labelled with the new tasks: the run's images and errors count them
        summary.errors += part.errors
        summary.shards_failed += part.shards_failed
        summary.dropped += part.dropped
        summary.shards_kept += part.shards_kept

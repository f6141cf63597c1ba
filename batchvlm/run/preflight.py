"""The one check before a run: `validate`, `run --dry-run`, `run` (each worker) and the launchers
(local workers, Ray) all call `preflight`, so what validate accepts a run can do.

Run by the process that will run the job (a worker, a launcher on its node, the first Ray actor),
so the device is the one it will use. Nothing is loaded but the model's host side (config and tokenizer: every task's prompt rendered
and measured against the context), and nothing is written: a refused job leaves no folder behind
and clears nothing. In order: the output folder's layout, the inputs (listed, each URL's fsspec
backend there; the first Parquet file's image column; the keep columns: their types over every
Parquet file, a folder's sidecar extensions), where the output folder is (a folder, writable, apart from the inputs, no
file there a run would replace that it did not write), the device, the tasks, a local model
folder's weight files, and, for a folder labelled before, that the label-affecting settings match.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from ..data.checks import check_first_parquet, check_sidecars
from ..data.sources import SourceError, count_samples, keep_fields, list_files
from ..dist import Rank
from ..job import Job
from ..output import manifest
from ..output.layout import Layout
from ..output.placement import check_apart_from_inputs, check_no_foreign_files, check_writable
from ..output.shardlist import ShardList, plan


@dataclass(frozen=True)
class Preflight:
    """A job that passed: as it runs on this machine, with the shards a run would have."""

    job: Job  # model.device and model.dtype concrete
    layout: Layout
    shards: ShardList  # the frozen list plus what is new (nothing written back)
    clear: bool  # the run starts over (--overwrite, output.mode: overwrite)
    # the output columns of input.keep, with their types unified over every Parquet file: each
    # footer read once, here (the writer's schema takes them from here)
    keep_columns: list[pa.Field]

    def done(self) -> list:
        """The shards a run would skip."""
        if self.clear:
            return []
        with self.layout.listed():
            return [s for s in self.shards if manifest.is_done(self.layout, s)]

    def kept(self) -> list[str]:
        """A line for each shard done before whose input files are all gone now (an unmounted mount
        point): a run keeps its labels, says so and exits 1; validate and --dry-run warn."""
        if self.clear:
            return []
        with self.layout.listed():
            return [note for s in self.shards if (note := manifest.inputs_gone(self.layout, s))]

    def images(self) -> int | None:
        """Images in all shards; None where a container does not say (tar)."""
        sizes = [count_samples(s) for s in self.shards]
        return None if None in sizes else sum(sizes)


def clears(job: Job, overwrite: bool) -> bool:
    """Whether a run starts over: `--overwrite`, or `output.mode: overwrite`."""
    return overwrite or job.output.mode == "overwrite"


def preflight(job: Job, clear: bool, rank: Rank, dry: bool = False) -> Preflight:
    """Everything that can be checked before any work starts; `rank`: this process's, for the
    device. `dry` (validate, --dry-run) also refuses shards that cannot be read, which a run
    would fail one by one."""
    from ..device import for_device
    from ..models.registry import check_tasks

    layout = Layout.at(job.output.dir)
    if layout.in_store:  # the store first: every other check of the output reads it
        check_writable(layout.dir)
    resume = not clear and layout.dir.is_dir()  # labels there count (a file there is refused below)
    if resume:
        layout.check()  # a folder of the first layout is refused before any of its files is touched
    if job.input.kind == "parquet":
        manifest.check_not_input(layout, list_files(job.input))
    shards = plan(job.input, layout if resume else None)
    if dry and (unreadable := [s for s in shards if not s.planned]):
        field = "input.folder" if job.input.folder else "input.parquet"
        more = f" (and {len(unreadable) - 1} more)" if len(unreadable) > 1 else ""
        raise SourceError(f"{field}: cannot read {unreadable[0].url}{more}; a run would fail its shard(s)")
    check_first_parquet(shards, job.input)  # a wrong image column is refused before the model loads
    keep_columns = keep_fields(job.input, shards)  # refuses input.keep columns whose types clash across files
    check_sidecars(job.input, shards)  # input.keep extensions no file of a folder has
    if not layout.in_store:
        check_writable(layout.dir)
    check_apart_from_inputs(layout.dir, job.input, [(s.stem, s.url) for s in shards])
    check_no_foreign_files(layout, [s.stem for s in shards], clear)
    job = for_device(job, rank)  # dtype resolved before any settings are compared
    check_tasks(job.model, job.tasks, job.engine, job.output.constrain)
    if resume:
        manifest.check_settings(layout, job.label_fingerprint(), job.label_settings())
    return Preflight(job, layout, shards, clear, keep_columns)

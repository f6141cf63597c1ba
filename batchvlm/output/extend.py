"""A finished job that gains tasks: only the new tasks run, and their columns are added to each
done shard.

A job's tasks may grow by tasks appended after the ones its folder was labelled with (every
other label-affecting setting unchanged: manifest.check_settings says how many were added). A
task removed or changed is refused without --overwrite: its column would mean two things in one
folder. A shard labelled before with the old tasks is done; the run labels its images with the
tasks whose columns its Parquet file lacks (`missing_tasks`: read from the file, so a run cut
short while adding them resumes where it stopped), and `write_extended` writes the file again
in the schema a fresh shard gets: the old columns are the old file's Arrow arrays unchanged, the
new ones come from the rows, and the file is replaced as a shard is written (a temporary in
`__batchvlm__/`, the done marker naming it, then the rename): readers see the old file or the
new one.

Provenance: each file's `batchvlm` metadata maps every label column to the run that made it
(`columns_by_run`: column -> that run's start time, the `started` of its job record), and
`__batchvlm__/job.json` keeps every run's start time and the tasks it added (`runs`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..tasks import Task, label_columns
from .layout import Layout
from .writer import replace_shard_file


def missing_tasks(layout: Layout, stem: str, tasks: list[Task], raw_text: bool) -> list[int]:
    """The tasks whose columns the shard's done Parquet file lacks (all of them where it is unreadable)."""
    try:
        names = set(pq.read_schema(layout.parquet(stem)).names)
    except (OSError, pa.ArrowInvalid):
        return list(range(len(tasks)))
    return sorted({i for col, i, _ in label_columns(tasks, raw_text) if col not in names})


def columns_by_run(table_meta: dict[str, Any], tasks: list[Task], raw_text: bool, started: str,
                   added: set[str]) -> dict[str, str]:
    """Label column -> the start time of the run that made it: `added` by this run (`started`),
    the others as the file recorded them (files written before this record: the run that wrote it)."""
    before = table_meta.get("columns_by_run") or {}
    return {col: started if col in added else before.get(col, table_meta.get("started", "unknown"))
            for col, _, _ in label_columns(tasks, raw_text)}


@dataclass(frozen=True)
class ShardExtender:
    """writer.WriterThread's `write` for done shards gaining columns: as writer.write_shard
    (temporary, marker, rename), the shard's file rewritten with the columns of `sch` it lacks
    taken from `rows` (its rows of this run, in the file's row order); its other columns, and its
    done marker but for `output` and `columns_extended`, as they were."""

    tasks: list[Task]  # the job's, all of them
    raw_text: bool
    started: str  # this run's start time (its job record's `started`)

    def __call__(self, layout: Layout, stem: str, rows: list[dict[str, Any]], sch: pa.Schema, compression: str,
                 stats: dict[str, Any]) -> None:
        final = layout.parquet(stem)
        old = pq.read_table(final)
        if [r["key"] for r in rows] != old.column("key").to_pylist():
            raise RuntimeError(f"shard {stem}: the rows labelled now are not the rows of its file (the input "
                               "changed under the run); run again")
        old_meta = json.loads((old.schema.metadata or {}).get(b"batchvlm", b"{}"))
        added = [f.name for f in sch if f.name not in old.column_names]
        columns = [old.column(f.name) if f.name in old.column_names
                   else pa.array([r.get(f.name) for r in rows], type=f.type) for f in sch]
        meta = old_meta | json.loads(sch.metadata[b"batchvlm"]) | {
            "shard": stem, "finished": old_meta.get("finished"),
            "columns_by_run": columns_by_run(old_meta, self.tasks, self.raw_text, self.started, set(added))}
        table = pa.Table.from_arrays(columns, schema=sch.with_metadata({"batchvlm": json.dumps(meta)}))
        marker = json.loads(layout.stats(stem).read_text())
        marker |= {"columns_extended": marker.get("columns_extended", []) + added}
        replace_shard_file(layout, stem, final, table, compression, marker)

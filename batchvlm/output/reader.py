"""Reading a finished output folder back: its job, its rows, and the images they came from.

An output folder stays readable when its inputs do not: `status`, `preview` and `export`
work from the folder alone. The job record keeps absolute paths; a project moved as a whole
(inputs and outputs together) is found again relative to where the folder is now, and a shard
whose input is gone is still listed (from its stats), only its images cannot be read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from .shardlist import plan
from ..data.sources import Encoded, ShardRef, SourceError, read_shard
from ..job import InputSpec, Job, is_url
from ..tasks import column_of, kind_of
from .layout import Layout, OutputConflict
from .store import StoreError
from .storepath import StorePath
from .manifest import has_output, read_stats


class OutputError(ValueError):
    pass


def _moved(path: str, recorded_out: Path, actual_out: Path) -> str:
    """`path` as it lies relative to the output folder, after the folder moved."""
    if is_url(path) or recorded_out == actual_out:
        return path
    return os.path.normpath(actual_out / os.path.relpath(path, recorded_out))


def _relocated_input(inp: InputSpec, recorded_out: Path, actual_out: Path) -> InputSpec:
    """The inputs where they are found: as recorded, or moved along with the output folder."""
    try:
        plan(inp)
        return inp
    except SourceError:
        pass
    updates = {f: [_moved(p, recorded_out, actual_out) for p in getattr(inp, f)]
               for f in ("shards", "parquet") if getattr(inp, f)}
    if inp.folder:
        updates["folder"] = _moved(inp.folder, recorded_out, actual_out)
    moved = inp.model_copy(update=updates)
    try:
        plan(moved)
        return moved
    except SourceError:
        return inp  # gone: shards are listed from their stats, images cannot be read


def _kind(inp: InputSpec) -> str:
    return "folder" if inp.folder else "tar" if inp.shards else "parquet"


@dataclass
class Output:
    layout: Layout
    job: Job  # as recorded, with output.dir (and the inputs, if they moved with it) where they are now
    record: dict[str, Any]
    recorded_dir: Path | StorePath  # where the folder was when it was written

    @classmethod
    def open(cls, out_dir: str | Path) -> Output:
        layout = Layout.at(out_dir)
        try:
            layout.check()
            record = json.loads(layout.job_file.read_text())
            job = Job.model_validate(record["job_spec"])
        except (OutputConflict, StoreError) as e:
            raise OutputError(str(e)) from None
        except (OSError, ValueError, KeyError, TypeError):
            raise OutputError(f"{layout.dir}: not a batchvlm output folder (no readable "
                              f"{layout.job_file.relative_to(layout.dir)})") from None
        actual = layout.dir.resolve()
        recorded = actual if layout.in_store else Path(job.output.dir)  # an output in a store does not move
        inp = _relocated_input(job.input, recorded, actual)
        job = job.model_copy(update={"input": inp, "output": job.output.model_copy(update={"dir": str(actual)})})
        return cls(layout, job, record, recorded)

    @property
    def dir(self) -> Path:
        return self.layout.dir

    def columns(self, kind: str) -> list[str]:
        return [column_of(t) for t in self.job.tasks if kind_of(t) == kind]

    def labels(self, kinds: tuple[str, ...] = ("detect", "point")) -> list[str]:
        """Object names of the tasks of these kinds, in job order."""
        names: list[str] = []
        for t in self.job.tasks:
            if kind_of(t) in kinds:
                names += [o for o in getattr(t, kind_of(t)).objects if o not in names]
        return names

    def input_shards(self) -> list[ShardRef] | None:
        """The job's input shards, or None when the inputs cannot be listed (gone)."""
        try:
            return plan(self.job.input, self.layout)
        except SourceError:
            return None

    def shards(self, partial: bool = False) -> list[ShardRef]:
        """Finished shards, in shard order (their Parquet and done marker exist); with `partial`
        also those a --limit run cut short. Listed from the stats where the inputs are gone."""
        done = []
        listed = self.input_shards()
        if listed is not None:
            for shard in listed:
                stats = read_stats(self.layout, shard.stem)
                if stats and has_output(self.layout, stats) and (
                        stats.get("complete") or (partial and "rows" in stats)):
                    done.append(shard)
            return done
        files = list(self.dir.glob("*.parquet")) + (list(self.layout.partial_dir.glob("*.parquet*"))
                                                    if partial else [])
        for stem in sorted({self.layout.stem_of(p) for p in files}):  # the inputs are gone: listed from the stats
            stats = read_stats(self.layout, stem)
            if stats and (stats.get("complete") or (partial and "rows" in stats)) and has_output(self.layout, stats):
                source = _moved(str(stats.get("source", "")), self.recorded_dir, self.dir.resolve())
                done.append(ShardRef(stem, source, _kind(self.job.input)))
        return done

    def rows(self, limit: int | None = None, partial: bool = False) -> Iterator[tuple[ShardRef, dict[str, Any]]]:
        n = 0
        for shard in self.shards(partial):
            path = self.layout.file_of(shard.stem, read_stats(self.layout, shard.stem))
            for row in pq.read_table(path if isinstance(path, Path) else path.open()).to_pylist():
                if limit is not None and n >= limit:
                    return
                yield shard, row
                n += 1

    def encoded(self, shard: ShardRef, keys: set[str]) -> Iterator[Encoded]:
        """The input bytes of `keys` of one shard; OutputError when the input is gone."""
        try:
            for enc in read_shard(shard, self.job.input):
                if isinstance(enc, Encoded) and enc.key in keys and enc.data:
                    yield enc
        except (OSError, SourceError) as e:
            raise OutputError(f"{shard.stem}: cannot read its input {shard.url} ({getattr(e, 'strerror', None) or e})"
                              ) from None

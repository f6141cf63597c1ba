"""Reading a finished output folder back: its job, its rows, and the images they came from."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from PIL import Image

from ..data.decode import decode
from ..data.shardlist import plan
from ..data.sources import Encoded, ShardRef, read_shard
from ..job import Job
from ..tasks import column_of, kind_of
from .layout import Layout, OutputConflict
from .manifest import read_stats


class OutputError(ValueError):
    pass


@dataclass
class Output:
    layout: Layout
    job: Job
    record: dict[str, Any]

    @classmethod
    def open(cls, out_dir: str | Path) -> Output:
        layout = Layout(Path(out_dir))
        try:
            layout.check()
            record = json.loads(layout.job_file.read_text())
        except OutputConflict as e:
            raise OutputError(str(e)) from None
        except (OSError, ValueError):
            raise OutputError(f"{layout.dir}: not a batchvlm output folder (no readable "
                              f"{layout.job_file.relative_to(layout.dir)})") from None
        return cls(layout, Job.model_validate(record["job_spec"]), record)

    def columns(self, kind: str) -> list[str]:
        return [column_of(t) for t in self.job.tasks if kind_of(t) == kind]

    def labels(self, kinds: tuple[str, ...] = ("detect", "point")) -> list[str]:
        """Object names of the tasks of these kinds, in job order."""
        names: list[str] = []
        for t in self.job.tasks:
            if kind_of(t) in kinds:
                names += [o for o in getattr(t, kind_of(t)).objects if o not in names]
        return names

    def shards(self, partial: bool = False) -> list[ShardRef]:
        """Finished shards, in shard order (their Parquet and done marker exist); with `partial`
        also those a --limit run cut short."""
        done = []
        for shard in plan(self.job.input, self.layout):
            stats = read_stats(self.layout, shard.stem)
            if stats and self.layout.parquet(shard.stem).exists() and (
                    stats.get("complete") or (partial and "rows" in stats)):
                done.append(shard)
        return done

    def rows(self, limit: int | None = None, partial: bool = False) -> Iterator[tuple[ShardRef, dict[str, Any]]]:
        n = 0
        for shard in self.shards(partial):
            for row in pq.read_table(self.layout.parquet(shard.stem)).to_pylist():
                if limit is not None and n >= limit:
                    return
                yield shard, row
                n += 1

    def images(self, shard: ShardRef, keys: set[str]) -> Iterator[tuple[str, Image.Image, str]]:
        """(key, image after EXIF orientation, original format) for `keys` of one shard."""
        for enc in read_shard(shard, self.job.input):
            if isinstance(enc, Encoded) and enc.key in keys and enc.data:
                d = decode(enc.data, self.job.loader.max_image_pixels)
                if d.image is not None:
                    yield enc.key, d.image, d.format or "JPEG"

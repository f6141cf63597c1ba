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
from ..data.sources import Encoded, ShardRef, list_shards, read_shard
from ..job import Job
from ..tasks import column_of, kind_of
from .manifest import JOB_FILE, read_stats


class OutputError(ValueError):
    pass


@dataclass
class Output:
    dir: Path
    job: Job
    record: dict[str, Any]

    @classmethod
    def open(cls, out_dir: str | Path) -> Output:
        out = Path(out_dir)
        try:
            record = json.loads((out / JOB_FILE).read_text())
        except (OSError, ValueError):
            raise OutputError(f"{out}: not a batchvlm output folder (no readable {JOB_FILE})") from None
        return cls(out, Job.model_validate(record["job_spec"]), record)

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
        for p in sorted(self.dir.glob("*.parquet")):
            stats = read_stats(self.dir, p.stem)
            if stats and (stats.get("complete") or (partial and "rows" in stats)):
                done.append(p.stem)
        by_stem = {s.stem: s for s in list_shards(self.job.input)}
        missing = [s for s in done if s not in by_stem]
        if missing:
            raise OutputError(f"{self.dir}: input shard for {missing[0]!r} is gone; cannot read its images")
        return [by_stem[s] for s in done]

    def rows(self, limit: int | None = None, partial: bool = False) -> Iterator[tuple[ShardRef, dict[str, Any]]]:
        n = 0
        for shard in self.shards(partial):
            for row in pq.read_table(self.dir / f"{shard.stem}.parquet").to_pylist():
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

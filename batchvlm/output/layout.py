"""Where everything lives in an output folder.

    <dir>/<shard>.parquet        the labels, one file per shard; nothing else at this level
    <dir>/__batchvlm__/          metadata, which no reader of <dir> picks up (see META_DIR)
        job.json                 the resolved job, provenance and the label fingerprint
        shards.json              the frozen shard list: which files / row ranges each shard holds
        shards.lock              held while a rank extends the shard list
        run-<rank>-of-<world>.lock  held by the run of one rank (output/lock.py)
        <shard>.stats.json       rows, errors, timings, the file it is for: the done marker
        partial/<shard>.parquet.partial  a shard cut short by --limit (complete: false), until it is
                                 redone: not named .parquet, so `**/*.parquet` globs leave it out
        <shard>.claim            work-stealing leases
        *.tmp-<host>-<pid>       files being written (a shard's Parquet is renamed up into <dir>)

An output in an object store (`s3://bucket/prefix`, docs/object-store.md) has the same keys, but
no lock files: its `dir` is a StorePath, and its claims and commits are conditional PUTs.

Folders written by the first layout (stats files and `_job.json` beside the Parquet files) are
refused with a one-line message: their shard names differ too (`_root`), so they are relabelled.
"""

from __future__ import annotations

import json
import shutil
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from .storepath import StorePath

# pyarrow (and so pandas), Spark and Hive skip paths starting with `_` or `.`; the `datasets`
# library skips only `.` and `__` directories, and would feed the JSON here to its Parquet
# reader. Two leading underscores keep the folder out of every one of them.
META_DIR = "__batchvlm__"
OLD_JOB_FILE = "_job.json"
# A partial shard's suffix. Recursive globs (`out/**/*.parquet` in polars, DuckDB, pyarrow) would
# read a partial/<shard>.parquet as labels; folders written before this suffix may still hold one.
PARTIAL_SUFFIX = ".parquet.partial"


class OutputConflict(RuntimeError):
    pass


def own_stats(path: Path) -> dict | None:
    """The stats file at `path` if batchvlm wrote it (either layout): it names its own shard."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("shard") == path.name.removesuffix(".stats.json") else None


def is_old_stats(path: Path) -> bool:
    return own_stats(path) is not None


def is_store_url(url: str) -> bool:
    """An output in an S3-compatible object store (docs/object-store.md)."""
    return url.startswith("s3://")


@dataclass(frozen=True)
class Layout:
    dir: Path | StorePath

    @classmethod
    def at(cls, out_dir: str | Path) -> Layout:
        """The layout of `output.dir`: a local folder, or an `s3://bucket/prefix`."""
        if isinstance(out_dir, str) and is_store_url(out_dir):
            return cls(StorePath.from_url(out_dir))
        return cls(Path(out_dir))

    @property
    def in_store(self) -> bool:
        return not isinstance(self.dir, Path)

    def listed(self) -> AbstractContextManager[None]:
        """Within (this thread): an output in a store answers which Parquet objects, done markers and
        partial objects exist from one listing of each level (S3Store.listed), not a request per
        shard; a folder is read as ever. For the reads that find which shards are done."""
        if not self.in_store:
            return nullcontext()
        below = [f"{p.key}/" if p.key else "" for p in (self.dir, self.meta, self.partial_dir)]
        return self.dir.store.listed(below, (".parquet", ".stats.json", PARTIAL_SUFFIX))

    @property
    def meta(self) -> Path:
        return self.dir / META_DIR

    @property
    def job_file(self) -> Path:
        return self.meta / "job.json"

    @property
    def shard_list(self) -> Path:
        return self.meta / "shards.json"

    @property
    def shard_lock(self) -> Path:
        return self.meta / "shards.lock"

    def run_lock(self, rank: int, world: int) -> Path:
        return self.meta / f"run-{rank}-of-{world}.lock"

    @staticmethod
    def is_run_lock(path: Path) -> bool:
        return path.name.startswith("run-") and path.name.endswith(".lock") and "-of-" in path.name

    def parquet(self, stem: str) -> Path:
        return self.dir / f"{stem}.parquet"

    def stats(self, stem: str) -> Path:
        return self.meta / f"{stem}.stats.json"

    @property
    def partial_dir(self) -> Path:
        return self.meta / "partial"

    def partial(self, stem: str) -> Path:
        """Where a shard that is not done keeps its rows: out of every reader's sight."""
        return self.partial_dir / f"{stem}{PARTIAL_SUFFIX}"

    def partials(self, stem: str) -> tuple[Path, Path]:
        """A shard's partial file, and where folders written before PARTIAL_SUFFIX kept it."""
        return self.partial(stem), self.partial_dir / f"{stem}.parquet"

    @staticmethod
    def stem_of(path: Path) -> str:
        """The shard of a Parquet or partial file."""
        return path.name.removesuffix(PARTIAL_SUFFIX).removesuffix(".parquet")

    def file_of(self, stem: str, stats: dict | None) -> Path:
        """The Parquet file a shard's stats describe: the labels when done, else its partial rows
        (or, in folders written before partial/ existed, the top-level file)."""
        if stats and not stats.get("complete"):
            for path in self.partials(stem):
                if path.exists():
                    return path
        return self.parquet(stem)

    def old_layout(self) -> bool:
        """`_job.json`, or a done marker of the first layout beside the Parquet files (one that
        names its own shard: a user's `mine.stats.json` is no such thing)."""
        return (self.dir / OLD_JOB_FILE).exists() or any(is_old_stats(p) for p in self.dir.glob("*.stats.json"))

    def remove_if_unused(self, created_dir: bool) -> None:
        """After a refused run: the metadata folder if it holds nothing but locks (this run made
        it to hold its lock), and the output folder if this run created it and it is empty."""
        try:
            if self.meta.is_dir() and all(self.is_run_lock(p) or p == self.shard_lock for p in self.meta.iterdir()):
                shutil.rmtree(self.meta)
            if created_dir:
                self.dir.rmdir()
        except OSError:
            pass  # not empty, or gone: nothing of ours to undo

    def check(self) -> None:
        """Refuse a folder of the first layout (before any of its files is touched)."""
        if self.old_layout():
            raise OutputConflict(
                f"{self.dir} was written by an older batchvlm (done markers beside the Parquet files, now kept "
                f"in {META_DIR}/); relabel it with --overwrite, or choose a new output.dir")

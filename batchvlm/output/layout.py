"""Where everything lives in an output folder.

    <dir>/<shard>.parquet        the labels, one file per shard; nothing else at this level
    <dir>/__batchvlm__/          metadata, which no reader of <dir> picks up (see META_DIR)
        job.json                 the resolved job, provenance and the label fingerprint
        shards.json              the frozen shard list: which files / row ranges each shard holds
        shards.lock              held while a rank extends the shard list
        run-<rank>-of-<world>.lock  held by the run of one rank (output/lock.py)
        <shard>.stats.json       rows, errors, timings; written last: the done marker
        <shard>.claim            work-stealing leases
        *.tmp-<host>-<pid>       files being written (a shard's Parquet is renamed up into <dir>)

Folders written by the first layout (stats files and `_job.json` beside the Parquet files) are
refused with a one-line message: their shard names differ too (`_root`), so they are relabelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# pyarrow (and so pandas), Spark and Hive skip paths starting with `_` or `.`; the `datasets`
# library skips only `.` and `__` directories, and would feed the JSON here to its Parquet
# reader. Two leading underscores keep the folder out of every one of them.
META_DIR = "__batchvlm__"
OLD_JOB_FILE = "_job.json"


class OutputConflict(RuntimeError):
    pass


@dataclass(frozen=True)
class Layout:
    dir: Path

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

    def old_layout(self) -> bool:
        return (self.dir / OLD_JOB_FILE).exists() or next(self.dir.glob("*.stats.json"), None) is not None

    def check(self) -> None:
        """Refuse a folder of the first layout (before any of its files is touched)."""
        if self.old_layout():
            raise OutputConflict(
                f"{self.dir} was written by an older batchvlm (done markers beside the Parquet files, now kept "
                f"in {META_DIR}/); relabel it with --overwrite, or choose a new output.dir")

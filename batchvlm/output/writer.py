"""Parquet output: one file per input shard, written whole under a temporary name in
`__batchvlm__/`, fsynced, marked done by `__batchvlm__/<stem>.stats.json` (written atomically,
naming the size of the file it is for), and only then renamed up into
the output folder. A shard that is not done (cut short by --limit) goes to
`__batchvlm__/partial/` instead: readers of the output folder see done shards only.

A crash at any moment leaves either no file, a `*.tmp-*` file in `__batchvlm__/` (never seen by
readers, swept on the next run), or a done marker that matches no file (redone from scratch on
the next run). A finished shard is never rewritten by a resumed run; one whose input changed
is replaced by the rename, so readers see the old file or the new one, never a mix.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..tasks import Task, args_of, kind_of, label_columns
from .layout import Layout
from .store import StoreError
from .store_commit import CommitLost, commit_to_store
from .storepath import StorePath

BOX = pa.struct([("label", pa.string()), ("x_min", pa.float32()), ("y_min", pa.float32()),
                 ("x_max", pa.float32()), ("y_max", pa.float32())])
POINT = pa.struct([("label", pa.string()), ("x", pa.float32()), ("y", pa.float32())])
SCORES = pa.list_(pa.struct([("label", pa.string()), ("prob", pa.float32())]))
TYPES = {"caption": pa.string(), "query": pa.string(), "detect": pa.list_(BOX), "point": pa.list_(POINT),
         "ocr": pa.string(), "regions": pa.list_(BOX), "classify": pa.string(), "json": pa.string(),
         "similarity": pa.float32()}
RAW_TEXT = pa.list_(pa.struct([("label", pa.string()), ("text", pa.string())]))
TOKENS = pa.struct([("prompt", pa.int32()), ("generated", pa.int32())])


def label_type(task: Task, embed_dim: int | None = None) -> pa.DataType:
    """A task's label column type; an embed column's width is the model's (`embed_dim`)."""
    if kind_of(task) != "embed":
        return TYPES[kind_of(task)]
    if embed_dim is None:
        raise ValueError("an embed column needs the model's embedding width")
    return pa.list_(pa.float16() if args_of(task).dtype == "float16" else pa.float32(), embed_dim)


def schema(tasks: list[Task], metadata: dict[str, Any], kept: list[pa.Field] | None = None,
           raw_text: bool = False, embed_dim: int | None = None) -> pa.Schema:
    """The label columns, the task columns (a classify column followed by its `<name>_scores`;
    with `raw_text`, a `<name>_raw` column after each detect / point column: output.raw_text),
    the truncation flags, the token counts (`<name>_tokens`), then the `input.keep` columns (`kept`).
    `embed_dim`: the model's embedding width, for embed columns (fixed_size_list)."""
    fields = [
        pa.field("key", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("error", pa.string()),
    ]
    for col, i, what in label_columns(tasks, raw_text):
        fields.append(pa.field(col, label_type(tasks[i], embed_dim) if what == "label" else
                               {"scores": SCORES, "raw": RAW_TEXT, "truncated": pa.bool_(), "tokens": TOKENS}[what]))
    fields += kept or []
    return pa.schema(fields, metadata={"batchvlm": json.dumps(metadata)})


def tmp_path(path: Path, folder: Path | None = None) -> Path:
    """Where `path` is written before its rename (in `folder`, by default its own): named by host
    and pid, so a sweep can tell a crashed writer's leftovers from another live rank's file."""
    return (folder or path.parent) / f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputWriteError(RuntimeError):
    """Output could not be written (disk full, folder gone read-only): one line for the user."""


def write_failure(e: BaseException, out_dir: Path) -> OutputWriteError:
    """One line for a failed write of the output, saying what to do."""
    if isinstance(e, StoreError):  # one line already, naming the URL
        return OutputWriteError(str(e))
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return OutputWriteError(f"output.dir: no space left on {out_dir}; free some space (finished shards "
                                "are kept, a re-run continues) or choose another output.dir")
    if isinstance(e, OSError):
        return OutputWriteError(f"output.dir: cannot write in {out_dir}: {e.strerror or e}")
    return OutputWriteError(f"writing output failed: {type(e).__name__}: {e}")


@contextmanager
def _removing_on_error(tmp: Path) -> Iterator[None]:
    """A failed write leaves no temporary behind (a full disk stays no fuller than it was)."""
    try:
        yield
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: Path | StorePath, data: bytes) -> None:
    if not isinstance(path, Path):  # one PUT is atomic already
        path.write_bytes(data)
        return
    tmp = tmp_path(path)
    with _removing_on_error(tmp):
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    _fsync_dir(path.parent)


def output_stat(path: Path) -> dict[str, int] | None:
    """What a done marker remembers of its Parquet file (a rename keeps both; manifest.py
    compares the size)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def replace_shard_file(layout: Layout, stem: str, final: Path, table: pa.Table, compression: str,
                       marker: dict[str, Any]) -> None:
    """`table` becomes the file `final` of shard `stem`: written whole under a temporary name in
    `__batchvlm__/` and fsynced, then its done marker (`marker` and the file's `output` stat), then
    the rename. Until the rename the marker names a file that is not there: the shard is not done,
    and a run redoes it whole."""
    tmp = tmp_path(final, layout.meta)  # same filesystem: the rename is atomic
    with _removing_on_error(tmp):
        pq.write_table(table, tmp, compression=None if compression == "none" else compression)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        marker = marker | {"output": output_stat(tmp)}
        atomic_write_bytes(layout.stats(stem), json.dumps(marker, indent=1).encode())
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_shard(layout: Layout, stem: str, rows: list[dict[str, Any]], sch: pa.Schema, compression: str,
                stats: dict[str, Any], confirm: Callable[[str], Any] | None = None) -> None:
    """`confirm(stem)`: this rank's claim of the shard in an object store, refreshed just before
    the commit (None: it was taken over); store_commit.py."""
    meta = json.loads(sch.metadata[b"batchvlm"]) | {"shard": stem, "finished": stats.get("finished")}
    table = pa.Table.from_pylist(rows, schema=sch.with_metadata({"batchvlm": json.dumps(meta)}))
    if layout.in_store:
        commit_to_store(layout, stem, table, compression, stats, confirm)
        return
    done = bool(stats.get("complete"))
    final = layout.parquet(stem) if done else layout.partial(stem)
    final.parent.mkdir(exist_ok=True)
    replace_shard_file(layout, stem, final, table, compression, stats)
    if done:
        for path in layout.partials(stem):
            path.unlink(missing_ok=True)


@dataclass
class ShardOutput:
    stem: str
    rows: list[dict[str, Any]]
    stats: dict[str, Any]


class WriterThread:
    """Writes finished shards in the background so the accelerator never waits on disk. A shard
    handed over is written before close() returns, also where a KeyboardInterrupt (a second
    Ctrl-C) cut put()'s wait for room short; `unwritten` names those not written yet."""

    def __init__(self, layout: Layout, sch: pa.Schema, compression: str, on_written=None, confirm=None, write=None):
        self.layout, self.schema, self.compression = layout, sch, compression
        # (layout, stem, rows, schema, compression, stats); extend.py's too. `confirm`: write_shard's
        # check that the claim is still this rank's
        self.write = write or partial(write_shard, confirm=confirm)
        self.confirm = confirm
        self.on_written = on_written  # called with the stem after its done marker is down
        # Handed over, not written yet; the first is being written. Each is a whole shard's rows: one
        # being written and one waiting (plus the one put() holds) keep memory at a few shards' worth
        # while the writer is behind, which only happens when labelling outruns the disk.
        self._todo: deque[ShardOutput] = deque()
        self._room = threading.Condition()
        self._closing = False
        self._abandoned = False  # a third Ctrl-C: start no more writes
        self._writing: str | None = None  # the shard being written now
        self._error: BaseException | None = None
        self.written: list[str] = []
        self.lost: list[str] = []  # shards another rank committed (an object store's claim taken over)
        self._thread = threading.Thread(target=self._run, name="batchvlm-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._room:
                while not self._todo and not self._closing:
                    self._room.wait()
                if not self._todo or self._abandoned:
                    return
            self._write_first()

    def _write_first(self) -> None:
        with self._room:
            if self._abandoned:
                return
            item = self._todo[0]
            self._writing = item.stem
        try:
            if self._error is None:
                self.write(self.layout, item.stem, item.rows, self.schema, self.compression, item.stats)
                self.written.append(item.stem)
                if self.on_written is not None:
                    self.on_written(item.stem)
        except CommitLost:
            self.lost.append(item.stem)  # another rank's now: it writes the shard, this one nothing
        except Exception as e:  # noqa: BLE001 - surfaced to the main thread by put/close
            self._error = e  # (a KeyboardInterrupt in close() leaves the shard to write, not failed)
        finally:
            self._writing = None
        with self._room:
            self._todo.popleft()
            self._room.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise write_failure(self._error, self.layout.dir) from self._error

    @property
    def unwritten(self) -> list[str]:
        with self._room:
            return [item.stem for item in self._todo]

    def abandon(self) -> str | None:
        """Start no more writes (a third Ctrl-C); -> the shard being written now, which may still
        finish. The others of `unwritten` are never written."""
        with self._room:
            self._abandoned = True
            self._room.notify_all()
            return self._writing

    def holds(self, stem: str) -> bool:
        """Handed over: written, or to be."""
        return stem in self.written or stem in self.unwritten

    def put(self, item: ShardOutput) -> None:
        self._check()
        with self._room:
            self._todo.append(item)  # from here on it is written, whatever interrupts the wait
            self._room.notify_all()
            while len(self._todo) > 2 and self._thread.is_alive() and not self._abandoned:
                self._room.wait()

    def close(self) -> None:
        """Write what is handed over and stop; again after an interrupted close, it writes what is left
        in this thread."""
        with self._room:
            self._closing = True
            self._room.notify_all()
        self._thread.join()
        while self._todo and not self._abandoned:  # handed over after the thread ended
            self._write_first()
        self._check()

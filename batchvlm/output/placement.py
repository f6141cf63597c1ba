"""Where the output folder may be: checked before any work starts (validate, --dry-run, run).

It must be a folder (or creatable as one), writable, and apart from the inputs: no output
file may replace an input, and an input folder may not hold the output folder (exported
images and previews written there would become inputs of the next run), and no file a run
would write may be there unless this output wrote it (img2dataset keeps `00000.parquet` beside
`00000.tar`; a user may keep their own `root-00000.parquet`).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from ..job import InputSpec, is_url
from .layout import Layout, is_old_stats
from .manifest import OutputConflict, read_stats
from .store import StoreError
from .storepath import StorePath


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_store(out_dir: StorePath) -> None:
    """An output in an object store: reachable with the credentials at hand, writable, and
    honouring conditional writes (StorePath.store.probe); one line naming the URL if not."""
    try:
        out_dir.store.probe(out_dir.key)
    except StoreError as e:
        raise OutputConflict(str(e)) from None


def check_writable(out_dir: Path | StorePath) -> None:
    """A real write, not os.access: root passes every permission check, but not a read-only
    mount or a full disk's inode table. Nothing is created but a probe file, removed at once."""
    if not isinstance(out_dir, Path):
        return check_store(out_dir)
    where = _existing_ancestor(out_dir)
    if not where.is_dir():
        what = "is a file" if where == out_dir else f"is below the file {where}"
        raise OutputConflict(f"output.dir: {out_dir} {what}; name a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".batchvlm-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        reason = "read-only filesystem" if e.errno == errno.EROFS else e.strerror
        raise OutputConflict(f"output.dir: cannot write in {where} ({reason}); choose a writable output.dir") from None


def check_apart_from_inputs(out_dir: Path | StorePath, inp: InputSpec, shard_urls: list[tuple[str, str]]) -> None:
    """`shard_urls`: (stem, url) of every input shard. (An output in a store: inputs in the same
    bucket under its prefix are not looked for.)"""
    if not isinstance(out_dir, Path):
        return
    out = Path(os.path.abspath(out_dir))
    if inp.folder and not is_url(inp.folder):
        root = Path(os.path.abspath(inp.folder))
        if out == root or root in out.parents:
            raise OutputConflict(f"output.dir: {out} is inside input.folder {root}; files written there would "
                                 "become inputs. Choose an output folder outside it")
    for stem, url in shard_urls:
        target = out / f"{stem}.parquet"
        if not is_url(url) and target.exists() and os.path.exists(url) and target.samefile(url):
            raise OutputConflict(f"output.dir: {out} holds the input {url}; labels would replace it. "
                                 "Choose another output folder")


def _there(path: Path | StorePath) -> bool:
    """Anything at `path` (in a store: an object, asked of the listing, never a prefix below it)."""
    return path.is_file() if isinstance(path, StorePath) else path.exists()


def _has_record(layout: Layout, stem: str) -> bool:
    """A stats file of `stem` (read, in a folder; in a store, where only the commit protocol writes
    markers, that one is listed is enough: no request per shard)."""
    return layout.stats(stem).is_file() if layout.in_store else read_stats(layout, stem) is not None


def check_no_foreign_files(layout: Layout, stems: list[str], clear: bool) -> None:
    """Every shard's Parquet file that exists was written by this output: its shard has a record
    in the metadata folder (the stats file is written before the Parquet file is renamed up, so
    a file without one was never ours), or, where a run starts over, a done marker of the first
    layout beside it. Anything else would be replaced by labels: refused, naming it."""
    if not layout.dir.is_dir():
        return
    with layout.listed():  # a store: one listing of each level, not requests per shard
        foreign = [stem for stem in stems if _there(layout.parquet(stem)) and not _has_record(layout, stem)]
    for stem in foreign:
        path = layout.parquet(stem)
        if clear and is_old_stats(layout.dir / f"{stem}.stats.json"):
            continue
        raise OutputConflict(f"output.dir: {path} was not written by this output (no record of shard {stem} "
                             "in its __batchvlm__ folder); labels would replace it. Move the file away, or choose "
                             "another output.dir")

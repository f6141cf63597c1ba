"""Where the output folder may be: checked before any work starts (validate, --dry-run, run).

It must be a folder (or creatable as one), writable, and apart from the inputs: no output
file may replace an input, and an input folder may not hold the output folder (exported
images and previews written there would become inputs of the next run).
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from ..job import InputSpec, is_url
from .manifest import OutputConflict


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(out_dir: Path) -> None:
    """A real write, not os.access: root passes every permission check, but not a read-only
    mount or a full disk's inode table. Nothing is created but a probe file, removed at once."""
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


def check_apart_from_inputs(out_dir: Path, inp: InputSpec, shard_urls: list[tuple[str, str]]) -> None:
    """`shard_urls`: (stem, url) of every input shard."""
    out = Path(os.path.abspath(out_dir))
    if inp.folder:
        root = Path(os.path.abspath(inp.folder))
        if out == root or root in out.parents:
            raise OutputConflict(f"output.dir: {out} is inside input.folder {root}; files written there would "
                                 "become inputs. Choose an output folder outside it")
    for stem, url in shard_urls:
        target = out / f"{stem}.parquet"
        if not is_url(url) and target.exists() and os.path.exists(url) and target.samefile(url):
            raise OutputConflict(f"output.dir: {out} holds the input {url}; labels would replace it. "
                                 "Choose another output folder")

"""What validate (preflight) checks of the inputs beyond listing them, before any work: things a
run would otherwise find only shard by shard, after labelling (issue 40).
"""

from __future__ import annotations

import os
from contextlib import nullcontext

import fsspec
import pyarrow as pa

from ..job import InputSpec, is_url
from . import remote
from .sources import ShardRef, SourceError, check_backend, check_parquet_columns


def check_first_parquet(shards: list[ShardRef], inp: InputSpec) -> None:
    """validate, --dry-run and run: the first readable Parquet input's image column (its footer,
    and the URLs of a path column's first row group; a file that could not be read fails its own
    shard)."""
    import pyarrow.parquet as pq

    first = next((s for s in shards if s.kind == "parquet" and s.planned), None)
    if first is None:
        return
    try:
        with fsspec.open(first.url, "rb") as f:
            pf = pq.ParquetFile(f)
            schema = pf.schema_arrow
            check_parquet_columns(first.url, schema, inp)
            _check_image_paths(pf, first.url, inp)
    except SourceError:
        raise
    except (OSError, ValueError) as e:
        raise SourceError(f"input.parquet: cannot read {first.url}: {e}") from None


def _check_image_paths(pf, url: str, inp: InputSpec) -> None:
    """The backends of the URLs in a path column (strings: a {bytes, path} struct holds its images
    as a rule, and is not read here), in its first row group: a path column names one store."""
    t = pf.schema_arrow.field(inp.image_column).type
    if pf.metadata.num_row_groups == 0 or not (pa.types.is_string(t) or pa.types.is_large_string(t)):
        return
    values = pf.read_row_group(0, columns=[inp.image_column]).column(0).to_pylist()
    protocols = {p.split("://", 1)[0]: p for p in set(values) if isinstance(p, str) and is_url(p)}
    for path in protocols.values():
        check_backend(path, f"input.image_column ({url})")


def check_sidecars(inp: InputSpec, shards: list[ShardRef]) -> None:
    """A folder's `input.keep` names sidecar extensions some file beside its images has (`path`
    aside): a misspelt one would be a column of nulls. Directories are listed until every
    extension is found, so a job whose sidecars are there costs one listing."""
    wanted = {ext for ext in inp.keep if ext != "path"}
    if inp.kind != "folder" or not wanted:
        return
    for url in dict.fromkeys(s.url for s in shards):
        try:
            with os.scandir(url) if not is_url(url) else nullcontext(remote.names_in(url)) as it:
                for e in it:
                    name = e if isinstance(e, str) else e.name
                    wanted -= {ext for ext in wanted if name.endswith(f".{ext}")}
        except OSError:
            continue  # an unreadable directory fails its own shards
        if not wanted:
            return
    raise SourceError(f"input.keep: no file beside the images of {inp.folder} ends in .{sorted(wanted)[0]} (a "
                      "folder's keep names sidecar extensions: img.json beside img.jpg, or path)")

"""Input sources: the job's shards, and the encoded samples inside each.

A shard is the unit of work and of output: one tar file, one Parquet file, or one directory of
an image folder. Every source yields `Encoded` samples (key + image bytes, or an error) in a
stable order, so a shard labelled twice gives the same rows.

Error policy: a sample that cannot be read becomes an `Encoded` with an error (it will be an
error row); a shard whose container is corrupt (a truncated tar) ends with a `ShardDamaged`
marker after the samples that could be read; an I/O failure (network, permissions) raises and
leaves the shard unfinished, to be retried by the next run.
"""

from __future__ import annotations

import glob as globlib
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
from braceexpand import braceexpand

from ..job import InputSpec, is_url

FOLDER_EXTS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


@dataclass(frozen=True)
class ShardRef:
    stem: str  # output file stem, unique within the job
    url: str  # tar / Parquet path or URL, or a directory
    kind: str  # "tar" | "parquet" | "folder"


@dataclass
class Encoded:
    key: str
    data: bytes | None
    error: str | None = None
    path: str | None = None  # where the image bytes came from, for folder and path columns


@dataclass
class ShardDamaged:
    error: str


class SourceError(ValueError):
    pass


def _expand(patterns: list[str]) -> list[str]:
    out: list[str] = []
    for pattern in patterns:
        for p in braceexpand(pattern):
            if any(c in p for c in "*?["):
                if is_url(p):
                    fs, _, _ = fsspec.get_fs_token_paths(p)
                    protocol = p.split("://", 1)[0]
                    out += sorted(f"{protocol}://{m}" for m in fs.glob(p))
                else:
                    out += sorted(globlib.glob(p))
            else:
                out.append(p)
    return list(dict.fromkeys(out))


def _stem(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    for ext in (".tar.gz", ".tgz", ".tar", ".parquet"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def list_shards(inp: InputSpec) -> list[ShardRef]:
    """All shards of the input, sorted by stem; the same list on every rank."""
    if inp.folder:
        root = Path(inp.folder)
        if not root.is_dir():
            raise SourceError(f"input.folder: {root} is not a directory")
        shards = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if any(Path(f).suffix.lower() in FOLDER_EXTS for f in filenames):
                rel = Path(dirpath).relative_to(root)
                stem = "_root" if rel == Path(".") else str(rel).replace(os.sep, "__")
                shards.append(ShardRef(stem, dirpath, "folder"))
    else:
        kind = "tar" if inp.shards else "parquet"
        patterns = inp.shards or inp.parquet
        urls = _expand([patterns] if isinstance(patterns, str) else patterns)
        missing = [u for u in urls if not is_url(u) and not os.path.exists(u)]
        if missing:
            raise SourceError(f"input.{'shards' if inp.shards else 'parquet'}: not found: {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        shards = [ShardRef(_stem(u), u, kind) for u in urls]
    stems = [s.stem for s in shards]
    dupes = sorted({s for s in stems if stems.count(s) > 1})
    if dupes:
        raise SourceError(f"input: two shards would write the same output {dupes[0]!r}.parquet")
    if not shards:
        raise SourceError("input: no shards found")
    return sorted(shards, key=lambda s: s.stem)


def read_shard(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded | ShardDamaged]:
    reader = {"tar": _read_tar, "folder": _read_folder, "parquet": _read_parquet}[shard.kind]
    yield from reader(shard, inp)


def _pick_image(sample: dict, image_keys: list[str]) -> tuple[bytes | None, str | None]:
    for ext in image_keys:
        if ext in sample:
            return sample[ext], None
    present = sorted(k for k in sample if not k.startswith("__"))
    return None, f"no image in sample (has: {', '.join(present) or 'nothing'})"


def _tar_members(f) -> Iterator[tuple[str, str, bytes]]:
    """(key, lower-case extension, data) of every regular file, in archive order (webdataset's
    naming: the key is the path up to the first dot of the file name). Raises tarfile.ReadError
    where the archive breaks, including where stream mode would quietly stop."""
    from webdataset.tariterators import base_plus_ext

    tar = tarfile.open(fileobj=f, mode="r|*")
    for info in tar:
        key, ext = base_plus_ext(info.name)
        if info.isreg() and key is not None and not re.match(r"__[^/]*__($|/)", info.name):
            yield key, ext.lower(), tar.extractfile(info).read()
        tar.members = []  # a stream holds no index: memory stays flat on huge shards
    # Stream mode ends quietly at a header it cannot read (bad checksum, cut short, missing).
    # A whole archive ends in zero blocks: the first one ended the loop, at least one follows.
    zeros = 0
    while chunk := tar.fileobj.read(1 << 20):
        if chunk.strip(b"\0"):
            raise tarfile.ReadError(f"unreadable header at byte {tar.offset}")
        zeros += len(chunk)
    if zeros < 512:
        raise tarfile.ReadError(f"cut short at byte {tar.offset} (no end-of-archive blocks)")


def _read_tar(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded | ShardDamaged]:
    image_keys = [k.lower() for k in inp.image_keys]
    with fsspec.open(shard.url, "rb") as f:
        key, sample, damaged = None, {}, None
        try:
            for k, ext, data in _tar_members(f):
                if k != key and key is not None:
                    yield Encoded(key, *_pick_image(sample, image_keys))
                    sample = {}
                key = k
                sample.setdefault(ext, data)  # a.jpg and a.JPG: the first wins
        except (tarfile.TarError, EOFError) as e:
            damaged = ShardDamaged(f"damaged tar: {e}")
        if key is not None:  # the last sample (before a break: its members so far were read whole)
            yield Encoded(key, *_pick_image(sample, image_keys))
        if damaged:
            yield damaged


def _read_folder(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded]:
    root = Path(shard.url)
    names = sorted(f for f in os.listdir(root) if Path(f).suffix.lower() in FOLDER_EXTS
                   and ((root / f).is_file() or (root / f).is_symlink()))  # a broken link: an error row
    for name in names:
        path = root / name
        try:
            data = path.read_bytes()
        except OSError as e:
            yield Encoded(name, None, f"read: {e.strerror}", str(path))
            continue
        yield Encoded(name, data, None, str(path))


def _read_parquet(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded]:
    import pyarrow.parquet as pq

    with fsspec.open(shard.url, "rb") as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if inp.image_column not in names:
            raise SourceError(f"input.image_column: {shard.url} has no column {inp.image_column!r} (has {names})")
        if inp.key_column and inp.key_column not in names:
            raise SourceError(f"input.key_column: {shard.url} has no column {inp.key_column!r}")
        columns = [inp.image_column] + ([inp.key_column] if inp.key_column else [])
        row = 0
        base = shard.url.rsplit("/", 1)[0]
        for batch in pf.iter_batches(batch_size=256, columns=columns):
            images = batch.column(inp.image_column).to_pylist()
            keys = batch.column(inp.key_column).to_pylist() if inp.key_column else [None] * len(images)
            for value, key in zip(images, keys):
                key = str(key) if key is not None else str(row)
                row += 1
                if isinstance(value, dict):  # the datasets library's {"bytes", "path"} image struct
                    value = value.get("bytes") or value.get("path")
                if value is None:
                    yield Encoded(key, None, "no image (null)")
                elif isinstance(value, bytes):
                    yield Encoded(key, value)
                else:
                    path = value if is_url(value) or os.path.isabs(value) else f"{base}/{value}"
                    try:
                        with fsspec.open(path, "rb") as img:
                            yield Encoded(key, img.read(), None, path)
                    except OSError as e:
                        yield Encoded(key, None, f"read {value}: {e.strerror or e}", path)

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
    name: str | None = None  # the image's file name in the input (tar member, file), where it has one


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
    by_stem: dict[str, list[str]] = {}
    for s in shards:
        by_stem.setdefault(s.stem, []).append(s.url)
    if dupes := sorted(stem for stem, urls in by_stem.items() if len(urls) > 1):
        field = "folder" if inp.folder else "shards" if inp.shards else "parquet"
        a, b = by_stem[dupes[0]][:2]
        raise SourceError(f"input.{field}: {a} and {b} would both write {dupes[0]}.parquet" + _own_output(a, b))
    if not shards:
        raise SourceError("input: no shards found")
    return sorted(shards, key=lambda s: s.stem)


def _own_output(*urls: str) -> str:
    """Why two shards share a name when one of them is a file batchvlm wrote."""
    from ..output.manifest import written_by_us

    ours = [u for u in urls if u.endswith(".parquet") and not is_url(u) and written_by_us(Path(u))]
    if not ours:
        return "; rename one"
    return (f"; {ours[0]} is batchvlm's own output: the pattern matches the output folder "
            f"{os.path.dirname(ours[0])}. Narrow the pattern or move output.dir")


PARQUET_IMAGE_TYPES = "image bytes (binary), a path (string), or a {bytes, path} struct"


def check_parquet_columns(url: str, schema, inp: InputSpec) -> None:
    """The image column exists and holds something an image can come from."""
    import pyarrow as pa

    names = schema.names
    if inp.image_column not in names:
        raise SourceError(f"input.image_column: {url} has no column {inp.image_column!r} (has {names})")
    if inp.key_column and inp.key_column not in names:
        raise SourceError(f"input.key_column: {url} has no column {inp.key_column!r} (has {names})")
    t = schema.field(inp.image_column).type
    ok = (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
          or pa.types.is_large_string(t) or pa.types.is_null(t)
          or (pa.types.is_struct(t) and {"bytes", "path"} & {t.field(i).name for i in range(t.num_fields)}))
    if not ok:
        raise SourceError(f"input.image_column: column {inp.image_column!r} of {url} is {t}; expected "
                          f"{PARQUET_IMAGE_TYPES}")


def check_first_parquet(shards: list[ShardRef], inp: InputSpec) -> None:
    """validate / --dry-run: read the schema of the first Parquet input (its footer only)."""
    import pyarrow.parquet as pq

    first = next((s for s in shards if s.kind == "parquet"), None)
    if first is None:
        return
    try:
        with fsspec.open(first.url, "rb") as f:
            schema = pq.ParquetFile(f).schema_arrow
    except (OSError, ValueError) as e:
        raise SourceError(f"input.parquet: cannot read {first.url}: {e}") from None
    check_parquet_columns(first.url, schema, inp)


def count_samples(shard: ShardRef) -> int | None:
    """Samples in a shard where the container says so cheaply (a Parquet footer, a folder
    listing); None for tar shards (a stream has no index) and unreadable ones."""
    try:
        if shard.kind == "parquet":
            import pyarrow.parquet as pq

            with fsspec.open(shard.url, "rb") as f:
                return pq.ParquetFile(f).metadata.num_rows
        if shard.kind == "folder":
            return len(_folder_images(Path(shard.url)))
    except (OSError, ValueError):
        return None
    return None


def read_shard(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded | ShardDamaged]:
    reader = {"tar": _read_tar, "folder": _read_folder, "parquet": _read_parquet}[shard.kind]
    yield from reader(shard, inp)


def _pick_image(key: str, sample: dict, image_keys: list[str]) -> Encoded:
    for ext in image_keys:
        if ext in sample:
            return Encoded(key, sample[ext], name=f"{key}.{ext}")
    present = sorted(k for k in sample if not k.startswith("__"))
    return Encoded(key, None, f"no image in sample (has: {', '.join(present) or 'nothing'})")


# webdataset's metadata members (`__meta__.json`, `dir/__info__.txt`, `__x__/...`) are no samples
_METADATA = re.compile(r"(^|/)__[^/]*__(\.[^/]*)?($|/)")


def _tar_members(f) -> Iterator[tuple[str, str, bytes]]:
    """(key, lower-case extension, data) of every regular file, in archive order (webdataset's
    naming: the key is the path up to the first dot of the file name). Raises tarfile.ReadError
    where the archive breaks, including where stream mode would quietly stop."""
    from webdataset.tariterators import base_plus_ext

    tar = tarfile.open(fileobj=f, mode="r|*")
    for info in tar:
        key, ext = base_plus_ext(info.name)
        if info.isreg() and key is not None and not _METADATA.search(info.name):
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
                    yield _pick_image(key, sample, image_keys)
                    sample = {}
                key = k
                sample.setdefault(ext, data)  # a.jpg and a.JPG: the first wins
        except (tarfile.TarError, EOFError) as e:
            damaged = ShardDamaged(f"damaged tar: {e}")
        if key is not None:  # the last sample (before a break: its members so far were read whole)
            yield _pick_image(key, sample, image_keys)
        if damaged:
            yield damaged


def _folder_images(root: Path) -> list[str]:
    return sorted(f for f in os.listdir(root) if Path(f).suffix.lower() in FOLDER_EXTS
                  and ((root / f).is_file() or (root / f).is_symlink()))  # a broken link: an error row


def _read_folder(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded]:
    root = Path(shard.url)
    for name in _folder_images(root):
        path = root / name
        try:
            data = path.read_bytes()
        except OSError as e:
            yield Encoded(name, None, f"read: {e.strerror}", str(path), name)
            continue
        yield Encoded(name, data, None, str(path), name)


def _read_parquet(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded]:
    import pyarrow.parquet as pq

    with fsspec.open(shard.url, "rb") as f:
        pf = pq.ParquetFile(f)
        check_parquet_columns(shard.url, pf.schema_arrow, inp)
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
                    name = path.rstrip("/").rsplit("/", 1)[-1]
                    try:
                        with fsspec.open(path, "rb") as img:
                            yield Encoded(key, img.read(), None, path, name)
                    except OSError as e:
                        yield Encoded(key, None, f"read: {value}: {e.strerror or e}", path, name)

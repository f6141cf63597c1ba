"""Input sources: what the job's input holds, and the encoded samples inside each shard.

A shard is the unit of work and of output: one tar file, a row range of a Parquet file, or up
to `input.shard_size` images of one directory (which ones: output/shardlist.py). Every source
yields `Encoded` samples (key + image bytes or an error, plus the `input.keep` metadata) in a
stable order, so a shard labelled twice gives the same rows.

Error policy: a sample that cannot be decoded, or whose file no longer exists, becomes an
`Encoded` with an error (it will be an error row); a shard whose container is corrupt (a
truncated tar, not a tar) ends with a `ShardDamaged` marker after the samples that could be
read; a tar's members that are no sample's (no extension, dotfiles, links and devices) are counted
in a `TarSkipped` marker before the end; an I/O failure (network, permissions, an unlistable directory) raises and leaves the
shard unfinished, to be retried by the next run.
"""

from __future__ import annotations

import glob as globlib
import os
import re
import tarfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
from braceexpand import braceexpand
from PIL import features

from ..job import InputSpec, is_url
from . import remote

AVIF = features.check("avif")  # Pillow >= 11.2 wheels read AVIF
FOLDER_EXTS = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff",
               *([".avif"] if AVIF else [])}
# Image files a folder holds that are not labelled: counted, with the reason, never silently left out
UNREADABLE_EXTS = {".heic": "HEIC", ".heif": "HEIC", ".jxl": "JPEG XL", ".raw": "raw", ".cr2": "raw", ".nef": "raw",
                   ".arw": "raw", ".dng": "raw", ".svg": "SVG", **({} if AVIF else {".avif": "AVIF"})}


@dataclass(frozen=True)
class ShardRef:
    stem: str  # output file stem, unique within the job; never starts with "_" or "."
    url: str  # tar / Parquet path or URL, or a directory
    kind: str  # "tar" | "parquet" | "folder"
    files: tuple[str, ...] | None = None  # folder: the image names (in `url`) it holds; None: not listable
    rows: tuple[int, int] | None = None  # parquet: the row range [start, end) it holds; None: all
    size: int | None = None  # tar / parquet: the local input file's size and mtime when listed
    mtime_ns: int | None = None
    signature: str | None = None  # folder: digest of its files' names, sizes and mtimes when listed (not frozen)

    def same_images(self, other: ShardRef) -> bool:
        """Both hold the same images (whatever the files' stats)."""
        return (self.stem, self.url, self.kind, self.files, self.rows) == (other.stem, other.url, other.kind,
                                                                         other.files, other.rows)

    @property
    def planned(self) -> bool:
        """False for a placeholder: a directory or Parquet file that could not be read when the
        shards were planned. It is not frozen, and reading it fails (until the next plan)."""
        return not ((self.kind == "folder" and self.files is None) or (self.kind == "parquet" and self.rows is None))


@dataclass
class Encoded:
    key: str
    data: bytes | None
    error: str | None = None
    meta: dict[str, Any] | None = None  # the `input.keep` values of the sample
    path: str | None = None  # where the image bytes came from, for folder and path columns
    name: str | None = None  # the image's file name in the input (tar member, file), where it has one


@dataclass
class ShardDamaged:
    error: str


@dataclass
class TarSkipped:
    counts: dict[str, int]  # why members of the tar were not taken -> how many


class SourceError(ValueError):
    pass


NO_IMAGE = "no image in sample"  # a tar sample none of whose members is an image
NO_IMAGE_NULL = "no image (null)"  # a Parquet row whose image cell is null
NO_IMAGE_KINDS = (NO_IMAGE, "no image")  # their error kinds (output/rows.py): rows that held no image to label


def no_images_message(inp: InputSpec, shards: int) -> str:
    """What a job none of whose shards holds an image is told (run: exit code 2; status)."""
    if inp.kind == "tar":
        return (f"input.shards: none of the {shards} tar(s) holds an image (a member whose extension is one of "
                f"input.image_keys: {', '.join(inp.image_keys)}); nothing was labelled")
    what = f"input.image_column {inp.image_column!r} is null in every row" if inp.kind == "parquet" else "none"
    return f"input: no image in any of the {shards} shard(s) ({what}); nothing was labelled"


def shown(name: str) -> str:
    """`name` as valid UTF-8 text. A file name whose bytes are not UTF-8 reaches Python with
    surrogate escapes, which no Parquet string, seed or JSON reader takes: its bytes are written
    `\\xNN` instead (`caf\\xe9.jpg`). Keys, kept paths, shard names and sources are made of it;
    the file itself is still opened by its real name."""
    if name.isascii():
        return name
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate that no file name decodes to
        return name.encode("utf-8", "backslashreplace").decode("utf-8")
    return raw.decode("utf-8", "backslashreplace")


def _expand(patterns: list[str], field: str) -> list[str]:
    out: list[str] = []
    for pattern in patterns:
        for p in braceexpand(pattern):
            if any(c in p for c in "*?["):
                if is_url(p):
                    try:
                        matched = remote.glob(p, field)
                    except remote.RemoteError as e:
                        raise SourceError(str(e)) from None
                    if not matched:  # a store has no folders: a wrong prefix is an empty match
                        raise SourceError(f"{field}: no file matches {p}; fix the URL")
                    out += matched
                else:
                    out += sorted(globlib.glob(p))
            else:
                out.append(p)
    return list(dict.fromkeys(out))


def file_stem(url: str) -> str:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    for ext in (".tar.gz", ".tgz", ".tar", ".parquet"):
        if name.endswith(ext):
            return name[: -len(ext)]
    return name


def check_backend(url: str, field: str) -> None:
    """fsspec can open `url` here: each protocol it names (`s3://`, `simplecache::s3://`) is known
    and its backend installed. A missing one would fail every shard (or image) after the work."""
    if not is_url(url):
        return
    for part in url.split("::"):
        protocol = part.split("://", 1)[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as e:
            raise SourceError(f"{field}: {url} needs fsspec's {protocol!r} backend, which is not installed "
                              f"here ({e})") from None
        except ValueError:
            raise SourceError(f"{field}: {url}: fsspec knows no protocol {protocol!r}") from None


def list_files(inp: InputSpec) -> list[str]:
    """The tar or Parquet files the job names, in pattern order (globs sorted), each once."""
    field = "shards" if inp.shards else "parquet"
    patterns = getattr(inp, field)
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        check_backend(pattern, f"input.{field}")
    urls = _expand([patterns] if isinstance(patterns, str) else patterns, f"input.{field}")
    missing = [u for u in urls if not is_url(u) and not os.path.exists(u)]
    try:  # URLs in a store: against one listing of each folder they name
        missing += remote.missing([u for u in urls if is_url(u) and remote.listable(u)], f"input.{field}")
    except remote.RemoteError as e:
        raise SourceError(str(e)) from None
    if missing:
        raise SourceError(f"input.{field}: not found: {missing[0]}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if not urls:
        raise SourceError("input: no shards found")
    return urls


def file_stat(url: str) -> tuple[int | None, int | None]:
    """(size, mtime_ns) of a local input file; (None, None) for URLs (not compared)."""
    if is_url(url):
        return None, None
    st = os.stat(url)
    return st.st_size, st.st_mtime_ns


@dataclass
class FolderScan:
    images: dict[str, list[str]]  # relative directory ("." = the root) -> its image file names, sorted
    unreadable: dict[str, str]  # relative directory -> why it could not be listed
    stat: dict[str, tuple[int, int]]  # "<dir>/<name>" -> (size, mtime_ns) of each image; (-1, -1): a broken link
    skipped: Counter[str]  # why files were not taken -> how many


# The first bytes of the formats in FOLDER_EXTS: a file named .heic (or another unreadable
# extension) that holds one of these is an image to label, whatever its name says.
_READABLE_MAGIC = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*")


def _head(path: str) -> bytes:
    try:
        if is_url(path):
            return remote.read_or_none(path, 16) or b""
        with open(path, "rb") as f:
            return f.read(16)
    except OSError:
        return b""


def _readable_content(path: str) -> bool:
    head = _head(path)
    return head.startswith(_READABLE_MAGIC) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def _skip_reason(entry: os.DirEntry) -> str | None:
    """Why a file of the folder is no image to label; None if it is one. A broken link is
    taken: reading it gives an error row."""
    if not (entry.is_file() or entry.is_symlink()):
        return "not a regular file"
    return _name_reason(entry.name, entry.path)


def _name_reason(name: str, path: str) -> str | None:
    """Why a file named `name` (at `path`) is no image to label, by its name (and, for a name of an
    unreadable format, its first bytes); None if it is one."""
    suffix = Path(name).suffix.lower()
    if name.startswith("._"):
        return "macOS ._ metadata"
    if suffix in FOLDER_EXTS:
        return None
    if suffix in UNREADABLE_EXTS:
        if _readable_content(path):  # e.g. a JPEG an export named .heic
            return None
        return f"{UNREADABLE_EXTS[suffix]} (unreadable: convert to JPEG or PNG)"
    return "not an image"


def sidecar_names(image: str, ext: str) -> tuple[str, str]:
    """The names a folder image's `ext` sidecar may have, in the order read: its own (`img.jpg.txt`,
    as gallery-dl and many export tools write), then the one beside its stem (`img.txt`)."""
    return f"{image}.{ext}", Path(image).with_suffix(f".{ext}").name


def in_folder(folder: str, rel: str) -> str:
    """`rel` (a posix path; "." the folder itself) in a local folder or one in a store (a URL, whose
    `//` no Path may fold)."""
    if is_url(folder):
        return folder.rstrip("/") if rel == "." else f"{folder.rstrip('/')}/{rel}"
    return str(Path(folder) / rel)


def folder_rel(path: str, folder: str) -> str:
    """The posix path of `path` relative to `folder` ("." for the folder itself): in_folder's inverse."""
    if is_url(folder):
        root = folder.rstrip("/")
        return "." if path.rstrip("/") == root else path.removeprefix(root + "/")
    return Path(path).relative_to(folder).as_posix()


def _sidecars(images: list[str], keep: tuple[str, ...]) -> set[str]:
    """The names of every sidecar of `keep` that the images of one directory may have."""
    exts = [ext for ext in keep if ext != "path"]
    return {side for name in images for ext in exts for side in sidecar_names(name, ext)}


def _stat(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
    except OSError:
        return -1, -1
    return st.st_size, st.st_mtime_ns


def scan_folder(root: str, keep: tuple[str, ...] = ()) -> FolderScan:
    """Every directory under `root` that holds images, walked in sorted order (hidden ones too).
    Symlinked directories are followed, each real directory once (a link back up is a loop).
    The sidecars of `keep` (input.keep) beside the images are read, so not counted as skipped.
    A folder in a store (a URL) is listed once, whole."""
    if is_url(root):
        return _scan_store(root, keep)
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"input.folder: {root} is not a directory")
    scan = FolderScan({}, {}, {}, Counter())
    todo, seen = [Path(".")], {os.path.realpath(root)}
    while todo:
        rel = todo.pop()
        try:
            with os.scandir(root / rel) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            if rel == Path("."):
                raise SourceError(f"input.folder: cannot list {root}: {e.strerror}") from None
            scan.unreadable[rel.as_posix()] = f"cannot list {root / rel}: {e.strerror}"
            continue
        names, subdirs, others = [], [], []
        for e in entries:
            if e.is_dir():  # follows links
                real = os.path.realpath(e.path)
                if real in seen:
                    scan.skipped["links to a folder already read"] += 1
                else:
                    seen.add(real)
                    subdirs.append(rel / e.name)
            elif (why := _skip_reason(e)) is None:
                names.append(e.name)
                scan.stat[(rel / e.name).as_posix()] = _stat(Path(e.path))
            else:
                others.append((e.name, why))
        sidecars = _sidecars(names, keep) if keep else set()
        scan.skipped.update(why for name, why in others if name not in sidecars)
        if names:
            scan.images[rel.as_posix()] = names
        todo += reversed(subdirs)
    return scan


def _scan_store(root: str, keep: tuple[str, ...]) -> FolderScan:
    """scan_folder of a folder in a store: its directories are key prefixes, in the order a local
    walk takes them (a directory before its subdirectories, each level sorted)."""
    try:
        files = remote.list_tree(root, "input.folder")
    except remote.RemoteError as e:
        raise SourceError(str(e)) from None
    by_dir: dict[str, list[remote.RemoteFile]] = {}
    for f in files:
        by_dir.setdefault(f.path.rpartition("/")[0] or ".", []).append(f)
    scan = FolderScan({}, {}, {}, Counter())
    for rel in sorted(by_dir, key=lambda r: () if r == "." else tuple(r.split("/"))):
        names, others = [], []
        for f in sorted(by_dir[rel], key=lambda f: f.path):
            name = f.path.rpartition("/")[2]
            if (why := _name_reason(name, in_folder(root, f.path))) is None:
                names.append(name)
                scan.stat[f.path] = (f.size, f.mtime_ns)
            else:
                others.append((name, why))
        sidecars = _sidecars(names, keep) if keep else set()
        scan.skipped.update(why for name, why in others if name not in sidecars)
        if names:
            scan.images[rel] = names
    return scan


def check_columns(names: list[str], inp: InputSpec, url: str) -> None:
    if inp.image_column not in names:
        raise SourceError(f"input.image_column: {url} has no column {inp.image_column!r} (has {names})")
    if inp.key_column and inp.key_column not in names:
        raise SourceError(f"input.key_column: {url} has no column {inp.key_column!r}")
    if missing := [c for c in inp.keep if c not in names]:
        raise SourceError(f"input.keep: {url} has no column {missing[0]!r} (has {names})")


def parquet_rows(url: str, inp: InputSpec) -> int | None:
    """Rows of a Parquet input file, after checking it has the columns the job reads; None if it
    cannot be read (corrupt, I/O error)."""
    import pyarrow.parquet as pq

    try:
        with fsspec.open(url, "rb") as f:
            meta = pq.read_metadata(f)
    except (OSError, ValueError):
        return None
    check_columns(meta.schema.to_arrow_schema().names, inp, url)
    return meta.num_rows


def keep_fields(inp: InputSpec, shards: list[ShardRef]) -> list[pa.Field]:
    """The output columns of `input.keep`: strings for tar and folder sidecars; for Parquet the
    input tables' types, unified over every input file as Arrow unifies schemas (int32 and int64
    -> int64, null and x -> x). Types that do not unify (string in one file, int64 in another)
    would fail the write of labels already made: refused, naming both files (preflight calls
    this before any work; every footer is read)."""
    if not inp.keep:
        return []
    if inp.kind != "parquet":
        return [pa.field(name, pa.string()) for name in inp.keep]
    import pyarrow.parquet as pq

    # placeholders are files that could not be read (they fail their own shards)
    urls = list(dict.fromkeys(s.url for s in shards if s.planned))
    fields: dict[str, tuple[pa.Field, str]] = {}  # name -> (its type so far, the first file that has it)
    for url in urls:
        with fsspec.open(url, "rb") as f:
            sch = pq.read_schema(f)
        check_columns(sch.names, inp, url)
        for name in inp.keep:
            field = sch.field(name)
            if name not in fields:
                fields[name] = field, url
                continue
            so_far, first = fields[name]
            try:
                unified = pa.unify_schemas([pa.schema([so_far]), pa.schema([field])], promote_options="permissive")
            except (pa.ArrowTypeError, pa.ArrowInvalid):
                raise SourceError(f"input.keep: column {name!r} is {so_far.type} in {first} but {field.type} in "
                                  f"{url}; Arrow cannot store both in one column. Cast it in one of the files, or "
                                  "leave the column out") from None
            fields[name] = unified.field(name), first
    return [fields[name][0] for name in inp.keep] if fields else []


PARQUET_IMAGE_TYPES = "image bytes (binary), a path (string), or a {bytes, path} struct"


def check_parquet_columns(url: str, schema, inp: InputSpec) -> None:
    """The image column exists and holds something an image can come from."""
    import pyarrow as pa

    check_columns(schema.names, inp, url)
    t = schema.field(inp.image_column).type
    ok = (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
          or pa.types.is_large_string(t) or pa.types.is_null(t)
          or (pa.types.is_struct(t) and {"bytes", "path"} & {t.field(i).name for i in range(t.num_fields)}))
    if not ok:
        raise SourceError(f"input.image_column: column {inp.image_column!r} of {url} is {t}; expected "
                          f"{PARQUET_IMAGE_TYPES}")


def count_samples(shard: ShardRef) -> int | None:
    """Samples in a shard where the container says so cheaply (a Parquet footer, a folder
    listing); None for tar shards (a stream has no index) and unreadable ones."""
    try:
        if shard.kind == "parquet":
            if shard.rows is not None:  # the row range the shard holds
                return shard.rows[1] - shard.rows[0]
            return None
        if shard.kind == "folder":
            return len(shard.files) if shard.files is not None else None
    except (OSError, ValueError):
        return None
    return None


def read_shard(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded | TarSkipped | ShardDamaged]:
    reader = {"tar": _read_tar, "folder": _read_folder, "parquet": _read_parquet}[shard.kind]
    yield from reader(shard, inp)


# webdataset's metadata members (`__meta__.json`, `dir/__info__.txt`, `__x__/...`) are no samples
_METADATA = re.compile(r"(^|/)__[^/]*__(\.[^/]*)?($|/)")


def split_member(name: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member under webdataset's naming: the key is the path up to the
    first dot of the file name, the extension the rest (`d/a.b.jpg` -> `d/a`, `b.jpg`); None for a
    name without a dot (`README`) or starting with one (`._a.jpg`, `.DS_Store`). webdataset's own
    regex agrees but on a dotfile in a folder (`d/._a.jpg` -> key `d/`, an image `_a.jpg`)."""
    folder, slash, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (folder + slash + stem, ext) if dot and stem else None


def _unnamed_reason(name: str) -> str:
    """Why a regular member that `split_member` gives no key is no part of a sample (counted)."""
    base = name.rsplit("/", 1)[-1]
    if base.startswith("._"):
        return "macOS ._ metadata"
    return "hidden file (name starts with a dot)" if base.startswith(".") else "no extension"


def _tar_members(f, skipped: Counter[str]) -> Iterator[tuple[str, str, str, bytes]]:
    """(name, key, lower-case extension, data) of every regular file that names a sample, in
    archive order; the members that do not are counted in `skipped`, by reason. Raises
    tarfile.ReadError where the archive breaks, including where stream mode would quietly stop."""
    tar = tarfile.open(fileobj=f, mode="r|*")
    for info in tar:
        name = shown(info.name)  # tarfile decodes member names as UTF-8 with surrogate escapes
        if info.isdir() or _METADATA.search(name):
            pass  # no sample, nothing to count
        elif not info.isreg():
            skipped["not a regular file (link, device)"] += 1
        elif (split := split_member(name)) is None:
            skipped[_unnamed_reason(name)] += 1
        else:
            yield name, split[0], split[1].lower(), tar.extractfile(info).read()
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


def _text(data: bytes | None) -> str | None:
    return None if data is None else data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class _Member:
    name: str  # the member's path in the archive, as shown
    ext: str  # lower case: all of the file name after its first dot (webdataset's field name)
    data: bytes


def _tar_samples(key: str, members: list[_Member], inp: InputSpec, image_keys: set[str]) -> Iterator[Encoded]:
    """The images of one webdataset sample (consecutive members of one key), each its own Encoded.

    An image is a member whose extension, or last extension (`img.v1.jpg`), is one of
    `input.image_keys`. Its key is the sample's where the whole extension is one (`a.jpg` -> `a`),
    else its name without the last extension (`img.v1.jpg` -> `img.v1`); where two images of the
    sample would share a key (`a.jpg`, `a.png`) each is keyed by its whole name. A sidecar of
    `input.keep` is the image's own (`img.v1.json`) where there is one, else the sample's (`img.json`)."""
    images = [m for m in members if m.ext in image_keys or m.ext.rsplit(".", 1)[-1] in image_keys]
    by_ext = {m.ext: m.data for m in reversed(members)}  # a.txt and a.TXT: the first wins

    def sidecar(own: str | None, ext: str) -> str | None:
        data = by_ext.get(f"{own}.{ext}") if own else None
        return _text(by_ext.get(ext) if data is None else data)

    def meta(own: str | None) -> dict[str, str | None] | None:
        return {ext: sidecar(own, ext.lower()) for ext in inp.keep} if inp.keep else None

    if not images:
        present = ", ".join(sorted(by_ext)) or "nothing"
        yield Encoded(key, None, f"{NO_IMAGE} (has: {present}; input.image_keys: {', '.join(inp.image_keys)})",
                      meta=meta(None))
        return
    owns = [None if m.ext in image_keys else m.ext.rsplit(".", 1)[0] for m in images]
    keys = [key if own is None else f"{key}.{own}" for own in owns]
    shared = {k for k in keys if keys.count(k) > 1}
    for m, own, k in zip(images, owns, keys):
        yield Encoded(m.name if k in shared else k, m.data, meta=meta(own), name=m.name)


def _read_tar(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded | TarSkipped | ShardDamaged]:
    image_keys = {k.lower() for k in inp.image_keys}
    with fsspec.open(shard.url, "rb") as f:
        key, members, damaged, skipped = None, [], None, Counter()
        try:
            for name, k, ext, data in _tar_members(f, skipped):
                if k != key and key is not None:
                    yield from _tar_samples(key, members, inp, image_keys)
                    members = []
                key = k
                members.append(_Member(name, ext, data))
        except (tarfile.TarError, EOFError) as e:
            damaged = ShardDamaged(f"damaged tar: {e}")
        if key is not None:  # the last sample (before a break: its members so far were read whole)
            yield from _tar_samples(key, members, inp, image_keys)
        if skipped:
            yield TarSkipped(dict(skipped))
        if damaged:
            yield damaged


def _read_or_none(path: str) -> bytes | None:
    """The file's bytes; None if it does not exist. Other I/O errors (permissions, a flaky disk)
    raise: the shard is left unfinished and retried, not marked done with error rows."""
    if is_url(path):
        return remote.read_or_none(path)
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def _sidecar(folder: str, image: str, ext: str) -> bytes | None:
    for name in sidecar_names(image, ext):
        if (data := _read_or_none(in_folder(folder, name))) is not None:
            return data
    return None


def _read_folder(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded]:
    root = shard.url
    if shard.files is None:  # a directory that could not be listed when the shards were planned
        os.listdir(root)  # raises again if it still cannot
        raise SourceError(f"{root} became readable after the shards were planned; the next run labels it")
    for name in shard.files:
        path = in_folder(root, name)
        meta: dict[str, Any] | None = None
        if inp.keep:
            meta = {ext: _text(_sidecar(root, name, ext)) for ext in inp.keep if ext != "path"}
            if "path" in inp.keep:
                rel = folder_rel(path, inp.folder) if is_url(root) else os.path.relpath(path, inp.folder)
                meta["path"] = shown(rel)
        data = _read_or_none(path)
        key = shown(name)
        yield Encoded(key, data, None if data is not None else "read: file not found", meta, path, key)


def _row_groups(pf, start: int, end: int) -> tuple[list[int], int]:
    """The row groups that hold rows [start, end), and the row number of the first one's first row."""
    groups, first, offset = [], start, 0
    for g in range(pf.num_row_groups):
        n = pf.metadata.row_group(g).num_rows
        if offset < end and offset + n > start:
            first = offset if not groups else first
            groups.append(g)
        offset += n
    return groups, first


def _read_parquet(shard: ShardRef, inp: InputSpec) -> Iterator[Encoded]:
    import pyarrow.parquet as pq

    with fsspec.open(shard.url, "rb") as f:
        pf = pq.ParquetFile(f)  # a placeholder's file raises here again if it is still unreadable
        if shard.rows is None:
            raise SourceError(f"{shard.url} became readable after the shards were planned; the next run labels it")
        check_parquet_columns(shard.url, pf.schema_arrow, inp)
        start, end = shard.rows
        groups, row = _row_groups(pf, start, end)
        if not groups:
            return
        columns = list(dict.fromkeys([inp.image_column, *([inp.key_column] if inp.key_column else []), *inp.keep]))
        base = shard.url.rsplit("/", 1)[0]
        for batch in pf.iter_batches(batch_size=256, row_groups=groups, columns=columns):
            lo, hi = max(start - row, 0), min(end - row, batch.num_rows)
            if lo < hi:
                yield from image_cells(batch.slice(lo, hi - lo), row + lo, inp, base)
            row += batch.num_rows
            if row >= end:
                return


def image_cells(batch, first_row: int, inp: InputSpec, base: str) -> Iterator[Encoded]:
    """Encoded samples of a Parquet / Arrow batch: image bytes, a path (relative to `base`) or the
    datasets library's {bytes, path} struct; keys from `inp.key_column`, else row numbers."""
    images = batch.column(inp.image_column).to_pylist()
    keys = batch.column(inp.key_column).to_pylist() if inp.key_column else [None] * len(images)
    kept = {c: batch.column(c).to_pylist() for c in inp.keep}
    for i, (value, key) in enumerate(zip(images, keys)):
        meta = {c: v[i] for c, v in kept.items()} if kept else None
        if inp.key_column and (key is None or str(key) == ""):  # no key: an error row named by its row
            what = "null" if key is None else "empty"
            yield Encoded(f"row {first_row + i}", None, f"key: {what} in input.key_column {inp.key_column!r}", meta)
            continue
        key = str(key) if key is not None else str(first_row + i)
        if isinstance(value, dict):  # the datasets library's {"bytes", "path"} image struct
            value = value.get("bytes") or value.get("path")
        if value is None:
            yield Encoded(key, None, NO_IMAGE_NULL, meta)
        elif isinstance(value, bytes):
            yield Encoded(key, value, None, meta)
        else:
            path = value if is_url(value) or os.path.isabs(value) else f"{base}/{value}"
            name = path.rstrip("/").rsplit("/", 1)[-1]
            try:
                with fsspec.open(path, "rb") as img:
                    yield Encoded(key, img.read(), None, meta, path, name)
            except FileNotFoundError:
                where = "" if path == value else f" at {path} (a relative path is read from the Parquet file's folder)"
                yield Encoded(key, None, f"read {value}: file not found{where}", meta, path, name)
            except OSError as e:
                yield Encoded(key, None, f"read {value}: {e.strerror or e}", meta, path, name)

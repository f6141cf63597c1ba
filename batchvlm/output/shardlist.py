"""The job's shards, frozen: which images each shard holds is fixed for the life of an output folder.

The first run lists the input and writes the list to `__batchvlm__/shards.json`; later runs reuse
it and add shards for what is new, so a resumed or extended job never relabels or skips an image:

    folder   images not in any shard of their directory yet go into new shards of that
             directory, `<dir>-<n>`, at most `input.shard_size` each; frozen shards never change
    parquet  a file of more than shard_size rows becomes row ranges `<file>-<n>`; a file whose
             size or modification time changed is split again (its done markers no longer match)
    tar      one shard per tar, `<file>`

New tars and Parquet files are added in the order of their names.

Shards keep the order they were frozen in, new ones last: ranks that planned at different
moments of one launch agree on every shard they both saw (the partition is by position).

Shard names never start with `_` or `.` (readers skip such files): a directory is named by its
relative path with `__` for `/` and leading dots and underscores dropped, `root` for the top
level; a tar or Parquet file by its stem, leading dots and underscores dropped; with a `+N`
suffix where two directories or two files (`d1/x.tar`, `d2/x.tar`) would get the same name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from dataclasses import asdict, replace
from typing import Any

from ..data.sources import (FolderScan, ShardRef, SourceError, file_stat, file_stem, folder_rel, in_folder,
                            list_files, parquet_rows, scan_folder, shown)
from ..job import InputSpec
from .layout import Layout
from .writer import atomic_write_bytes

VERSION = 1


def plan(inp: InputSpec, layout: Layout | None = None, freeze: bool = False) -> ShardList:
    """The frozen shards of `layout` plus those for images added since. With `freeze`, the list is
    written back (under a lock, so concurrent ranks extend it one at a time) and outputs of
    Parquet row ranges that no longer exist are removed."""
    if not freeze:
        return _merge(inp, _load(inp, layout) if layout else [])[0]
    if layout.in_store:
        shards, dropped = _freeze_in_store(inp, layout)
    else:
        layout.meta.mkdir(parents=True, exist_ok=True)
        with open(layout.shard_lock, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            prior = _load(inp, layout)
            shards, dropped = _merge(inp, prior)
            frozen = [replace(s, signature=None) for s in shards if s.planned]
            if frozen != prior:
                _save(inp, layout, frozen)
    for stem in dropped:
        layout.parquet(stem).unlink(missing_ok=True)
        layout.stats(stem).unlink(missing_ok=True)
        for path in layout.partials(stem):
            path.unlink(missing_ok=True)
    return shards


def _freeze_in_store(inp: InputSpec, layout: Layout) -> tuple[ShardList, list[str]]:
    """An object store has no lock: the list is written with a conditional PUT on the ETag it was
    read with (If-None-Match where there was none), and merged again from the top where another
    rank wrote it in between."""
    store, key = layout.shard_list.store, layout.shard_list.key
    while True:
        seen = store.head(key)
        prior = _load(inp, layout) if seen else []
        shards, dropped = _merge(inp, prior)
        frozen = [replace(s, signature=None) for s in shards if s.planned]
        if frozen == prior or store.put(key, _encode(inp, frozen), if_none_match=seen is None,
                                         if_match=seen.etag if seen else None):
            return shards, dropped


def _load(inp: InputSpec, layout: Layout) -> list[ShardRef]:
    try:
        d = json.loads(layout.shard_list.read_text())
    except FileNotFoundError:
        return []
    except ValueError as e:
        raise SourceError(f"{layout.shard_list} is not valid JSON ({e}); restore it, or relabel with --overwrite") \
            from None
    if (d.get("version"), d.get("input"), d.get("shard_size")) != (VERSION, inp.kind, inp.shard_size):
        return []  # planned for other settings: the fingerprint check refused any labels made with them
    root = inp.folder
    return [ShardRef(**(s | {"url": in_folder(root, s["url"]) if root else s["url"],
                             "files": tuple(s["files"]) if s.get("files") is not None else None,
                             "rows": tuple(s["rows"]) if s.get("rows") is not None else None}))
            for s in d["shards"]]


def _encode(inp: InputSpec, shards: list[ShardRef]) -> bytes:
    root = inp.folder

    def entry(s: ShardRef) -> dict[str, Any]:
        e = {k: v for k, v in asdict(s).items() if v is not None and k != "signature"}
        if root:  # relative: the folder may move
            e["url"] = folder_rel(s.url, root)
        return e

    data = {"version": VERSION, "input": inp.kind, "shard_size": inp.shard_size, "shards": [entry(s) for s in shards]}
    return json.dumps(data, separators=(",", ":")).encode()


def _save(inp: InputSpec, layout: Layout, shards: list[ShardRef]) -> None:
    atomic_write_bytes(layout.shard_list, _encode(inp, shards))


class ShardList(list[ShardRef]):
    """The planned shards, and the files a folder scan did not take: reason -> count."""

    def __init__(self, shards: list[ShardRef], skipped: dict[str, int] | None = None):
        super().__init__(shards)
        self.skipped = skipped or {}


def skipped_note(skipped: dict[str, int]) -> str:
    """`3 file(s) skipped (2 HEIC images ..., 1 macOS ._ metadata)`, or '': the files of a folder, or
    members of the done tars, that are no images to label."""
    if not skipped:
        return ""
    parts = ", ".join(f"{n} {why}" for why, n in sorted(skipped.items(), key=lambda kv: -kv[1]))
    return f"{sum(skipped.values())} file(s) skipped ({parts})"


def _merge(inp: InputSpec, prior: list[ShardRef]) -> tuple[ShardList, list[str]]:
    """-> (all shards, stems of frozen shards that no longer exist)."""
    shards, dropped = (_merge_folder(inp, prior), []) if inp.folder else _merge_files(inp, prior)
    shards = shards if isinstance(shards, ShardList) else ShardList(shards)
    if inp.kind == "parquet" and shards and all(s.rows == (0, 0) for s in shards):  # readable, every one empty
        more = f" (and {len(shards) - 1} more file(s))" if len(shards) > 1 else ""
        raise SourceError(f"input.parquet: no rows in {shards[0].url}{more}")
    stems = [s.stem for s in shards]
    if len(set(stems)) != len(stems):
        dupe = next(s for s in stems if stems.count(s) > 1)
        raise SourceError(f"input: two shards would write the same output {dupe!r}.parquet")
    return shards, dropped


def _dir_name(rel: str, used: set[str]) -> str:
    base = "root" if rel == "." else shown(rel).replace("/", "__").lstrip("._") or "dir"
    name, n = base, 1
    while name in used:
        n += 1
        name = f"{base}+{n}"
    used.add(name)
    return name


def _signature(scan: FolderScan, rel: str, files: tuple[str, ...]) -> str:
    """A digest of the shard's images as they are now: replacing, touching or deleting one changes it."""
    h = hashlib.sha256()
    for name in files:
        size, mtime_ns = scan.stat.get(f"{rel}/{name}" if rel != "." else name, (-1, -1))
        h.update(f"{name}\0{size}\0{mtime_ns}\n".encode("utf-8", "surrogateescape"))  # names as on disk
    return h.hexdigest()[:32]


def _merge_folder(inp: InputSpec, prior: list[ShardRef]) -> ShardList:
    root = inp.folder
    scan = scan_folder(root, tuple(inp.keep))
    by_dir: dict[str, list[ShardRef]] = {}
    for s in prior:
        by_dir.setdefault(folder_rel(s.url, root), []).append(s)
    names = {rel: shards[0].stem.rsplit("-", 1)[0] for rel, shards in by_dir.items()}
    used = set(names.values())
    shards = list(prior)
    for rel, files in scan.images.items():
        frozen = by_dir.get(rel, [])
        known = {f for s in frozen for f in s.files}
        new = [f for f in files if f not in known]
        if not new:
            continue
        name = names.get(rel) or _dir_name(rel, used)
        for k, i in enumerate(range(0, len(new), inp.shard_size), start=len(frozen)):
            shards.append(ShardRef(f"{name}-{k:05d}", in_folder(root, rel), "folder",
                                   tuple(new[i : i + inp.shard_size])))
    # A directory that cannot be listed: a placeholder shard (not frozen) that fails when read, so
    # the run reports it and the next one, once it is readable, freezes its images.
    for rel in scan.unreadable:
        if rel not in by_dir:
            shards.append(ShardRef(f"{_dir_name(rel, used)}-00000", in_folder(root, rel), "folder", None))
    if not shards:
        raise SourceError(f"input.folder: no images found in {root}")
    signed = [replace(s, signature=_signature(scan, folder_rel(s.url, root), s.files))
              if s.files is not None else s for s in shards]
    return ShardList(signed, dict(scan.skipped))


def _split(url: str, base: str, inp: InputSpec, size: int | None, mtime_ns: int | None) -> list[ShardRef]:
    if inp.kind == "tar":
        return [ShardRef(base, url, "tar", size=size, mtime_ns=mtime_ns)]
    n = parquet_rows(url, inp)
    if n is None:  # unreadable: a placeholder that fails when read; the next run plans it again
        return [ShardRef(base, url, "parquet", size=size, mtime_ns=mtime_ns)]
    if n <= inp.shard_size:
        return [ShardRef(base, url, "parquet", rows=(0, n), size=size, mtime_ns=mtime_ns)]
    return [ShardRef(f"{base}-{k:05d}", url, "parquet", rows=(i, min(i + inp.shard_size, n)), size=size,
                     mtime_ns=mtime_ns) for k, i in enumerate(range(0, n, inp.shard_size))]


def _base_of(shards: list[ShardRef]) -> str:
    """The name a frozen file's shards were made from (`x`, or `x` of `x-00000`, `x-00001`)."""
    return shards[0].stem if len(shards) == 1 else shards[0].stem.rsplit("-", 1)[0]


def _new_file(url: str, inp: InputSpec, used: set[str], size: int | None, mtime_ns: int | None) -> list[ShardRef]:
    """A new file's shards, named by its stem without leading dots and underscores, with `+N`
    where another file (`d1/x.tar`, `d2/x.tar`) or a row range already has a name."""
    base = shown(file_stem(url)).lstrip("._") or "shard"
    n = 1
    while True:
        shards = _split(url, base if n == 1 else f"{base}+{n}", inp, size, mtime_ns)
        if not used.intersection(s.stem for s in shards):
            return shards
        n += 1


def _by_name(url: str) -> tuple[str, bool, str]:
    """New files in the order of their names (`a.tar` before `_a.tar`: the plain name wins `a`)."""
    stem = file_stem(url)
    return stem.lstrip("._"), stem != stem.lstrip("._"), url


def _merge_files(inp: InputSpec, prior: list[ShardRef]) -> tuple[list[ShardRef], list[str]]:
    urls = list_files(inp)
    frozen: dict[str, list[ShardRef]] = {}
    for s in prior:
        frozen.setdefault(s.url, []).append(s)
    listed = set(urls)
    # names of files still listed; a frozen file no longer listed (moved with the project) lends
    # its name to the file found in its place, so its done markers still apply
    used = {s.stem for s in prior if s.url in listed}
    current, dropped = {}, []
    for url in [u for u in frozen if u in listed] + sorted((u for u in urls if u not in frozen), key=_by_name):
        size, mtime_ns = file_stat(url)
        old = frozen.get(url)
        if old and (inp.kind == "tar" or (old[0].size, old[0].mtime_ns) == (size, mtime_ns)):
            # a tar's membership is the tar: only its stat is refreshed (done markers compare it)
            current[url] = [replace(s, size=size, mtime_ns=mtime_ns) for s in old]
            continue
        if old:
            current[url] = _split(url, _base_of(old), inp, size, mtime_ns)
        else:
            current[url] = _new_file(url, inp, used, size, mtime_ns)
        used |= {c.stem for c in current[url]}
        dropped += [s.stem for s in old or [] if s.stem not in {c.stem for c in current[url]}]
    order = [u for u in frozen if u in current] + sorted((u for u in urls if u not in frozen), key=_by_name)
    return [s for u in order for s in current[u]], dropped

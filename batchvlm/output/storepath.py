"""StorePath: an object-store location that answers the part of pathlib the output layer reads
with (exists, read_text, stat, glob, iterdir, unlink, `/`), so that manifest, status, reader and
placement read an `s3://` output and a local folder with the same code. Writes that must be
atomic do not go through it: they are the commit protocol's (store_commit.py, claims_store.py).

A "directory" is a key prefix: it exists while any object lies below it; mkdir and rmdir do nothing.
"""

from __future__ import annotations

import fnmatch
import io
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from types import SimpleNamespace

from .store import S3Store, parse_url


@dataclass(frozen=True)
class StorePath:
    store: S3Store = field(compare=False, hash=False, repr=False)
    bucket: str
    key: str  # no leading or trailing slash; "" is the bucket's top

    @classmethod
    def from_url(cls, url: str, store: S3Store | None = None) -> StorePath:
        bucket, prefix = parse_url(url)
        return cls(store or S3Store(bucket), bucket, prefix)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.store, self.bucket, f"{self.key}/{name}".lstrip("/"))

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem

    @property
    def parent(self) -> StorePath:
        return StorePath(self.store, self.bucket, self.key.rpartition("/")[0])

    @property
    def _below(self) -> str:
        return f"{self.key}/" if self.key else ""

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def is_file(self) -> bool:
        return self.store.head(self.key) is not None

    def is_dir(self) -> bool:
        return self.store.exists_below(self._below)

    def is_symlink(self) -> bool:
        return False

    def read_bytes(self) -> bytes:
        data = self.store.get(self.key)
        if data is None:
            raise FileNotFoundError(str(self))
        return data

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """One PUT: readers see the old object or the new one, never a part."""
        self.store.put(self.key, data)

    def open(self, mode: str = "rb") -> io.BytesIO:
        if mode != "rb":
            raise ValueError("a StorePath opens for reading only")
        return self.store.open(self.key)

    def stat(self) -> SimpleNamespace:
        info = self.store.head(self.key)
        if info is None:
            raise FileNotFoundError(str(self))
        return SimpleNamespace(st_size=info.size, st_mtime=info.mtime, st_mtime_ns=int(info.mtime * 1e9))

    def unlink(self, missing_ok: bool = False) -> None:
        self.store.delete(self.key)  # deleting a missing key is no error in S3

    def rmtree(self) -> None:
        for o in self.store.list(self._below, recursive=True)[0]:
            self.store.delete(o.key)

    def iterdir(self) -> list[StorePath]:
        objects, prefixes = self.store.list(self._below)
        return ([StorePath(self.store, self.bucket, o.key) for o in objects]
                + [StorePath(self.store, self.bucket, p.rstrip("/")) for p in prefixes])

    def glob(self, pattern: str) -> list[StorePath]:
        """One level, as the output layer globs (`*.stats.json`, `*.parquet`)."""
        return [StorePath(self.store, self.bucket, o.key) for o in self.store.list(self._below)[0]
                if fnmatch.fnmatchcase(o.key.rsplit("/", 1)[-1], pattern)]

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        pass

    def rmdir(self) -> None:
        pass

    def resolve(self) -> StorePath:
        return self

    def relative_to(self, other: StorePath) -> PurePosixPath:
        return PurePosixPath(self.key.removeprefix(other._below))

    def samefile(self, other: object) -> bool:
        return self == other

"""An S3-compatible object store under an output: the few requests the output protocol makes
(docs/object-store.md), through boto3, with every failure turned into one line that names the URL.

boto3 was chosen by scripts/bench_s3.py: obstore is ~2x faster per request, but per-request cost
is nothing next to labelling a shard, and boto3 alone has the whole standard credential chain
(environment, `~/.aws/config` profiles, SSO, web identity, instance / pod roles),
`AWS_ENDPOINT_URL[_S3]`, conditional PUTs (If-None-Match / If-Match) and retries with backoff.
Credentials are never read here, only used by boto3: no key reaches a message, a log or job.json.

Retries: botocore's standard mode (exponential backoff with jitter, on 5xx, throttling and
timeouts), `AWS_MAX_ATTEMPTS` attempts (default 10, about a minute and a half of waiting); a
store still failing after them raises StoreError, which ends the run with exit 1 (retryable).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path

from ..data.remote import BAD_CREDENTIALS, error_code
from .store_listing import MARKER, Snapshot

MAX_ATTEMPTS = 10
# A pending shard's upload holds at most CONCURRENCY parts of PART_BYTES in memory (64 MiB); below
# MULTIPART_BYTES a shard goes up in one PUT (read from its local file as it is sent).
PART_BYTES = 16 << 20
CONCURRENCY = 4
MULTIPART_BYTES = 64 << 20


class StoreError(RuntimeError):
    """The store refused or failed a request (after retries): one line, naming the URL."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    etag: str
    mtime: float  # the store's Last-Modified, seconds since the epoch
    server_now: float | None = None  # the store's clock when it answered (HEAD), for leases


def parse_url(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without slashes at either end)."""
    rest = url.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise StoreError(f"output.dir: {url} names no bucket; write s3://bucket/prefix")
    return bucket, prefix.strip("/")


def attempts() -> int:
    return int(os.environ.get("AWS_MAX_ATTEMPTS") or MAX_ATTEMPTS)


def _client():
    import boto3
    from botocore.config import Config

    cfg = Config(retries={"mode": "standard", "max_attempts": attempts()}, connect_timeout=10, read_timeout=60)
    return boto3.session.Session().client("s3", config=cfg)


class S3Store:
    """One bucket, through one boto3 client (thread-safe: the writer, the claims' heartbeat and
    the loader's work stealing share it)."""

    def __init__(self, bucket: str):
        self.bucket = bucket
        self._client, self._pid = None, None
        self._listing = threading.local()  # .snapshot: a Snapshot while `listed` is in force

    @property
    def client(self):
        """This process's client: a forked loader worker (which takes claims) makes its own, never
        sharing its parent's open connections."""
        if self._pid != os.getpid():
            self._client, self._pid = _client(), os.getpid()
        return self._client

    @property
    def endpoint(self) -> str:
        return self.client.meta.endpoint_url

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def fail(self, e: Exception, key: str, doing: str) -> StoreError:
        """One line for a failed request; never the credentials, never the store's own message
        (some quote the key id)."""
        from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

        url = self.url(key)
        if isinstance(e, NoCredentialsError):
            return StoreError(f"output.dir: no credentials for {url}; set AWS_PROFILE or AWS_ACCESS_KEY_ID / "
                              "AWS_SECRET_ACCESS_KEY, or run with an instance / pod role")
        if isinstance(e, EndpointConnectionError) or type(e).__name__ in ("ConnectTimeoutError", "ReadTimeoutError"):
            return StoreError(f"output.dir: cannot reach the store of {url} at {self.endpoint} ({type(e).__name__}); "
                              "check AWS_ENDPOINT_URL and the network. Finished shards are kept: run again")
        if isinstance(e, ClientError):
            code = e.response.get("Error", {}).get("Code", "?")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                return StoreError(f"output.dir: the bucket of {url} does not exist at {self.endpoint}; create it "
                                  "or fix the URL")
            if code in BAD_CREDENTIALS or status == 401:
                return StoreError(f"output.dir: {self.endpoint} refused the credentials for {url} ({code}); check "
                                  "AWS_PROFILE / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
            if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
                return StoreError(f"output.dir: no permission to {doing} {url} ({code}); the credentials need "
                                  "s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on the prefix")
            if status is not None and status >= 500:
                return StoreError(f"output.dir: the store of {url} kept failing ({status} {code}) after {attempts()} "
                                  "attempts; finished shards are kept: run again")
            return StoreError(f"output.dir: cannot {doing} {url} ({status} {code})")
        return StoreError(f"output.dir: cannot {doing} {url} ({type(e).__name__})")

    def _call(self, doing: str, key: str, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - botocore's errors, one line each
            raise self.fail(e, key, doing) from None

    @contextmanager
    def listed(self, prefixes: list[str], suffixes: tuple[str, ...]) -> Iterator[None]:
        """Within, in this thread of this process only: HEADs and GETs of the keys directly under
        `prefixes` (each ends in `/`) whose names end in one of `suffixes` are answered from one
        listing of each prefix (store_listing.py): one not listed does not exist, with no request
        made; a listed one's HEAD is its listing, a listed marker is read ahead. For the reads of a
        plan or a status (which shards are done), never for claims or commits, which must see the
        store as it is at that moment: they run in other threads and processes, or outside it."""
        objects: dict[str, ObjectInfo] = {}
        for prefix in prefixes:
            objects |= {o.key: o for o in self.list(prefix)[0]}
        before = getattr(self._listing, "snapshot", None)
        self._listing.snapshot = Snapshot(os.getpid(), set(prefixes), suffixes, objects)
        try:
            yield
        finally:
            self._listing.snapshot = before

    def _snapshot(self, key: str) -> Snapshot | None:
        """The listing in force that answers for `key`, if any."""
        snap = getattr(self._listing, "snapshot", None)
        return snap if snap is not None and snap.answers(key) else None

    def head(self, key: str) -> ObjectInfo | None:
        if snap := self._snapshot(key):
            return snap.objects.get(key)
        try:
            r = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as e:  # noqa: BLE001
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self.fail(e, key, "read") from None
        date = r.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
        return ObjectInfo(key, r["ContentLength"], r["ETag"], r["LastModified"].timestamp(),
                          parsedate_to_datetime(date).timestamp() if date else None)

    def get(self, key: str) -> bytes | None:
        got = self.fetch(key)
        return got[0] if got else None

    def fetch(self, key: str) -> tuple[bytes, str] | None:
        """-> (the object's bytes, their ETag), read in one request; None where there is none."""
        if snap := self._snapshot(key):
            if key not in snap.objects:
                return None
            if key.endswith(MARKER):
                return snap.body(key, self.fetch)
        try:
            r = self.client.get_object(Bucket=self.bucket, Key=key)
            return r["Body"].read(), r["ETag"]
        except Exception as e:  # noqa: BLE001
            if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                return None
            raise self.fail(e, key, "read") from None

    def put(self, key: str, data: bytes, *, if_none_match: bool = False, if_match: str | None = None,
            about: str | None = None) -> str | None:
        """-> the new ETag; None where the condition failed (the object exists / has another ETag / is gone).
        `about`: the key a failure names (the output's, for a probe), `key` if None."""
        kw = {"IfNoneMatch": "*"} if if_none_match else {"IfMatch": if_match} if if_match else {}
        try:
            return self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **kw)["ETag"]
        except Exception as e:  # noqa: BLE001
            # 412 failed, 409 a concurrent conditional write won, 404 If-Match on a deleted object
            if kw and error_code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404"):
                return None
            raise self.fail(e, about or key, "write") from None

    def upload(self, key: str, path: Path) -> None:
        """A local file up to `key`: one PUT, or multipart (parts of PART_BYTES, CONCURRENCY at a
        time) for a large one. Either way the object appears whole or not at all."""
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(multipart_threshold=MULTIPART_BYTES, multipart_chunksize=PART_BYTES,
                             max_concurrency=CONCURRENCY, use_threads=True)
        self._call("write", key, self.client.upload_file, str(path), self.bucket, key, Config=cfg)

    def delete(self, key: str) -> None:
        self._call("delete", key, self.client.delete_object, Bucket=self.bucket, Key=key)

    def delete_many(self, keys: list[str]) -> None:
        """Delete `keys`, 1000 a request (S3's DeleteObjects ceiling)."""
        for i in range(0, len(keys), 1000):
            batch = keys[i : i + 1000]
            r = self._call("delete", batch[0], self.client.delete_objects, Bucket=self.bucket,
                           Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
            if errors := r.get("Errors"):
                code = errors[0].get("Code", "?")
                raise StoreError(f"output.dir: cannot delete {self.url(errors[0].get('Key', ''))} ({code}) and "
                                 f"{len(errors) - 1} more; the credentials need s3:DeleteObject")

    def list(self, prefix: str, recursive: bool = False) -> tuple[list[ObjectInfo], list[str]]:
        """-> (objects, sub-prefixes) directly under `prefix` (which ends in `/`); all objects below
        it with `recursive`. One request per 1000 keys."""
        objects, prefixes = [], []
        kw = {} if recursive else {"Delimiter": "/"}
        pages = self._call("list", prefix, lambda: list(self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix, **kw)))
        for page in pages:
            objects += [ObjectInfo(o["Key"], o["Size"], o["ETag"], o["LastModified"].timestamp())
                        for o in page.get("Contents", [])]
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
        return objects, prefixes

    def exists_below(self, prefix: str) -> bool:
        r = self._call("list", prefix, self.client.list_objects_v2, Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        return r.get("KeyCount", 0) > 0

    def probe(self, prefix: str) -> None:
        """Refuse a store this output cannot rely on: not reachable, not writable, or one whose
        conditional create does not fail for an object that exists (claims and done markers
        would then not keep ranks apart)."""
        key = f"{prefix}/__batchvlm__/probe-{os.getpid()}-{os.urandom(4).hex()}".lstrip("/")
        self.exists_below(prefix + "/" if prefix else "")
        if self.put(key, b"probe", if_none_match=True, about=prefix) is None:
            raise StoreError(f"output.dir: cannot create a probe object at {self.url(key)}")
        try:
            if self.put(key, b"again", if_none_match=True) is not None:
                raise StoreError(f"output.dir: the store of {self.url(prefix)} ({self.endpoint}) ignores conditional "
                                 "writes (If-None-Match); batchvlm needs them to label exactly once. Use a store that "
                                 "has them (AWS S3, R2, MinIO, Ceph RGW 18+), or a local / mounted output.dir")
        finally:
            self.delete(key)

    def open(self, key: str) -> io.BytesIO:
        data = self.get(key)
        if data is None:
            raise FileNotFoundError(self.url(key))
        return io.BytesIO(data)

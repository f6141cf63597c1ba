"""Inputs at a URL (`s3://`, `gs://`, any fsspec protocol): listing them and reading their bytes,
with a failure of the store as one line naming the URL and what to fix.

The client and its credentials are the backend's own: for `s3://`, s3fs builds its client through
botocore, which takes the standard chain (environment, `~/.aws/config` profiles, SSO, web identity,
instance / pod roles) and `AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3` for a store that is not AWS,
as the output's client does (docs/object-store.md). A job file names no endpoint and no key.

Listing cost: a store lists 1000 keys a request. A glob (`s3://b/in/*.tar`) lists its folder once;
explicit URLs are checked against one listing of each folder they name (not one request each); a
folder input is listed once, recursively (newer s3fs: one paginated listing of the prefix; s3fs
0.4: one per directory). Listings are never served from s3fs's cache: a plan sees the store as it
is now, also in a long-lived process.
"""

from __future__ import annotations

from dataclasses import dataclass

import fsspec

# botocore / s3fs error codes that mean the credentials themselves were refused
BAD_CREDENTIALS = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
                    "InvalidClientTokenId")


class RemoteError(ValueError):
    """The store refused or failed a listing or a read (sources.py makes it a SourceError)."""


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to the folder listed, posix
    size: int
    mtime_ns: int


# Protocols whose folders are key prefixes a listing answers (not https://, not chained URLs)
STORES = ("s3://", "s3a://", "gs://", "gcs://", "az://", "abfs://", "abfss://")


def listable(url: str) -> bool:
    return url.startswith(STORES)


def filesystem(url: str):
    """-> (fsspec filesystem, the path it names `url` by)."""
    return fsspec.core.url_to_fs(url)  # no listing (get_fs_token_paths would expand a glob here)


def error_code(e: BaseException) -> str | None:
    """The store's error code where the backend kept it (botocore's ClientError, maybe as the cause)."""
    for err in (e, e.__cause__, e.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict) and (code := response.get("Error", {}).get("Code")):
            return str(code)
    return None


def failure(e: Exception, field: str, url: str, fs=None) -> RemoteError:
    """One line for a store that failed listing or reading `url`: never the store's own message
    (some quote the key id), never a credential."""
    code = error_code(e)
    kind = type(e).__name__
    if code in BAD_CREDENTIALS or kind in ("NoCredentialsError", "PartialCredentialsError"):
        return RemoteError(f"{field}: the store refused the credentials for {url} ({code or kind}); check "
                           "AWS_PROFILE / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL)")
    if isinstance(e, PermissionError) or code in ("AccessDenied", "AllAccessDisabled"):
        return RemoteError(f"{field}: no permission to read {url} ({code or 'AccessDenied'}); the credentials "
                           "need s3:ListBucket and s3:GetObject on it")
    if isinstance(e, FileNotFoundError) or code in ("NoSuchBucket", "NoSuchKey"):
        if fs is not None and not _bucket_exists(fs, url):
            return RemoteError(f"{field}: the bucket of {url} does not exist; create it or fix the URL "
                               "(another store: set AWS_ENDPOINT_URL)")
        return RemoteError(f"{field}: nothing at {url}; fix the URL")
    if kind in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionError",
                "ClientConnectorError") or isinstance(e, (ConnectionError, TimeoutError)):
        return RemoteError(f"{field}: cannot reach the store of {url} ({kind}); check AWS_ENDPOINT_URL and the "
                           "network")
    return RemoteError(f"{field}: cannot read {url} ({code or kind})")


def _bucket_exists(fs, url: str) -> bool:
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    try:
        fs.ls(bucket)
    except FileNotFoundError:
        return False
    except Exception:  # noqa: BLE001 - unknown: say what was asked for
        return True
    return True


def glob(pattern: str, field: str) -> list[str]:
    """The URLs matching `pattern`, sorted: one listing of the folder it names (1000 keys a request)."""
    fs, _ = filesystem(pattern)
    protocol = pattern.split("://", 1)[0]
    try:
        fs.invalidate_cache()
        return sorted(f"{protocol}://{m}" for m in fs.glob(pattern))
    except Exception as e:  # noqa: BLE001 - the backend's errors, one line each
        raise failure(e, field, pattern, fs) from None


def missing(urls: list[str], field: str) -> list[str]:
    """Those of `urls` that are not there: one listing of each folder they name, never a request each."""
    by_folder: dict[str, list[str]] = {}
    for url in urls:
        by_folder.setdefault(url.rsplit("/", 1)[0], []).append(url)
    gone = []
    for folder, named in by_folder.items():
        fs, path = filesystem(folder)
        try:
            fs.invalidate_cache()
            there = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)}
        except FileNotFoundError as e:
            if not _bucket_exists(fs, folder):
                raise failure(e, field, folder, fs) from None
            there = set()  # an empty "folder": every URL named in it is missing
        except Exception as e:  # noqa: BLE001
            raise failure(e, field, folder, fs) from None
        gone += [u for u in named if u.rsplit("/", 1)[-1] not in there]
    return gone


def list_tree(root: str, field: str) -> list[RemoteFile]:
    """Every file below the folder `root`, sorted by path."""
    fs, path = filesystem(root)
    path = path.rstrip("/")
    try:
        fs.invalidate_cache()
        found = fs.find(path, detail=True)
    except Exception as e:  # noqa: BLE001
        raise failure(e, field, root, fs) from None
    if not found:
        raise failure(FileNotFoundError(root), field, root, fs)
    files = []
    for name, info in found.items():
        rel = name.rstrip("/").removeprefix(path).lstrip("/")
        if not rel or info.get("type") == "directory" or name.endswith("/"):  # a "folder" marker object
            continue
        files.append(RemoteFile(rel, int(info.get("size") or 0), _mtime_ns(info)))
    return sorted(files, key=lambda f: f.path)


def _mtime_ns(info: dict) -> int:
    when = info.get("LastModified") or info.get("mtime") or info.get("last_modified")
    if hasattr(when, "timestamp"):
        return int(when.timestamp() * 1e9)
    return int(float(when) * 1e9) if isinstance(when, (int, float)) else -1


def names_in(folder: str) -> list[str]:
    """The file names directly in `folder`; [] where it cannot be listed."""
    fs, path = filesystem(folder)
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path.rstrip("/"), detail=False)]
    except Exception:  # noqa: BLE001 - an unreadable folder fails its own shards
        return []


def read_or_none(url: str, limit: int | None = None) -> bytes | None:
    """The object's bytes (the first `limit` of them); None if it does not exist. Other failures
    raise: the shard is left unfinished and retried, not marked done with error rows."""
    try:
        with fsspec.open(url, "rb") as f:
            return f.read() if limit is None else f.read(limit)
    except FileNotFoundError:
        return None

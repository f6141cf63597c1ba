"""What is already in an output folder: finished shards, the job that wrote them, leftovers.

`<stem>.stats.json` with `"complete": true` is the done marker. `_job.json` records the
resolved job and the fingerprint of its label-affecting settings; a run whose settings differ
is refused unless it overwrites.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..job import is_url
from .writer import atomic_write_bytes

if TYPE_CHECKING:
    from ..data.sources import ShardRef

JOB_FILE = "_job.json"


class OutputConflict(RuntimeError):
    pass


def read_stats(out_dir: Path, stem: str) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / f"{stem}.stats.json").read_text())
    except (OSError, ValueError):
        return None


def is_done(out_dir: Path, stem: str) -> bool:
    stats = read_stats(out_dir, stem)
    return bool(stats and stats.get("complete")) and (out_dir / f"{stem}.parquet").exists()


STALE_TMP_S = 3600  # a temporary file this old belongs to a dead writer, whatever its host


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temporaries(out_dir: Path) -> list[str]:
    """Remove `*.tmp-<host>-<pid>` files of dead writers (never finished output): this host's
    with a dead pid, or any host's older than STALE_TMP_S. Other ranks' files in progress stay."""
    host, now, gone = socket.gethostname(), time.time(), []
    for p in out_dir.glob("*.tmp-*"):
        owner = p.name.rsplit(".tmp-", 1)[1]
        owner_host, _, pid = owner.rpartition("-")
        try:
            dead = (owner_host == host and pid.isdigit() and not pid_alive(int(pid))) or now - p.stat().st_mtime > STALE_TMP_S
        except FileNotFoundError:
            continue
        if dead:
            p.unlink(missing_ok=True)
            gone.append(p.name)
    return gone


def written_by_us(path: Path) -> bool:
    """A Parquet file batchvlm wrote: it carries our key-value metadata."""
    import pyarrow.parquet as pq

    try:
        return b"batchvlm" in (pq.read_schema(path).metadata or {})
    except (OSError, ValueError):
        return False


def clear_outputs(out_dir: Path) -> None:
    """--overwrite: remove everything batchvlm wrote here (and nothing else)."""
    for p in out_dir.glob("*.parquet"):
        if written_by_us(p):
            p.unlink(missing_ok=True)
    for pattern in ("*.stats.json", "*.tmp-*", "*.claim", "*.claim.takeover-*", JOB_FILE):
        for p in out_dir.glob(pattern):
            p.unlink(missing_ok=True)


def check_not_input(out_dir: Path, shards: list[ShardRef]) -> None:
    """Refuse an output folder where a shard's output file would replace an input file."""
    for ref in shards:
        out = out_dir / f"{ref.stem}.parquet"
        if not is_url(ref.url) and out.exists() and out.samefile(ref.url):
            raise OutputConflict(f"output.dir: {out_dir} holds the input {ref.url}; labels would replace it. "
                                 "Choose another output folder")


@dataclass
class PriorJob:
    fingerprint: str
    weights_sha256: str | None


def read_prior(out_dir: Path) -> PriorJob | None:
    try:
        d = json.loads((out_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return PriorJob(d.get("label_fingerprint", ""), (d.get("model") or {}).get("weights_sha256"))


def check_settings(out_dir: Path, fingerprint: str) -> None:
    prior = read_prior(out_dir)
    if prior and prior.fingerprint != fingerprint:
        raise OutputConflict(
            f"{out_dir} holds labels made with other settings (model, tasks or sampling changed); "
            "use --overwrite to start over, or another output.dir")


def check_weights(out_dir: Path, sha256: str) -> None:
    prior = read_prior(out_dir)
    if prior and prior.weights_sha256 and prior.weights_sha256 != sha256:
        raise OutputConflict(f"{out_dir} holds labels from other model weights ({prior.weights_sha256[:12]}...); "
                             "use --overwrite to start over")


def record_failure(out_dir: Path, stem: str, source: str, error: str) -> None:
    """A shard that could not be read: a stats file that is not a done marker, with the error."""
    stats = {"shard": stem, "source": source, "complete": False, "failed": error}
    atomic_write_bytes(out_dir / f"{stem}.stats.json", json.dumps(stats, indent=1).encode())


def write_job_record(out_dir: Path, record: dict[str, Any]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_bytes(out_dir / JOB_FILE, json.dumps(record, indent=1, default=str).encode())

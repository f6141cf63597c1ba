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
from typing import Any

from .writer import atomic_write_bytes

JOB_FILE = "_job.json"


def lock_path(out_dir: Path, rank: int, world: int) -> Path:
    """The run lock of one rank (output/lock.py)."""
    return out_dir / f"_run-{rank}-of-{world}.lock"


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


def is_our_stats(path: Path) -> bool:
    """A stats file batchvlm wrote (a done marker or a failure record) names its own shard."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and d.get("shard") == path.name.removesuffix(".stats.json") and "complete" in d


def clear_outputs(out_dir: Path) -> None:
    """--overwrite: remove everything batchvlm wrote here (and nothing else)."""
    for p in out_dir.glob("*.parquet"):
        if written_by_us(p):
            p.unlink(missing_ok=True)
    for p in out_dir.glob("*.stats.json"):
        if is_our_stats(p):
            p.unlink(missing_ok=True)
    for pattern in ("*.tmp-*", "*.claim", "*.claim.takeover-*", JOB_FILE):
        for p in out_dir.glob(pattern):
            p.unlink(missing_ok=True)


@dataclass
class PriorJob:
    fingerprint: str
    settings: dict[str, Any] | None  # label_settings() of the job that wrote the folder
    weights_sha256: str | None


def read_prior(out_dir: Path) -> PriorJob | None:
    try:
        d = json.loads((out_dir / JOB_FILE).read_text())
    except (OSError, ValueError):
        return None
    return PriorJob(d.get("label_fingerprint", ""), d.get("label_settings"),
                    (d.get("model") or {}).get("weights_sha256"))


def _first_difference(before: Any, now: Any, path: str = "") -> tuple[str, Any, Any] | None:
    if isinstance(before, dict) and isinstance(now, dict):
        for k in sorted(set(before) | set(now), key=str):
            if found := _first_difference(before.get(k), now.get(k), f"{path}.{k}" if path else str(k)):
                return found
        return None
    if isinstance(before, list) and isinstance(now, list) and len(before) == len(now):
        for i, (a, b) in enumerate(zip(before, now)):
            if found := _first_difference(a, b, f"{path}.{i}"):
                return found
        return None
    return None if before == now else (path, before, now)


def check_settings(out_dir: Path, fingerprint: str, settings: dict[str, Any]) -> None:
    prior = read_prior(out_dir)
    if not prior or prior.fingerprint == fingerprint:
        return
    diff = _first_difference(prior.settings, settings) if prior.settings is not None else None
    what = (f"{diff[0]} was {json.dumps(diff[1])}, is now {json.dumps(diff[2])}" if diff
            else "model, tasks or sampling changed")
    raise OutputConflict(f"{out_dir} holds labels made with other settings ({what}); "
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

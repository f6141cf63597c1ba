"""What is already in an output folder: finished shards, the job that wrote them, leftovers.

`__batchvlm__/<stem>.stats.json` with `"complete": true` is the done marker, valid while the input
shard it was made from is unchanged (same size and modification time, recorded in it).
`__batchvlm__/job.json` records the resolved job and the fingerprint of its label-affecting
settings; a run whose settings differ is refused unless it overwrites, but for tasks appended
after the folder's own (their columns are added to the done shards: extend.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.sources import NO_IMAGE_KINDS
from ..job import is_url, model_path
from .layout import META_DIR, OLD_JOB_FILE, Layout, OutputConflict, is_old_stats, own_stats
from .writer import atomic_write_bytes, output_stat

if TYPE_CHECKING:
    from ..data.sources import ShardRef

__all__ = ["OutputConflict"]


def lock_path(layout: Layout, rank: int, world: int) -> Path:
    """The run lock of one rank (output/lock.py), inside the metadata folder."""
    return layout.run_lock(rank, world)


def read_stats(layout: Layout, stem: str) -> dict[str, Any] | None:
    try:
        return json.loads(layout.stats(stem).read_text())
    except (OSError, ValueError):
        return None


def input_stat(ref: ShardRef) -> dict[str, int | str] | None:
    """What a done marker remembers of its input, to tell when it changed: a file's size and
    mtime, a folder shard's digest of its images' (the same, per file)."""
    if ref.signature is not None:
        return {"files": ref.signature}
    return None if ref.size is None else {"size": ref.size, "mtime_ns": ref.mtime_ns}


def done_stats(layout: Layout, ref: ShardRef) -> dict[str, Any] | None:
    """The stats of a finished shard whose input is unchanged since; None if it is to be (re)labelled."""
    stats = read_stats(layout, ref.stem)
    return stats if still_done(layout, ref, stats) else None


def still_done(layout: Layout, ref: ShardRef, stats: dict[str, Any] | None) -> bool:
    """done_stats on stats already read."""
    # a folder marker written before folders were compared (input null) stays valid
    same_input = stats is not None and (stats.get("input") == input_stat(ref)
                                        or (ref.kind == "folder" and stats.get("input") is None))
    return same_input and was_done(layout, stats)


def has_output(layout: Layout, stats: dict[str, Any]) -> bool:
    """The shard's Parquet file is the one its stats were written for: by its size, which a
    copy of the folder keeps (mtimes it may not). Markers written before they named their file:
    the file exists."""
    path = layout.file_of(str(stats.get("shard")), stats)
    if not isinstance(stats.get("output"), dict):
        return path.exists()
    now = output_stat(path)
    return now is not None and now["size"] == stats["output"].get("size")


def prior_output(layout: Layout, stem: str) -> dict[str, Any] | None:
    """The stats of a shard that was done, whatever its input is now: complete, its file still the
    one they were written for. A run replaces such a shard only by a complete new one."""
    stats = read_stats(layout, stem)
    return stats if was_done(layout, stats) else None


def was_done(layout: Layout, stats: dict[str, Any] | None) -> bool:
    """prior_output on stats already read."""
    return stats is not None and bool(stats.get("complete")) and has_output(layout, stats)


def missing_inputs(ref: ShardRef) -> list[str]:
    """The local input files of `ref` that are not there (a folder's images, a tar or Parquet
    file): an unmounted mount point, a sync in progress. URLs are not looked at."""
    if is_url(ref.url):
        return []
    folder = ref.kind == "folder" and ref.files is not None
    paths = [Path(ref.url) / f for f in ref.files] if folder else [Path(ref.url)]
    return [str(p) for p in paths if not p.exists()]


def kept_note(stem: str, why: str) -> str:
    """One line for a done shard a run did not replace, and how to relabel it on purpose."""
    return (f"{stem}: labels from before kept ({why}); restore the input and run again, or delete "
            f"{META_DIR}/{stem}.stats.json to relabel it as it is now")


def inputs_gone(layout: Layout, ref: ShardRef) -> str | None:
    """A kept_note for a shard that was done and whose input files are all gone now (an unmounted
    mount point: relabelling it would replace its labels by "file not found" rows), else None. A
    folder shard that lost some of its images is relabelled (they become error rows). For run,
    status and validate."""
    if not (gone := missing_inputs(ref)) or prior_output(layout, ref.stem) is None:  # the cheap test first
        return None
    if ref.kind == "folder" and ref.files is not None and len(gone) < len(ref.files):
        return None
    return kept_note(ref.stem, f"its {len(gone)} input file(s) are gone, {gone[0]} first")


def images_in(stats: dict[str, Any]) -> int:
    """Rows of a shard that came from an image: all but the samples that held none (a tar
    sample of text members only, a null Parquet cell)."""
    kinds = stats.get("error_kinds") or {}
    return stats.get("rows", 0) - sum(kinds.get(k, 0) for k in NO_IMAGE_KINDS)


def damaged_note(stem: str, rows: int) -> str:
    return f"{stem}: {rows} sample(s) kept"


def is_done(layout: Layout, ref: ShardRef) -> bool:
    return done_stats(layout, ref) is not None


STALE_TMP_S = 3600  # a temporary file this old belongs to a dead writer, whatever its host


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_temporaries(layout: Layout) -> list[str]:
    """Remove `*.tmp-<host>-<pid>` files of dead writers (never finished output): this host's
    with a dead pid, or any host's older than STALE_TMP_S. Other ranks' files in progress stay."""
    host, now, gone = socket.gethostname(), time.time(), []
    for p in layout.meta.glob("*.tmp-*"):
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
        return b"batchvlm" in (pq.read_schema(path if isinstance(path, Path) else path.open()).metadata or {})
    except (OSError, ValueError):
        return False


def is_our_stats(path: Path) -> bool:
    """A stats file batchvlm wrote: a done marker or a failure record."""
    return (d := own_stats(path)) is not None and "complete" in d


def own_stems(layout: Layout) -> set[str]:
    """The shards this output wrote or planned: its shard list's, and those with a stats file (in
    either layout). A batchvlm Parquet file copied in from another job is none of them."""
    stems = set()
    try:
        shards = json.loads(layout.shard_list.read_text()).get("shards")
        stems |= {s["stem"] for s in shards if isinstance(s, dict) and isinstance(s.get("stem"), str)}
    except (OSError, ValueError, AttributeError, TypeError):
        pass  # no list (or not ours): the stats files still name what was written
    for p in [*layout.meta.glob("*.stats.json"), *layout.dir.glob("*.stats.json")]:
        if (d := own_stats(p)) is not None:
            stems.add(d["shard"])
    return stems


def clear_outputs(layout: Layout) -> None:
    """--overwrite: remove what this output wrote (and nothing else), in either layout: the
    Parquet files of its own shards, not others that batchvlm wrote for other jobs. The run
    locks in the metadata folder stay: this run holds its own (unlinking a held lock would let a
    second run take a fresh one)."""
    if layout.in_store:
        return _clear_store(layout)
    for stem in own_stems(layout):
        if written_by_us(p := layout.parquet(stem)):
            p.unlink(missing_ok=True)
    if layout.meta.is_dir():
        for p in layout.meta.iterdir():
            if layout.is_run_lock(p):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True) if isinstance(p, Path) else p.rmtree()
            else:
                p.unlink(missing_ok=True)
    for p in layout.dir.glob("*.stats.json"):  # the first layout's done markers
        if is_old_stats(p):
            p.unlink(missing_ok=True)
    for pattern in ("*.parquet.tmp-*", "*.stats.json.tmp-*", "*.claim", "*.claim.takeover-*", OLD_JOB_FILE):
        for p in layout.dir.glob(pattern):
            p.unlink(missing_ok=True)


def _clear_store(layout: Layout) -> None:
    """clear_outputs of an output in a store, in requests of 1000 keys: its own shards' Parquet
    objects and everything below `__batchvlm__/` (a store holds no run lock). An object beside its
    own stats file is ours without a read; one without (a stem of an old shard list, which the
    preflight does not check) is read to tell, as in a folder. Which exist comes from listings,
    not a request per shard."""
    with layout.listed():
        ours = [p.key for stem in own_stems(layout) if (p := layout.parquet(stem)).is_file()
                and (layout.stats(stem).is_file() or written_by_us(p))]
    store = layout.dir.store
    below = store.list(f"{layout.meta.key}/", recursive=True)[0]
    store.delete_many(ours + [o.key for o in below])


def check_not_input(layout: Layout, parquet_inputs: list[str]) -> None:
    """Refuse an output folder that holds Parquet input: labels could replace it, and readers of
    the output folder would read it as labels. (An output in a store holds no local input.)"""
    if layout.in_store or not layout.dir.is_dir():
        return
    for url in parquet_inputs:
        if not is_url(url) and Path(url).parent.samefile(layout.dir):
            if written_by_us(Path(url)):
                raise OutputConflict(f"input.parquet: {url} is batchvlm's own output: the pattern matches the "
                                     f"output folder {layout.dir}. Narrow the pattern or move output.dir")
            raise OutputConflict(f"output.dir: {layout.dir} holds the input {url}; labels would replace it or "
                                 "mix with it. Choose another output folder")


@dataclass
class PriorJob:
    fingerprint: str
    settings: dict[str, Any] | None  # label_settings() of the job that wrote the folder
    weights_sha256: str | None
    backend: str | None  # the backend model.backend resolved to (native | transformers)


def read_prior(layout: Layout) -> PriorJob | None:
    try:
        d = json.loads(layout.job_file.read_text())
    except (OSError, ValueError):
        return None
    model = d.get("model") or {}
    return PriorJob(d.get("label_fingerprint", ""), d.get("label_settings"), model.get("weights_sha256"),
                    model.get("backend"))


def _as_run(settings: dict[str, Any], backend: str | None) -> dict[str, Any]:
    """Label settings as the prior run resolved them: `backend: auto` ran as `backend` (native
    where a family matches), so `auto` and that backend label alike; a local model folder is
    its real path."""
    model = settings.get("model")
    if not isinstance(model, dict):
        return settings
    model = model | {"name": model_path(str(model.get("name")))}
    if backend and model.get("backend") == "auto":
        model["backend"] = backend
    return settings | {"model": model}


_ABSENT = object()  # a list item or key one side does not have


def _first_difference(before: Any, now: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """(path, before, now) of the first setting that differs; a list that grew or shrank
    differs at its first extra or missing item (a task added is that task, not both lists)."""
    if isinstance(before, dict) and isinstance(now, dict):
        for k in sorted(set(before) | set(now), key=str):
            here = f"{path}.{k}" if path else str(k)
            if found := _first_difference(before.get(k, _ABSENT), now.get(k, _ABSENT), here):
                return found
        return None
    if isinstance(before, list) and isinstance(now, list):
        for i in range(max(len(before), len(now))):
            a = before[i] if i < len(before) else _ABSENT
            b = now[i] if i < len(now) else _ABSENT
            if found := _first_difference(a, b, f"{path}.{i}"):
                return found
        return None
    return None if before == now else (path, before, now)


def _shown(value: Any) -> str:
    return "not there" if value is _ABSENT else json.dumps(value)


def check_settings(layout: Layout, fingerprint: str, settings: dict[str, Any] | None = None) -> None:
    prior = read_prior(layout)
    if not prior or prior.fingerprint == fingerprint:
        return
    if prior.settings is not None and settings is not None:
        before, now = _as_run(prior.settings, prior.backend), _as_run(settings, prior.backend)
        if before == now:
            return
        if {k: v for k, v in before.items() if k != "tasks"} == {k: v for k, v in now.items() if k != "tasks"}:
            _check_tasks_grew(layout, before.get("tasks") or [], now.get("tasks") or [])
            return
    diff = (_first_difference(prior.settings, settings)
            if prior.settings is not None and settings is not None else None)
    what = (f"{diff[0]} was {_shown(diff[1])}, is now {_shown(diff[2])}" if diff
            else "model, tasks, sampling or which images a shard holds changed")
    raise OutputConflict(f"{layout.dir} holds labels made with other settings ({what}); "
                         "use --overwrite to start over, or another output.dir")


def _check_tasks_grew(layout: Layout, before: list, now: list) -> None:
    """Tasks appended after the folder's are new columns for its done shards (output/extend.py);
    a task removed or changed would leave a column meaning two things: refused. Not yet in an
    object store (extend.py rewrites files in place)."""
    if now[:len(before)] == before:
        if layout.in_store and len(now) > len(before):
            raise OutputConflict(f"{layout.dir} holds labels of {len(before)} task(s) and the job adds more: adding "
                                 "tasks to an output in an object store is not supported yet; label the new tasks "
                                 "into another output.dir, or relabel with --overwrite")
        return
    path, was, is_now = _first_difference(before, now, "tasks")
    raise OutputConflict(f"{layout.dir} holds labels made with other settings ({path} was {_shown(was)}, is now "
                         f"{_shown(is_now)}); a labelled job may gain tasks after its own, but removing or changing "
                         "one needs --overwrite (or another output.dir)")


def check_weights(layout: Layout, sha256: str) -> None:
    prior = read_prior(layout)
    if prior and prior.weights_sha256 and prior.weights_sha256 != sha256:
        raise OutputConflict(f"{layout.dir} holds labels from other model weights ({prior.weights_sha256[:12]}...); "
                             "use --overwrite to start over")


def record_failure(layout: Layout, ref: ShardRef, error: str) -> None:
    """A shard that could not be read: a stats file that is not a done marker, with the error."""
    stats = {"shard": ref.stem, "source": ref.url, "complete": False, "failed": error}
    atomic_write_bytes(layout.stats(ref.stem), json.dumps(stats, indent=1).encode())


def runs(layout: Layout, started: str, n_tasks: int) -> list[dict[str, Any]]:
    """The job record's `runs`: each run's start and how many tasks the job had then (a run that
    added tasks is one whose count grew), the runs before this one as the record kept them."""
    try:
        prior = json.loads(layout.job_file.read_text())
    except (OSError, ValueError):
        prior = {}
    before = prior.get("runs") or ([{"started": prior["started"], "tasks": len(prior.get("tasks") or [])}]
                                   if "started" in prior else [])
    return before + [{"started": started, "tasks": n_tasks}]


def write_job_record(layout: Layout, record: dict[str, Any]) -> None:
    layout.meta.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(layout.job_file, json.dumps(record, indent=1, default=str).encode())

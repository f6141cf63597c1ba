"""Work stealing on a shared filesystem: a rank claims a shard by creating `<stem>.claim` in the
output's `__batchvlm__/` folder atomically (O_EXCL). Claims are leases: their holder refreshes them
while it works, and a claim not refreshed for `lease_s` (its holder died), or held by a dead
process on this host, may be taken over. A finished shard's claim is removed after its done
marker is written.

A launcher whose ranks are all gone can free their claims at once (`release_launch`): the claims
of a rank that died on another host otherwise wait out their lease. Ranks it starts put its
launch id (BATCHVLM_LAUNCH) in their claims."""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from pathlib import Path

from ..data.sources import ShardRef
from .layout import Layout
from .manifest import is_done, pid_alive
from .writer import tmp_path

LAUNCH_ENV = "BATCHVLM_LAUNCH"


@functools.cache
def _kernel() -> dict[str, object]:
    """Which kernel and pid namespace this process runs in. A host name alone is not enough:
    containers given one fixed host name on several machines share it, and the initial pid
    namespace has the same inode on every machine; the boot id is one kernel's own."""
    ids: dict[str, object] = {}
    for key, read in (("boot", lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip()),
                      ("pidns", lambda: os.stat("/proc/self/ns/pid").st_ino)):
        try:
            ids[key] = read()
        except OSError:
            ids[key] = None
    return ids


def holder_died(holder: object) -> bool:
    """A claim's holder (its JSON) is a process of this host, kernel and pid namespace that is
    gone (kill -9): its lease need not be waited out. Claims written before the boot id or the
    namespace was recorded are judged by what they record."""
    if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
        return False
    if any(holder.get(k, v) != v for k, v in _kernel().items()):
        return False
    pid = holder.get("pid")
    return isinstance(pid, int) and pid != os.getpid() and not pid_alive(pid)


class Claims:
    def __init__(self, folder: Path, lease_s: float = 300.0, heartbeat_s: float = 30.0):
        self.folder, self.lease_s, self.heartbeat_s = folder, lease_s, heartbeat_s
        me = {"host": socket.gethostname(), "pid": os.getpid()} | _kernel()
        self.me = json.dumps(me | ({"launch": os.environ[LAUNCH_ENV]} if os.environ.get(LAUNCH_ENV) else {})).encode()

    def path(self, stem: str) -> Path:
        return self.folder / f"{stem}.claim"

    def take(self, stem: str) -> bool:
        path = self.path(stem)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                mtime_ns = path.stat().st_mtime_ns
            except FileNotFoundError:
                return self.take(stem)
            if time.time() - mtime_ns / 1e9 <= self.lease_s and not self._holder_died(path):
                return False
            return self._take_over(stem, mtime_ns)
        with os.fdopen(fd, "wb") as f:
            f.write(self.me)
        return True

    def is_free(self, stem: str) -> bool:
        """No live holder: no claim, one not refreshed for a lease, or one of a dead process here."""
        path = self.path(stem)
        try:
            mtime_ns = path.stat().st_mtime_ns
        except FileNotFoundError:
            return True
        return time.time() - mtime_ns / 1e9 > self.lease_s or self._holder_died(path)

    def _holder_died(self, path: Path) -> bool:
        """A holder on this host whose process is gone (kill -9): no need to wait for its lease."""
        try:
            return holder_died(json.loads(path.read_bytes()))
        except (OSError, ValueError):
            return False

    def _take_over(self, stem: str, mtime_ns: int) -> bool:
        """Take a dead holder's lease. Ranks that saw the same stale claim race for a token
        named by its mtime (O_EXCL): one wins, the others leave it alone. A token older than a
        lease belongs to a taker that died before replacing the claim."""
        token = self.folder / f"{stem}.claim.takeover-{mtime_ns}"
        try:
            os.close(os.open(token, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            try:
                if time.time() - token.stat().st_mtime <= self.lease_s:
                    return False
                token.unlink()
            except FileNotFoundError:
                pass
            return self.take(stem)
        tmp = tmp_path(self.path(stem))
        tmp.write_bytes(self.me)
        os.replace(tmp, self.path(stem))
        return True

    def take_pending(self, layout: Layout, ref: ShardRef) -> bool:
        """Claim a shard that is not done: False if it is, or another rank holds it."""
        if is_done(layout, ref) or not self.take(ref.stem):
            return False
        if is_done(layout, ref):  # finished and released between the check and the take
            self.release(ref.stem)
            return False
        return True

    def release(self, stem: str) -> None:
        self.path(stem).unlink(missing_ok=True)
        for token in self.folder.glob(f"{stem}.claim.takeover-*"):
            token.unlink(missing_ok=True)

    def keep_alive(self, stems: set[str], stop: threading.Event) -> threading.Thread:
        """Refresh the leases of `stems` (a live set) until `stop` is set."""

        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                for stem in list(stems):
                    try:
                        os.utime(self.path(stem))
                    except FileNotFoundError:
                        pass

        t = threading.Thread(target=beat, name="batchvlm-claims", daemon=True)
        t.start()
        return t


def release_launch(folder: Path, launch: str) -> list[str]:
    """Remove the claims of `launch`, whose ranks have all ended (so none is live); -> their shards."""
    freed = []
    for path in folder.glob("*.claim"):
        try:
            holder = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue
        if isinstance(holder, dict) and holder.get("launch") == launch:
            path.unlink(missing_ok=True)
            freed.append(path.name.removesuffix(".claim"))
    return freed

"""Work stealing on a shared filesystem: a rank claims a shard by creating `<stem>.claim`
atomically (O_EXCL). Claims are leases: their holder refreshes them while it works, and a
claim not refreshed for `lease_s` (its holder died) may be taken over. A finished shard's
claim is removed after its done marker is written."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from .writer import tmp_path


class Claims:
    def __init__(self, out_dir: Path, lease_s: float = 300.0, heartbeat_s: float = 30.0):
        self.out_dir, self.lease_s, self.heartbeat_s = out_dir, lease_s, heartbeat_s
        self.me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()}).encode()

    def path(self, stem: str) -> Path:
        return self.out_dir / f"{stem}.claim"

    def take(self, stem: str) -> bool:
        path = self.path(stem)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                stale = time.time() - path.stat().st_mtime > self.lease_s
            except FileNotFoundError:
                return self.take(stem)
            if not stale:
                return False
            tmp = tmp_path(path)
            tmp.write_bytes(self.me)
            os.replace(tmp, path)  # take over a dead holder's lease
            return True
        with os.fdopen(fd, "wb") as f:
            f.write(self.me)
        return True

    def release(self, stem: str) -> None:
        self.path(stem).unlink(missing_ok=True)

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

"""Claims in an object store: leases built on conditional PUTs, no lock server (docs/object-store.md).

A claim is the object `__batchvlm__/<stem>.claim` (who holds it, and a nonce: every write has its
own ETag). A rank takes a shard by creating it with If-None-Match: *; its heartbeat rewrites it every
`heartbeat_s` with If-Match on the ETag it last wrote. A claim not rewritten for `lease_s`, judged
on the store's own clock (its Last-Modified against the Date of the HEAD that read it, so the
ranks' clocks do not matter), belongs to a dead rank: another rank takes it over with If-Match on
the ETag it saw, so of several that saw it expire, one wins; a claim whose holder is a dead process
of this host (claims.holder_died) is taken over so at once. A holder whose rewrite fails has lost
the shard and commits nothing of it (store_commit.py asks `confirm` before the done marker).
"""

from __future__ import annotations

import json
import os
import threading
import time

from .claims import Claims, holder_died
from .layout import Layout
from .store import StoreError
from .store_commit import Held
from .storepath import StorePath

# The lease of an object-store claim, in seconds (default 300); shorter only for tests and for
# stores whose uploads of a shard take far less. The heartbeat rewrites a claim every tenth of it.
LEASE_ENV = "BATCHVLM_LEASE_S"


class StoreClaims(Claims):
    def __init__(self, folder: StorePath, lease_s: float = 300.0, heartbeat_s: float = 30.0):
        super().__init__(folder, lease_s, heartbeat_s)  # type: ignore[arg-type]
        self.store = folder.store
        self.held: dict[str, Held] = {}  # stem -> this rank's claim, as it wrote it last
        self.released: set[str] = set()  # written: no more heartbeats
        self._lock = threading.Lock()
        self._rewriting = threading.Lock()

    def _body(self, marker: str | None) -> bytes:
        return json.dumps(json.loads(self.me) | {"marker": marker, "at": time.time(),
                                                  "nonce": os.urandom(8).hex()}).encode()

    def _key(self, stem: str) -> str:
        return self.path(stem).key  # type: ignore[attr-defined]

    def _expired(self, stem: str) -> tuple[str | None, bool]:
        """-> (the claim's ETag or None where there is none, whether it expired)."""
        info = self.store.head(self._key(stem))
        if info is None:
            return None, True
        now = info.server_now if info.server_now is not None else time.time()
        return info.etag, now - info.mtime > self.lease_s

    def take(self, stem: str) -> bool:
        # the marker first: a commit of another rank after this read fails this rank's commit
        marker = self.store.head(Layout(self.folder.parent).stats(stem).key)  # type: ignore[arg-type]
        body = self._body(marker.etag if marker else None)
        etag = self.store.put(self._key(stem), body, if_none_match=True)
        if etag is None:
            seen, expired = self._expired(stem)
            if not expired and (seen := self._dead_holder(stem)) is None:
                return False
            # gone meanwhile (released): create it; else take the expired one over, one taker wins
            etag = self.store.put(self._key(stem), body, if_none_match=seen is None, if_match=seen)
        if etag is None:
            return False
        with self._lock:
            self.held[stem] = Held(etag, marker.etag if marker else None)
        return True

    def _dead_holder(self, stem: str) -> str | None:
        """The ETag of the claim of `stem` where its holder is a dead process of this host (kill -9):
        taken over at once, with If-Match on that ETag, not after its lease."""
        got = self.store.fetch(self._key(stem))
        try:
            return got[1] if got and holder_died(json.loads(got[0])) else None
        except ValueError:
            return None

    def is_free(self, stem: str) -> bool:
        return self._expired(stem)[1] or self._dead_holder(stem) is not None

    def _held(self, stem: str) -> Held | None:
        """This rank's claim of `stem`. One taken in a loader worker (another process) is this
        rank's where it names this rank (`me`, made before the workers were forked)."""
        with self._lock:
            if stem in self.held:
                return self.held[stem]
        got = self.store.fetch(self._key(stem))
        try:
            holder = json.loads(got[0]) if got else {}
        except ValueError:
            return None
        me = json.loads(self.me)
        if not isinstance(holder, dict) or {k: holder.get(k) for k in me} != me:
            return None
        with self._lock:
            self.held[stem] = Held(got[1], holder.get("marker"))
        return self.held[stem]

    def confirm(self, stem: str) -> Held | None:
        """Rewrite this rank's claim now: None (and the claim forgotten) where it is no longer
        this rank's, taken over after its lease."""
        with self._rewriting:  # the heartbeat and the commit: one rewrite at a time, each on the last ETag
            return self._rewrite(stem)

    def _rewrite(self, stem: str) -> Held | None:
        held = self._held(stem)
        new = self.store.put(self._key(stem), self._body(held.marker), if_match=held.claim) if held else None
        with self._lock:
            if new is None:
                self.held.pop(stem, None)
                return None
            self.held[stem] = Held(new, held.marker)
            return self.held[stem]

    def release(self, stem: str) -> None:
        with self._rewriting:
            held = self._held(stem)
            with self._lock:
                self.held.pop(stem, None)
                self.released.add(stem)
            if held is not None and self._expired(stem)[0] == held.claim:  # never another rank's claim
                self.store.delete(self._key(stem))

    def release_unused(self) -> None:
        """Once the run's loader workers are gone: delete the claims they took for this run that it
        never labelled (a stop, a failure), which would otherwise wait out their lease. Those this
        run wrote were released already; a store that is down leaves them to their lease."""
        try:
            for path in self.folder.glob("*.claim"):
                stem = path.name.removesuffix(".claim")
                if stem not in self.released and self._held(stem) is not None:
                    self.release(stem)
        except StoreError:
            pass

    def keep_alive(self, stems: set[str], stop: threading.Event) -> threading.Thread:
        def beat() -> None:
            while not stop.wait(self.heartbeat_s):
                for stem in list(stems - self.released):
                    try:
                        self.confirm(stem)
                    except StoreError:
                        pass  # the store is down: the commit's own confirm says so, in one line

        t = threading.Thread(target=beat, name="batchvlm-claims", daemon=True)
        t.start()
        return t

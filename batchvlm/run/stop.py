"""Stopping a run: a signal asks it to stop after the images in flight, a second Ctrl-C at once."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from .log import log


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C ended the run once the finished shards were written; `unwritten`: those a
    third one left, `busy`: the one being written then (kept if its write finished)."""

    def __init__(self, unwritten: list[str], busy: str | None):
        super().__init__()
        self.unwritten, self.busy = unwritten, busy


def interrupted_line(e: KeyboardInterrupt, job_file: Path) -> str:
    """What a run ended by a second Ctrl-C kept and lost (`e`: an Interrupted, or a plain Ctrl-C
    that came before the run loop)."""
    left, busy = getattr(e, "unwritten", []), getattr(e, "busy", None)
    lost = (f"; {len(left)} finished shard(s) were not written ({', '.join(left[:3])}"
            f"{', ...' if len(left) > 3 else ''}): the next run labels them again" if left else "")
    lost += f"; {busy} was being written (kept if that finished)" if busy else ""
    return (f"\nbatchvlm: interrupted: the shards written so far are kept, the unfinished ones are "
            f"labelled by the next run{lost} (batchvlm status {job_file})")


class StopFlag:
    """Set by SIGTERM / SIGUSR1 / SIGINT: stop taking new images, finish those in flight.
    A second SIGINT interrupts at once."""

    def __init__(self):
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.event.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        first = not self.event.is_set()
        self.event.set()  # before the message: a second signal may run its handler inside this one
        if first:  # say so at once: the images in flight may take a while
            again = ("; Ctrl-C again stops at once, dropping them (finished shards are still written)"
                     if signum == signal.SIGINT else "")
            log(f"\nbatchvlm: {signal.Signals(signum).name}: stopping after the images in flight{again}")

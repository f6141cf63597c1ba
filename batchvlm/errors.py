"""The failures a user (or the machine) can cause, and how a command ends on one: a single line,
`batchvlm: error: <field or file>: <cause>; <fix>`, and an exit code from exits.py.

Below both the CLI and the launchers (run/launch.py, run/ray.py), so that each ends a failure the
same way. The exception classes are imported inside the functions: the commands that load no
model (status, preview, export, --help, --version) start without torch.
"""

from __future__ import annotations

import errno
from pathlib import Path

from .exits import EXIT_FAILED, EXIT_JOB_ERROR, EXIT_STOPPED


class UsageError(ValueError):
    """A command line that cannot run as given: a flag's value, or a package that a flag needs and
    this install lacks. One line naming the flag, exit 2 as for a job error: the same command
    fails the same way."""


def error_line(message: str) -> str:
    return f"batchvlm: error: {message}"


def user_errors() -> tuple[type[Exception], ...]:
    """A job that cannot run as written: the job file, its inputs, the model, the output folder;
    or a command line that cannot run as given (UsageError)."""
    from .data.sources import SourceError
    from .job import JobError
    from .models.base.errors import FamilyError, ModelLoadError
    from .output.layout import OutputConflict

    return JobError, SourceError, ModelLoadError, FamilyError, OutputConflict, UsageError


def run_failure(e: Exception, out_dir: str) -> tuple[int, str] | None:
    """-> (exit code, one line) for a run that ended on `e`; None for a bug (its traceback stands)."""
    from .data.loader import SharedMemoryFull
    from .models.base.errors import ModelFetchError
    from .output.lock import RunLockHeld
    from .output.store import StoreError
    from .output.writer import OutputWriteError, write_failure

    # in this order: a held lock is an OutputConflict, a failed fetch a ModelLoadError
    if isinstance(e, RunLockHeld):  # not the job's fault: run again once the other run is gone
        return EXIT_STOPPED, str(e)
    if isinstance(e, ModelFetchError):  # the hub, for now
        return EXIT_FAILED, str(e)
    if isinstance(e, user_errors()):
        return EXIT_JOB_ERROR, str(e)
    if isinstance(e, ValueError):  # an inconsistent rank environment
        return EXIT_JOB_ERROR, str(e)
    if isinstance(e, (OutputWriteError, SharedMemoryFull, StoreError)):  # a store down mid-run: retryable
        return EXIT_FAILED, str(e)
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EROFS):  # the job record, a stats file
        return EXIT_FAILED, str(write_failure(e, Path(out_dir)))
    return None

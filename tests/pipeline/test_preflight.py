"""The one run path's pieces in process, loading no model: preflight (what validate accepts a run
can do), the exit code a summary decides, and the code and line of a run's failure."""

import errno
import json

import pytest
from support.inputs import write_job

from batchvlm.dist import Rank
from batchvlm.errors import UsageError, run_failure
from batchvlm.exits import EXIT_FAILED, EXIT_JOB_ERROR, EXIT_OK, EXIT_STOPPED
from batchvlm.job import JobError, load_job
from batchvlm.models.base.errors import ModelFetchError
from batchvlm.output.layout import OutputConflict
from batchvlm.output.lock import RunLockHeld
from batchvlm.run import RunSummary, run_job
from batchvlm.run.preflight import clears, preflight
from batchvlm.shapes.shards import write_shards


@pytest.fixture
def job(tmp_path):
    write_shards(tmp_path / "data", 2, 2, seed=3)
    return load_job(write_job(tmp_path / "job.yaml", "data/shapes-*.tar"))


def test_preflight_checks_what_a_run_would_do_and_writes_nothing(job, tmp_path):
    pre = preflight(job, clears(job, False), Rank(0, 1, 0), dry=True)
    assert [s.stem for s in pre.shards] == ["shapes-000000", "shapes-000001"] and pre.done() == []
    assert (pre.job.model.device, pre.job.model.dtype) == ("cpu", "float32")  # as the run resolves them
    assert not (tmp_path / "out").exists()
    meta = tmp_path / "out" / "__batchvlm__"
    meta.mkdir(parents=True)
    (meta / "job.json").write_text(json.dumps({"label_fingerprint": "labelled by another job"}))
    with pytest.raises(OutputConflict, match="other settings"):
        preflight(job, clears(job, False), Rank(0, 1, 0), dry=True)
    overwrite = job.model_copy(update={"output": job.output.model_copy(update={"mode": "overwrite"})})
    assert clears(overwrite, False) and clears(job, True)
    preflight(overwrite, clears(overwrite, False), Rank(0, 1, 0), dry=True)  # a run would clear it: no refusal
    with pytest.raises(OutputConflict, match="several ranks"):  # each rank would clear the others' labels
        run_job(job, overwrite=True, rank=Rank(0, 2, 0))
    assert sorted(p.name for p in meta.iterdir()) == ["job.json"]


def test_the_summary_decides_the_exit_code(job, capsys):
    assert RunSummary(2, 0, shards_written=["a", "b"]).end(job) == EXIT_OK
    assert RunSummary(2, 0, stopped_by_signal=True, shards_failed=["a"]).end(job) == EXIT_STOPPED
    assert RunSummary(2, 0, shards_failed=["a"]).end(job) == EXIT_FAILED
    assert RunSummary(2, 0, shards_damaged=["a: 1 samples kept"]).end(job) == EXIT_FAILED
    allow = job.model_copy(update={"input": job.input.model_copy(update={"allow_damaged": True})})
    assert RunSummary(2, 0, shards_damaged=["a: 1 samples kept"]).end(allow) == EXIT_OK
    capsys.readouterr()
    assert RunSummary(2, 2, no_images=True).end(job) == EXIT_JOB_ERROR
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("batchvlm: 0 shard(s) written, 2 already done") and lines[1].startswith("batchvlm: error: ")


def test_a_run_failure_is_a_code_and_one_line(tmp_path):
    assert run_failure(RunLockHeld("held by host:1"), "out") == (EXIT_STOPPED, "held by host:1")
    assert run_failure(ModelFetchError("the hub is down"), "out") == (EXIT_FAILED, "the hub is down")
    assert run_failure(JobError("tasks.0: no"), "out") == (EXIT_JOB_ERROR, "tasks.0: no")
    assert run_failure(UsageError("--budgets: 7: no"), "out") == (EXIT_JOB_ERROR, "--budgets: 7: no")
    assert run_failure(ValueError("BATCHVLM_LOCAL_RANK: 3 of 2"), "out")[0] == EXIT_JOB_ERROR
    code, line = run_failure(OSError(errno.ENOSPC, "No space left on device"), str(tmp_path))
    assert code == EXIT_FAILED and line.startswith(f"output.dir: no space left on {tmp_path}")
    assert run_failure(OSError(errno.EIO, "I/O error"), "out") is None  # a bug or a broken machine: its traceback
    assert run_failure(RuntimeError("a bug"), "out") is None

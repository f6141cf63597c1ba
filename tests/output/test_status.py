"""`status` while a job runs and after its inputs were touched (issue 40 item 18): a shard a live
run holds is running; a done shard whose input changed shows its rows until a run relabels it."""

import json
import os
import time

from support.cli import cli, cli_app
from support.inputs import good_png, write_job, write_tar

from batchvlm.output.claims import Claims
from batchvlm.output.layout import Layout
from batchvlm.output.lock import RunLock


def three_shards(tmp_path, **sections):
    for i in range(3):
        write_tar(tmp_path / f"s-00{i}.tar", [(f"{i}{k}.png", good_png(60 + k, 40)) for k in range(2)])
    return write_job(tmp_path / "job.yaml", "s-{000..002}.tar", tasks=[{"caption": {}}],
                     engine={"max_new_tokens": 4}, **sections)


def status(tmp_path, job) -> dict:
    return json.loads(cli_app(tmp_path, "status", job, "--json", check=True).stdout)


def test_a_touched_input_keeps_its_rows_in_status_until_relabelled(tmp_path):
    job = three_shards(tmp_path)
    cli("run", job)
    before = status(tmp_path, job)
    assert (before["done"], before["pending"], before["rows"]) == (3, 0, 6), before
    t = time.time() + 5
    os.utime(tmp_path / "s-001.tar", (t, t))  # a re-copy, a `touch`: same bytes, new mtime
    report = status(tmp_path, job)
    assert (report["done"], report["changed"], report["pending"], report["rows"]) == (2, 1, 0, 6), report
    assert report["changed_shards"] == ["s-001"] and report["tokens"] == before["tokens"], report
    line = cli_app(tmp_path, "status", job, check=True).stdout
    assert "1 changed" in line and "done, input changed: s-001" in line, line
    r = cli("run", job)  # the run relabels it, as before
    assert "1 shard(s) written, 2 already done" in r.stderr, r.stderr
    assert (status(tmp_path, job)["done"], status(tmp_path, job)["changed"]) == (3, 0)


def test_shards_a_live_run_holds_are_running(tmp_path):
    job = three_shards(tmp_path, runtime={"work_stealing": True})
    layout = Layout(tmp_path / "out")
    layout.meta.mkdir(parents=True)
    claims = Claims(layout.meta)
    assert claims.take("s-000") and claims.take("s-002")  # this process: a live holder
    old = time.time() - 3600  # a claim not refreshed for an hour: its holder is gone
    os.utime(claims.path("s-002"), (old, old))
    report = status(tmp_path, job)
    assert (report["running"], report["running_shards"], report["pending"]) == (1, ["s-000"], 2), report
    assert "1 running" in cli_app(tmp_path, "status", job, check=True).stdout


def test_the_shards_of_a_rank_whose_run_lock_is_held_are_running(tmp_path):
    job = three_shards(tmp_path)
    layout = Layout(tmp_path / "out")
    with RunLock(layout, 1, 2):  # rank 1 of 2 labels s-001
        report = status(tmp_path, job)
        assert (report["running_shards"], report["pending"]) == (["s-001"], 2), report
    report = status(tmp_path, job)  # released: nobody runs it
    assert (report["running"], report["pending"]) == (0, 3), report

"""scripts/gpu_check.sh --dry-run walks every step of both calls at tiny sizes on CPU (a minute
or two: slow; a file of its own, so that a test worker runs it beside test_gpu_check.py)."""

import json
import re

import pytest
from support.gpu_check import RUNNERS, gpu_check, planned


@pytest.mark.slow
def test_the_dry_run_walks_every_step_of_both_calls(tmp_path):
    run, summary = gpu_check(tmp_path, "--dry-run", timeout=1200)
    assert run.returncode == 0, summary + run.stdout[-4000:] + run.stderr[-2000:]
    calls = planned(gpu_check(tmp_path, "--plan")[0].stdout)
    lines = summary.splitlines()
    for call, steps in calls.items():
        start = lines.index(f"== call {call}: {380 if call == 1 else 220} s x4 on CPU")
        walked = lines[start + 1 : start + 1 + len(steps)]
        assert [line.split(":")[0] for line in walked] == [s for s, _ in steps], summary
        assert all(re.match(r"^\w+: ok in \d+s/\d+s$", line) for line in walked), summary
        assert re.match(rf"^call {call} dry run: every step ok", lines[start + 1 + len(steps)]), summary
    # the headline JSON lands in $OUT itself: rows and runners in the first call's order
    bench = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["workload"] for r in bench["results"]] == ["caption@1024x768", "mixed"]
    assert all([k for k in r if k in RUNNERS] == RUNNERS for r in bench["results"])
    assert bench["results"][0]["crops_per_image"] == 13.0

"""scripts/bench_host.py at tiny sizes: every family and task mix comes out with positive host
times per step (its timings are not checked: a shared CPU makes them noise)."""

import json
import os
import subprocess
import sys

from support.paths import REPO

FAMILIES = ["moondream", "qwen3_vl", "qwen3_5", "florence2"]
MIXES = ["caption", "detect+point", "classify10", "json"]


def test_every_family_and_mix_has_host_times_per_step(tmp_path):
    out = tmp_path / "host.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_host.py"), "--rows", "8", "--steps", "3", "--skip", "1",
         "--json-vocab", "600", "--corpus-chars", "1000000", "--workdir", str(tmp_path / "models"), "--json", str(out)],
        capture_output=True, text=True, timeout=900, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    table = [line for line in run.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(table) == len(FAMILIES) * len(MIXES)
    results = json.loads(out.read_text())
    assert sorted((r["family"], r["mix"]) for r in results) == sorted((f, m) for f in FAMILIES for m in MIXES)
    for r in results:
        assert r["rows"] == 8 and r["steps"] >= 1, r
        for part in ("plan", "staging", "commit", "host"):
            assert 0 < r[part]["p50"] <= r[part]["p90"], (r["family"], r["mix"], part, r[part])
        # only json rows have masks (the Qwens' at the --json-vocab vocabulary)
        assert (r["masks"]["p50"] > 0) == (r["mix"] == "json"), (r["family"], r["mix"], r["masks"])


def test_against_another_checkout_prints_both_and_their_ratio(tmp_path):
    out = tmp_path / "against.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_host.py"), "--against", str(REPO), "--repeat", "1",
         "--families", "moondream", "--mixes", "caption", "--rows", "8", "--steps", "3", "--skip", "1",
         "--workdir", str(tmp_path / "models"), "--json", str(out)],
        capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert "| moondream | caption | 8 |" in run.stdout
    (r,) = json.loads(out.read_text())
    for part in ("staging", "host"):
        assert len(r[part]["other"]) == len(r[part]["this"]) == 1 and r[part]["ratio"] > 0, r

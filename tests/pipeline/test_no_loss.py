"""Finished labels are never lost to what happens to the input or the folder later (issue 40):
a tar re-copied and cut short, an input folder that is empty for a while (an unmounted mount
point), `--overwrite` beside Parquet files this output did not write. Through the real CLI."""

from __future__ import annotations

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image
from support.cli import cli_app
from support.inputs import encode_image, write_job

from batchvlm.shapes.shards import write_shards


def _bytes(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.parquet"))}


def test_4_a_tar_cut_short_never_replaces_its_complete_labels(tmp_path):
    tars = write_shards(tmp_path / "data", 2, 4, seed=3)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    assert cli_app(tmp_path, "run", job).returncode == 0
    out = tmp_path / "out"
    before, marker = _bytes(out), (out / "__batchvlm__" / "shapes-000000.stats.json").read_bytes()
    whole = tars[0].read_bytes()
    tars[0].write_bytes(whole[: len(whole) // 2])  # re-copied, and the copy broke off
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 1, r.stdout
    assert "shapes-000000: labels from before kept" in r.stdout and "KEPT FROM BEFORE" in r.stdout, r.stdout
    assert "delete __batchvlm__/shapes-000000.stats.json" in r.stdout
    assert _bytes(out) == before and (out / "__batchvlm__" / "shapes-000000.stats.json").read_bytes() == marker
    tars[0].write_bytes(whole + b"")  # the complete copy again: nothing to relabel but its stat
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 0, r.stdout
    assert pq.read_table(out / "shapes-000000.parquet").num_rows == 4

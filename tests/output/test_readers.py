"""Every reader of an output folder sees done shards only, however it lists the files: the folder
itself (pyarrow, pandas, `datasets`), a glob of its top level (polars), and a recursive glob
(`out/**/*.parquet` in polars and DuckDB), which also walks `__batchvlm__/`. A shard cut short
by --limit waits there as `partial/<shard>.parquet.partial`: not a `.parquet` name."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
import yaml
from PIL import Image
from support.cli import inproc
from support.inputs import encode_image
from support.paths import REPO


def test_a_recursive_glob_reads_done_shards_only(tmp_path):
    for sub, n in (("a", 2), ("b", 2)):
        (tmp_path / "img" / sub).mkdir(parents=True)
        for i in range(n):
            im = Image.new("RGB", (24, 16), (40 * i, 200, 30))
            (tmp_path / "img" / sub / f"{i}.png").write_bytes(encode_image(im, "PNG"))
    job = {"name": "readers", "input": {"folder": "img"}, "model": {"name": str(REPO / "batchvlm" / "models" / "demo")},
           "tasks": [{"caption": {"length": "short"}}], "engine": {"max_new_tokens": 2}, "loader": {"workers": 0},
           "output": {"dir": "out"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    code, out = inproc(tmp_path, "run", "job.yaml", "--limit", "3")  # a-00000 done, b-00000 cut short
    assert code == 0, out
    code, out = inproc(tmp_path, "status", "job.yaml")
    assert "1/2 shards done, 1 partial" in out, out

    root = tmp_path / "out"
    assert [p.relative_to(root).as_posix() for p in root.glob("**/*.parquet")] == ["a-00000.parquet"]
    assert (root / "__batchvlm__" / "partial" / "b-00000.parquet.partial").is_file()
    assert pq.read_table(root).num_rows == 2
    duckdb = pytest.importorskip("duckdb")
    assert duckdb.sql(f"select count(*) from '{root}/**/*.parquet'").fetchall() == [(2,)]
    pl = pytest.importorskip("polars")
    assert pl.read_parquet(f"{root}/**/*.parquet").height == 2 and pl.read_parquet(f"{root}/*.parquet").height == 2

    code, out = inproc(tmp_path, "run", "job.yaml")  # the partial shard is redone, its partial file gone
    assert code == 0, out
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("**/*.parquet*")) == [
        "a-00000.parquet", "b-00000.parquet"]
    assert pl.read_parquet(f"{root}/**/*.parquet").height == 4

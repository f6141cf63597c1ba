"""A finished job that gains a task (issue 40 item 16): only the new task runs, on the done
shards' images; its columns are added to each done shard's file (the old columns unchanged, the
file replaced whole), which then equals what a fresh run with every task writes; the files and
job.json say which run made which column. A task removed or changed is refused in one line."""

import json

import pyarrow.parquet as pq
from PIL import Image
from support.cli import inproc
from support.inputs import encode_image, write_job, write_tar

CAPTION = {"caption": {"length": "short"}}
QUERY = {"query": {"question": "How many shapes?", "name": "n_shapes"}}


def shards(root):
    for s in range(2):
        write_tar(root / f"x-{s:03d}.tar", [(f"{i}.png", encode_image(Image.new("RGB", (40 + 8 * i, 32),
                                                                                   (200, 40 * i, 30 * s)), "PNG"))
                                            for i in range(3)])


def tables(out):
    return {p.name: pq.read_table(p) for p in sorted(out.glob("*.parquet"))}


def meta(table) -> dict:
    return json.loads(table.schema.metadata[b"batchvlm"])


def test_a_job_gains_a_task_without_relabelling(tmp_path):
    shards(tmp_path)
    job = write_job(tmp_path / "job.yaml", "x-{000..001}.tar", tasks=[CAPTION])
    code, out = inproc(tmp_path, "run", job)
    assert code == 0, out
    before = tables(tmp_path / "out")
    first_run = meta(next(iter(before.values())))["started"]

    write_job(tmp_path / "job.yaml", "x-{000..001}.tar", tasks=[CAPTION, QUERY])
    code, out = inproc(tmp_path, "run", job, "--dry-run")
    assert code == 0 and "2 shard(s), 2 done, 0 to label, 2 done shard(s) to gain the new tasks' columns" in out, out
    code, out = inproc(tmp_path, "run", job)
    assert code == 0, out
    assert "0 shard(s) written, 2 already done, 2 of those gained the new tasks' columns, 6 images" in out, out
    assert "2 done shard(s) gain the columns of tasks.1" in out, out
    after = tables(tmp_path / "out")

    fresh_job = write_job(tmp_path / "fresh.yaml", "x-{000..001}.tar", out="fresh", tasks=[CAPTION, QUERY])
    code, out = inproc(tmp_path, "run", fresh_job)
    assert code == 0, out
    fresh = tables(tmp_path / "fresh")
    for name, old in before.items():
        new = after[name]
        assert new.select(old.column_names).equals(old)  # the old columns, unchanged
        assert new.schema.remove_metadata() == fresh[name].schema.remove_metadata()
        assert new.equals(fresh[name])  # as a fresh run with both tasks labels them
        by_run = meta(new)["columns_by_run"]
        assert by_run["caption"] == by_run["caption_truncated"] == first_run
        assert by_run["n_shapes"] == by_run["n_shapes_truncated"] != first_run
    record = json.loads((tmp_path / "out" / "__batchvlm__" / "job.json").read_text())
    assert [r["tasks"] for r in record["runs"]] == [1, 2] and record["runs"][0]["started"] == first_run

    code, out = inproc(tmp_path, "run", job)  # nothing left to do
    assert code == 0 and "0 shard(s) written, 2 already done" in out and "gained" not in out, out
    assert tables(tmp_path / "out").keys() == after.keys()

    for tasks, what in (([QUERY], 'tasks.0.caption was'), ([CAPTION, {"query": {"question": "Which?",
                                                                                     "name": "n_shapes"}}],
                                                               "tasks.1.query.question was")):
        write_job(tmp_path / "job.yaml", "x-{000..001}.tar", tasks=tasks)
        code, out = inproc(tmp_path, "run", job)
        lines = [line for line in out.strip().splitlines() if line.startswith("batchvlm: error")]
        assert code == 2 and len(lines) == 1 and what in lines[0], out
        assert "removing or changing one needs --overwrite" in lines[0]

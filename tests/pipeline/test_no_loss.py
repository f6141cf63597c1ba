"""Finished labels are never lost to what happens to the input or the folder later (issue 40):
a tar re-copied and cut short, an input folder that is empty for a while (an unmounted mount
point), `--overwrite` beside Parquet files this output did not write. Through the real CLI."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import yaml
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
    tars[0].write_bytes(whole)  # the complete copy again: relabelled, whole
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 0, r.stdout
    assert pq.read_table(out / "shapes-000000.parquet").num_rows == 4


def _folder_job(tmp_path):
    img = tmp_path / "img"
    img.mkdir()
    for i, colour in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200)]):
        (img / f"{i}.png").write_bytes(encode_image(Image.new("RGB", (24, 16), colour), "PNG"))
    job = write_job(tmp_path / "job.yaml", "unused")
    spec = yaml.safe_load(job.read_text()) | {"input": {"folder": "img", "shard_size": 2}}
    job.write_text(yaml.safe_dump(spec))
    return img, job


def test_3_a_done_shard_whose_images_vanished_is_not_relabelled_into_errors(tmp_path):
    img, job = _folder_job(tmp_path)
    assert cli_app(tmp_path, "run", job).returncode == 0
    out = tmp_path / "out"
    before = _bytes(out)
    shutil.move(img, tmp_path / "away")
    img.mkdir()  # the mount point, nothing mounted on it
    r = cli_app(tmp_path, "status", job, "--json")
    assert r.returncode == 0, r.stdout
    report = json.loads(r.stdout)
    assert report["rows"] == 3 and report["pending"] == 0, report
    assert [s.split(":")[0] for s in report["kept_shards"]] == ["root-00000", "root-00001"], report
    r = cli_app(tmp_path, "status", job)
    assert "kept: root-00000: labels from before kept" in r.stdout, r.stdout
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 1, r.stdout
    assert "2 KEPT FROM BEFORE" in r.stdout and "(its 2 input file(s) are gone, " in r.stdout, r.stdout
    assert "img/0.png first" in r.stdout
    assert "delete __batchvlm__/root-00000.stats.json to relabel it" in r.stdout
    assert _bytes(out) == before
    img.rmdir()
    shutil.move(tmp_path / "away", img)  # mounted again
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 0 and "2 already done" in r.stdout, r.stdout
    assert _bytes(out) == before
    (img / "1.png").unlink()  # one image of a shard deleted on purpose: relabelled, as documented
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 0 and "1 shard(s) written" in r.stdout, r.stdout
    rows = pq.read_table(tmp_path / "out" / "root-00000.parquet").to_pylist()
    assert [(row["key"], row["status"]) for row in rows] == [("0.png", "ok"), ("1.png", "error")]


def test_validate_and_dry_run_warn_of_done_shards_whose_inputs_are_gone(tmp_path):
    img, job = _folder_job(tmp_path)
    assert cli_app(tmp_path, "run", job).returncode == 0
    shutil.move(img, tmp_path / "away")
    img.mkdir()  # an unmounted mount point: a run would keep both shards and exit 1
    r = cli_app(tmp_path, "validate", job)
    assert r.returncode == 0, r.stdout
    for stem in ("root-00000", "root-00001"):
        assert f"warning: shard {stem}: labels from before kept (its " in r.stdout, r.stdout
    assert "a run keeps them and exits 1" in r.stdout
    r = cli_app(tmp_path, "run", job, "--dry-run")
    assert "2 shard(s), 0 done, 0 to label" in r.stdout and r.stdout.count("warning: shard root-") == 2, r.stdout
    img.rmdir()
    shutil.move(tmp_path / "away", img)  # mounted again: nothing to warn of
    assert "warning" not in cli_app(tmp_path, "validate", job).stdout


def test_5_overwrite_deletes_only_what_this_output_wrote(tmp_path):
    write_shards(tmp_path / "data", 1, 2, seed=5)
    other = write_job(tmp_path / "other.yaml", "data/shapes-*.tar", out="other", tasks=[{"caption": {}}])
    assert cli_app(tmp_path, "run", other).returncode == 0
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar")
    assert cli_app(tmp_path, "run", job).returncode == 0
    out = tmp_path / "out"
    copied = out / "from-other-job.parquet"  # another job's labels, copied in to read them together
    shutil.copy(tmp_path / "other" / "shapes-000000.parquet", copied)
    r = cli_app(tmp_path, "run", job, "--overwrite")
    assert r.returncode == 0, r.stdout
    assert copied.read_bytes() == (tmp_path / "other" / "shapes-000000.parquet").read_bytes()
    assert pq.read_table(out / "shapes-000000.parquet").num_rows == 2

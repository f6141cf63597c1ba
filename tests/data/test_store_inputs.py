"""Inputs in an object store (tar shards, Parquet files, an image folder under an s3:// prefix),
read through fsspec against the real S3 server of the tests (moto on 127.0.0.1): the endpoint
comes from AWS_ENDPOINT_URL, as a user's run has it. Labels equal those of the same job on local
copies; a missing bucket, no such prefix, a wrong key are one line before any model load."""

from __future__ import annotations

import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.cli import cli_app
from support.inputs import write_job
from support.s3server import SECRET, bucket, s3  # noqa: F401 - the fixtures

from batchvlm.shapes.shards import write_shards

def _images(tars) -> list[tuple[str, bytes, bytes]]:
    """(key, image bytes, json sidecar) of every sample of the tars."""
    out = []
    for t in tars:
        with tarfile.open(t) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        out += [(n.split(".")[0], data, members[n.split(".")[0] + ".json"]) for n, data in members.items()
                if not n.endswith(".json")]
    return out


def _inputs(tmp_path, kind: str) -> dict:
    """The same images as `kind` in tmp_path/local (returns the job's `input:` relative to it)."""
    tars = write_shards(tmp_path / "local" / "tars", 3, 2, seed=4)
    if kind == "tar":
        return {"shards": "tars/shapes-*.tar", "keep": ["json"]}
    images = _images(tars)
    if kind == "parquet":
        table = pa.table({"id": [k for k, _, _ in images], "image": [im for _, im, _ in images]})
        (tmp_path / "local" / "p").mkdir()
        pq.write_table(table[:4], tmp_path / "local" / "p" / "a.parquet")
        pq.write_table(table[4:], tmp_path / "local" / "p" / "b.parquet")
        return {"parquet": "p/*.parquet", "key_column": "id", "shard_size": 3}
    for i, (key, image, side) in enumerate(images):  # two directories, one nested, with sidecars
        folder = tmp_path / "local" / "img" / ("top" if i % 2 else "top/inner")
        folder.mkdir(parents=True, exist_ok=True)
        ext = "png" if image.startswith(b"\x89PNG") else "jpg"
        (folder / f"{key}.{ext}").write_bytes(image)
        (folder / f"{key}.json").write_bytes(side)
    (tmp_path / "local" / "img" / "top" / "notes.md").write_text("not an image")
    return {"folder": "img", "keep": ["json", "path"], "shard_size": 2}


def _upload(client, name: str, local, prefix: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        client.upload_file(str(path), name, f"{prefix}/{path.relative_to(local).as_posix()}")


def _labels(table: pa.Table) -> list[dict]:
    rows = table.drop_columns([c for c in ("source",) if c in table.column_names]).to_pylist()
    return sorted(rows, key=lambda r: r["key"])


def _in_store(client, name: str, prefix: str) -> pa.Table:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=name, Prefix=f"{prefix}/", Delimiter="/")
    keys = [o["Key"] for page in pages for o in page.get("Contents", []) if o["Key"].endswith(".parquet")]
    return pa.concat_tables(pq.read_table(pa.BufferReader(client.get_object(Bucket=name, Key=k)["Body"].read()))
                            for k in keys)


@pytest.mark.parametrize("kind", ["tar", "parquet", "folder"])
def test_inputs_in_the_store_label_as_local_copies(tmp_path, bucket, kind):
    name, client = bucket
    given = _inputs(tmp_path, kind)
    field = next(k for k in ("shards", "parquet", "folder") if k in given)
    quick = {"tasks": [{"caption": {}}], "engine": {"max_new_tokens": 4}}
    local = write_job(tmp_path / "local" / "job.yaml", "x", out="out", input={"shards": None} | given, **quick)
    cli_app(tmp_path, "run", local, check=True)
    want = _labels(pq.read_table(tmp_path / "local" / "out", columns=None))

    _upload(client, name, tmp_path / "local", "in")
    remote = given | {field: f"s3://{name}/in/{given[field]}"}
    job = write_job(tmp_path / "job.yaml", "x", out=f"s3://{name}/out", input={"shards": None} | remote, **quick)
    r = cli_app(tmp_path, "run", job, check=True)
    assert "0 errors" in r.stdout, r.stdout
    got = _labels(_in_store(client, name, "out"))
    assert len(want) == 6 and got == want
    if kind == "folder":  # resumed: the images' sizes and mtimes in the store are as they were
        r = cli_app(tmp_path, "run", job, "--dry-run", check=True)
        assert ": 4 shard(s), 4 done, 0 to label" in r.stdout, r.stdout


def _refused(tmp_path, *args) -> str:
    r = cli_app(tmp_path, *args)
    assert r.returncode == 2, r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith("batchvlm: error: ")]
    assert len(lines) == 1 and "loaded" not in r.stdout, r.stdout  # one line, before any model load
    assert SECRET not in r.stdout and "AKIATESTKEY" not in r.stdout
    return lines[0].removeprefix("batchvlm: error: ")


def test_a_missing_bucket_prefix_file_or_key_is_one_line(tmp_path, s3, bucket):
    server, _ = s3
    name, client = bucket
    write_shards(tmp_path / "data", 2, 1, seed=1)
    _upload(client, name, tmp_path / "data", "in")

    def job(**inp):
        return write_job(tmp_path / "job.yaml", "x", input={"shards": None} | inp)

    assert _refused(tmp_path, "run", job(shards="s3://no-such-bucket/in/*.tar")) == (
        "input.shards: the bucket of s3://no-such-bucket/in/*.tar does not exist; create it or fix the URL "
        "(another store: set AWS_ENDPOINT_URL)")
    assert _refused(tmp_path, "validate", job(shards=f"s3://{name}/nope/*.tar")) == (
        f"input.shards: no file matches s3://{name}/nope/*.tar; fix the URL")
    assert _refused(tmp_path, "validate", job(shards=f"s3://{name}/in/shapes-00000{{0..2}}.tar")) == (
        f"input.shards: not found: s3://{name}/in/shapes-000002.tar")
    assert _refused(tmp_path, "validate", job(folder=f"s3://{name}/nope")) == (
        f"input.folder: nothing at s3://{name}/nope; fix the URL")
    assert _refused(tmp_path, "validate", job(parquet="s3://no-such-bucket/p.parquet")).startswith(
        "input.parquet: the bucket of s3://no-such-bucket does not exist")
    server.set_auth(True)  # from here on moto checks keys: ours is none it knows
    try:
        line = _refused(tmp_path, "run", job(shards=f"s3://{name}/in/*.tar"))
    finally:
        server.set_auth(False)
    assert line == (f"input.shards: the store refused the credentials for s3://{name}/in/*.tar (InvalidAccessKeyId); "
                    "check AWS_PROFILE / AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL)")

"""output.dir: s3://bucket/prefix against a real S3 server process on 127.0.0.1 (moto, served one
request at a time), through the client code a user's run uses (AWS_ENDPOINT_URL, no patching):
the layout and its readers, kill -9 at each step of the commit protocol, two ranks racing, an
expired claim taken over, a store without conditional writes, wrong credentials, an unreachable
endpoint, a 503 window."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pytest
from support.cli import cli_app
from support.inputs import write_job
from support.s3server import SECRET, bucket, s3  # noqa: F401 - the fixtures

from batchvlm.shapes.shards import write_shards


def _objects(client, bucket: str, prefix: str = "labels/") -> dict[str, dict]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"].removeprefix(prefix): o for page in pages for o in page.get("Contents", [])}


def _done(client, bucket: str) -> dict[str, str]:
    """stem -> ETag of the shards done: a complete marker naming the Parquet object beside it."""
    objs, done = _objects(client, bucket), {}
    for key in objs:
        if key.endswith(".stats.json"):
            d = json.loads(client.get_object(Bucket=bucket, Key=f"labels/{key}")["Body"].read())
            parquet = objs.get(f"{d['shard']}.parquet")
            if d["complete"] and parquet and parquet["Size"] == d["output"]["size"]:
                done[d["shard"]] = parquet["ETag"]
    return done


def _keys(client, bucket: str, stem: str) -> list[str]:
    import pyarrow.parquet as pq

    body = client.get_object(Bucket=bucket, Key=f"labels/{stem}.parquet")["Body"].read()
    return pq.read_table(pa.BufferReader(body), columns=["key"]).column("key").to_pylist()


def _top_level(client, bucket: str) -> set[str]:
    return {k.split("/")[0] if "/" in k else k for k in _objects(client, bucket)}


def test_run_limit_resume_status_preview_export_and_readers(tmp_path, s3, bucket):
    import pyarrow.dataset as ds
    from pyarrow import fs

    name, client = bucket
    write_shards(tmp_path / "data", 3, 4, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    cli_app(tmp_path, "validate", job, check=True)
    assert _objects(client, name) == {}  # validate writes nothing (its probe is gone)
    cli_app(tmp_path, "run", job, "--limit", "5", check=True)
    report = json.loads(cli_app(tmp_path, "status", job, "--json", check=True).stdout)
    assert (report["done"], report["partial"], report["pending"]) == (1, 1, 1)
    assert "__batchvlm__/partial/shapes-000001.parquet.partial" in _objects(client, name)
    cli_app(tmp_path, "run", job, check=True)
    proxy = s3[1]
    proxy.requests.clear()
    r = cli_app(tmp_path, "status", f"s3://{name}/labels", check=True)
    assert "3/3 shards done, 0 partial" in r.stdout
    # which shards are done comes from one listing of each level: a marker read per done shard, no
    # HEAD of a Parquet object, no request for a marker that is not there
    asked = [(m, path.split("?")[0].rsplit("/", 1)[-1]) for m, path in proxy.requests]
    assert sorted(n for m, n in asked if m == "GET" and n.endswith(".stats.json")) == [
        f"shapes-{s:06d}.stats.json" for s in range(3)]
    assert not [n for m, n in asked if m == "HEAD" and n.endswith(".parquet")], asked
    proxy.requests.clear()
    r = cli_app(tmp_path, "run", job, check=True)  # nothing to do: the same
    assert "0 shard(s) written, 3 already done" in r.stdout, r.stdout
    asked = [(m, path.split("?")[0].rsplit("/", 1)[-1]) for m, path in proxy.requests]
    assert len([n for m, n in asked if n.endswith(".stats.json")]) == 3, asked
    assert not [n for m, n in asked if m == "HEAD" and n.endswith(".parquet")], asked
    objs = _objects(client, name)
    assert _top_level(client, name) == {"shapes-000000.parquet", "shapes-000001.parquet", "shapes-000002.parquet",
                                        "__batchvlm__"}
    assert not [k for k in objs if k.endswith(".claim") or "partial/" in k or "probe" in k]
    job_json = client.get_object(Bucket=name, Key="labels/__batchvlm__/job.json")["Body"].read().decode()
    assert SECRET not in job_json and "AKIATESTKEY" not in job_json
    # readers open the prefix as a dataset: done shards only, every image once
    s3fs = fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"], region="us-east-1",
                           access_key="AKIATESTKEY", secret_key=SECRET)
    table = ds.dataset(f"{name}/labels", filesystem=s3fs, format="parquet").to_table(columns=["key"])
    expected = [f"{s:06d}_{i:04d}" for s in range(3) for i in range(4)]
    assert sorted(table.column("key").to_pylist()) == expected
    import pandas
    import polars

    url = os.environ["AWS_ENDPOINT_URL"]
    df = pandas.read_parquet(f"s3://{name}/labels/", columns=["key"], storage_options={  # through s3fs
        "key": "AKIATESTKEY", "secret": SECRET, "client_kwargs": {"endpoint_url": url}})
    assert sorted(df["key"]) == expected
    df = polars.read_parquet(f"s3://{name}/labels/*.parquet", columns=["key"], storage_options={
        "aws_endpoint_url": url, "aws_access_key_id": "AKIATESTKEY", "aws_secret_access_key": SECRET,
        "aws_region": "us-east-1", "aws_allow_http": "true"})
    assert sorted(df["key"]) == expected
    cli_app(tmp_path, "preview", f"s3://{name}/labels", "-o", tmp_path / "p.html", check=True)
    assert (tmp_path / "p.html").read_text().count('class="card') == 12
    cli_app(tmp_path, "export", "coco", f"s3://{name}/labels", tmp_path / "coco", check=True)
    assert json.loads((tmp_path / "coco" / "annotations.json").read_text())["images"]
    r = cli_app(tmp_path, "run", job, "--overwrite", check=True)  # cleared, labelled again
    assert "3 shard(s) written, 0 already done" in r.stdout and len(_done(client, name)) == 3
    # a folder may gain tasks (output/extend.py rewrites its files in place); a store not yet: one line
    grown = write_job(tmp_path / "grown.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels",
                      tasks=[{"caption": {}}, {"detect": {"objects": ["circle"]}}, {"point": {"objects": ["circle"]}}])
    r = cli_app(tmp_path, "validate", grown)
    assert r.returncode == 2 and "adding tasks to an output in an object store is not supported" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 1, r.stdout


def test_overwrite_leaves_a_foreign_object_at_a_stem_the_plan_no_longer_has(tmp_path, bucket):
    """--overwrite deletes this output's shards. A stem of the stored shard list that the job no
    longer plans is not checked by the preflight: an object there with no done marker is read to
    tell whose it is, and somebody else's stays."""
    import pyarrow.parquet as pq

    name, client = bucket
    write_shards(tmp_path / "data", 2, 2, seed=5)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    cli_app(tmp_path, "run", job, "--limit", "2", check=True)  # shard 0 done; the list names both
    (tmp_path / "data" / "shapes-000001.tar").unlink()
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"x": [1]}), sink)
    client.put_object(Bucket=name, Key="labels/shapes-000001.parquet", Body=sink.getvalue().to_pybytes())
    cli_app(tmp_path, "run", job, "--overwrite", check=True)
    objs = _objects(client, name)
    assert "shapes-000001.parquet" in objs and objs["shapes-000001.parquet"]["Size"] == len(sink.getvalue())
    assert list(_done(client, name)) == ["shapes-000000"]


def _run(job, env_extra=None) -> subprocess.Popen:
    env = os.environ | {"BATCHVLM_LEASE_S": "2"} | (env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "batchvlm.cli", "run", str(job)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _is_put(suffix: str):
    return lambda method, path: method == "PUT" and path.split("?")[0].endswith(suffix)


# The commit protocol's steps (store_commit.py), each killed once: before the done marker reaches
# the store (the claim held, the shard labelled), after the marker (its Parquet object not up), after
# the Parquet object (the claim not released). Then a run finishes: the dead runs' claims are taken
# over once their lease (2 s here) is out, and nothing done is written again.
KILL_POINTS = [("before", _is_put(".stats.json")), ("after", _is_put(".stats.json")), ("after", _is_put(".parquet"))]


def test_kill_9_at_each_commit_point_then_rerun(tmp_path, s3, bucket):
    _, proxy = s3
    name, client = bucket
    n_shards, per_shard = 4, 3
    write_shards(tmp_path / "data", n_shards, per_shard, seed=11)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    done: dict[str, str] = {}
    for when, test in KILL_POINTS:
        p = _run(job)
        proxy.kill = (p.pid, lambda m, path, test=test, when=when: when if test(m, path) else None)
        try:
            p.wait(timeout=300)
        finally:
            proxy.kill = None
        assert proxy.killed and proxy.killed[-1].startswith(when), p.stderr.read()
        now = _done(client, name)
        assert {s: now.get(s) for s in done} == done  # what was done stays, not written again
        done |= now
    assert 0 < len(done) < n_shards
    p = _run(job)
    assert p.wait(timeout=300) == 0, p.stderr.read()
    assert {s: e for s, e in _done(client, name).items() if s in done} == done
    for s in range(n_shards):
        assert _keys(client, name, f"shapes-{s:06d}") == [f"{s:06d}_{i:04d}" for i in range(per_shard)]
    assert _top_level(client, name) == {f"shapes-{s:06d}.parquet" for s in range(n_shards)} | {"__batchvlm__"}


def test_sigterm_releases_its_claims_then_a_rerun_extends_the_output(tmp_path, s3, bucket):
    """A stop request: the shards finished are written, the claims of the others deleted (also
    those its loader workers took, in other processes), so the next run takes them at once (no lease to wait out: the default 300 s here); a shard added to
    the input is labelled by the next run, the others not again."""
    import signal

    _, proxy = s3
    name, client = bucket
    write_shards(tmp_path / "data", 8, 4, seed=7)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels",
                    engine={"max_batch_size": 4},  # small batches: shards finish one by one
                    loader={"workers": 2})  # claims taken in forked workers, committed by the run
    env = {"BATCHVLM_LEASE_S": "300"}
    p = _run(job, env)
    proxy.kill = (p.pid, lambda m, path: "after" if _is_put(".parquet")(m, path) else None, signal.SIGTERM)
    assert p.wait(timeout=300) == 75, p.stderr.read()  # stopped: exits.EXIT_STOPPED
    done = _done(client, name)
    assert 0 < len(done) < 8 and not [k for k in _objects(client, name) if k.endswith(".claim")]
    write_shards(tmp_path / "more", 1, 2, seed=8)
    (tmp_path / "more" / "shapes-000000.tar").rename(tmp_path / "data" / "shapes-000008.tar")
    p = _run(job, env)
    assert p.wait(timeout=200) == 0, p.stderr.read()
    now = _done(client, name)
    assert {s: now[s] for s in done} == done and len(now) == 9


def test_two_ranks_racing_write_every_shard_once(tmp_path, bucket):
    name, client = bucket
    n_shards = 6
    write_shards(tmp_path / "data", n_shards, 2, seed=5)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    runs = [_run(job), _run(job)]
    logs = [p.communicate(timeout=300)[1] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], logs
    written = [int(line.split(" shard(s) written")[0].rsplit(" ", 1)[-1])
               for log in logs for line in log.splitlines() if " shard(s) written" in line]
    assert sum(written) == n_shards, logs  # every shard committed by exactly one of them
    assert len(_done(client, name)) == n_shards
    for s in range(n_shards):
        assert _keys(client, name, f"shapes-{s:06d}") == [f"{s:06d}_{i:04d}" for i in range(2)]


def test_an_expired_claim_is_taken_over_once_and_its_old_holder_commits_nothing(bucket):
    import pyarrow.parquet as pq

    from batchvlm.output.claims_store import StoreClaims
    from batchvlm.output.layout import Layout
    from batchvlm.output.store_commit import CommitLost, commit_to_store

    name, client = bucket
    layout = Layout.at(f"s3://{name}/labels")
    a, b, c = (StoreClaims(layout.meta, lease_s=1) for _ in range(3))
    assert a.take("s") and not b.take("s")
    time.sleep(2.5)  # the store's clock counts whole seconds
    assert b.take("s") and not c.take("s")  # one taker of the expired claim wins
    table = pa.table({"key": ["k"]})
    stats = {"shard": "s", "complete": True, "rows": 1}
    with pytest.raises(CommitLost):
        commit_to_store(layout, "s", table, "zstd", stats, a.confirm)  # the old holder woke up
    assert "s.parquet" not in _objects(client, name)
    commit_to_store(layout, "s", table, "zstd", stats, b.confirm)
    body = client.get_object(Bucket=name, Key="labels/s.parquet")["Body"].read()
    assert pq.read_table(pa.BufferReader(body)).column("key").to_pylist() == ["k"]
    # a claim taken before another rank committed its shard: its commit fails at the marker
    assert c.take("t")
    client.put_object(Bucket=name, Key="labels/__batchvlm__/t.stats.json", Body=b'{"shard": "t"}')
    with pytest.raises(CommitLost):
        commit_to_store(layout, "t", table, "zstd", stats | {"shard": "t"}, c.confirm)


HOLD = """import sys
from batchvlm.output.claims_store import StoreClaims
from batchvlm.output.layout import Layout
claims = StoreClaims(Layout.at(sys.argv[1]).meta)
print(claims.take("s"), claims.take("t"), flush=True)
sys.stdin.read()"""


def test_a_dead_holder_on_this_host_is_taken_over_at_once(bucket):
    """A claim names its holder's host and pid: where the host is this one and the process is gone
    (kill -9), its shard is taken at once (If-Match on its ETag, by one taker), not after the lease."""
    from batchvlm.output.claims_store import StoreClaims
    from batchvlm.output.layout import Layout

    name, client = bucket
    url = f"s3://{name}/labels"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().split() == ["True", "True"]
        mine, other = StoreClaims(Layout.at(url).meta), StoreClaims(Layout.at(url).meta)  # a lease of 300 s
        assert not mine.take("s") and not mine.is_free("s")  # its holder lives
    finally:
        holder.kill()
        holder.wait()
    assert mine.is_free("t") and mine.take("s")
    assert not other.take("s") and not other.is_free("s")  # taken once: now held by a live process
    claim = json.loads(client.get_object(Bucket=name, Key="labels/__batchvlm__/s.claim")["Body"].read())
    assert claim["pid"] == os.getpid()


def test_a_listing_answers_for_keys_it_lacks_and_reads_markers_ahead(s3, bucket):
    """store.listed (store_listing.py): within it, a key the listing lacks costs no request, and the
    markers are read READ_AHEAD at a time, each once; outside it every request goes to the store."""
    from batchvlm.output.store import S3Store

    _, proxy = s3
    name, client = bucket
    meta = "labels/__batchvlm__/"
    for i in range(70):
        client.put_object(Bucket=name, Key=f"{meta}s{i:03d}.stats.json", Body=str(i).encode())
    store = S3Store(name)
    proxy.requests.clear()
    with store.listed(["labels/", meta], (".parquet", ".stats.json")):
        assert store.head("labels/s000.parquet") is None and store.get(f"{meta}nope.stats.json") is None
        assert store.head(f"{meta}s001.stats.json").size == 1
        got = [store.get(f"{meta}s{i:03d}.stats.json") for i in [5, *range(70)]]
    assert got == [b"5", *(str(i).encode() for i in range(70))]
    gets = [path for m, path in proxy.requests if m == "GET" and "list-type" not in path]
    assert len(gets) == 64 + 6 + 1, gets  # s005 and the 63 after it; s000-s005; s069
    assert [m for m, path in proxy.requests if m != "GET"] == []
    assert store.head("labels/s000.parquet") is None and proxy.requests[-1][0] == "HEAD"


def test_a_large_shard_goes_up_in_parts(tmp_path, bucket, monkeypatch):
    """Above the multipart threshold (made 5 MiB here, S3's smallest part) the upload is
    multipart; the object appears whole, with a multipart ETag (`<md5>-<parts>`)."""
    from batchvlm.output import store
    from batchvlm.output.storepath import StorePath

    name, client = bucket
    monkeypatch.setattr(store, "MULTIPART_BYTES", 5 << 20)
    monkeypatch.setattr(store, "PART_BYTES", 5 << 20)
    big = tmp_path / "big.parquet"
    big.write_bytes(os.urandom(12 << 20))
    where = StorePath.from_url(f"s3://{name}/labels/big.parquet")
    where.store.upload(where.key, big)
    head = client.head_object(Bucket=name, Key="labels/big.parquet")
    assert head["ContentLength"] == 12 << 20 and head["ETag"].endswith('-3"')
    assert where.read_bytes() == big.read_bytes()


def _refusal(tmp_path, *args) -> str:
    r = cli_app(tmp_path, *args)
    assert r.returncode == 2, r.stdout
    lines = [line for line in r.stdout.splitlines() if line.startswith("batchvlm: error: ")]
    assert len(lines) == 1, r.stdout
    assert SECRET not in r.stdout and "AKIATESTKEY" not in r.stdout
    return lines[0]


def test_a_store_without_conditional_writes_is_refused(tmp_path, s3, bucket):
    _, proxy = s3
    name, client = bucket
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    proxy.unconditional = True
    for cmd in ("validate", "run"):
        assert "ignores conditional writes" in _refusal(tmp_path, cmd, job)
    assert _objects(client, name) == {}


def test_a_missing_bucket_and_a_wrong_credential_are_one_line(tmp_path, s3, bucket):
    server, _ = s3
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out="s3://no-such-bucket/labels")
    assert "the bucket of s3://no-such-bucket/labels" in _refusal(tmp_path, "validate", job)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{bucket[0]}/labels")
    server.set_auth(True)  # from here on moto checks keys: ours is none it knows
    try:
        line = _refusal(tmp_path, "run", job)
    finally:
        server.set_auth(False)
    assert "refused the credentials" in line and "InvalidAccessKeyId" in line


def test_an_unreachable_endpoint_is_one_line_before_any_work(tmp_path, s3, bucket, monkeypatch):
    import socket

    with socket.socket() as sock:  # a port nobody listens on once this closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{bucket[0]}/labels")
    for command in ("validate", "run"):
        line = _refusal(tmp_path, command, job)
        assert f"cannot reach the store of s3://{bucket[0]}/labels" in line and f"127.0.0.1:{port}" in line, line
        assert "AWS_ENDPOINT_URL" in line


def test_credentials_that_may_only_read_are_refused_before_any_model_load(tmp_path, s3, bucket, monkeypatch):
    """moto with its authentication on, and an IAM user whose policy allows reads only: validate and
    run refuse the output in one line naming its URL and the permissions it needs, exit 2."""
    import boto3

    server, _ = s3
    name, client = bucket
    iam, user = boto3.client("iam"), f"reader-{name}"
    iam.create_user(UserName=user)
    read_only = {"Effect": "Allow", "Action": ["s3:Get*", "s3:List*"], "Resource": "*"}  # AmazonS3ReadOnlyAccess
    iam.put_user_policy(UserName=user, PolicyName="read-only",
                        PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [read_only]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    write_shards(tmp_path / "data", 1, 2, seed=1)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    server.set_auth(True)
    try:
        lines = [_refusal(tmp_path, cmd, job) for cmd in ("validate", "run")]
        r = cli_app(tmp_path, "run", job)
    finally:
        server.set_auth(False)
    assert lines == [f"batchvlm: error: output.dir: no permission to write s3://{name}/labels (AccessDenied); the "
                     "credentials need s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket on the prefix"] * 2
    assert "loaded" not in r.stdout and key["SecretAccessKey"] not in r.stdout
    assert _objects(client, name) == {}


def test_a_store_that_fails_for_a_while_is_retried_then_the_run_stops_cleanly(tmp_path, s3, bucket, monkeypatch):
    _, proxy = s3
    monkeypatch.setenv("BATCHVLM_LEASE_S", "2")  # the claims the failed run could not release expire soon
    name, client = bucket
    write_shards(tmp_path / "data", 3, 2, seed=3)
    job = write_job(tmp_path / "job.yaml", "data/shapes-*.tar", out=f"s3://{name}/labels")
    proxy.fail_503 = 2  # a short window: retried with backoff, nobody notices
    cli_app(tmp_path, "run", job, "--limit", "2", check=True)
    assert proxy.seen_503 >= 2
    # down from this run's second commit on (shard 2's), for good: one line, exit 1 (retryable), the
    # shards finished before it kept
    commits = itertools.count()
    proxy.fail_from = lambda m, path: _is_put(".stats.json")(m, path) and next(commits) == 1
    r = cli_app(tmp_path, "run", job)
    assert r.returncode == 1, r.stdout
    [line] = [line for line in r.stdout.splitlines() if line.startswith("batchvlm: error: ")]
    assert line.startswith(f"batchvlm: error: output.dir: the store of s3://{name}/labels/") and line.endswith(
        " kept failing (503 SlowDown) after 3 attempts; finished shards are kept: run again"), r.stdout
    proxy.fail_503 = 0
    assert sorted(_done(client, name)) == ["shapes-000000", "shapes-000001"]
    cli_app(tmp_path, "run", job, check=True)
    assert len(_done(client, name)) == 3

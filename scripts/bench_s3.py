"""Choose the S3 client of `output.dir: s3://...` (issue 41): boto3, obstore and pyarrow's
S3FileSystem against a local moto server, for what the output protocol does: small PUTs (done
markers, claims), GETs, a listing, a 64 MiB shard upload, and whether the client can send a
conditional PUT (If-None-Match: * to create, If-Match: <etag> to replace) at all.

    python scripts/bench_s3.py [--n 200]

Numbers on a loaded shared machine against an in-process Python server are indicative only: they
mostly measure the client's per-request overhead (the server is the same for all three).
"""

from __future__ import annotations

import argparse
import os
import time


def _server():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def _timed(fn, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t) / n * 1e3


def bench_boto3(url: str, n: int, big: bytes) -> dict:
    import boto3
    from botocore.exceptions import ClientError

    s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
    s3.create_bucket(Bucket="bench-boto3")
    r = {"put ms": _timed(lambda i: s3.put_object(Bucket="bench-boto3", Key=f"k/{i}", Body=b"x" * 512), n),
         "get ms": _timed(lambda i: s3.get_object(Bucket="bench-boto3", Key=f"k/{i}")["Body"].read(), n),
         "list ms": _timed(lambda i: s3.list_objects_v2(Bucket="bench-boto3", Prefix="k/"), 10)}
    t = time.perf_counter()
    s3.upload_fileobj(__import__("io").BytesIO(big), "bench-boto3", "big")  # multipart over 8 MiB
    r["64MiB s"] = time.perf_counter() - t
    s3.put_object(Bucket="bench-boto3", Key="c", Body=b"1", IfNoneMatch="*")
    try:
        s3.put_object(Bucket="bench-boto3", Key="c", Body=b"2", IfNoneMatch="*")
        r["if-none-match"] = "sent, NOT honoured"
    except ClientError as e:
        r["if-none-match"] = f"yes ({e.response['Error']['Code']})"
    try:
        s3.put_object(Bucket="bench-boto3", Key="c", Body=b"2", IfMatch='"0000"')
        r["if-match"] = "sent, NOT honoured"
    except ClientError as e:
        r["if-match"] = f"yes ({e.response['Error']['Code']})"
    return r


def bench_obstore(url: str, n: int, big: bytes) -> dict:
    import boto3
    import obstore as obs
    from obstore.store import S3Store

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="bench-obstore")
    st = S3Store("bench-obstore", endpoint=url, region="us-east-1", access_key_id="x", secret_access_key="x",
                 client_options={"allow_http": True})
    r = {"put ms": _timed(lambda i: obs.put(st, f"k/{i}", b"x" * 512), n),
         "get ms": _timed(lambda i: bytes(obs.get(st, f"k/{i}").bytes()), n),
         "list ms": _timed(lambda i: obs.list(st, "k/").collect(), 10)}
    t = time.perf_counter()
    obs.put(st, "big", big)
    r["64MiB s"] = time.perf_counter() - t
    obs.put(st, "c", b"1", mode="create")
    try:
        obs.put(st, "c", b"2", mode="create")
        r["if-none-match"] = "sent, NOT honoured"
    except Exception as e:  # noqa: BLE001 - obstore's AlreadyExistsError
        r["if-none-match"] = f"yes ({type(e).__name__})"
    try:
        obs.put(st, "c", b"2", mode={"e_tag": '"0000"'})
        r["if-match"] = "sent, NOT honoured"
    except Exception as e:  # noqa: BLE001
        r["if-match"] = f"yes ({type(e).__name__})"
    return r


def bench_pyarrow(url: str, n: int, big: bytes) -> dict:
    import boto3
    from pyarrow import fs

    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket="bench-pyarrow")
    f = fs.S3FileSystem(endpoint_override=url, region="us-east-1", access_key="x", secret_key="x")

    def put(i):
        with f.open_output_stream(f"bench-pyarrow/k/{i}") as out:
            out.write(b"x" * 512)

    def get(i):
        with f.open_input_stream(f"bench-pyarrow/k/{i}") as inp:
            inp.read()

    r = {"put ms": _timed(put, n), "get ms": _timed(get, n),
         "list ms": _timed(lambda i: f.get_file_info(fs.FileSelector("bench-pyarrow/k/")), 10)}
    t = time.perf_counter()
    with f.open_output_stream("bench-pyarrow/big") as out:
        out.write(big)
    r["64MiB s"] = time.perf_counter() - t
    r["if-none-match"] = r["if-match"] = "no (no API for a conditional write)"
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    n = ap.parse_args().n
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "x")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "x")
    server, url = _server()
    big = os.urandom(64 << 20)
    try:
        for name, fn in (("boto3", bench_boto3), ("obstore", bench_obstore), ("pyarrow", bench_pyarrow)):
            r = fn(url, n, big)
            print(f"{name:8s} " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                                           for k, v in r.items()), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()

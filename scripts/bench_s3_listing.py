"""What listing a large prefix costs (issue 41): S3 answers a listing 1000 keys a request
(ListObjectsV2's MaxKeys ceiling), so a prefix of N keys takes ceil(N / 1000) requests one after
another (each page names where the next starts). This times a page of 1000 keys against a local
moto server, through boto3 (the output's client) and s3fs (the inputs' client, fsspec's glob and
find), and extrapolates to a million keys.

    python scripts/bench_s3_listing.py [--keys 5000]

Indicative only: an in-process Python server on a shared machine, where a page costs mostly the
server rendering 1000 keys of XML; what a page takes on AWS S3 is not measured here (docs/object-store.md
states the request counts, which do not depend on the store).
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor


def main() -> None:
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=5000)
    args = ap.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bench")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket="bench", Key=f"in/{i:07d}.jpg", Body=b"x"), range(args.keys)))

    pages = 0
    t = time.perf_counter()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix="in/"):
        pages += 1
        assert len(page.get("Contents", [])) <= 1000
    boto_page = (time.perf_counter() - t) / pages

    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    t = time.perf_counter()
    found = fs.glob("bench/in/*.jpg")
    fsspec_page = (time.perf_counter() - t) / pages
    assert len(found) == args.keys
    server.stop()
    print(f"{args.keys} keys: {pages} pages of <= 1000 keys")
    for name, page in (("boto3 list_objects_v2", boto_page), ("s3fs glob", fsspec_page)):
        print(f"  {name}: {page * 1e3:.0f} ms a page here; a million keys: 1000 requests one after another, "
              f"{page * 1000:.0f} s at this rate")


if __name__ == "__main__":
    main()

"""A real S3 server for the tests: moto's standalone server (the S3 REST protocol over HTTP) on
127.0.0.1, served single-threaded (moto checks a conditional PUT's condition and writes in two
steps: one request at a time makes each PUT atomic, as S3's are), and a proxy in front of it that
can answer 503 for a while or drop the conditional headers (a store without conditional writes).
Runs see them through AWS_ENDPOINT_URL, as a user's run sees any other store.
"""

from __future__ import annotations

import http.client
import itertools
import logging
import os
import signal
import threading
import urllib.request
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

SECRET = "s3cr3t-that-no-line-may-show"
_buckets = itertools.count()


class _Served:
    """An HTTP server answering on a daemon thread until stop()."""

    def _serve(self, server) -> None:
        self._server = server
        self.port = server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


class MotoServer(_Served):
    def __init__(self):
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        app = DomainDispatcherApplication(create_backend_app)
        self._serve(make_server("127.0.0.1", 0, app, threaded=False, request_handler=MotoRequestHandler))

    def set_auth(self, on: bool) -> None:
        """moto accepts any key until told to check them (then only keys its IAM knows pass)."""
        req = urllib.request.Request(f"{self.url}/moto-api/reset-auth", data=b"0" if on else b"inf", method="POST",
                                     headers={"Content-Type": "text/plain"})  # not a form: flask keeps the body
        urllib.request.urlopen(req).read()


class Proxy(_Served):
    """Forwards every request to `target`; `fail_503` > 0 answers that many requests with 503
    SlowDown instead, `unconditional` drops If-None-Match / If-Match from PUTs. `kill` (a process
    group and a test of (method, path) -> "before" | "after") kill -9s a run at an exact request
    of the commit protocol: before it reaches the store, or once the store has done it (its answer
    never sent): the deterministic kill points of the crash tests."""

    def __init__(self, target_port: int):
        self.fail_503 = 0
        self.unconditional = False
        self.seen_503 = 0
        self.kill: tuple | None = None  # (pgid, test[, signal]): SIGKILL unless a signal is given
        self.fail_from = None  # a test of (method, path): from the first request it matches, all get 503
        self.killed: list[str] = []
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        proxy = self

        def kill_point(method: str, path: str, when: str) -> bool:
            if proxy.kill is None or proxy.kill[1](method, path) != when:
                return False
            pgid, _, *sig = proxy.kill
            proxy.kill = None
            proxy.killed.append(f"{when} {method} {path}")
            os.killpg(pgid, sig[0] if sig else signal.SIGKILL)
            return sig == [] or sig[0] == signal.SIGKILL  # another signal: the request goes on

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _any(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                proxy.requests.append((self.command, self.path))
                if kill_point(self.command, self.path, "before"):
                    self.close_connection = True
                    return
                if proxy.fail_from is not None and proxy.fail_from(self.command, self.path):
                    proxy.fail_from, proxy.fail_503 = None, 10**9
                if proxy.fail_503 > 0:
                    proxy.fail_503 -= 1
                    proxy.seen_503 += 1
                    msg = b"<Error><Code>SlowDown</Code><Message>slow down</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                headers = {k: v for k, v in self.headers.items()
                           if not (proxy.unconditional and k.lower() in ("if-none-match", "if-match"))}
                conn = http.client.HTTPConnection("127.0.0.1", target_port, timeout=60)
                conn.request(self.command, self.path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
                if kill_point(self.command, self.path, "after"):
                    self.close_connection = True
                    return
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
                        self.send_header(k, v)
                length = r.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._serve(server)


@contextmanager
def serving():
    """A moto server and a proxy before it: -> (server, proxy)."""
    server = MotoServer()
    proxy = Proxy(server.port)
    try:
        yield server, proxy
    finally:
        proxy.stop()
        server.stop()


def store_env(proxy: Proxy) -> dict[str, str]:
    """The environment a user's run would have for the test store (through the proxy)."""
    return {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "AKIATESTKEY", "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "3"}


def written(client, bucket: str, prefix: str) -> dict[str, list[str]]:
    """What an output in the store holds: its top-level objects, done markers and claims (names
    under `prefix/`), and the image keys of all its Parquet objects, sorted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/")
    keys = sorted(o["Key"].removeprefix(f"{prefix}/") for page in pages for o in page.get("Contents", []))
    top = [k for k in keys if "/" not in k]
    images = []
    for k in top:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/{k}")["Body"].read()
        images += pq.read_table(pa.BufferReader(body), columns=["key"]).column("key").to_pylist()
    return {"top": top, "markers": [k for k in keys if k.endswith(".stats.json")],
            "claims": [k for k in keys if k.endswith(".claim")], "images": sorted(images)}


# Fixtures for the test modules that use the server (imported there by name):


@pytest.fixture(scope="module")
def s3():
    with serving() as (server, proxy):
        yield server, proxy


@pytest.fixture
def bucket(s3, monkeypatch):
    """A fresh bucket; the environment a user's run would have (through the proxy)."""
    import boto3

    server, proxy = s3
    proxy.fail_503, proxy.unconditional, proxy.kill, proxy.fail_from = 0, False, None, None
    for k, v in store_env(proxy).items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    name = f"t{next(_buckets)}-{os.getpid()}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=name)
    return name, client

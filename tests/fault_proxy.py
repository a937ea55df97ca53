"""An HTTP proxy in front of a test object-store server (S3, GCS or Azure emulator) that does what a
throttled, flaky, slow or dying store does, deterministically (counted requests, never timing):

- ``fail_next`` / ``fail_matching``: answer a burst of errors (503 SlowDown, 500) instead of forwarding;
- ``cut_next``: send a GET's headers (the whole ``Content-Length``) and half its body, then close the
  connection: a download cut mid-stream;
- ``corrupt_next``: flip one byte of a GET's body on the way (same length): what only a checksum catches;
- ``delay_matching``: wait ``seconds`` before forwarding each matching request: a slow server;
- ``die_after``: after ``count`` more matching GETs, close the port and every open connection (nothing
  answers, as when a server dies); ``go_down`` at once; ``come_back`` listens again on the same port.

Requests are forwarded unchanged, Host header included, so SigV4 signatures made for the proxy's address
still verify (Azure's and GCS's do not name the host; fake-gcs-server is given its own address as Host, as
it routes by it). ``fragment`` arguments match the URL-decoded path
without its query (GCS's object paths are encoded: ``ds%2Fshards%2F...``; a listing's prefix is in its
query, so a fragment naming objects never matches a LIST). ``get_counts`` counts forwarded GETs per path.
``proxied_env`` gives a cloud's client variables pointing at the proxy.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.s3_server import free_port

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    def __init__(self, upstream_port: int, rewrite_host: bool = False) -> None:
        self.upstream_port = upstream_port
        self.rewrite_host = rewrite_host  # fake-gcs-server routes by Host: it must see its own address
        self.port = free_port()
        self._lock = threading.Lock()
        self._fail_left, self._fail_fragment = 0, ""
        self._fail_matching: str | None = None
        self._status = 503
        self._cut_left, self._cut_fragment, self._cut_after = 0, "", 0
        self._corrupt_left, self._corrupt_fragment = 0, ""
        self._delay_fragment: str | None = None
        self._delay_s = 0.0
        self._die_left: int | None = None
        self._die_fragment = ""
        self._connections: set[socket.socket] = set()
        self.failed = 0  # errors answered so far
        self.forwarded = 0
        self.cut = 0  # bodies cut so far
        self.corrupted = 0
        self.delayed = 0
        self.methods: list[str] = []  # "GET /bucket/key" of every forwarded request
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:  # the proxy died under it
                    pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = urllib.parse.unquote(self.path.split("?", 1)[0])  # the object, not a listing's prefix
                get = self.command == "GET"
                with proxy._lock:
                    matching = proxy._fail_matching is not None and proxy._fail_matching in path
                    fail = (proxy._fail_left > 0 and proxy._fail_fragment in path) or matching
                    die = False
                    if fail:
                        proxy._fail_left -= 0 if matching else 1
                        proxy.failed += 1
                    elif get and proxy._die_left is not None and proxy._die_fragment in path:
                        die = proxy._die_left == 0
                        proxy._die_left -= 1
                    if not fail and not die:
                        proxy.forwarded += 1
                        proxy.methods.append(f"{self.command} {path}")
                    cut = get and not fail and not die and proxy._cut_left > 0 and proxy._cut_fragment in path
                    if cut and proxy._cut_after > 0:
                        proxy._cut_after -= 1
                        cut = False
                    proxy._cut_left -= cut
                    corrupt = (get and not fail and not die and not cut and proxy._corrupt_left > 0
                               and proxy._corrupt_fragment in path)
                    proxy._corrupt_left -= corrupt
                    delay = proxy._delay_s if proxy._delay_fragment is not None and \
                        proxy._delay_fragment in path else 0.0
                    status = proxy._status
                if die:
                    threading.Thread(target=proxy.go_down, daemon=True).start()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fail:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(_SLOW_DOWN)
                    return
                if delay:
                    with proxy._lock:
                        proxy.delayed += 1
                    time.sleep(delay)
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
                try:
                    headers = dict(self.headers.items())
                    if proxy.rewrite_host:
                        headers = {k: v for k, v in headers.items() if k.lower() != "host"}
                        headers["Host"] = f"127.0.0.1:{proxy.upstream_port}"
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                cut = cut and len(data) > 1 and response.status < 300
                corrupt = corrupt and len(data) > 0 and response.status < 300
                with proxy._lock:
                    proxy.cut += cut
                    proxy.corrupted += corrupt
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                # A HEAD's Content-Length is the object's size, not the (empty) body's.
                head_length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", head_length or str(len(data)))
                self.end_headers()
                if self.command == "HEAD":
                    return
                if cut:  # the whole length announced, half of it sent, the connection closed
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if corrupt:
                    middle = len(data) // 2
                    data = data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:]
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._handler = Handler
        self._listen()

    def _listen(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def go_down(self) -> None:
        """Close the port and every open connection: new connections are refused until ``come_back``, and a
        request in flight gets no answer."""
        self.close()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def come_back(self) -> None:
        with self._lock:
            self._die_left = None
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, count: int, status: int = 503, fragment: str = "") -> None:
        """Answer the next ``count`` requests (whose path contains ``fragment``) with ``status`` (a burst), then
        forward again."""
        with self._lock:
            self._fail_left, self._status, self._fail_fragment = count, status, fragment

    def fail_matching(self, fragment: str | None, status: int = 503) -> None:
        """Answer every request whose path contains ``fragment`` (e.g. ``/.lock``: a lease's requests) with
        ``status`` until called again with None."""
        with self._lock:
            self._fail_matching, self._status = fragment, status

    def cut_next(self, count: int, fragment: str = "", after: int = 0) -> None:
        """Cut the body of the next ``count`` GETs whose path contains ``fragment`` half-way (once ``after`` of
        them went through whole)."""
        with self._lock:
            self._cut_left, self._cut_fragment, self._cut_after = count, fragment, after

    def corrupt_next(self, count: int, fragment: str = "") -> None:
        """Flip a byte in the middle of the body of the next ``count`` GETs whose path contains ``fragment``."""
        with self._lock:
            self._corrupt_left, self._corrupt_fragment = count, fragment

    def delay_matching(self, fragment: str | None, seconds: float) -> None:
        """Wait ``seconds`` before forwarding each request whose path contains ``fragment`` (None: none)."""
        with self._lock:
            self._delay_fragment, self._delay_s = fragment, seconds

    def die_after(self, count: int, fragment: str = "") -> None:
        """Forward ``count`` more GETs whose path contains ``fragment``; at the next one, go down."""
        with self._lock:
            self._die_left, self._die_fragment = count, fragment

    def get_counts(self, fragment: str = "") -> Counter[str]:
        """Forwarded GETs per path (URL-decoded, query left out), of the paths containing ``fragment``."""
        with self._lock:
            methods = list(self.methods)
        return Counter(m[4:] for m in methods if m.startswith("GET ") and fragment in m)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def proxied_env(server: Any, proxy: FaultProxy, directory: str) -> dict[str, str]:
    """``server``'s client variables (S3, GCS or Azure emulator), pointing at ``proxy`` instead; a GCS key
    file naming the proxy is written into ``directory``."""
    env = dict(server.env())
    if server.scheme == "s3":
        env["AWS_ENDPOINT_URL"] = proxy.endpoint
    elif server.scheme == "az":
        env["AZURE_ENDPOINT"] = f"{proxy.endpoint}/{server.endpoint.rsplit('/', 1)[1]}"
    else:
        with open(env["GOOGLE_SERVICE_ACCOUNT_PATH"]) as f:
            key = json.load(f)
        key["gcs_base_url"] = proxy.endpoint
        path = os.path.join(directory, "proxied-service-account.json")
        with open(path, "w") as f:
            json.dump(key, f)
        env["GOOGLE_SERVICE_ACCOUNT_PATH"] = path
    return env


def proxy_for(server: Any) -> FaultProxy:
    """A proxy in front of ``server`` (S3, GCS or Azure emulator); ``proxied_env`` points a client at it."""
    port = int(server.ports["s3"]) if server.scheme == "s3" else int(server.port)
    return FaultProxy(port, rewrite_host=server.scheme == "gs")


def shorten_retries(monkeypatch: Any) -> None:
    """obstore gives up on a request after ~2 s of retries instead of a minute, on every cloud (for tests
    whose request must fail)."""
    from datetime import timedelta

    import shardio.store.azure
    import shardio.store.gcs
    import shardio.store.s3

    def fast() -> dict[str, Any]:
        return {"max_retries": 2, "retry_timeout": timedelta(seconds=2),
                "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(milliseconds=500),
                            "base": 2}}

    for module in (shardio.store.s3, shardio.store.gcs, shardio.store.azure):
        monkeypatch.setattr(module, "retry_config", fast)

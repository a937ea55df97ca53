"""An HTTP proxy in front of the test S3 server that can answer a burst of errors (503 SlowDown, 500)
instead of forwarding, or go away for a while (its port closed: connections refused, as while a server
restarts): what a throttled, flaky or restarting object store does. Requests are forwarded unchanged,
Host header included, so SigV4 signatures made for the proxy's address still verify.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.s3_server import free_port

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._fail_left = 0
        self._fail_matching: str | None = None
        self._status = 503
        self.failed = 0  # errors answered so far
        self.forwarded = 0
        self.methods: list[str] = []  # "GET /bucket/key" of every forwarded request
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    matching = proxy._fail_matching is not None and proxy._fail_matching in self.path
                    fail = proxy._fail_left > 0 or matching
                    if fail:
                        proxy._fail_left -= 0 if matching else 1
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                        proxy.methods.append(f"{self.command} {self.path}")
                    status = proxy._status
                if fail:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(_SLOW_DOWN)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=120)
                try:
                    upstream.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    response = upstream.getresponse()
                    data = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status, response.reason)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                # A HEAD's Content-Length is the object's size, not the (empty) body's.
                head_length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", head_length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
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
        """Close the port: new connections are refused until ``come_back``."""
        self.close()

    def come_back(self) -> None:
        self._listen()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def fail_next(self, count: int, status: int = 503) -> None:
        """Answer the next ``count`` requests with ``status`` (a burst), then forward again."""
        with self._lock:
            self._fail_left, self._status = count, status

    def fail_matching(self, fragment: str | None, status: int = 503) -> None:
        """Answer every request whose path contains ``fragment`` (e.g. ``/.lock``: a lease's requests) with
        ``status`` until called again with None."""
        with self._lock:
            self._fail_matching, self._status = fragment, status

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

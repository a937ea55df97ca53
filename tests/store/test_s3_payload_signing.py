"""Uploads are signed as the AWS SDKs sign them: the body's SHA-256 in the signature over plain HTTP, and
``UNSIGNED-PAYLOAD`` over HTTPS (TLS guards the body; hashing every byte written is CPU the job pays); an
``AWS_UNSIGNED_PAYLOAD`` the user set wins either way."""

from __future__ import annotations

import hashlib
import http.server
import threading
from typing import ClassVar

import pytest

pytest.importorskip("obstore")

from shardio.store import s3 as s3_storage


class _RecordingS3(http.server.BaseHTTPRequestHandler):
    """Answers every PUT with 200 and an ETag, keeping the payload hash header it was sent with the body."""

    seen: ClassVar[list[tuple[str, bytes]]] = []

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _RecordingS3.seen.append((self.headers.get("x-amz-content-sha256", ""), body))
        self.send_response(200)
        self.send_header("ETag", '"0123"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def aws_keys(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_UNSIGNED_PAYLOAD", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")


@pytest.fixture
def http_endpoint(aws_keys, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RecordingS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    _RecordingS3.seen = []
    yield
    server.shutdown()
    server.server_close()


def _upload(tmp_path, data: bytes) -> tuple[str, bytes]:
    local = tmp_path / "shard.npy"
    local.write_bytes(data)
    s3_storage.S3Storage().upload(str(local), "s3://bucket/ds/shards/a.npy")
    assert len(_RecordingS3.seen) == 1
    return _RecordingS3.seen[0]


def test_over_plain_http_the_body_is_hashed_into_the_signature(http_endpoint, tmp_path):
    data = b"pixels" * 10_000
    header, body = _upload(tmp_path, data)
    assert body == data
    assert header == hashlib.sha256(data).hexdigest()


def test_a_users_aws_unsigned_payload_wins_over_the_default(http_endpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_UNSIGNED_PAYLOAD", "true")
    header, body = _upload(tmp_path, b"x" * 1000)
    assert (header, body) == ("UNSIGNED-PAYLOAD", b"x" * 1000)


@pytest.mark.parametrize("endpoint", [None, "https://minio.example:9000", "HTTPS://r2.example"])
def test_over_https_uploads_go_unsigned_as_the_sdks_send_them(aws_keys, monkeypatch, endpoint):
    if endpoint:
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setattr(s3_storage, "_aws_bucket_region", lambda bucket: None)  # AWS itself: no region probe
    assert str(s3_storage.S3Storage()._store("bucket").config.get("unsigned_payload")).lower() == "true"


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9", "https://minio.example:9000"])
def test_a_users_choice_is_left_to_obstore(aws_keys, monkeypatch, endpoint):
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_UNSIGNED_PAYLOAD", "false")
    assert "unsigned_payload" not in s3_storage.S3Storage()._store("bucket").config

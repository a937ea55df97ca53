"""On AWS itself (no custom endpoint) each bucket is addressed in its own region, found as boto3 finds it:
a bucket in another region than the profile's must work, not fail on a redirect obstore does not follow."""

from __future__ import annotations

import http.server
import threading
from typing import ClassVar

import pytest

pytest.importorskip("obstore")

from shardio.store import s3 as object_storage

# bucket -> (status of a HEAD, the x-amz-bucket-region AWS sends with it)
ANSWERS = {"moved": (301, "eu-west-3"), "private": (403, "ap-south-1"), "open": (200, "us-west-2"),
           "missing": (404, None)}


class _FakeAws(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_HEAD(self) -> None:
        bucket = self.path.split("?")[0].strip("/")
        status, region = ANSWERS.get(bucket, (404, None))
        _FakeAws.seen.append((bucket, self.headers.get("Authorization")))
        self.send_response(status)
        if region:
            self.send_header("x-amz-bucket-region", region)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_aws(monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeAws)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_REGION", "ca-central-1")  # the profile's region, not the buckets'
    monkeypatch.setattr(object_storage, "_AWS_PROBE_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    _FakeAws.seen = []
    yield
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("bucket", ["moved", "private", "open"])
def test_each_aws_bucket_is_addressed_in_its_own_region(fake_aws, bucket):
    store = object_storage.S3Storage()._store(bucket)
    assert store.config["region"] == ANSWERS[bucket][1]
    # Anonymous: no credentials are sent to find a region (botocore tries a 301 once more: at most two).
    assert 1 <= len(_FakeAws.seen) <= 2 and set(_FakeAws.seen) == {(bucket, None)}


def test_a_region_that_cannot_be_told_falls_back_to_the_configured_one(fake_aws):
    assert object_storage.S3Storage()._store("missing").config["region"] == "ca-central-1"


def test_a_custom_endpoint_is_never_probed(fake_aws, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # MinIO, R2, SeaweedFS: their own region
    assert object_storage.S3Storage()._store("moved").config["region"] == "ca-central-1"
    assert _FakeAws.seen == []


def test_a_probe_that_cannot_connect_falls_back_quietly(fake_aws, monkeypatch):
    monkeypatch.setattr(object_storage, "_AWS_PROBE_ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    assert object_storage._aws_bucket_region("moved") is None

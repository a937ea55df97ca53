"""An Azure Blob Storage emulator for the test session: Azurite (``npm install azurite``; ``make test``
installs it into ``.node/``), on loopback, its data in a temp dir.

The product reaches it as it would reach Azure: ``AZURE_STORAGE_ACCOUNT_NAME`` / ``AZURE_STORAGE_ACCOUNT_KEY``
(Azurite's well-known development account) and ``AZURE_ENDPOINT``. Set-up and inspection (containers,
seeding, listing) sign requests with the account key here (Shared Key), independent of the product's client.
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass

from tests.s3_server import _port_open, free_port

ACCOUNT = "devstoreaccount1"
# Azurite's published development key (not a secret: every Azurite install accepts it).
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def binary() -> str:
    local = os.path.join(_REPO, ".node", "node_modules", ".bin", "azurite-blob")
    found = local if os.path.exists(local) else shutil.which("azurite-blob")
    if not found:
        raise RuntimeError(f"no azurite-blob: npm install --prefix {_REPO}/.node azurite (make test does)")
    return found


@dataclass
class AzureServer:
    root: str
    port: int = 0
    process: subprocess.Popen | None = None
    scheme = "az"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": KEY,
                "AZURE_ENDPOINT": self.endpoint}

    def start(self, timeout_s: float = 60.0) -> None:
        self.port = self.port or free_port()
        data = os.path.join(self.root, "data")
        os.makedirs(data, exist_ok=True)
        log = open(os.path.join(self.root, "azurite.log"), "ab")
        self.process = subprocess.Popen(
            [binary(), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--location", data, "--silent",
             "--skipApiVersionCheck", "--disableProductStyleUrl"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"azurite exited with {self.process.returncode}; see {self.root}/azurite.log")
            if _port_open(self.port):
                try:
                    self._request("GET", "", {"comp": "list"})
                    return
                except OSError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"azurite did not answer within {timeout_s} s; see {self.root}/azurite.log")

    def _request(self, method: str, path: str, query: dict[str, str] | None = None, body: bytes = b"",
                 headers: dict[str, str] | None = None) -> bytes:
        """One Blob API request signed with the account key (Shared Key, the emulator's path-style form)."""
        query, headers = dict(query or {}), dict(headers or {})
        headers.update({"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": "2021-08-06"})
        if method in ("PUT", "POST"):
            headers.setdefault("Content-Type", "application/octet-stream")
        canonical_headers = "".join(f"{k}:{v}\n" for k, v in sorted(
            (k.lower(), v) for k, v in headers.items() if k.lower().startswith("x-ms-")))
        resource = f"/{ACCOUNT}/{ACCOUNT}/{urllib.parse.quote(path)}" + "".join(
            f"\n{k}:{v}" for k, v in sorted(query.items()))
        signed = "\n".join([method, "", "", str(len(body)) if body else "", "", headers.get("Content-Type", ""),
                            "", "", "", "", "", ""]) + "\n" + canonical_headers + resource
        signature = base64.b64encode(hmac.new(base64.b64decode(KEY), signed.encode(), hashlib.sha256).digest())
        headers["Authorization"] = f"SharedKey {ACCOUNT}:{signature.decode()}"
        url = f"{self.endpoint}/{urllib.parse.quote(path)}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, data=body if method in ("PUT", "POST") else None, headers=headers,
                                         method=method)
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.read()

    def new_bucket(self) -> str:
        name = f"t{uuid.uuid4().hex[:16]}"
        self._request("PUT", name, {"restype": "container"})
        return name

    def put_file(self, bucket: str, key: str, path: str) -> None:
        with open(path, "rb") as f:
            self._request("PUT", f"{bucket}/{key}", body=f.read(), headers={"x-ms-blob-type": "BlockBlob"})

    def get_bytes(self, bucket: str, key: str) -> bytes:
        return self._request("GET", f"{bucket}/{key}")

    def list_keys(self, bucket: str, prefix: str = "") -> list[str]:
        keys: list[str] = []
        marker = ""
        while True:
            query = {"restype": "container", "comp": "list", "prefix": prefix}
            if marker:
                query["marker"] = marker
            page = self._request("GET", bucket, query).decode()
            keys += re.findall(r"<Blob><Name>([^<]+)</Name>", page)
            found = re.search(r"<NextMarker>([^<]+)</NextMarker>", page)
            if not found:
                return sorted(keys)
            marker = found.group(1)

    def stop(self, crash: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

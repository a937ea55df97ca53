"""One bucket on one of the session's object-store servers (S3: SeaweedFS; GCS: fake-gcs-server; Azure:
Azurite), with what the behavioural tests do to it from outside the product: seed a dataset, list its keys,
copy it back to compare with the local tools. The ``cloud_bucket`` fixture (tests/conftest.py) gives one
per cloud."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass
class CloudBucket:
    server: Any  # S3Server, GCSServer or AzureServer
    name: str

    @property
    def cloud(self) -> str:
        return {"s3": "s3", "gs": "gcs", "az": "azure"}[self.server.scheme]

    def url(self, prefix: str = "") -> str:
        return f"{self.server.scheme}://{self.name}" + (f"/{prefix}" if prefix else "")

    def keys(self, prefix: str) -> list[str]:
        """The keys under ``prefix/``, relative to it."""
        return [key[len(prefix) + 1:] for key in self.server.list_keys(self.name, prefix + "/")]

    def upload_dir(self, directory: str, prefix: str = "ds") -> str:
        for base, _, files in os.walk(directory):
            for name in files:
                path = os.path.join(base, name)
                self.server.put_file(self.name, f"{prefix}/{os.path.relpath(path, directory)}", path)
        return self.url(prefix)

    def fetch(self, prefix: str, local: str) -> str:
        for rel in self.keys(prefix):
            path = os.path.join(local, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(self.server.get_bytes(self.name, f"{prefix}/{rel}"))
        return local

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


def unusable_credentials(cloud: str, tmp_path: Any, monkeypatch: Any) -> tuple[str, str]:
    """Break ``cloud``'s credentials as a user does (a key file path mistyped, an account key pasted
    half, a profile that does not exist), with nothing else configured: a URL on that cloud and what the
    refusal must say."""
    for name in ("GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_KEY",
                 "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
                 "AZURE_CLIENT_SECRET", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud login, no ~/.aws
    if cloud == "gcs":
        monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT_PATH", str(tmp_path / "typo.json"))
        return "gs://cred-check-bucket/ds", f"GOOGLE_SERVICE_ACCOUNT_PATH names the key file " \
                                            f"'{tmp_path / 'typo.json'}', which does not exist"
    if cloud == "azure":
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "acct")
        monkeypatch.setenv("AZURE_ENDPOINT", "http://127.0.0.1:9/acct")
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "pasted half==")
        return "az://cred-check-container/ds", "AZURE_STORAGE_ACCOUNT_KEY is not an account key: not base64"
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    return "s3://cred-check-bucket/ds", "AWS_PROFILE names the profile 'no-such-profile', which is in neither"


def point_environment_at(server: Any, *also: str) -> dict[str, str | None]:
    """Set the server's variables (``server.env()``: endpoint, credentials) in this process, as a cluster's
    nodes would have them; returns what they, and the variables named in ``also``, were before, for
    ``restore_environment``."""
    env = server.env()
    saved = {key: os.environ.get(key) for key in (*env, *also)}
    os.environ.update(env)
    return saved


def restore_environment(saved: dict[str, str | None]) -> None:
    """Put back the variables ``point_environment_at`` saved: each as it was, or unset if it was."""
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

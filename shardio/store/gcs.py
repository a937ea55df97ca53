"""``Storage`` on Google Cloud Storage (``gs://bucket/key``), through obstore's ``GCSStore``; everything
but the store's construction is shared (``shardio.store.object_store``).

Configuration is Google's own, read by obstore: a service account key file (``GOOGLE_APPLICATION_CREDENTIALS``
or ``GOOGLE_SERVICE_ACCOUNT_PATH``), its JSON in ``GOOGLE_SERVICE_ACCOUNT_KEY``, the application default
credentials of ``gcloud auth application-default login`` (``~/.config/gcloud/application_default_credentials.json``),
or, on Google Cloud machines, the instance's service account from the metadata server. A server other than
Google's (an emulator) is named by the key file's ``gcs_base_url``.

The commit's conditional writes: create-if-absent is ``x-goog-if-generation-match: 0`` and a conditional
replace names the object's generation (``x-goog-if-generation-match: GENERATION``), not its ETag.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from shardio.errors import StorageAccessError
from shardio.store.object_store import ObjectStorage, client_options, retry_config
from shardio.store.s3_errors import StoreSettings

__all__ = ["GCSStorage"]

_KEY_FILE_VARIABLES = ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_APPLICATION_CREDENTIALS")
_ADC_FILE = os.path.join("~", ".config", "gcloud", "application_default_credentials.json")


def _key() -> dict[str, Any]:
    """The service account key this process uses (from the environment), or {} (application default
    credentials, the metadata server)."""
    if os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        try:
            return json.loads(os.environ["GOOGLE_SERVICE_ACCOUNT_KEY"])
        except ValueError:
            return {}
    for name in _KEY_FILE_VARIABLES:
        if os.environ.get(name):
            try:
                with open(os.path.expanduser(os.environ[name])) as f:
                    return json.load(f)
            except (OSError, ValueError):
                return {}  # obstore says what is wrong with it, naming the file
    return {}


def _endpoint() -> str | None:
    """A server other than Google's, as the key file names it (``gcs_base_url``), else None."""
    return _key().get("gcs_base_url") or None


def _finds_no_credentials() -> bool:
    """No key, no application default credentials, and no metadata server to ask (not a Google Cloud
    machine): said at once rather than after obstore retries the metadata server for a minute."""
    if os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY") or any(os.environ.get(n) for n in _KEY_FILE_VARIABLES):
        return False
    if os.path.exists(os.path.expanduser(_ADC_FILE)):
        return False
    try:
        socket.getaddrinfo("metadata.google.internal", 80)
        return False
    except OSError:
        return True


class GCSStorage(ObjectStorage):
    """``Storage`` for ``gs://`` URLs. One instance serves every bucket."""

    scheme = "gs"
    # Non-secret settings given to a cluster's tasks: none are needed (a key file names a file on this
    # machine; each node has its own credentials). The key itself travels only with --pass-credentials.
    CARRIED_VARIABLES = ("GOOGLE_CLOUD_PROJECT",)
    CREDENTIAL_VARIABLES = ("GOOGLE_SERVICE_ACCOUNT_KEY",)

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import GCSStore

        if _finds_no_credentials():
            raise StorageAccessError(
                f"gs://{bucket}: no Google Cloud credentials on this machine ({socket.gethostname()}): no "
                "GOOGLE_APPLICATION_CREDENTIALS / GOOGLE_SERVICE_ACCOUNT_PATH key file, no "
                "GOOGLE_SERVICE_ACCOUNT_KEY, no application default credentials, no metadata server; HINT: run "
                "`gcloud auth application-default login` or point GOOGLE_APPLICATION_CREDENTIALS at a service "
                "account key file (on a Ray cluster, on every node)")
        return GCSStore(bucket, client_options=client_options(_endpoint()), retry_config=retry_config())

    def where(self) -> str:
        return _endpoint() or "Google Cloud Storage"

    def settings(self) -> StoreSettings:
        return StoreSettings(
            "Google Cloud Storage", "the key file's gcs_base_url", _endpoint(),
            "GOOGLE_APPLICATION_CREDENTIALS / GOOGLE_SERVICE_ACCOUNT_PATH or application default credentials",
            "gcloud storage buckets create gs://BUCKET")

    def _version(self, meta: dict[str, Any]) -> str:
        """The generation: GCS's conditional replace names it (``x-goog-if-generation-match``)."""
        return meta.get("version") or ""

    def _replace_mode(self, version: str) -> Any:
        return {"version": version}

"""``Storage`` on Azure Blob Storage (``az://container/key``, the account from the environment), through
obstore's ``AzureStore``; everything but the store's construction is shared (``shardio.store.object_store``).

Configuration is Azure's own, read by obstore: ``AZURE_STORAGE_ACCOUNT_NAME`` and one of an account key
(``AZURE_STORAGE_ACCOUNT_KEY``), a SAS token (``AZURE_STORAGE_SAS_TOKEN``), a service principal
(``AZURE_CLIENT_ID`` / ``AZURE_CLIENT_SECRET`` / ``AZURE_TENANT_ID``), workload identity
(``AZURE_FEDERATED_TOKEN_FILE``) or, on Azure machines, the managed identity. A server other than
``https://ACCOUNT.blob.core.windows.net`` (Azurite, a sovereign cloud) is ``AZURE_ENDPOINT``
(``http://HOST:PORT/ACCOUNT`` for Azurite), or ``AZURE_STORAGE_USE_EMULATOR=true`` with
``AZURITE_BLOB_STORAGE_URL``.

The commit's conditional writes: create-if-absent is ``If-None-Match: *``, a conditional replace
``If-Match: ETAG``.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from shardio.errors import StorageAccessError
from shardio.store.object_store import ObjectStorage, client_options, retry_config
from shardio.store.s3_errors import StoreSettings

__all__ = ["AzureStorage"]


def _endpoint() -> str | None:
    if os.environ.get("AZURE_ENDPOINT"):
        return os.environ["AZURE_ENDPOINT"]
    if os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true"):
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
        return f"{os.environ.get('AZURITE_BLOB_STORAGE_URL', 'http://127.0.0.1:10000').rstrip('/')}/{account}"
    return None


# Any of these names a credential obstore uses without asking a metadata service.
_CREDENTIAL_SOURCES = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_KEY",
                       "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_SAS_KEY", "AZURE_STORAGE_TOKEN",
                       "AZURE_CLIENT_SECRET", "AZURE_FEDERATED_TOKEN_FILE", "AZURE_SKIP_SIGNATURE",
                       "AZURE_STORAGE_USE_EMULATOR", "AZURE_USE_AZURE_CLI")
_IMDS = ("169.254.169.254", 80)  # the instance metadata service of an Azure machine (its managed identity)


def _finds_no_credentials() -> bool:
    """No key, SAS, token, secret or federated token in the environment, and no metadata service to ask
    for a managed identity: said at once rather than after obstore retries the metadata service."""
    if any(os.environ.get(name) for name in _CREDENTIAL_SOURCES):
        return False
    try:
        with socket.create_connection(_IMDS, timeout=1):
            return False
    except OSError:
        return True


class AzureStorage(ObjectStorage):
    """``Storage`` for ``az://`` URLs. One instance serves every container of the account."""

    scheme = "az"
    CARRIED_VARIABLES = ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_ENDPOINT", "AZURE_STORAGE_USE_EMULATOR",
                         "AZURITE_BLOB_STORAGE_URL", "AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_AUTHORITY_HOST")
    CREDENTIAL_VARIABLES = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_CLIENT_SECRET")

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import AzureStore

        if not os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") and not _endpoint():
            raise StorageAccessError(
                f"az://{bucket}: no Azure storage account named on this machine ({socket.gethostname()}); "
                "HINT: set AZURE_STORAGE_ACCOUNT_NAME and its credentials (AZURE_STORAGE_ACCOUNT_KEY, "
                "AZURE_STORAGE_SAS_TOKEN, or AZURE_CLIENT_ID / AZURE_CLIENT_SECRET / AZURE_TENANT_ID; on Azure "
                "machines the managed identity needs none)")
        if _finds_no_credentials():
            raise StorageAccessError(
                f"az://{bucket}: no Azure credentials on this machine ({socket.gethostname()}): no "
                "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, AZURE_CLIENT_SECRET or "
                "AZURE_FEDERATED_TOKEN_FILE, and no managed identity (no metadata service); HINT: set one (on a "
                "Ray cluster, on every node, or pass the driver's with `preprocess run --pass-credentials`); "
                "a public container reads with AZURE_SKIP_SIGNATURE=true")
        return AzureStore(bucket, client_options=client_options(_endpoint()), retry_config=retry_config())

    def where(self) -> str:
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "ACCOUNT")
        return _endpoint() or f"https://{account}.blob.core.windows.net"

    def settings(self) -> StoreSettings:
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "ACCOUNT")
        return StoreSettings(
            "Azure Blob Storage", "AZURE_ENDPOINT", _endpoint(),
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or "
            "AZURE_CLIENT_ID / AZURE_CLIENT_SECRET / AZURE_TENANT_ID",
            f"az storage container create --account-name {account} --name BUCKET"
            + (" --blob-endpoint ENDPOINT" if _endpoint() else ""))

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
from shardio.store.object_store import CLIENT_OPTIONS, RETRY_CONFIG, ObjectStorage
from shardio.store.s3_errors import StoreSettings

__all__ = ["AzureStorage"]


def _endpoint() -> str | None:
    if os.environ.get("AZURE_ENDPOINT"):
        return os.environ["AZURE_ENDPOINT"]
    if os.environ.get("AZURE_STORAGE_USE_EMULATOR", "").lower() in ("1", "true"):
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "devstoreaccount1")
        return f"{os.environ.get('AZURITE_BLOB_STORAGE_URL', 'http://127.0.0.1:10000').rstrip('/')}/{account}"
    return None


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
        client_options = dict(CLIENT_OPTIONS)
        endpoint = _endpoint()
        if endpoint and endpoint.startswith("http://"):
            client_options["allow_http"] = True
        return AzureStore(bucket, client_options=client_options, retry_config=RETRY_CONFIG)

    def where(self) -> str:
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "ACCOUNT")
        return _endpoint() or f"https://{account}.blob.core.windows.net"

    def settings(self) -> StoreSettings:
        account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "ACCOUNT")
        return StoreSettings(
            "Azure Blob Storage", "AZURE_ENDPOINT", _endpoint(),
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or "
            "AZURE_CLIENT_ID / AZURE_CLIENT_SECRET / AZURE_TENANT_ID",
            f"az storage container create --account-name {account} --name BUCKET")

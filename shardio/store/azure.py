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

import binascii
import os
import socket
from base64 import b64decode
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


_ACCOUNT_KEYS = ("AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ACCESS_KEY", "AZURE_STORAGE_KEY")


def _credential_problem() -> str | None:
    """What makes the Azure credentials in the environment unusable, naming the variable (never its value),
    or None. An account key is base64 (88 characters from the portal's "Access keys"); obstore would say only
    "Invalid Access Key: Invalid symbol 32, offset 3"."""
    for name in _ACCOUNT_KEYS:
        key = os.environ.get(name)
        if key:
            try:
                b64decode(key.strip(), validate=True)
            except (binascii.Error, ValueError):
                return (f"{name} is not an account key: not base64 ({len(key)} characters); HINT: copy "
                        "key1 or key2 from the storage account's Access keys "
                        "(`az storage account keys list`)")
    token_file = os.environ.get("AZURE_FEDERATED_TOKEN_FILE")
    if token_file and not os.path.isfile(token_file):
        return (f"AZURE_FEDERATED_TOKEN_FILE names {token_file!r}, which is not a file; HINT: point it at "
                "the workload identity's token file or unset it")
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
        if _finds_no_credentials():
            raise StorageAccessError(
                f"az://{bucket}: no Azure credentials on this machine ({socket.gethostname()}): no "
                "AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, AZURE_CLIENT_SECRET or "
                "AZURE_FEDERATED_TOKEN_FILE, and no managed identity (no metadata service); HINT: set one (on a "
                "Ray cluster, on every node, or pass the driver's with `preprocess run --pass-credentials`); "
                "a public container reads with AZURE_SKIP_SIGNATURE=true")
        problem = _credential_problem()
        if problem:
            raise StorageAccessError(f"az://{bucket}: unusable Azure credentials on this machine "
                                     f"({socket.gethostname()}): {problem}")
        return AzureStore(bucket, client_options=client_options(_endpoint()), retry_config=retry_config())

    def credential_sources(self) -> list[str]:
        return [f"{name}={os.environ[name]}" if name == "AZURE_FEDERATED_TOKEN_FILE" else name
                for name in _CREDENTIAL_SOURCES if os.environ.get(name)]

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

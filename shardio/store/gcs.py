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
    credentials, the metadata server). Unusable keys are {} here: ``_key_problem`` says what is wrong."""
    if os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        try:
            found = json.loads(os.environ["GOOGLE_SERVICE_ACCOUNT_KEY"])
        except ValueError:
            return {}
        return found if isinstance(found, dict) else {}
    for name in _KEY_FILE_VARIABLES:
        if os.environ.get(name):
            try:
                with open(os.path.expanduser(os.environ[name])) as f:
                    found = json.load(f)
            except (OSError, ValueError):
                return {}
            return found if isinstance(found, dict) else {}
    return {}


# What application default credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud's file) may be: obstore reads
# no other "type" (an external account, an impersonated service account).
_ADC_TYPES = ("service_account", "authorized_user")


def _json_problem(text: str, adc: bool) -> str | None:
    """What is wrong with a key's JSON (None: nothing this side can tell; obstore checks the fields)."""
    if not text.strip():
        return "is empty"
    try:
        found = json.loads(text)
    except ValueError as e:
        return f"is not JSON ({e})"
    if not isinstance(found, dict):
        return f"is JSON but not an object (a {type(found).__name__})"
    if adc and found.get("type") not in _ADC_TYPES:
        said = f'"type" is {found["type"]!r}' if "type" in found else 'has no "type" field'
        return f'{said}: expected "service_account" (a key file) or "authorized_user" (gcloud\'s login)'
    return None


def _file_problem(path: str, adc: bool) -> str | None:
    """What is wrong with the key file at ``path``, in words, or None."""
    full = os.path.expanduser(path)
    if os.path.isdir(full):
        return "is a directory, not a key file"
    try:
        with open(full, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return "does not exist"
    except UnicodeDecodeError:
        return "is not JSON (binary: a .p12 key? download the key as JSON)"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return _json_problem(text, adc)


def _key_problem() -> str | None:
    """What makes this machine's Google credentials unusable, naming the variable and the file, or None.
    obstore reads them all when a store is made (a service account key, and application default
    credentials even beside one) and would say only "Unable to decode service account file"."""
    for name in (*_KEY_FILE_VARIABLES, "GOOGLE_SERVICE_ACCOUNT_KEY"):
        # obstore takes "" as a key to decode, or as a file named "".
        if name in os.environ and not os.environ[name].strip():
            return f"{name} is set but empty; HINT: unset it, or set it to a service account key"
    key_files = [n for n in ("GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH") if os.environ.get(n)]
    if key_files and os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        return (f"both {key_files[0]} (a key file) and GOOGLE_SERVICE_ACCOUNT_KEY (a key's JSON) are set; "
                "HINT: unset one of them")
    for name in key_files:
        problem = _file_problem(os.environ[name], adc=False)
        if problem:
            return f"{name} names the key file {os.environ[name]!r}, which {problem}"
    if os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        problem = _json_problem(os.environ["GOOGLE_SERVICE_ACCOUNT_KEY"], adc=False)
        if problem:
            return f"GOOGLE_SERVICE_ACCOUNT_KEY (a key's JSON) {problem}"
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        path = os.environ["GOOGLE_APPLICATION_CREDENTIALS"]
        problem = _file_problem(path, adc=True)
        if problem:
            return f"GOOGLE_APPLICATION_CREDENTIALS names the credentials file {path!r}, which {problem}"
    elif os.path.isfile(os.path.expanduser(_ADC_FILE)):
        problem = _file_problem(_ADC_FILE, adc=True)
        if problem:
            return (f"the application default credentials {os.path.expanduser(_ADC_FILE)!r} {problem}; HINT: "
                    "run `gcloud auth application-default login` again")
    return None


def _credential_sources() -> list[str]:
    """The credentials this machine configures, named (never a secret's value)."""
    named = [f"{n}={os.environ[n]}" for n in _KEY_FILE_VARIABLES if os.environ.get(n)]
    if os.environ.get("GOOGLE_SERVICE_ACCOUNT_KEY"):
        named.append("GOOGLE_SERVICE_ACCOUNT_KEY (a key's JSON)")
    if not os.environ.get("GOOGLE_APPLICATION_CREDENTIALS") and os.path.isfile(os.path.expanduser(_ADC_FILE)):
        named.append(os.path.expanduser(_ADC_FILE))
    return named


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

        problem = _key_problem()
        if problem:
            hint = "" if "HINT:" in problem else (
                "; HINT: point it at a service account key file (JSON, from the Cloud console or `gcloud iam "
                "service-accounts keys create`) or unset it")
            raise StorageAccessError(f"gs://{bucket}: unusable Google Cloud credentials on this machine "
                                     f"({socket.gethostname()}): {problem}{hint}")
        if _finds_no_credentials():
            raise StorageAccessError(
                f"gs://{bucket}: no Google Cloud credentials on this machine ({socket.gethostname()}): no "
                "GOOGLE_APPLICATION_CREDENTIALS / GOOGLE_SERVICE_ACCOUNT_PATH key file, no "
                "GOOGLE_SERVICE_ACCOUNT_KEY, no application default credentials, no metadata server; HINT: run "
                "`gcloud auth application-default login` or point GOOGLE_APPLICATION_CREDENTIALS at a service "
                "account key file (on a Ray cluster, on every node)")
        return GCSStore(bucket, client_options=client_options(_endpoint()), retry_config=retry_config())

    def credential_sources(self) -> list[str]:
        return _credential_sources()

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

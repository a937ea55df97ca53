"""``Storage`` on S3-compatible object storage (``s3://bucket/key``), through obstore.

Created when the first ``s3://`` path is opened (``shardio.store.backends.for_path``), which imports
obstore: a training image without the ``s3`` extra still imports ``shardio``. obstore was chosen over
fsspec/s3fs because the commit protocol needs
conditional writes (put-if-absent, If-Match) as first-class calls, and because it is faster on the
same server (``bench/README.md``, "Object storage"). Works against AWS S3, MinIO, Cloudflare R2 and
SeaweedFS; the tests run it against SeaweedFS.

Configuration is the standard AWS one, nothing of ours: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_SESSION_TOKEN``, ``AWS_REGION`` (or ``AWS_DEFAULT_REGION``), ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for a non-AWS server, and profiles (``AWS_PROFILE``, ``~/.aws/config``,
``~/.aws/credentials``, SSO, instance roles), which boto3 resolves when no key is in the environment.

How the directory protocol's guarantees map onto object storage, the requests, retries and errors: the
shared ``shardio.store.object_store``; S3 names the version of a conditional replace by its ETag.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from shardio.errors import StorageAccessError
from shardio.store.object_store import ObjectStorage, client_options, retry_config, split_url
from shardio.store.s3_errors import StoreSettings

__all__ = ["CARRIED_VARIABLES", "CREDENTIAL_VARIABLES", "S3Storage", "carried_settings", "driver_credentials",
           "split_url"]


def _endpoint() -> str | None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name]
    return None


def _store_options() -> dict[str, Any]:
    """obstore's S3Store keyword arguments from the standard AWS environment and config files."""
    options: dict[str, Any] = {"retry_config": retry_config()}
    endpoint = _endpoint()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if not os.environ.get("AWS_ACCESS_KEY_ID"):
        # No key in the environment: profiles, SSO, instance roles, as the AWS CLI resolves them.
        try:
            import boto3
        except ImportError:
            boto3 = None
        if boto3 is not None:
            from botocore.exceptions import BotoCoreError

            try:
                session = boto3.Session()
                if session.get_credentials() is not None:
                    from obstore.auth.boto3 import Boto3CredentialProvider

                    options["credential_provider"] = Boto3CredentialProvider(session)
                region = region or session.region_name
                scoped = session._session.get_scoped_config()  # the profile's section of ~/.aws/config
            except BotoCoreError as e:
                raise StorageAccessError(f"unusable AWS configuration on this machine "
                                         f"({socket.gethostname()}): {_profile_problem(e)}") from None
            endpoint = endpoint or (scoped.get("s3") or {}).get("endpoint_url") or scoped.get("endpoint_url")
    options["client_options"] = client_options(endpoint)
    if endpoint:
        options["endpoint"] = endpoint
        # Non-AWS servers (MinIO, SeaweedFS, R2) address buckets by path, not by virtual host.
        options["virtual_hosted_style_request"] = False
    if region:
        options["region"] = region
    if _unsigned_payload_by_default(endpoint):
        options["unsigned_payload"] = True
    return options


def _unsigned_payload_by_default(endpoint: str | None) -> bool:
    """Whether uploads go with ``UNSIGNED-PAYLOAD``, as the AWS SDKs send them, where nothing says otherwise:
    over HTTPS (AWS itself, or an ``https://`` endpoint) TLS already guards the body, and signing it costs a
    SHA-256 pass over every byte written (the largest single cost uploads add to a job's worker). Over plain
    HTTP the payload stays signed, as the SDKs sign it. ``AWS_UNSIGNED_PAYLOAD`` set either way wins (obstore
    reads it)."""
    if os.environ.get("AWS_UNSIGNED_PAYLOAD"):
        return False
    return endpoint is None or endpoint.lower().startswith("https://")


def _profile_problem(error: Exception) -> str:
    """What boto3 could not use in the AWS configuration (a profile, a config file), naming it."""
    from botocore.exceptions import ConfigParseError, ProfileNotFound

    config = os.environ.get("AWS_CONFIG_FILE", "~/.aws/config")
    credentials = os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    if isinstance(error, ProfileNotFound):
        profile = os.environ.get("AWS_PROFILE", os.environ.get("AWS_DEFAULT_PROFILE"))
        variable = "AWS_PROFILE" if "AWS_PROFILE" in os.environ else "AWS_DEFAULT_PROFILE"
        if not profile:
            return (f"{variable} is set but empty; HINT: unset it or name a profile "
                    "(`aws configure list-profiles`)")
        return (f"{variable} names the profile {profile!r}, which is in neither {config} nor {credentials}; "
                "HINT: name one that is (`aws configure list-profiles`), or create it "
                "(`aws configure --profile NAME`)")
    if isinstance(error, ConfigParseError):
        return f"{error} (not an AWS config file: [profile NAME] sections of key = value lines)"
    return (f"{error} (from AWS_PROFILE, {config} and {credentials}); HINT: fix it there, or set "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")


def _key_pair_problem() -> str | None:
    """Half a key in the environment (obstore would say "Missing SecretAccessKey"), or None."""
    has_id = bool(os.environ.get("AWS_ACCESS_KEY_ID"))
    has_secret = bool(os.environ.get("AWS_SECRET_ACCESS_KEY"))
    if has_id == has_secret:
        return None
    given, missing = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")[:: 1 if has_id else -1]
    return f"{given} is set but {missing} is not; HINT: set both, or unset {given} to use a profile or a role"


# What a process on another machine needs to reach the same store as this one, none of it secret: the
# endpoint, the region and obstore's S3 options (addressing style, plain http, ...). Never a key, a secret
# or a token, nor AWS_PROFILE / AWS_CONFIG_FILE (they name files on this machine).
CARRIED_VARIABLES = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION",
                     "AWS_ALLOW_HTTP", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_S3_EXPRESS",
                     "AWS_UNSIGNED_PAYLOAD", "AWS_SKIP_SIGNATURE", "AWS_CHECKSUM_ALGORITHM", "AWS_REQUEST_PAYER")
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def carried_settings() -> dict[str, str]:
    """This process's non-secret S3 settings as environment variables (``CARRIED_VARIABLES``), a profile's
    endpoint and region included: what a Ray task on another node is given so that it reaches the same
    server in the same region (``preprocess.cluster.cluster_access``)."""
    settings = {name: os.environ[name] for name in CARRIED_VARIABLES if os.environ.get(name)}
    options = _store_options()  # resolves a profile's endpoint and region too
    if options.get("endpoint") and not _endpoint():
        settings["AWS_ENDPOINT_URL"] = options["endpoint"]
    if options.get("region"):
        settings.setdefault("AWS_REGION", options["region"])
    return settings


def driver_credentials() -> dict[str, str]:
    """This process's credentials as environment variables (the environment's, else what a profile, SSO
    or an instance role resolves to now: temporary ones expire). Only for ``--pass-credentials``."""
    found = {name: os.environ[name] for name in CREDENTIAL_VARIABLES if os.environ.get(name)}
    if "AWS_ACCESS_KEY_ID" in found:
        return found
    try:
        import boto3
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return {}
    try:
        credentials = boto3.Session().get_credentials()
    except BotoCoreError as e:
        raise StorageAccessError(f"unusable AWS configuration on this machine ({socket.gethostname()}): "
                                 f"{_profile_problem(e)}") from None
    if credentials is None:
        return {}
    frozen = credentials.get_frozen_credentials()
    found = {"AWS_ACCESS_KEY_ID": frozen.access_key, "AWS_SECRET_ACCESS_KEY": frozen.secret_key}
    if frozen.token:
        found["AWS_SESSION_TOKEN"] = frozen.token
    return found


def _finds_no_credentials(options: dict[str, Any]) -> bool:
    """Whether this machine has no credentials at all, as boto3 resolves them (environment, profiles,
    SSO, container and instance roles; it gives the instance metadata service 1 s). Said at once: obstore
    would ask the metadata service again and, off EC2, retry its connect timeouts for a minute."""
    if os.environ.get("AWS_ACCESS_KEY_ID") or "credential_provider" in options:
        return False
    if os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true"):
        return False
    try:
        import boto3  # noqa: F401 - without it this cannot be told: obstore tries by itself
    except ImportError:
        return False
    return True  # _store_options asked boto3 already, and it found none


# Where the region probe goes: AWS's global endpoint (None); the tests point it at a fake server.
_AWS_PROBE_ENDPOINT: str | None = None


def _aws_bucket_region(bucket: str) -> str | None:
    """The AWS region ``bucket`` lives in, or None if that cannot be told (the request itself then says
    what is wrong). AWS answers a request signed for another region with a redirect or a 400 that obstore
    does not follow, and a bucket is often in another region than the profile's (public datasets in
    us-east-1): boto3 finds the bucket's region by itself, and so does this, with one anonymous HEAD of the
    bucket, whose ``x-amz-bucket-region`` header AWS sends even when it refuses the request."""
    try:
        import boto3
        import botocore
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return None
    config = Config(signature_version=botocore.UNSIGNED, connect_timeout=5, read_timeout=10,
                    retries={"max_attempts": 2})
    try:
        client = boto3.session.Session().client("s3", region_name="us-east-1",
                                                endpoint_url=_AWS_PROBE_ENDPOINT, config=config)
        headers = client.head_bucket(Bucket=bucket)["ResponseMetadata"]["HTTPHeaders"]
    except ClientError as exc:
        headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    except (BotoCoreError, ValueError):
        return None
    return headers.get("x-amz-bucket-region") or None


class S3Storage(ObjectStorage):
    """``Storage`` for ``s3://`` URLs (``shardio.store.object_store``). One instance serves every bucket."""

    scheme = "s3"
    CARRIED_VARIABLES = CARRIED_VARIABLES
    CREDENTIAL_VARIABLES = CREDENTIAL_VARIABLES

    def _new_store(self, bucket: str) -> Any:
        from obstore.store import S3Store

        problem = _key_pair_problem()
        if problem:
            raise StorageAccessError(f"s3://{bucket}: unusable AWS credentials on this machine "
                                     f"({socket.gethostname()}): {problem}")
        try:
            options = dict(_store_options())
        except StorageAccessError as e:
            raise StorageAccessError(f"s3://{bucket}: {e}") from None
        if _finds_no_credentials(options):
            raise StorageAccessError(
                f"s3://{bucket}: no S3 credentials on this machine ({socket.gethostname()}): no "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, no profile in ~/.aws, no instance or "
                "container role; HINT: set them (on a Ray cluster, on every node, or pass the driver's "
                "with `preprocess run --pass-credentials`); a public bucket reads with "
                "AWS_SKIP_SIGNATURE=true")
        # AWS itself: the bucket's own region, as boto3 finds it (else the configured one).
        region = None if "endpoint" in options else _aws_bucket_region(bucket)
        if region:
            options["region"] = region
        return S3Store(bucket, **options)

    def where(self) -> str:
        return _endpoint() or "AWS S3"

    def settings(self) -> StoreSettings:
        endpoint = _endpoint()
        create = "aws s3 mb s3://BUCKET" + (" --endpoint-url ENDPOINT" if endpoint else "")
        return StoreSettings("AWS S3", "AWS_ENDPOINT_URL", endpoint,
                             "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE", create)

    def carried_settings(self) -> dict[str, str]:
        return carried_settings()

    def driver_credentials(self) -> dict[str, str]:
        return driver_credentials()

"""An object-store request that failed, said in one line a user can act on: the URL, the endpoint the
request went to, what came back (HTTP status, the server's error code) or the network error underneath
(DNS, connection refused, timeout, TLS), and the most likely fix.

Why parse text: obstore raises one Python exception per failure with no ``__cause__``; everything it
knows is in the message, a Rust ``Display`` line (``Error performing HEAD http://host/b/k ... - Server
returned non-2xx status code: 403 Forbidden: BODY``) followed by a ``Debug source:`` dump of the error
chain (``ConnectError("dns error", Custom { error: "failed to lookup address information ..." })``).
Its first words alone ("Generic S3 error") say nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from shardio.errors import StorageAccessError, StorageUnavailable

__all__ = ["RequestFailure", "StoreSettings", "explain", "parse", "refused_access"]


@dataclass(frozen=True)
class StoreSettings:
    """How the user configured a backend, for the hints: its name, the variable naming a custom
    endpoint and its value (None: the provider's own), where credentials come from, and how to create a
    bucket (or container)."""

    name: str  # "S3", "GCS", "Azure"
    endpoint_variable: str  # "AWS_ENDPOINT_URL"
    endpoint: str | None
    credentials: str  # "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE"
    create_bucket: str  # a command, with BUCKET and ENDPOINT to fill in


@dataclass(frozen=True)
class RequestFailure:
    """The parts of one obstore error (``parse``); any may be missing."""

    method: str | None = None
    request_url: str | None = None
    status: int | None = None
    status_text: str = ""
    code: str | None = None  # the server's error code: <Code>NoSuchBucket</Code>, JSON "code"
    network: str | None = None  # "dns error: failed to lookup address information: ..."
    first_line: str = ""

    @property
    def endpoint(self) -> str | None:
        """``scheme://host[:port]`` the request went to."""
        if not self.request_url:
            return None
        parts = urlsplit(self.request_url)
        return f"{parts.scheme}://{parts.netloc}"

    def cause(self) -> str:
        if self.status is not None:
            text = f"HTTP {self.status} {self.status_text}".rstrip()
            return f"{text} ({self.code})" if self.code else text
        if self.network:
            return f"network error: {self.network}"
        return self.first_line


_PERFORMING = re.compile(r"Error performing ([A-Z]+) (\w+://[^\s,]+)")
_STATUS = re.compile(r"status code: (\d{3})([A-Za-z ]*)")
_DEBUG_STATUS = re.compile(r"status: (\d{3}),")
# A JSON answer's "code" only when it is a name (GCS's JSON errors carry the HTTP status there as a number).
# An OAuth token service's answer names its error in "error" (``invalid_grant``, ``invalid_client``).
_CODES = (re.compile(r"<Code>([^<]+)</Code>"), re.compile(r'"code"\s*:\s*"?([A-Za-z][A-Za-z0-9_.]*)'),
          re.compile(r'"error"\s*:\s*"([a-z_]+)"'))
# obstore's words when the request that failed was the one fetching a token for the credentials (OAuth,
# a metadata service), not the store's own: "Error performing token request: ..." (Azure, GCS).
_TOKEN_REQUEST = re.compile(r"token request|TokenRequest", re.IGNORECASE)
_CONNECT = re.compile(r'ConnectError\(\s*"([^"]+)"')
_DETAILS = (re.compile(r'message: "([^"]+)"'), re.compile(r'error: "([^"]+)"'))
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")


def parse(error: BaseException) -> RequestFailure:
    """The request, status, server code and network error named in an obstore exception's text."""
    text = str(error)
    shown = text.split("\n\nDebug source:", 1)[0]
    performing = _PERFORMING.search(text)
    status = _STATUS.search(shown) or _DEBUG_STATUS.search(text)
    code = next((m.group(1) for m in (c.search(text) for c in _CODES) if m), None)
    network = None
    if status is None:
        kind = _HTTP_KIND.search(text)
        connect = _CONNECT.search(text)
        detail = next((m.group(1) for m in (d.search(text) for d in _DETAILS) if m), None)
        parts = [p for p in (connect.group(1) if connect else None, detail) if p]
        if not parts and kind:
            parts = [f"{kind.group(1).lower()} error" + (": timed out" if kind.group(1) == "Timeout" else "")]
        if not parts and " - " in shown:
            parts = [shown.rsplit(" - ", 1)[1].strip()]
        network = ": ".join(parts) or None
    return RequestFailure(
        method=performing.group(1) if performing else None,
        request_url=performing.group(2) if performing else None,
        status=int(status.group(1)) if status else None,
        status_text=(status.group(2).strip() if status and status.re is _STATUS else ""),
        code=code,
        network=network,
        first_line=shown.split("\n", 1)[0][:300],
    )


_REGION_CODES = ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException",
                 "IncorrectEndpoint")
_CREDENTIAL_CODES = ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "InvalidToken",
                     "ExpiredToken", "AuthenticationFailed", "AuthorizationFailure")
_MISSING_BUCKET_CODES = ("NoSuchBucket", "ContainerNotFound")


def refused_access(failure: RequestFailure) -> bool:
    """Whether the server refused the credentials or named a missing bucket (not the request's form)."""
    return (failure.code or "") in (*_CREDENTIAL_CODES, *_MISSING_BUCKET_CODES) or failure.status in (401, 403)


def explain(url: str, doing: str, error: BaseException, settings: StoreSettings,
            bucket: str) -> StorageAccessError | StorageUnavailable:
    """The exception to raise for ``error`` (obstore's), met while ``doing`` (``"HEAD"``) on ``url``:
    ``StorageAccessError`` (exit 2: no retry helps) for refused credentials, a missing bucket, a wrong
    region; ``StorageUnavailable`` for the rest (network, 5xx: obstore retried them already)."""
    failure = parse(error)
    endpoint = failure.endpoint or settings.endpoint or settings.name
    if settings.endpoint and failure.endpoint and not settings.endpoint.startswith(failure.endpoint):
        where = f"{endpoint} (not the store: a credential service)"  # a token request failed (IMDS, OAuth)
    elif settings.endpoint:
        where = f"{endpoint} ({settings.endpoint_variable})"
    else:
        where = f"{endpoint} ({settings.name} itself: no {settings.endpoint_variable} is set)"
    head = f"{url}: {doing} "
    cause = failure.cause()
    other_server = (f"if the bucket is on another server (MinIO, SeaweedFS, R2, an emulator), set "
                    f"{settings.endpoint_variable}=http(s)://HOST:PORT") if not settings.endpoint else ""
    status, code = failure.status, failure.code or ""
    if _TOKEN_REQUEST.search(str(error)) and status is not None and 400 <= status < 500:
        # The credential service refused the credentials themselves (a wrong secret, tenant, refresh token):
        # no retry and no other endpoint helps.
        return StorageAccessError(f"{head}refused by {endpoint} (not the store: a credential service): "
                                  f"{cause}; HINT: check the credentials ({settings.credentials}) on this machine")
    if code in _MISSING_BUCKET_CODES:
        # The endpoint as configured, path and all (Azurite's names the account: http://HOST:PORT/ACCOUNT): the
        # command must create the bucket where the store looked, not on the cloud itself.
        server = settings.endpoint or endpoint
        if settings.endpoint and where == f"{endpoint} ({settings.endpoint_variable})":
            where = f"{settings.endpoint} ({settings.endpoint_variable})"
        create = settings.create_bucket.replace("BUCKET", bucket).replace("ENDPOINT", server)
        return StorageAccessError(f"{head}failed at {where}: {cause}: bucket {bucket!r} does not exist there; "
                                  f"HINT: create it first (shardio never creates buckets), e.g. `{create}`"
                                  + (f"; or {other_server}" if other_server else ""))
    if status in (401, 403) or code in _CREDENTIAL_CODES:
        fixes = [f"check the credentials ({settings.credentials}) on this machine and the bucket's policy"]
        if other_server:
            fixes.insert(0, other_server)
        return StorageAccessError(f"{head}refused by {where}: {cause}; HINT: " + "; or ".join(fixes))
    if code in _REGION_CODES or status == 301:
        return StorageAccessError(f"{head}refused by {where}: {cause}; HINT: the bucket is in another region: "
                                  "set AWS_REGION to the bucket's region")
    if status is not None and status >= 500:
        return StorageUnavailable(f"{head}failed at {where} after retries: {cause}; HINT: the server kept "
                                  "failing for a minute: check its health and logs, then rerun")
    if failure.network is not None:
        if "certificate" in failure.network.lower() or "tls" in failure.network.lower():
            fix = (f"check https vs http in {settings.endpoint_variable} and that this machine trusts the "
                   "server's certificate")
        elif settings.endpoint:
            fix = (f"nothing answered at {endpoint}: check {settings.endpoint_variable} (host, port, http vs "
                   "https) and that the server is running and reachable from this machine")
        else:
            fix = f"{other_server}; else check this machine's network, DNS and proxy"
        return StorageUnavailable(f"{head}failed at {where} after retries: {cause}; HINT: {fix}")
    if status is not None and not code:
        # An answer with no S3/Azure/GCS error in it: the endpoint is some other HTTP server (a console,
        # another service's port).
        return StorageUnavailable(f"{head}failed at {where}: {cause}, with no {settings.name} error in the "
                                  f"answer; HINT: check that {endpoint} is the {settings.name} API's address "
                                  f"({settings.endpoint_variable}), not another service's port")
    return StorageUnavailable(f"{head}failed at {where} after retries: {cause}"
                              + (f"; HINT: {other_server}" if other_server else ""))

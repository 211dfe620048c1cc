"""One S3 session: the aiobotocore client of a bucket and prefix, keys made full,
and S3's answers sorted into permanent burstfs errors and temporary failures.

Split from :mod:`burstfs.remote.s3` so that the object operations there read as
what they send and check, not how a request is made or classified.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import botocore.exceptions
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from ..config import RemoteURL, S3Options, redact_url
from ..errors import RemoteError, RemoteNotFound

#: S3's longest key, in UTF-8 bytes (the prefix included).
MAX_KEY_BYTES = 1024
#: Error codes that concern one object (its key, its size, one argument): that file
#: fails, the drain goes on (see burstfs.errors.error_scope).
_OBJECT_CODES = {
    "KeyTooLongError": "key_too_long",
    "InvalidArgument": "invalid_argument",
    "InvalidObjectName": "bad_key",
    "EntityTooLarge": "too_large",
}
#: Error codes S3 uses for throttling and transient trouble.  BadDigest means the
#: bytes changed in flight (we computed the checksum over what we sent), so a
#: resend is the right answer too.
_TEMP_CODES = frozenset(
    {
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "InternalError",
        "ServiceUnavailable",
        "BadDigest",
    }
)
_TEMP_STATUS = frozenset({500, 502, 503, 504})
#: Of those, the codes that say "too many requests": the store answers, and asks us to slow down.
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"})
_TEMP_EXCEPTIONS: tuple[type[BaseException], ...] = (
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ResponseStreamingError,
    botocore.exceptions.IncompleteReadError,  # a body shorter than its Content-Length (a dropped connection)
    aiohttp.ClientError,
    TimeoutError,
    ConnectionError,
)
_DENIED_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled", "ExpiredToken", "InvalidToken"}
)


class ChecksumMismatch(Exception):
    """The store reported a checksum (or MD5 ETag) other than the one of the bytes we sent:
    it did not store them intact.  Temporary: the request is sent again."""


def error_code(exc: botocore.exceptions.ClientError) -> tuple[str, int]:
    """S3's error code and HTTP status of a refused request."""
    error = exc.response.get("Error", {})
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return str(error.get("Code", "")), int(status)


def is_temp_failure(exc: BaseException) -> bool:
    """Whether sending the request again may succeed (throttling, a dropped connection, ...)."""
    if isinstance(exc, botocore.exceptions.ClientError):
        code, status = error_code(exc)
        return status in _TEMP_STATUS or code in _TEMP_CODES
    return isinstance(exc, (*_TEMP_EXCEPTIONS, ChecksumMismatch))


def is_throttling(exc: BaseException) -> bool:
    """Whether the store refused ``exc``'s request for its rate (503 SlowDown and the like)."""
    return isinstance(exc, botocore.exceptions.ClientError) and error_code(exc)[0] in _THROTTLE_CODES


#: The slowest a request body may go up before the request is given up (see S3Session.call).
MIN_SEND_RATE = 1 << 20


class S3Session:
    """``s3://bucket/prefix`` through one aiobotocore client, created on first use."""

    def __init__(
        self,
        url: RemoteURL,
        options: S3Options,
        *,
        max_connections: int,
        connect_timeout: float,
        read_timeout: float,
    ) -> None:
        self.url = url
        self.options = options
        self.read_timeout = read_timeout
        self.endpoint_url = options.endpoint()
        self.bucket = url.bucket
        self.prefix = f"{url.prefix}/" if url.prefix else ""
        self._config = AioConfig(
            retries={"mode": "standard", "total_max_attempts": 1},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max_connections,
            # No SHA-256 of every body for the signature (botocore's default on plain HTTP; on
            # HTTPS with a checksum it skips it too): each body carries its CRC32C, a signed
            # header the store checks, and the hash cost ~1.4 s of the mover's loop per GiB.
            s3={"addressing_style": "path" if options.path_style else "virtual", "payload_signing_enabled": False},
            # We send CRC32C ourselves where it matters and verify reads with xxh3;
            # botocore's default CRC32 would be extra work on the event loop, and
            # some S3-compatible stores reject its trailing checksums.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            # The endpoint is resolved once, by S3Options.endpoint (botocore's lookup): the
            # client goes nowhere else, so that the store the cache records is the one it uses.
            ignore_configured_endpoint_urls=True,
        )
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._client_lock = asyncio.Lock()

    def full(self, key: str) -> str:
        """The bucket key of a remote-relative ``key`` (RemoteError if S3 would refuse its length)."""
        full = self.prefix + key
        if len(full.encode()) > MAX_KEY_BYTES:
            raise RemoteError(
                f"{self.url}: key {key[:80]!r}... is longer than S3's {MAX_KEY_BYTES} bytes", kind="key_too_long"
            )
        return full

    def rel(self, full_key: str) -> str:
        return full_key[len(self.prefix) :]

    def where(self) -> str:
        return f"{self.url} (endpoint {redact_url(self.endpoint_url) if self.endpoint_url else 'AWS default'})"

    async def client(self) -> Any:
        async with self._client_lock:
            if self._client is None:
                self._client = await self._stack.enter_async_context(
                    get_session().create_client(
                        "s3", region_name=self.options.region, endpoint_url=self.endpoint_url, config=self._config
                    )
                )
            return self._client

    def map_error(self, exc: Exception, what: str) -> Exception | None:
        """The burstfs error for a permanent failure, or None to let ``exc`` (temporary) through."""
        if isinstance(exc, botocore.exceptions.NoCredentialsError):
            return RemoteError(
                f"{self.where()}: no AWS credentials found (environment, ~/.aws, role)", kind="no_credentials"
            )
        if not isinstance(exc, botocore.exceptions.ClientError) or is_temp_failure(exc):
            return None
        code, status = error_code(exc)
        if code == "NoSuchBucket":
            return RemoteError(f"{self.where()}: bucket {self.bucket!r} does not exist", kind="no_bucket")
        if code == "NoSuchUpload":
            return RemoteNotFound(f"{self.url}: {what}: no such multipart upload")
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return RemoteNotFound(f"{self.url}: {what}: not found ({code})")
        if code == "InvalidRange":
            return RemoteError(f"{self.url}: {what}: range not satisfiable", kind="invalid_range")
        if code in _OBJECT_CODES:
            message = exc.response.get("Error", {}).get("Message", "")
            return RemoteError(f"{self.url}: {what}: {code}: {message}", kind=_OBJECT_CODES[code])
        if code in _DENIED_CODES or status == 403:
            return RemoteError(f"{self.where()}: {what}: access denied ({code or status})", kind="access_denied")
        message = exc.response.get("Error", {}).get("Message", "")
        return RemoteError(f"{self.url}: {what}: {code or status}: {message}", kind="remote")

    async def call(self, op: str, what: str, **params: Any) -> Any:
        """One S3 request with errors mapped; temporary failures propagate unchanged."""
        client = await self.client()
        try:
            return await getattr(client, op)(Bucket=self.bucket, **params)
        except Exception as exc:
            mapped = self.map_error(exc, what)
            if mapped is None:
                raise
            raise mapped from exc

    async def send(self, op: str, what: str, size: int, **params: Any) -> Any:
        """:meth:`call` for a request that sends a body of ``size`` bytes: given up
        (``TimeoutError``, retried on a new connection like any temporary failure) after
        :meth:`send_deadline`.  The read timeout covers only the wait for an answer, and
        a server that accepts a connection and reads nothing (a black hole that lost its
        state) stalls the send of a body larger than the socket's buffers for good."""
        async with asyncio.timeout(self.send_deadline(size)):
            return await self.call(op, what, **params)

    def send_deadline(self, size: int) -> float:
        """Seconds a request sending ``size`` bytes of body may take in all (see :meth:`send`)."""
        return self.read_timeout + size / MIN_SEND_RATE

    async def read_body(self, response: dict[str, Any]) -> bytes:
        async with response["Body"] as stream:
            data: bytes = await stream.read()
            return data

    async def denial_detail(self, denied: RemoteError) -> RemoteError:
        """A HEAD has no body, so a 403 on head_bucket loses S3's error code: ask once more
        with a request that returns one (a one-key listing) and keep its code and message
        (InvalidAccessKeyId, SignatureDoesNotMatch, ...).  Only Code and Message are kept:
        S3 echoes the access key id and the string to sign in other fields."""
        client = await self.client()
        try:
            await client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
        except botocore.exceptions.ClientError as exc:
            code, status = error_code(exc)
            if code in _DENIED_CODES or status == 403:
                message = " ".join(str(exc.response.get("Error", {}).get("Message", "")).split())[:300]
                detail = f"{code}: {message}" if message else code
                return RemoteError(f"{self.where()}: check: access denied ({detail})", kind="access_denied")
        except Exception:  # noqa: S110 (the HEAD's denial is the answer; this only adds detail)
            pass
        return denied

    async def close(self) -> None:
        async with self._client_lock:
            await self._stack.aclose()
            self._client = None

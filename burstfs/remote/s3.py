"""S3 (and S3-compatible stores) as a remote, through aiobotocore.

Credentials come from the standard AWS chain (environment, shared files,
instance/container roles) and are never logged.  botocore's own retries are
off: :mod:`burstfs.remote.retry` owns retrying, so a throttled store is waited
for once, with one log line per retry.  Every PUT and uploaded part carries a
CRC32C the server verifies, computed here (package ``crc32c``) rather than by
botocore, which would need ``awscrt`` and run on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import botocore.exceptions
import crc32c

from ..config import RemoteURL, S3Options
from ..errors import RemoteError, RemoteNotFound
from .base import INTERNAL_DIR, ObjectInfo, Remote, UploadedPart
from .pool import run_workers
from .retry import RetryPolicy
from .s3client import ChecksumMismatch, S3Session, error_code, is_temp_failure, is_throttling

log = logging.getLogger("burstfs.remote")

#: S3 refuses single-request copies above 5 GiB; larger objects are copied in parts.
COPY_MAX_SINGLE = 5 * 1024**3
#: Part size for a multipart copy (server-side, so large parts cost nothing locally).
COPY_PART_SIZE = 512 * 1024**2
#: Server-side part copies in flight during one multipart copy.
COPY_CONCURRENCY = 8
#: Below this size a CRC32C is computed inline; above, in a thread (the C code releases the GIL).
_INLINE_CRC_BYTES = 256 * 1024


def crc32c_b64(data: bytes) -> str:
    """The CRC32C of ``data`` as S3 expects it in ``x-amz-checksum-crc32c``."""
    return base64.b64encode(crc32c.crc32c(data).to_bytes(4, "big")).decode()


async def _checksum(data: bytes) -> str:
    if len(data) < _INLINE_CRC_BYTES:
        return crc32c_b64(data)
    return await asyncio.to_thread(crc32c_b64, data)


class _PartBody(io.BytesIO):
    """A request body that reads ``data`` in place, never copying it whole.

    botocore wraps a bytes Body in ``io.BytesIO(data)``, which shares ``data`` until
    its buffer is exported; aiohttp exports it (``getbuffer``) only to learn its
    length, and that copies every part and PUT while it is in flight (8 parts of
    8 MiB held twice: 64 MiB more).  Here ``getbuffer`` is a read-only view of
    ``data``; aiohttp then sends it in 256 KiB reads, each waiting for the socket.
    Closed once the request is answered (``with``): aiobotocore never closes a
    body, and the part's bytes must not live as long as botocore's request objects.
    """

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self._data = data

    def getbuffer(self) -> memoryview:
        return memoryview(self._data)

    def close(self) -> None:
        self._data = b""
        super().close()


def _is_md5_etag(etag: str) -> bool:
    return len(etag) == 32 and all(c in "0123456789abcdefABCDEF" for c in etag)


def _composite_crc32c(parts: list[UploadedPart]) -> str | None:
    """S3's checksum of a multipart object: the CRC32C of the parts' CRC32Cs, then ``-N``."""
    try:
        raw = b"".join(base64.b64decode(p.checksum_crc32c or "", validate=True) for p in parts)
    except ValueError:
        return None
    if len(raw) != 4 * len(parts):
        return None
    return f"{crc32c_b64(raw)}-{len(parts)}"


def _multipart_etag(parts: list[UploadedPart]) -> str | None:
    """The ETag S3 gives an object assembled from ``parts`` (None if the part ETags are not MD5s)."""
    try:
        digests = b"".join(bytes.fromhex(p.etag) for p in parts)
    except ValueError:
        return None
    return f"{hashlib.md5(digests).hexdigest()}-{len(parts)}"


class S3Remote(Remote):
    """``s3://bucket/prefix`` through one aiobotocore client, created on first use."""

    min_part_size = 5 * 1024**2
    prefers_streams = True  # one GET per sequentially read file: per-request costs (and moto's) paid once

    def __init__(
        self,
        url: RemoteURL,
        options: S3Options | None = None,
        *,
        max_connections: int = 64,
        connect_timeout: float = 10.0,
        read_timeout: float = 20.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        if url.scheme != "s3":
            raise ValueError(f"S3Remote needs an s3:// URL, not {url}")
        self.url = url
        self.session = S3Session(
            url,
            options or S3Options(),
            max_connections=max_connections,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
        )
        self.retry = retry or RetryPolicy()
        self.copy_max_single = COPY_MAX_SINGLE
        self.copy_part_size = COPY_PART_SIZE
        self._warned_unverified = False
        # Set by the mover: multipart uploads this remote starts on its own (large
        # copies) are recorded, so a restart aborts them and nobody else's.
        self.on_upload_started: Callable[[str, str], Awaitable[None]] | None = None
        self.on_upload_ended: Callable[[str], Awaitable[None]] | None = None

    async def check(self) -> None:
        probe = self.session.full(f"{INTERNAL_DIR}/check-{uuid.uuid4().hex}")
        try:
            try:
                await self.session.call("head_bucket", "check")
            except RemoteError as exc:
                if exc.kind != "access_denied":
                    raise
                raise await self.session.denial_detail(exc) from exc
            written = await self.session.call("put_object", "write probe", Key=probe, Body=b"")
            if not written.get("ETag"):  # a web server that answers 200 to anything
                raise RemoteError(
                    f"{self.session.where()}: the write probe was answered without an ETag: "
                    "that address does not answer as S3 does (is --endpoint-url an S3 endpoint?)",
                    kind="not_s3",
                )
            await self.session.call("delete_object", "delete probe", Key=probe)
        except RemoteNotFound as exc:  # HEAD has no body, so a missing bucket is a bare 404
            other = " (or --endpoint-url is not an S3 endpoint)" if self.session.endpoint_url else ""
            raise RemoteError(
                f"{self.session.where()}: bucket {self.session.bucket!r} does not exist{other}", kind="no_bucket"
            ) from exc
        except Exception as exc:
            if isinstance(exc, botocore.exceptions.BotoCoreError) and not self.is_temp_failure(exc):
                # Not S3 at the other end as configured (TLS to a plain-HTTP port, a refused
                # request): one line that says so, never a traceback.
                raise RemoteError(f"cannot talk to {self.session.where()}: {exc}", kind="unreachable") from exc
            if not self.is_temp_failure(exc):
                raise
            kind = "unavailable" if isinstance(exc, botocore.exceptions.ClientError) else "unreachable"
            raise RemoteError(f"cannot reach {self.session.where()}: {exc}", kind=kind) from exc

    async def put_object(self, key: str, data: bytes) -> None:
        checksum = await _checksum(data)
        with _PartBody(data) as body:
            response = await self.session.send(
                "put_object",
                f"put {key}",
                len(data),
                Key=self.session.full(key),
                Body=body,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=checksum,
            )
        await self._verify(f"put {key}", response, checksum, data)

    async def create_object(self, key: str, data: bytes) -> bool:
        checksum = await _checksum(data)
        client = await self.session.client()
        try:
            async with asyncio.timeout(self.session.send_deadline(len(data))):  # see S3Session.send
                response = await client.put_object(
                    Bucket=self.session.bucket,
                    Key=self.session.full(key),
                    Body=data,
                    IfNoneMatch="*",
                    ChecksumAlgorithm="CRC32C",
                    ChecksumCRC32C=checksum,
                )
        except Exception as exc:
            if isinstance(exc, botocore.exceptions.ClientError) and error_code(exc)[1] == 412:
                return False  # PreconditionFailed: the key exists
            mapped = self.session.map_error(exc, f"create {key}")
            if mapped is None:
                raise
            raise mapped from exc
        await self._verify(f"create {key}", response, checksum, data)
        return True

    async def _verify(self, what: str, response: dict[str, Any], checksum: str, data: bytes) -> None:
        """Check what the store says it stored against what we sent (ChecksumMismatch if it differs).

        The CRC32C the store returns is compared; a store that returns none (it
        ignored the header) is checked by its ETag, the MD5 of a plain PUT or
        part, computed only then.  An ETag that is no MD5 (SSE-KMS, some
        gateways) cannot be checked: that is logged once, and the bytes are
        still covered by the xxh3 chunk digests checked at every read.
        """
        returned = response.get("ChecksumCRC32C")
        if returned:
            if returned != checksum:
                raise ChecksumMismatch(f"{what}: the store stored CRC32C {returned}, we sent {checksum}")
            return
        etag = str(response.get("ETag", "")).strip('"')
        if _is_md5_etag(etag):
            md5 = await asyncio.to_thread(lambda: hashlib.md5(data, usedforsecurity=False).hexdigest())
            if md5 != etag.lower():
                raise ChecksumMismatch(f"{what}: the store's ETag {etag} is not the MD5 of the bytes sent ({md5})")
            return
        if not self._warned_unverified:
            self._warned_unverified = True
            log.warning(
                "event=upload_unverified remote=%s what=%r etag=%r reason=no checksum and no MD5 ETag returned",
                self.url,
                what,
                etag,
            )

    async def get_object(self, key: str) -> bytes:
        response = await self.session.call("get_object", f"get {key}", Key=self.session.full(key))
        return await self.session.read_body(response)

    async def _ranged_get(self, key: str, start: int, end: int) -> dict[str, Any] | None:
        """The response of a GET of bytes ``[start, end)``; None if ``start`` is at or past the end."""
        what = f"get {key} bytes {start}-{end}"
        try:
            response: dict[str, Any] = await self.session.call(
                "get_object", what, Key=self.session.full(key), Range=f"bytes={start}-{end - 1}"
            )
        except RemoteError as exc:
            if exc.kind == "invalid_range":
                return None
            raise
        return response

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        if end <= start or (response := await self._ranged_get(key, start, end)) is None:
            return b""
        data = await self.session.read_body(response)
        if "ContentRange" not in response:  # a store that ignored Range sent the whole object
            return data[start:end]
        return data

    async def open_range(self, key: str, start: int, end: int) -> dict[str, Any] | None:
        return await self._ranged_get(key, start, end) if end > start else None

    def close_range(self, opened: dict[str, Any] | None) -> None:
        if opened is not None:
            opened["Body"].close()

    async def stream_range(
        self, key: str, start: int, end: int, piece: int, opened: Awaitable[dict[str, Any] | None] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """Bytes ``[start, end)`` as ONE GET (``opened``: that GET, sent earlier by
        :meth:`open_range`), its body handed on in ``piece``-byte pieces as it arrives.

        A body that ends early (a reset connection) raises a temporary error after
        the pieces that did arrive; the caller resumes from there.
        """
        if (response := await (opened if opened is not None else self.open_range(key, start, end))) is None:
            return
        what = f"get {key} bytes {start}-{end}"
        ranged = "ContentRange" in response  # a store that ignored Range sends the whole object
        left = min(end - start, int(response.get("ContentLength", end)) - (0 if ranged else start))
        async with response["Body"] as body:
            skip = 0 if ranged else start
            while skip > 0:
                data = await body.read(min(skip, piece))
                if not data:
                    return
                skip -= len(data)
            while left > 0:
                want = min(piece, left)
                parts: list[bytes] = []
                while want > 0:
                    data = await body.read(want)
                    if not data:
                        raise ConnectionError(f"{what}: the body ended {left - sum(map(len, parts))} bytes early")
                    parts.append(data)
                    want -= len(data)
                left -= sum(map(len, parts))
                yield parts[0] if len(parts) == 1 else b"".join(parts)

    async def warm(self) -> None:
        """Create the client and open a connection (a HEAD of the bucket) before the first read needs them."""
        with contextlib.suppress(Exception):  # the first real request reports any problem
            await self.session.call("head_bucket", "warm")

    async def head(self, key: str) -> ObjectInfo | None:
        try:
            response = await self.session.call("head_object", f"head {key}", Key=self.session.full(key))
        except RemoteNotFound:
            return None
        return ObjectInfo(
            key=key,
            size=int(response["ContentLength"]),
            etag=str(response["ETag"]).strip('"'),
            mtime=response["LastModified"].timestamp(),
        )

    async def list_dir(self, dir_key: str) -> tuple[list[ObjectInfo], list[str]]:
        dir_key = dir_key.strip("/")
        list_prefix = self.session.full(dir_key + "/") if dir_key else self.session.prefix
        files: list[ObjectInfo] = []
        dirs: list[str] = []
        token: dict[str, str] = {}
        while True:
            page = await self.session.call(
                "list_objects_v2", f"list {dir_key or '/'}", Prefix=list_prefix, Delimiter="/", **token
            )
            files.extend(self._info(obj) for obj in page.get("Contents", ()) if obj["Key"] != list_prefix)
            dirs.extend(p["Prefix"][len(list_prefix) :].rstrip("/") for p in page.get("CommonPrefixes", ()))
            if not page.get("IsTruncated"):
                return files, dirs
            token = {"ContinuationToken": page["NextContinuationToken"]}

    async def list_all(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        # Each page is retried here: a caller cannot restart a half-consumed iterator.
        token: dict[str, Any] = {}
        while True:
            page = await self.retry.call(
                self,
                self.session.call,
                "list_objects_v2",
                f"list {prefix or '/'}",
                what=f"list {prefix or '/'}",
                Prefix=self.session.full(prefix),
                **token,
            )
            for obj in page.get("Contents", ()):
                if not obj["Key"].endswith("/"):  # skip "directory marker" objects made by consoles
                    yield self._info(obj)
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def _info(self, obj: dict[str, Any]) -> ObjectInfo:
        return ObjectInfo(
            key=self.session.rel(obj["Key"]),
            size=int(obj["Size"]),
            etag=str(obj.get("ETag", "")).strip('"') or None,
            mtime=obj["LastModified"].timestamp(),
        )

    async def create_multipart(self, key: str) -> str:
        response = await self.session.call(
            "create_multipart_upload", f"create upload {key}", Key=self.session.full(key), ChecksumAlgorithm="CRC32C"
        )
        return str(response["UploadId"])

    async def upload_part(self, key: str, upload_id: str, part_number: int, offset: int, data: bytes) -> UploadedPart:
        checksum = await _checksum(data)
        what = f"upload {key} part {part_number}"
        with _PartBody(data) as body:
            response = await self.session.send(
                "upload_part",
                what,
                len(data),
                Key=self.session.full(key),
                UploadId=upload_id,
                PartNumber=part_number,
                Body=body,
                ChecksumAlgorithm="CRC32C",
                ChecksumCRC32C=checksum,
            )
        await self._verify(what, response, checksum, data)
        return UploadedPart(part_number, str(response["ETag"]).strip('"'), response.get("ChecksumCRC32C") or checksum)

    async def complete_multipart(self, key: str, upload_id: str, parts: list[UploadedPart]) -> None:
        ordered = sorted(parts, key=lambda p: p.part_number)
        listed = []
        for p in ordered:
            entry = {"PartNumber": p.part_number, "ETag": f'"{p.etag}"'}
            if p.checksum_crc32c:
                entry["ChecksumCRC32C"] = p.checksum_crc32c
            listed.append(entry)
        try:
            response = await self.session.call(
                "complete_multipart_upload",
                f"complete upload {key}",
                Key=self.session.full(key),
                UploadId=upload_id,
                MultipartUpload={"Parts": listed},
            )
            returned = str(response.get("ChecksumCRC32C") or "")
            expected = _composite_crc32c(ordered) if all(p.checksum_crc32c for p in ordered) else None
            if returned and expected and "-" in returned and returned != expected:
                raise RemoteError(
                    f"{self.url}: complete upload {key}: the store assembled CRC32C {returned}, "
                    f"the parts sent make {expected}",
                    kind="checksum",
                )
        except RemoteNotFound:
            # A retry of a completion whose reply was lost finds the upload gone; the
            # object's ETag tells whether it is ours.
            info = await self.head(key)
            if info is None or info.etag is None or info.etag != _multipart_etag(ordered):
                raise

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        with contextlib.suppress(RemoteNotFound):
            await self.session.call(
                "abort_multipart_upload", f"abort upload {key}", Key=self.session.full(key), UploadId=upload_id
            )

    async def list_multipart_uploads(self) -> list[tuple[str, str]]:
        uploads: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            page = await self.session.call(
                "list_multipart_uploads", "list uploads", Prefix=self.session.prefix, **markers
            )
            uploads.extend((self.session.rel(u["Key"]), u["UploadId"]) for u in page.get("Uploads", ()))
            if not page.get("IsTruncated"):
                return uploads
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    async def copy(self, src: str, dst: str) -> None:
        source = {"Bucket": self.session.bucket, "Key": self.session.full(src)}
        info = await self.head(src)
        if info is None:
            raise RemoteNotFound(f"{self.url}: copy source {src} not found")
        if info.size <= self.copy_max_single:
            await self.session.call(
                "copy_object", f"copy {src} to {dst}", Key=self.session.full(dst), CopySource=source
            )
            return
        await self._multipart_copy(src, dst, source, info.size)

    async def _multipart_copy(self, src: str, dst: str, source: dict[str, str], size: int) -> None:
        """Copy an object too large for one CopyObject as parallel server-side part copies."""
        part_size = max(self.copy_part_size, -(-size // self.max_parts))
        ranges = [(n + 1, off, min(off + part_size, size)) for n, off in enumerate(range(0, size, part_size))]
        upload_id = str(
            (await self.session.call("create_multipart_upload", f"create copy {dst}", Key=self.session.full(dst)))[
                "UploadId"
            ]
        )
        parts: list[UploadedPart] = []
        pending = iter(ranges)

        async def worker() -> None:
            for number, start, end in pending:
                what = f"copy {src} to {dst} part {number}"
                response = await self.retry.call(
                    self,
                    self.session.call,
                    "upload_part_copy",
                    what,
                    what=what,
                    Key=self.session.full(dst),
                    UploadId=upload_id,
                    PartNumber=number,
                    CopySource=source,
                    CopySourceRange=f"bytes={start}-{end - 1}",
                )
                parts.append(UploadedPart(number, str(response["CopyPartResult"]["ETag"]).strip('"')))

        try:  # recording it may be cancelled or fail too: the abort covers that as well
            if self.on_upload_started is not None:
                await self.on_upload_started(dst, upload_id)
            await run_workers(worker, min(COPY_CONCURRENCY, len(ranges)))
            await self.complete_multipart(dst, upload_id, parts)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.abort_multipart(dst, upload_id)
                if self.on_upload_ended is not None:
                    await self.on_upload_ended(upload_id)
            raise
        if self.on_upload_ended is not None:
            await self.on_upload_ended(upload_id)

    async def delete(self, key: str) -> None:
        await self.session.call("delete_object", f"delete {key}", Key=self.session.full(key))

    def is_temp_failure(self, exc: BaseException) -> bool:
        return is_temp_failure(exc)

    def is_throttling(self, exc: BaseException) -> bool:
        return is_throttling(exc)

    async def close(self) -> None:
        await self.session.close()

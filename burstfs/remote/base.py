"""The small interface every remote implements, and the values it returns.

Keys are relative to the remote URL (the bucket prefix, or the directory), use
``/`` as separator and never start with one.  Implementations raise
:class:`~burstfs.errors.RemoteNotFound` for a missing object or upload,
:class:`~burstfs.errors.RemoteError` for other permanent failures, and let
temporary failures (throttling, 5xx, connection resets, timeouts) propagate
unchanged so that :func:`burstfs.remote.retry.retrying` can recognise them with
:meth:`Remote.is_temp_failure`.  Remotes do not retry on their own, except for
requests hidden inside one call (pages of a listing, parts of a server-side
copy), which a caller could not restart on its own.
"""

from __future__ import annotations

import abc
import os
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

import xxhash

from ..config import RemoteURL

#: Top-level directory of a remote that holds burstfs' own bookkeeping (manifests,
#: temp files, uploads).  Remotes list it like anything else; callers skip it.
INTERNAL_DIR = ".burstfs"

#: The longest name a file remote's directory takes (NAME_MAX): a manifest whose name would
#: be longer (a file name of 251-255 bytes and ``.json``) goes by a digest of that name.
MAX_NAME_BYTES = 255
LONG_NAMES_DIR = f"{INTERNAL_DIR}/manifests-long"


def manifest_key(key: str) -> str:
    """Where the manifest of ``key`` lives on the remote: ``.burstfs/manifests/<key>.json``,
    or ``.burstfs/manifests-long/<dir>/<xxh3-128 of the name>.json`` for a name too long
    to take the suffix (the manifest's ``key`` field names the object either way)."""
    head, _, name = key.rpartition("/")
    if len(os.fsencode(name)) + len(".json") <= MAX_NAME_BYTES:
        return f"{INTERNAL_DIR}/manifests/{key}.json"
    digest = xxhash.xxh3_128_hexdigest(os.fsencode(name))
    return f"{LONG_NAMES_DIR}/{head}/{digest}.json" if head else f"{LONG_NAMES_DIR}/{digest}.json"


@dataclass(frozen=True)
class ObjectInfo:
    """One object as a listing or a HEAD sees it.

    key: relative to the remote URL.
    size: bytes.
    etag: the server's entity tag without quotes (``None`` where the remote has none).
    mtime: last modification, seconds since the epoch.
    """

    key: str
    size: int
    etag: str | None
    mtime: float

    @property
    def version(self) -> str:
        return object_version(self.etag, int(self.mtime * 1e9))


def object_version(etag: str | None, mtime_ns: int) -> str:
    """Which write of a key an object is, as a listing or a HEAD of it tells: its etag, or its
    mtime where the remote has none (a directory remote replaces a file by a rename)."""
    return f"etag:{etag}" if etag else f"mtime:{mtime_ns}"


@dataclass(frozen=True)
class UploadedPart:
    """What :meth:`Remote.complete_multipart` needs to know about one part.

    part_number: 1-based, as in S3.
    etag: the remote's opaque token for the part.
    checksum_crc32c: base64 CRC32C the server verified, where the remote does that.
    """

    part_number: int
    etag: str
    checksum_crc32c: str | None = None


class Remote(abc.ABC):
    """Where drained files live: an S3 prefix or a directory.  Use within one event loop."""

    url: RemoteURL
    #: Smallest part a multipart upload accepts, except the last (S3: 5 MiB).
    min_part_size: int = 0
    #: Most parts one multipart upload may have (S3: 10,000).
    max_parts: int = 10_000
    #: A file read from its start is best fetched as one streaming GET (:meth:`stream_range`)
    #: rather than as parallel ranged GETs (the restore's two plans, see burstfs.restore).
    prefers_streams: bool = False

    @abc.abstractmethod
    async def check(self) -> None:
        """Fail early: raise RemoteError (with a ``kind``) unless the remote is reachable and writable."""

    @abc.abstractmethod
    async def put_object(self, key: str, data: bytes) -> None:
        """Store ``data`` at ``key`` atomically (readers see the old or the new object)."""

    async def create_object(self, key: str, data: bytes) -> bool:
        """Store ``data`` at ``key`` only if no object is there (S3 ``If-None-Match: *``,
        ``O_EXCL`` on a file remote); False if one was.  Two nodes racing for one key:
        exactly one gets True.  This fallback (a HEAD, then a PUT) is not atomic: real
        remotes override it."""
        if await self.head(key) is not None:
            return False
        await self.put_object(key, data)
        return True

    @abc.abstractmethod
    async def get_object(self, key: str) -> bytes:
        """The whole object; RemoteNotFound if it is missing."""

    @abc.abstractmethod
    async def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, shorter at the end of the object; RemoteNotFound if missing."""

    async def stream_range(
        self, key: str, start: int, end: int, piece: int, opened: Awaitable[Any] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """Bytes ``[start, end)`` in pieces of ``piece`` bytes (the last one shorter), as they arrive.

        Fewer bytes than asked for (the object is shorter, or the connection ended
        early) is not an error here: the caller sees where the pieces stopped and
        resumes from there.  ``opened``: an :meth:`open_range` of the same bytes, sent
        earlier (remotes with a streaming read only).  This fallback reads one ranged
        piece after another; remotes with a streaming read (S3: one GET) override it.
        """
        if opened is not None:
            raise NotImplementedError(f"{type(self).__name__} sends no GET ahead of its stream")
        while start < end:
            data = await self.get_range(key, start, min(start + piece, end))
            if not data:
                return
            yield data
            start += len(data)

    async def open_range(self, key: str, start: int, end: int) -> Any:
        """Send the GET of bytes ``[start, end)`` that :meth:`stream_range` would send, and
        return it unread: for ``stream_range(..., opened=)``, or :meth:`close_range`.  Only
        remotes that prefer streams send one."""
        raise NotImplementedError(f"{type(self).__name__} sends no GET ahead of its stream")

    def close_range(self, opened: Any) -> None:  # noqa: B027 (nothing to release without open_range)
        """Release a GET :meth:`open_range` sent whose body nobody will read."""

    def expect_established(self) -> None:  # noqa: B027 (an object store has no such marks)
        """This cache drained here before: a remote lacking the marks burstfs leaves in it is
        another in its place (a file remote's file system unmounted: its empty mount point),
        refused rather than set up anew."""

    async def warm(self) -> None:  # noqa: B027 (most remotes have nothing to prepare)
        """Prepare for the first request (clients, connections) so that a read does not pay for it."""

    @abc.abstractmethod
    async def head(self, key: str) -> ObjectInfo | None:
        """Size and identity of ``key``, or None if there is no such object."""

    @abc.abstractmethod
    async def list_dir(self, dir_key: str) -> tuple[list[ObjectInfo], list[str]]:
        """One level below ``dir_key`` ('' = root): the objects, and the names of subdirectories."""

    @abc.abstractmethod
    def list_all(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Every object whose key starts with ``prefix``, recursively, in key order."""

    @abc.abstractmethod
    async def create_multipart(self, key: str) -> str:
        """Start a multipart upload to ``key``; returns its upload id."""

    @abc.abstractmethod
    async def upload_part(self, key: str, upload_id: str, part_number: int, offset: int, data: bytes) -> UploadedPart:
        """Upload one part; ``offset`` is where the part starts in the final object."""

    @abc.abstractmethod
    async def complete_multipart(self, key: str, upload_id: str, parts: list[UploadedPart]) -> None:
        """Publish the object made of ``parts`` (any order) atomically."""

    @abc.abstractmethod
    async def abort_multipart(self, key: str, upload_id: str) -> None:
        """Drop an upload and its parts; an unknown upload is fine (idempotent)."""

    @abc.abstractmethod
    async def list_multipart_uploads(self) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of every unfinished upload under this remote (cleanup after a crash)."""

    @abc.abstractmethod
    async def copy(self, src: str, dst: str) -> None:
        """Server-side copy of ``src`` to ``dst``; RemoteNotFound if ``src`` is missing."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; a missing object is fine."""

    @abc.abstractmethod
    def is_temp_failure(self, exc: BaseException) -> bool:
        """True if ``exc`` is worth retrying (throttling, 5xx, timeouts, dropped connections)."""

    def is_throttling(self, exc: BaseException) -> bool:
        """True if ``exc`` is the store asking for fewer requests (S3's 503 SlowDown)."""
        return False

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads."""

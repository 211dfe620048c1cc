"""Checksummed, optionally compressed file objects on a remote.

A file is cut into chunks of ``chunk_size`` bytes (the multipart part size).
Each chunk's xxh3-64 is computed when the file is staged; the upload re-reads
the staged bytes, checks them against those digests before anything leaves the
machine, and records them in a manifest next to the object
(``.burstfs/manifests/<key>.json``).  Reads fetch whole stored chunks and check
them against the manifest before a single byte is returned, so wrong bytes are
never served.  Without compression the object is exactly the file's bytes; with
lz4 each chunk is one lz4 frame, stored raw where compression does not pay.

:class:`ObjectStore` wraps a :class:`~burstfs.remote.Remote` (it does not
subclass it) and retries every remote call through a
:class:`~burstfs.remote.RetryPolicy`.  Hashing and (de)compression run in
worker threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import xxhash

from . import manifest as manifest_format
from .digests import FileDigests, StreamingDigests, WholeFileDigest, chunk_count, compute_digests
from .errors import (
    OBJECT,
    OBJECT_GONE,
    THROTTLED,
    CorruptDataError,
    ManifestError,
    RemoteError,
    RemoteNotFound,
    UploadCancelled,
    error_scope,
)
from .fileio import pread_full
from .manifest import ChunkInfo, Manifest, StoredChunk, decode_chunk, encode_chunk
from .remote import ObjectInfo, Remote, RetryPolicy, UploadedPart, fail_fast_group, run_workers
from .remote.base import manifest_key

# The objects layer's names, wherever they are defined (callers import them from here).
__all__ = [
    "ChunkInfo",
    "FileDigests",
    "Manifest",
    "ObjectStore",
    "StoredChunk",
    "StreamingDigests",
    "compute_digests",
    "manifest_key",
]

log = logging.getLogger("burstfs.objects")

#: Upload ids journaled before the create returns the real one (see ObjectStore._put_multipart).
PENDING_UPLOAD = "pending-"
#: Consecutive chunks are read by one ranged GET of up to this many bytes, each chunk verified
#: on its own: 1 MiB blocks would otherwise cost a request each.
RANGED_RUN_BYTES = 8 << 20
#: Chunks of one upload read (and hashed, encoded) at once.  Reading a staged chunk is
#: far faster than sending it, so two keep the parts in flight fed; more would only add
#: work that a paused drain cannot take back when the next burst of writers starts.
READS_IN_FLIGHT = 2


class RequestHealth(Protocol):
    """Hears how the remote answers an ObjectStore's requests (MoverStats)."""

    def retried(self, reason: str, first_attempt: float, throttled: bool) -> None:
        """A request failed for now and is tried again (``first_attempt``: epoch seconds;
        ``throttled``: the store asked for fewer requests)."""

    def answered(self) -> None:
        """A request succeeded (possibly after retries)."""


async def reported_call(
    retry: RetryPolicy, remote: Remote, health: RequestHealth | None, fn: Callable[..., Any], *args: Any, what: str
) -> Any:
    """``retry.call`` that tells ``health`` (if any) of each retry and of the answer."""
    if health is None:
        return await retry.call(remote, fn, *args, what=what)
    try:
        result = await retry.call(remote, fn, *args, what=what, on_retry=health.retried)
    except RemoteError as exc:
        if exc.kind not in ("unavailable", THROTTLED):  # a refusal (missing, denied) is an answer too
            health.answered()  # (a "slow down" until the retries ran out is the outage going on)
        raise
    health.answered()
    return result


class ObjectStore:
    """Files as verified objects on ``remote``; every remote call is retried by ``retry``."""

    def __init__(
        self,
        remote: Remote,
        retry: RetryPolicy | None = None,
        *,
        on_upload_started: Callable[[str, str], Awaitable[None]] | None = None,
        on_upload_ended: Callable[[str], Awaitable[None]] | None = None,
        health: RequestHealth | None = None,
        node_id: str = "",
    ) -> None:
        """``on_upload_started(key, upload_id)`` runs before the first part of a multipart upload
        goes up and ``on_upload_ended(upload_id)`` once it is completed or aborted, so that a
        restart aborts exactly the uploads this cache left (never another node's).
        ``health`` hears of every retry and every answered request (the status headline).
        ``node_id``: this mount's node; its manifests name it, and an object whose manifest
        names another node is never deleted or moved by this one (nodes share a prefix)."""
        self.remote = remote
        self.retry = retry or RetryPolicy()
        self.on_upload_started = on_upload_started
        self.on_upload_ended = on_upload_ended
        self.health = health
        self.node_id = node_id
        self.block_size = manifest_format.BLOCK_SIZE  # of the block digests manifests list

    async def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return await reported_call(self.retry, self.remote, self.health, fn, *args, what=what)

    # -- upload ---------------------------------------------------------------------

    async def upload_file(
        self,
        key: str,
        path: str | os.PathLike[str],
        expected: FileDigests | None,
        *,
        chunk_size: int = 0,
        generation: int,
        mtime_ns: int,
        mode: int,
        concurrency: int,
        compress: str | None = None,
        cancel_check: Callable[[], Awaitable[bool]] | None = None,
        pace: Callable[[], Awaitable[None]] | None = None,
        sent: Callable[[int], None] | None = None,
    ) -> Manifest:
        """Upload the staged file at ``path`` to ``key`` and write its manifest.

        Every chunk is checked against ``expected`` before it is sent: a mismatch
        (the staged file changed or rotted) raises CorruptDataError naming the
        file and byte range, and nothing is published.  Files of one chunk or
        less go up in a single PUT, larger ones as a multipart upload holding at
        most ``concurrency`` chunks in memory (or one part plus one chunk, if
        more) and at most ``concurrency`` parts in flight.
        If ``await cancel_check()`` returns true between chunks, the upload is aborted
        and :class:`~burstfs.errors.UploadCancelled` raised.  Any failure aborts
        the multipart upload.  Returns the manifest written.

        With ``expected`` None (a file whose digests were not taken as it was
        written, e.g. written through FUSE passthrough) there is nothing to check
        against: chunks of ``chunk_size`` are hashed as they are read for upload
        and the whole-file digest is taken by a concurrent pass, so the file is
        not read once more before the upload; the manifest carries both.
        A multipart upload awaits ``pace()`` before it reads each chunk and before it
        sends each part, and the whole-file pass before each window (the drain yields
        to writers with it: only the reads and sends already started go on).
        ``sent(n)`` hears of the file's bytes each part (or the single PUT) took to the
        remote, as they land: the drain's rate while a large file is under way.
        """
        if compress not in (None, "lz4"):
            raise ValueError(f"unknown compression {compress!r}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        size = (await asyncio.to_thread(os.stat, path)).st_size
        if expected is not None:
            chunk_size = expected.chunk_size
            if chunk_size <= 0 or len(expected.chunks) != chunk_count(expected.size, chunk_size):
                raise ValueError(f"digests of {key}: {len(expected.chunks)} chunks do not cover {expected.size} bytes")
            if size != expected.size:
                raise CorruptDataError(
                    f"staged file {path} ({key}) is {size} bytes, but {expected.size} were checksummed"
                )
        elif chunk_size <= 0:
            raise ValueError(f"chunk size must be positive, not {chunk_size}")
        reader = _ChunkReader(
            Path(path),
            key,
            size,
            chunk_size,
            expected.chunks if expected else None,
            compress,
            self._block_size_for(size, chunk_size, compress),
        )
        whole = None
        if expected is None:  # a file of one chunk (one PUT) never waits for writers
            whole = asyncio.ensure_future(_whole_digest(reader.path, size, pace if reader.count > 1 else None))
        try:
            if reader.count <= 1:
                chunks = await self._put_whole(key, reader, cancel_check)
                if sent is not None:
                    sent(size)
            else:
                chunks = await self._put_multipart(key, reader, concurrency, cancel_check, pace, sent)
            if whole is not None:
                digest = await whole
            else:
                assert expected is not None
                digest = expected.digest
        finally:
            if whole is not None and not whole.done():
                whole.cancel()
        blocks = reader.block_digests() if reader.block_size else ()
        manifest = Manifest(
            key=key,
            size=size,
            chunk_size=chunk_size,
            digest=digest,
            generation=generation,
            mtime_ns=mtime_ns,
            mode=mode,
            chunks=tuple(chunks),
            block_size=reader.block_size if blocks else 0,
            blocks=blocks,
            node=self.node_id,
        )
        await self._call(self.remote.put_object, manifest_key(key), manifest.to_json(), what=f"put manifest {key}")
        return manifest

    def _block_size_for(self, size: int, chunk_size: int, compress: str | None) -> int:
        """The block size of the manifest's block digests, or 0 for none: the chunks are
        larger than a block and stored plain (compressed chunks are read whole anyway)."""
        block = self.block_size
        if compress is not None or not block or chunk_size <= block or chunk_size % block:
            return 0
        return block if chunk_count(size, block) <= manifest_format.MAX_MANIFEST_CHUNKS else 0

    async def _put_whole(
        self, key: str, reader: _ChunkReader, cancel_check: Callable[[], Awaitable[bool]] | None
    ) -> list[ChunkInfo]:
        if not reader.count:
            await _check_cancel(cancel_check, key)
            await self._call(self.remote.put_object, key, b"", what=f"put {key}")
            return []
        info, data = await asyncio.to_thread(reader.read, 0)
        await _check_cancel(cancel_check, key)  # after the read: the bytes read are the version to send
        await self._call(self.remote.put_object, key, data, what=f"put {key}")
        return [info]

    async def _put_multipart(
        self,
        key: str,
        reader: _ChunkReader,
        concurrency: int,
        cancel_check: Callable[[], Awaitable[bool]] | None,
        pace: Callable[[], Awaitable[None]] | None = None,
        sent: Callable[[int], None] | None = None,
    ) -> list[ChunkInfo]:
        """Read, check and encode chunks in threads and upload them as parts, memory bounded.

        A part is a run of whole chunks, long enough for the remote's minimum part
        size (lz4 chunks can be small) and its part count limit (huge files).
        Chunks are read ahead (READS_IN_FLIGHT at once) and parts uploaded
        concurrently within a byte budget of ``concurrency`` chunks (or one part
        plus one chunk if larger).
        """
        chunk_size = reader.chunk_size
        count = reader.count
        target = self._part_target(chunk_size, count)
        budget = _ByteBudget(self.upload_memory(chunk_size, concurrency, reader.size))
        upload_slots = asyncio.Semaphore(concurrency)
        reads: asyncio.Queue[asyncio.Task[tuple[ChunkInfo, bytes]]] = asyncio.Queue()
        chunks: list[ChunkInfo] = []
        parts: list[UploadedPart] = []
        # Journaled before the create: a crash between the create and its record
        # leaves a placeholder, and the next start aborts the uploads to this key.
        placeholder = f"{PENDING_UPLOAD}{os.urandom(8).hex()}"
        if self.on_upload_started is not None:
            await self.on_upload_started(key, placeholder)
        upload_id: str = await self._call(self.remote.create_multipart, key, what=f"create upload {key}")
        try:
            if self.on_upload_started is not None:
                await self.on_upload_started(key, upload_id)
        except BaseException:
            await self._abort(key, upload_id)
            raise
        await self._upload_ended(placeholder)

        reading = asyncio.Semaphore(READS_IN_FLIGHT)

        async def read(index: int) -> tuple[ChunkInfo, bytes]:
            try:
                return await asyncio.to_thread(reader.read, index)
            finally:
                reading.release()

        async def read_ahead(group: asyncio.TaskGroup) -> None:
            for index in range(count):
                await reading.acquire()
                if pace is not None:
                    await pace()
                await _check_cancel(cancel_check, key)
                await budget.acquire(reader.length(index))
                reads.put_nowait(group.create_task(read(index)))

        async def send(number: int, offset: int, data: bytes, file_bytes: int) -> None:
            try:
                what = f"upload {key} part {number}"
                parts.append(await self._call(self.remote.upload_part, key, upload_id, number, offset, data, what=what))
                if sent is not None:
                    sent(file_bytes)
            finally:
                budget.release(len(data))
                upload_slots.release()

        async def assemble(group: asyncio.TaskGroup) -> None:
            buffer: list[bytes] = []
            buffered = offset = number = file_bytes = 0
            for index in range(count):
                info, data = await (await reads.get())
                budget.release(reader.length(index) - len(data))  # keep only what compression left
                chunks.append(info)
                buffer.append(data)
                buffered += len(data)
                file_bytes += reader.length(index)
                if buffered >= target or index == count - 1:
                    if pace is not None:
                        await pace()
                    await upload_slots.acquire()
                    number += 1
                    group.create_task(send(number, offset, b"".join(buffer), file_bytes))
                    offset += buffered
                    buffer, buffered, file_bytes = [], 0, 0

        try:
            async with fail_fast_group() as group:
                group.create_task(read_ahead(group))
                group.create_task(assemble(group))
            await _check_cancel(cancel_check, key)
            await self._call(self.remote.complete_multipart, key, upload_id, parts, what=f"complete upload {key}")
        except BaseException:
            await self._abort(key, upload_id)
            raise
        await self._upload_ended(upload_id)
        return chunks

    def _part_target(self, chunk_size: int, count: int) -> int:
        """Bytes a part gathers before it goes up: the remote's minimum part size, more for huge files."""
        return max(self.remote.min_part_size, chunk_size * -(-count // self.remote.max_parts))

    def upload_memory(self, chunk_size: int, concurrency: int, size: int = 0) -> int:
        """The most chunk bytes one upload of a ``size``-byte file holds (read ahead, being
        encoded or in flight): ``concurrency`` chunks, or one part plus one chunk if larger.
        Each is held once: the remote sends the caller's bytes without copying them whole."""
        target = self._part_target(chunk_size, chunk_count(size, chunk_size))
        return max(concurrency * chunk_size, target + chunk_size)

    async def _upload_ended(self, upload_id: str) -> None:
        if self.on_upload_ended is not None:
            try:
                await self.on_upload_ended(upload_id)
            except Exception as exc:  # the record stays: the next start aborts an upload already gone
                log.warning("event=upload_record_failed upload_id=%s error=%r", upload_id, str(exc))

    async def _abort(self, key: str, upload_id: str) -> None:
        try:
            await self._call(self.remote.abort_multipart, key, upload_id, what=f"abort upload {key}")
        except Exception as exc:  # abort_stale_uploads() removes it later
            log.warning("event=abort_failed key=%s upload_id=%s error=%r", key, upload_id, str(exc))
        else:
            await self._upload_ended(upload_id)

    # -- read -------------------------------------------------------------------------

    async def fetch_manifest(self, key: str) -> Manifest | None:
        """The manifest of ``key``, or None for an object burstfs did not write."""
        try:  # a ranged GET: a huge object at the manifest's key is never read whole
            data = await self._call(
                self.remote.get_range,
                manifest_key(key),
                0,
                manifest_format.MAX_MANIFEST_BYTES + 1,
                what=f"get manifest {key}",
            )
        except RemoteNotFound:
            return None
        try:
            manifest = Manifest.from_json(data)
        except ManifestError as exc:
            log.error("event=corrupt_manifest key=%s error=%r", key, str(exc))
            raise ManifestError(f"{key}: {exc}") from None
        if manifest.key != key:
            raise ManifestError(f"manifest at {manifest_key(key)} describes {manifest.key!r}")
        return manifest

    async def head(self, key: str) -> ObjectInfo | None:
        """Size and identity of the object at ``key`` (None if there is none), retried."""
        info: ObjectInfo | None = await self._call(self.remote.head, key, what=f"head {key}")
        return info

    async def read_chunks(
        self, key: str, manifest: Manifest, first: int, stop: int
    ) -> list[memoryview | CorruptDataError]:
        """Chunks ``[first, stop)`` by one ranged GET, each decoded and verified on its own:
        its plain bytes, or the CorruptDataError it failed with (logged)."""
        begin = manifest.stored_chunk(first).offset
        last = manifest.stored_chunk(stop - 1)
        stored = await self._call(
            self.remote.get_range, key, begin, last.offset + last.size, what=f"get {key} chunks {first}-{stop - 1}"
        )
        return await asyncio.to_thread(_decode_chunks, key, manifest, first, stop, begin, memoryview(stored))

    async def read_range(self, key: str, manifest: Manifest | None, start: int, end: int) -> bytes:
        """Logical bytes ``[start, end)`` of ``key``, shorter at the end of the file.

        With a manifest every chunk touched is fetched whole and verified first
        (CorruptDataError on a mismatch), by ranged GETs of up to ``RANGED_RUN_BYTES``
        of consecutive chunks (:meth:`read_chunks`), several at once; without one
        (an object another tool wrote) the bytes are returned unverified and the
        caller says so.
        """
        if manifest is None:
            data: bytes = await self._call(self.remote.get_range, key, start, end, what=f"get {key}")
            return data
        spans = manifest.stored_chunks(start, end)
        if not spans:
            return b""
        end = min(end, manifest.size)
        first, stop = spans[0].index, spans[-1].index + 1
        per_get = max(1, RANGED_RUN_BYTES // manifest.chunk_size)
        runs = [(run, min(run + per_get, stop)) for run in range(first, stop, per_get)]
        results: dict[int, memoryview] = {}
        pending = iter(runs)

        async def worker() -> None:
            for run_first, run_stop in pending:
                for index, chunk in enumerate(await self.read_chunks(key, manifest, run_first, run_stop), run_first):
                    if isinstance(chunk, CorruptDataError):
                        raise chunk
                    results[index] = chunk

        await run_workers(worker, len(runs))
        pieces = []
        for index in range(first, stop):
            chunk_start, _ = manifest.chunk_range(index)
            lo, hi = max(start, chunk_start) - chunk_start, min(end - chunk_start, len(results[index]))
            pieces.append(results[index][lo:hi])
        return b"".join(pieces)

    # -- namespace ------------------------------------------------------------------------

    async def rename(self, src: str, dst: str, *, delete_source: bool = True) -> None:
        """Move object and manifest with a server-side copy, then delete the old keys.

        Safe to repeat after a crash part way: if ``src`` is already gone and
        ``dst`` holds the same file (same whole-file digest), the move is complete.
        ``delete_source=False``: copy only; the caller deletes ``src`` once it has
        checked that no other file owns that key meanwhile.
        """
        manifest = await self.fetch_manifest(src)
        if manifest is not None and self._foreign(manifest):
            # Another node's object (a file this node knows from a listing, or one written at
            # this key since): never ours to move.  A directory renamed on every node (a temp
            # directory renamed to the step's name) has that node move its own: done if so.
            moved = await self.fetch_manifest(dst)
            if moved is not None and moved.digest == manifest.digest and moved.node == manifest.node:
                log.info("event=rename_done_by_owner src=%s dst=%s node=%s", src, dst, manifest.node)
                return
            raise RemoteError(
                f"{src} is node {manifest.node}'s file: not moved (a node moves only its own objects)",
                kind="key_conflict",
            )
        try:
            await self._call(self.remote.copy, src, dst, what=f"copy {src} to {dst}")
        except RemoteNotFound as exc:
            moved = await self.fetch_manifest(dst)
            if moved is None or (manifest is not None and moved.digest != manifest.digest):
                raise RemoteError(f"{src} is no longer on the remote: nothing to move to {dst}", OBJECT_GONE) from exc
            log.info("event=rename_already_done src=%s dst=%s", src, dst)
        else:
            if manifest is not None:
                moved_json = dataclasses.replace(manifest, key=dst).to_json()
                await self._call(self.remote.put_object, manifest_key(dst), moved_json, what=f"put manifest {dst}")
            else:  # a stale manifest at dst would make the new bytes look corrupt
                await self._call(self.remote.delete, manifest_key(dst), what=f"delete manifest {dst}")
        if delete_source:
            await self.delete(src)

    def _foreign(self, manifest: Manifest) -> bool:
        return bool(self.node_id and manifest.node and manifest.node != self.node_id)

    async def delete(self, key: str, *, spare_foreign: bool = True, listed_version: str | None = None) -> None:
        """Remove the object and its manifest (missing ones are fine), unless its manifest names
        another node (``spare_foreign``, for objects this node uploaded): that node wrote the key
        since (the same path written on two nodes), and its file is not this node's to delete.
        ``listed_version``: another node's file unlinked here goes only if the object is still the
        version this node listed (``ObjectInfo.version``): its owner may have rewritten it since."""
        if listed_version is not None:
            info = await self.head(key)
            if info is not None and info.version != listed_version:
                log.warning("event=remote_delete_spared key=%s reason=rewritten since this node listed it", key)
                return
        if self.node_id and spare_foreign:
            try:
                manifest = await self.fetch_manifest(key)
            except ManifestError:
                manifest = None  # unreadable: nobody's file can be served from it
            except RemoteError as exc:
                if error_scope(exc) != OBJECT:
                    raise
                manifest = None  # no manifest can exist at such a key (too long for one)
            if manifest is not None and self._foreign(manifest):
                log.warning("event=remote_delete_spared key=%s owner=%s", key, manifest.node)
                return
        await self._call(self.remote.delete, key, what=f"delete {key}")
        await self._call(self.remote.delete, manifest_key(key), what=f"delete manifest {key}")

    async def abort_stale_uploads(self, uploads: list[tuple[str, str]]) -> int:
        """Abort ``uploads`` ((key, upload_id) this cache started and left unfinished: call only
        when none of them is in flight); returns how many.  Never lists and aborts the whole
        prefix: other nodes' uploads in flight there are theirs."""
        unknown = {key for key, upload_id in uploads if upload_id.startswith(PENDING_UPLOAD)}
        listed = await self._call(self.remote.list_multipart_uploads, what="list uploads") if unknown else []
        known = [(k, u) for k, u in uploads if not u.startswith(PENDING_UPLOAD)]
        # A crash between a create and its record: the upload's id was never learned,
        # so every upload to that key goes (another node writing the same key retries).
        known += [(k, u) for k, u in listed if k in unknown and (k, u) not in known]
        for key, upload_id in known:
            await self._call(self.remote.abort_multipart, key, upload_id, what=f"abort upload {key}")
            await self._upload_ended(upload_id)
            log.info("event=stale_upload_aborted key=%s upload_id=%s", key, upload_id)
        for _key, upload_id in uploads:
            if upload_id.startswith(PENDING_UPLOAD):
                await self._upload_ended(upload_id)
        return len(known)


class _ByteBudget:
    """Bytes of chunk data the upload may hold; one task acquires, in chunk order."""

    def __init__(self, limit: int) -> None:
        self._free = limit
        self._changed = asyncio.Event()

    async def acquire(self, n: int) -> None:
        while self._free < n:
            self._changed.clear()
            await self._changed.wait()
        self._free -= n

    def release(self, n: int) -> None:
        self._free += n
        self._changed.set()


def _decode_chunks(
    key: str, manifest: Manifest, first: int, stop: int, begin: int, stored: memoryview
) -> list[memoryview | CorruptDataError]:
    """decode_chunk of each chunk in ``stored`` (the stored bytes from offset ``begin`` on; blocking)."""
    out: list[memoryview | CorruptDataError] = []
    for index in range(first, stop):
        span = manifest.stored_chunk(index)
        try:
            out.append(memoryview(decode_chunk(key, manifest, index, stored[span.offset - begin :][: span.size])))
        except CorruptDataError as exc:
            out.append(exc)
    return out


async def _whole_digest(path: Path, size: int, pace: Callable[[], Awaitable[None]] | None) -> str:
    """The whole-file digest of an upload, one window per thread hop, paused by ``pace``."""
    digest = WholeFileDigest(path, size)
    while not digest.done:
        if pace is not None:
            await pace()
        await asyncio.to_thread(digest.step)
    return digest.hexdigest()


async def _check_cancel(cancel_check: Callable[[], Awaitable[bool]] | None, key: str) -> None:
    if cancel_check is not None and await cancel_check():
        raise UploadCancelled(f"upload of {key} cancelled")


@dataclass(frozen=True)
class _ChunkReader:
    """Reads, verifies and encodes chunks of one staged file (blocking: called in threads).

    Each read opens the file itself: a read thread can outlive a failed upload
    (threads cannot be cancelled), and must never find a shared descriptor closed
    or, worse, reused for another file.
    """

    path: Path
    key: str
    size: int
    chunk_size: int
    expected: tuple[str, ...] | None  # xxh3 of each chunk taken at close; None: nothing to check
    compress: str | None
    block_size: int = 0  # also hash each block of this many bytes (0: no block digests)
    blocks: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)  # chunk index -> its blocks'

    @property
    def count(self) -> int:
        return chunk_count(self.size, self.chunk_size)

    def block_digests(self) -> tuple[str, ...]:
        """The xxh3-64 of every block, in order (once every chunk was read)."""
        return tuple(digest for index in range(self.count) for digest in self.blocks[index])

    def length(self, index: int) -> int:
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def read(self, index: int) -> tuple[ChunkInfo, bytes]:
        start = index * self.chunk_size
        length = self.length(index)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = pread_full(fd, length, start)
        finally:
            os.close(fd)
        digest = xxhash.xxh3_64_hexdigest(data)
        if len(data) != length:
            raise CorruptDataError(f"staged file {self.path} ({self.key}) shrank below {start + length} bytes")
        if self.expected is not None and digest != self.expected[index]:
            raise CorruptDataError(
                f"staged file {self.path} ({self.key}): bytes {start}-{start + length} no longer match "
                f"the checksum taken at close (xxh3 {digest}, expected {self.expected[index]})"
            )
        if self.block_size:
            view = memoryview(data)
            self.blocks[index] = tuple(
                xxhash.xxh3_64_hexdigest(view[at : at + self.block_size]) for at in range(0, length, self.block_size)
            )
        return encode_chunk(data, digest, self.compress)

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
import functools
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lz4.frame
import xxhash

from .errors import CorruptDataError, ManifestError, RemoteNotFound, UploadCancelled
from .remote import INTERNAL_DIR, Remote, RetryPolicy, UploadedPart, fail_fast_group, run_workers
from .fileio import pread_full

log = logging.getLogger("burstfs.objects")

MANIFEST_VERSION = 1
CODECS = ("raw", "lz4")
# Bounds on what a manifest read from the (shared, possibly hostile) remote may
# ask for: a chunk is at most one S3 part (5 GiB) and a file at most 2**20 chunks
# (S3's 5 TiB object limit at the smallest part size, 5 MiB).  2**20 chunk
# entries take ~66 MB of JSON; three commas per entry bound the element count
# before json.loads builds anything.
MAX_MANIFEST_CHUNK_SIZE = 5 << 30
MAX_MANIFEST_CHUNKS = 1 << 20
MAX_MANIFEST_BYTES = 80 << 20
_MAX_MANIFEST_COMMAS = 3 * MAX_MANIFEST_CHUNKS + 8192
_INT64 = 1 << 63
#: A chunk is stored compressed only if lz4 saves at least this fraction: below
#: that, decompressing on every read costs more than the bytes it saves.
MIN_COMPRESSION_SAVING = 0.10
#: Upload ids journaled before the create returns the real one (see ObjectStore._put_multipart).
PENDING_UPLOAD = "pending-"
# Read size of the whole-file digest pass.
DIGEST_READ_SIZE = 8 << 20


def manifest_key(key: str) -> str:
    """Where the manifest of ``key`` lives on the remote."""
    return f"{INTERNAL_DIR}/manifests/{key}.json"


def _chunk_count(size: int, chunk_size: int) -> int:
    return -(-size // chunk_size)


@dataclass(frozen=True)
class FileDigests:
    """Checksums of a staged file, computed when it was closed.

    size: bytes hashed.
    chunk_size: bytes per chunk (the last one may be shorter).
    chunks: xxh3-64 hex of each chunk, in order (empty for an empty file).
    digest: xxh3-128 hex of the whole file.
    """

    size: int
    chunk_size: int
    chunks: tuple[str, ...]
    digest: str


class StreamingDigests:
    """Digests of a file written front to back, computed as the writes land.

    A close then journals the digests without re-reading the file, and the
    upload checks them against the staged bytes.  The kernel's write-back may
    deliver writes slightly out of order (those ahead of the hashed prefix wait
    in a small buffer) and rewrites a partly written page from its start (the
    repeated bytes are compared with the last page hashed and skipped).
    Anything else (an overwrite, a hole, more than ``max_pending`` bytes out of
    order) makes the digests unusable and the drain hashes the file instead.
    Thread-safe: writes land in worker threads.
    """

    TAIL = 4096  # a page: how far back a write-back rewrite of a partial page reaches

    def __init__(self, chunk_size: int, max_pending: int = 32 << 20) -> None:
        self.chunk_size = chunk_size
        self.max_pending = max_pending
        self.size = 0  # bytes hashed: the prefix [0, size)
        self.broken = False
        self._whole = xxhash.xxh3_128()
        self._chunk = xxhash.xxh3_64()
        self._in_chunk = 0
        self._chunks: list[str] = []
        self._tail = b""  # the last bytes hashed, up to TAIL
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self._lock = threading.Lock()

    def update(self, offset: int, data: bytes) -> None:
        with self._lock:
            if self.broken or not data:
                return
            if offset > self.size:
                if offset in self._pending or self._pending_bytes + len(data) > self.max_pending:
                    self._break()
                else:
                    self._pending[offset] = data
                    self._pending_bytes += len(data)
                return
            self._consume(offset, data)
            while not self.broken:
                ready = [o for o in self._pending if o <= self.size]
                if not ready:
                    break
                for o in sorted(ready):
                    if self.broken:  # an overwrite among them: _break() dropped the rest
                        break
                    data = self._pending.pop(o)
                    self._pending_bytes -= len(data)
                    self._consume(o, data)

    def result(self, size: int) -> FileDigests | None:
        """The digests of a file of ``size`` bytes, or None if they do not cover exactly that."""
        with self._lock:
            if self.broken or self._pending or self.size != size:
                return None
            chunks = [*self._chunks, self._chunk.copy().hexdigest()] if self._in_chunk else list(self._chunks)
            return FileDigests(self.size, self.chunk_size, tuple(chunks), self._whole.hexdigest())

    def _consume(self, offset: int, data: bytes) -> None:
        """Hash ``data`` at ``offset`` <= size, skipping bytes that repeat the hashed tail."""
        overlap = self.size - offset
        if overlap:
            repeated = data[:overlap]
            if overlap > len(self._tail) or repeated != self._tail[len(self._tail) - overlap :][: len(repeated)]:
                self._break()  # a real overwrite: the journal gets no digests for this close
                return
            data = data[overlap:]
        if data:
            self._hash(data)

    def _hash(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            piece = view[: self.chunk_size - self._in_chunk]
            self._chunk.update(piece)
            self._whole.update(piece)
            self._in_chunk += len(piece)
            view = view[len(piece):]
            if self._in_chunk == self.chunk_size:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk = xxhash.xxh3_64()
                self._in_chunk = 0
        self.size += len(data)
        self._tail = (self._tail + data[-self.TAIL:])[-self.TAIL:]

    def _break(self) -> None:
        self.broken = True
        self._pending.clear()
        self._pending_bytes = 0


def whole_file_digest(path: str | os.PathLike[str], size: int) -> str:
    """xxh3-128 of the first ``size`` bytes of ``path`` (blocking: run it in a thread)."""
    whole = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY)
    try:
        offset = 0
        while offset < size:
            data = pread_full(fd, min(DIGEST_READ_SIZE, size - offset), offset)
            if not data:
                raise CorruptDataError(f"staged file {path} shrank below {size} bytes while it was hashed")
            whole.update(data)
            offset += len(data)
    finally:
        os.close(fd)
    return whole.hexdigest()


def compute_digests(path: str | os.PathLike[str], chunk_size: int) -> FileDigests:
    """Hash ``path`` chunk by chunk (blocking: run it in a thread)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk size must be positive, not {chunk_size}")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        whole = xxhash.xxh3_128()
        chunks = []
        offset = 0
        while offset < size:
            want = min(chunk_size, size - offset)
            data = pread_full(fd, want, offset)
            chunks.append(xxhash.xxh3_64_hexdigest(data))
            whole.update(data)
            offset += len(data)
            if len(data) < want:  # the file shrank while we read it: digest what is there
                break
        return FileDigests(offset, chunk_size, tuple(chunks), whole.hexdigest())
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk as stored: its xxh3-64 (of the plain bytes), codec, and stored length."""

    xxh3: str
    codec: str
    stored_size: int


@dataclass(frozen=True)
class StoredChunk:
    """Where chunk ``index`` lies in the stored object: ``size`` bytes at ``offset``."""

    index: int
    offset: int
    size: int


@dataclass(frozen=True)
class Manifest:
    """What was uploaded for one file, enough to verify (and decompress) any range of it.

    key: the object key.  size: the file's length.  chunk_size: plain bytes per chunk.
    digest: xxh3-128 of the whole file.  generation: the staged generation uploaded.
    mtime_ns, mode: the file's attributes at staging.  chunks: one ChunkInfo per chunk.
    """

    key: str
    size: int
    chunk_size: int
    digest: str
    generation: int
    mtime_ns: int
    mode: int
    chunks: tuple[ChunkInfo, ...]
    version: int = MANIFEST_VERSION

    def to_json(self) -> bytes:
        doc = {
            "version": self.version,
            "key": self.key,
            "size": self.size,
            "chunk_size": self.chunk_size,
            "digest": self.digest,
            "generation": self.generation,
            "mtime_ns": self.mtime_ns,
            "mode": self.mode,
            "chunks": [dataclasses.asdict(c) for c in self.chunks],
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate untrusted bytes from the remote.

        Raises only :class:`~burstfs.errors.ManifestError` (a CorruptDataError:
        that one file is corrupt), naming the offending key, for anything this
        version cannot use: too large, not JSON, nested too deep, non-finite or
        non-integer numbers, wrong types, another version, sizes that do not add up.
        """
        if isinstance(data, str):
            data = data.encode()
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
        if bytes(data).count(b",") > _MAX_MANIFEST_COMMAS:
            raise ManifestError("manifest has more elements than any valid manifest")
        try:
            doc = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise ManifestError(f"unreadable manifest: {type(exc).__name__}: {str(exc)[:200]}") from None
        return _manifest_from_doc(cls, doc)

    def _problem(self) -> str | None:
        """Why this manifest cannot be right (sizes, counts, codecs), or None."""
        if self.version != MANIFEST_VERSION:
            return f"'version' is {self.version} (this burstfs reads {MANIFEST_VERSION})"
        if not 0 < self.chunk_size <= MAX_MANIFEST_CHUNK_SIZE:
            return f"'chunk_size' {self.chunk_size} is outside 1..{MAX_MANIFEST_CHUNK_SIZE}"
        if not 0 <= self.size <= MAX_MANIFEST_CHUNKS * self.chunk_size:
            return f"'size' {self.size} is outside 0..{MAX_MANIFEST_CHUNKS} chunks of {self.chunk_size}"
        if len(self.chunks) != _chunk_count(self.size, self.chunk_size):
            return f"'chunks' has {len(self.chunks)} entries for {self.size} bytes in chunks of {self.chunk_size}"
        for index, chunk in enumerate(self.chunks):
            start, end = self.chunk_range(index)
            length = end - start
            if chunk.codec not in CODECS:
                return f"'chunks[{index}].codec' is {chunk.codec!r}, not one of {CODECS}"
            if chunk.codec == "raw" and chunk.stored_size != length:
                return f"'chunks[{index}].stored_size' is {chunk.stored_size} for a raw chunk of {length} bytes"
            # lz4 is kept only when it saves space; allow the frame's worst-case overhead anyway.
            if chunk.codec == "lz4" and not 0 < chunk.stored_size <= length + length // 255 + 64:
                return f"'chunks[{index}].stored_size' is {chunk.stored_size} for an lz4 chunk of {length} bytes"
        return None

    @functools.cached_property
    def _stored_offsets(self) -> list[int]:
        offsets = [0]
        for chunk in self.chunks:
            offsets.append(offsets[-1] + chunk.stored_size)
        return offsets

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Logical bytes ``[start, end)`` of chunk ``index``."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.size)

    def stored_chunk(self, index: int) -> StoredChunk:
        """Where chunk ``index`` is in the stored object."""
        return StoredChunk(index, self._stored_offsets[index], self.chunks[index].stored_size)

    def stored_chunks(self, start: int, end: int) -> list[StoredChunk]:
        """The stored chunks holding logical bytes ``[start, end)`` (clamped to the file)."""
        end = min(end, self.size)
        if start >= end:
            return []
        return [self.stored_chunk(i) for i in range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)]


class ObjectStore:
    """Files as verified objects on ``remote``; every remote call is retried by ``retry``."""

    def __init__(
        self, remote: Remote, retry: RetryPolicy | None = None, *,
        on_upload_started: Callable[[str, str], None] | None = None,
        on_upload_ended: Callable[[str], None] | None = None,
    ) -> None:
        """``on_upload_started(key, upload_id)`` runs before the first part of a multipart upload
        goes up and ``on_upload_ended(upload_id)`` once it is completed or aborted, so that a
        restart aborts exactly the uploads this cache left (never another node's)."""
        self.remote = remote
        self.retry = retry or RetryPolicy()
        self.on_upload_started = on_upload_started
        self.on_upload_ended = on_upload_ended

    async def _call(self, fn: Callable[..., Any], *args: Any, what: str) -> Any:
        return await self.retry.call(self.remote, fn, *args, what=what)

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
        cancel_check: Callable[[], bool] | None = None,
    ) -> Manifest:
        """Upload the staged file at ``path`` to ``key`` and write its manifest.

        Every chunk is checked against ``expected`` before it is sent: a mismatch
        (the staged file changed or rotted) raises CorruptDataError naming the
        file and byte range, and nothing is published.  Files of one chunk or
        less go up in a single PUT, larger ones as a multipart upload holding at
        most ``concurrency`` chunks in memory (or one part plus one chunk, if
        more) and at most ``concurrency`` parts in flight.
        If ``cancel_check()`` returns true between chunks, the upload is aborted
        and :class:`~burstfs.errors.UploadCancelled` raised.  Any failure aborts
        the multipart upload.  Returns the manifest written.

        With ``expected`` None (a file whose digests were not taken as it was
        written, e.g. written through FUSE passthrough) there is nothing to check
        against: chunks of ``chunk_size`` are hashed as they are read for upload
        and the whole-file digest is taken by a concurrent pass, so the file is
        not read once more before the upload; the manifest carries both.
        """
        if compress not in (None, "lz4"):
            raise ValueError(f"unknown compression {compress!r}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, not {concurrency}")
        size = (await asyncio.to_thread(os.stat, path)).st_size
        if expected is not None:
            chunk_size = expected.chunk_size
            if chunk_size <= 0 or len(expected.chunks) != _chunk_count(expected.size, chunk_size):
                raise ValueError(f"digests of {key}: {len(expected.chunks)} chunks do not cover {expected.size} bytes")
            if size != expected.size:
                raise CorruptDataError(f"staged file {path} ({key}) is {size} bytes, but {expected.size} were checksummed")
        elif chunk_size <= 0:
            raise ValueError(f"chunk size must be positive, not {chunk_size}")
        reader = _ChunkReader(Path(path), key, size, chunk_size, expected.chunks if expected else None, compress)
        whole = None if expected else asyncio.ensure_future(asyncio.to_thread(whole_file_digest, reader.path, size))
        try:
            if reader.count <= 1:
                chunks = await self._put_whole(key, reader, cancel_check)
            else:
                chunks = await self._put_multipart(key, reader, concurrency, cancel_check)
            if whole is not None:
                digest = await whole
            else:
                assert expected is not None
                digest = expected.digest
        finally:
            if whole is not None and not whole.done():
                whole.cancel()
        manifest = Manifest(
            key=key,
            size=size,
            chunk_size=chunk_size,
            digest=digest,
            generation=generation,
            mtime_ns=mtime_ns,
            mode=mode,
            chunks=tuple(chunks),
        )
        await self._call(self.remote.put_object, manifest_key(key), manifest.to_json(), what=f"put manifest {key}")
        return manifest

    async def _put_whole(
        self, key: str, reader: _ChunkReader, cancel_check: Callable[[], bool] | None
    ) -> list[ChunkInfo]:
        _check_cancel(cancel_check, key)
        if not reader.count:
            await self._call(self.remote.put_object, key, b"", what=f"put {key}")
            return []
        info, data = await asyncio.to_thread(reader.read, 0)
        await self._call(self.remote.put_object, key, data, what=f"put {key}")
        return [info]

    async def _put_multipart(
        self, key: str, reader: _ChunkReader, concurrency: int, cancel_check: Callable[[], bool] | None
    ) -> list[ChunkInfo]:
        """Read, check and encode chunks in threads and upload them as parts, memory bounded.

        A part is a run of whole chunks, long enough for the remote's minimum part
        size (lz4 chunks can be small) and its part count limit (huge files).
        Chunks are read ahead and parts uploaded concurrently within a byte
        budget of ``concurrency`` chunks (or one part plus one chunk if larger).
        """
        chunk_size = reader.chunk_size
        count = reader.count
        target = max(self.remote.min_part_size, chunk_size * -(-count // self.remote.max_parts))
        budget = _ByteBudget(max(concurrency * chunk_size, target + chunk_size))
        upload_slots = asyncio.Semaphore(concurrency)
        reads: asyncio.Queue[asyncio.Task[tuple[ChunkInfo, bytes]]] = asyncio.Queue()
        chunks: list[ChunkInfo] = []
        parts: list[UploadedPart] = []
        # Journaled before the create: a crash between the create and its record
        # leaves a placeholder, and the next start aborts the uploads to this key.
        placeholder = f"{PENDING_UPLOAD}{os.urandom(8).hex()}"
        if self.on_upload_started is not None:
            self.on_upload_started(key, placeholder)
        upload_id: str = await self._call(self.remote.create_multipart, key, what=f"create upload {key}")
        try:
            if self.on_upload_started is not None:
                self.on_upload_started(key, upload_id)
        except BaseException:
            await self._abort(key, upload_id)
            raise
        self._upload_ended(placeholder)

        async def read_ahead(group: asyncio.TaskGroup) -> None:
            for index in range(count):
                _check_cancel(cancel_check, key)
                await budget.acquire(reader.length(index))
                reads.put_nowait(group.create_task(asyncio.to_thread(reader.read, index)))

        async def send(number: int, offset: int, data: bytes) -> None:
            try:
                what = f"upload {key} part {number}"
                parts.append(await self._call(self.remote.upload_part, key, upload_id, number, offset, data, what=what))
            finally:
                budget.release(len(data))
                upload_slots.release()

        async def assemble(group: asyncio.TaskGroup) -> None:
            buffer: list[bytes] = []
            buffered = offset = number = 0
            for index in range(count):
                info, data = await (await reads.get())
                budget.release(reader.length(index) - len(data))  # keep only what compression left
                chunks.append(info)
                buffer.append(data)
                buffered += len(data)
                if buffered >= target or index == count - 1:
                    await upload_slots.acquire()
                    number += 1
                    group.create_task(send(number, offset, b"".join(buffer)))
                    offset += buffered
                    buffer, buffered = [], 0

        try:
            async with fail_fast_group() as group:
                group.create_task(read_ahead(group))
                group.create_task(assemble(group))
            _check_cancel(cancel_check, key)
            await self._call(self.remote.complete_multipart, key, upload_id, parts, what=f"complete upload {key}")
        except BaseException:
            await self._abort(key, upload_id)
            raise
        self._upload_ended(upload_id)
        return chunks

    def _upload_ended(self, upload_id: str) -> None:
        if self.on_upload_ended is not None:
            try:
                self.on_upload_ended(upload_id)
            except Exception as exc:  # the record stays: the next start aborts an upload already gone
                log.warning("event=upload_record_failed upload_id=%s error=%r", upload_id, str(exc))

    async def _abort(self, key: str, upload_id: str) -> None:
        try:
            await self._call(self.remote.abort_multipart, key, upload_id, what=f"abort upload {key}")
        except Exception as exc:  # abort_stale_uploads() removes it later
            log.warning("event=abort_failed key=%s upload_id=%s error=%r", key, upload_id, str(exc))
        else:
            self._upload_ended(upload_id)

    # -- read -------------------------------------------------------------------------

    async def fetch_manifest(self, key: str) -> Manifest | None:
        """The manifest of ``key``, or None for an object burstfs did not write."""
        try:  # a ranged GET: a huge object at the manifest's key is never read whole
            data = await self._call(self.remote.get_range, manifest_key(key), 0, MAX_MANIFEST_BYTES + 1,
                                    what=f"get manifest {key}")  # fmt: skip
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

    async def read_chunk(self, key: str, manifest: Manifest, index: int) -> bytes:
        """The plain bytes of chunk ``index``, verified against the manifest."""
        span = manifest.stored_chunk(index)
        stored = await self._call(
            self.remote.get_range, key, span.offset, span.offset + span.size, what=f"get {key} chunk {index}"
        )
        return await asyncio.to_thread(_decode_chunk, key, manifest, index, stored)

    async def read_range(self, key: str, manifest: Manifest | None, start: int, end: int) -> bytes:
        """Logical bytes ``[start, end)`` of ``key``, shorter at the end of the file.

        With a manifest every chunk touched is fetched whole and verified first
        (CorruptDataError on a mismatch); without one (an object another tool
        wrote) the bytes are returned unverified and the caller says so.
        """
        if manifest is None:
            data: bytes = await self._call(self.remote.get_range, key, start, end, what=f"get {key}")
            return data
        spans = manifest.stored_chunks(start, end)
        if not spans:
            return b""
        end = min(end, manifest.size)
        results: dict[int, bytes] = {}
        pending = iter(spans)

        async def worker() -> None:
            for span in pending:
                results[span.index] = await self.read_chunk(key, manifest, span.index)

        await run_workers(worker, len(spans))
        pieces = []
        for span in spans:
            chunk_start, _ = manifest.chunk_range(span.index)
            lo, hi = max(start, chunk_start) - chunk_start, min(end - chunk_start, len(results[span.index]))
            pieces.append(memoryview(results[span.index])[lo:hi])
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
        try:
            await self._call(self.remote.copy, src, dst, what=f"copy {src} to {dst}")
        except RemoteNotFound:
            moved = await self.fetch_manifest(dst)
            if moved is None or (manifest is not None and moved.digest != manifest.digest):
                raise
            log.info("event=rename_already_done src=%s dst=%s", src, dst)
        else:
            if manifest is not None:
                moved_json = dataclasses.replace(manifest, key=dst).to_json()
                await self._call(self.remote.put_object, manifest_key(dst), moved_json, what=f"put manifest {dst}")
            else:  # a stale manifest at dst would make the new bytes look corrupt
                await self._call(self.remote.delete, manifest_key(dst), what=f"delete manifest {dst}")
        if delete_source:
            await self.delete(src)

    async def delete(self, key: str) -> None:
        """Remove the object and its manifest (missing ones are fine)."""
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
            self._upload_ended(upload_id)
            log.info("event=stale_upload_aborted key=%s upload_id=%s", key, upload_id)
        for key, upload_id in uploads:
            if upload_id.startswith(PENDING_UPLOAD):
                self._upload_ended(upload_id)
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


def _check_cancel(cancel_check: Callable[[], bool] | None, key: str) -> None:
    if cancel_check is not None and cancel_check():
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

    @property
    def count(self) -> int:
        return _chunk_count(self.size, self.chunk_size)

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
        if self.compress == "lz4":
            packed = lz4.frame.compress(data, block_size=lz4.frame.BLOCKSIZE_MAX4MB, content_checksum=False)
            if len(packed) <= len(data) * (1 - MIN_COMPRESSION_SAVING):
                return ChunkInfo(digest, "lz4", len(packed)), packed
        return ChunkInfo(digest, "raw", len(data)), data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _field(doc: dict[str, Any], name: str, kind: type, where: str = "") -> Any:
    """``doc[name]``, which must be exactly of type ``kind`` (no bool for int, no float)."""
    label = f"{where}{name}"
    if name not in doc:
        raise ManifestError(f"invalid manifest: key '{label}' is missing")
    value = doc[name]
    if type(value) is not kind:
        raise ManifestError(f"invalid manifest: key '{label}' is {type(value).__name__}, expected {kind.__name__}")
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        raise ManifestError(f"invalid manifest: key '{label}' is out of range")
    return value


def _hex_field(doc: dict[str, Any], name: str, length: int, where: str = "") -> str:
    value: str = _field(doc, name, str, where)
    if len(value) != length or any(c not in "0123456789abcdef" for c in value):
        raise ManifestError(f"invalid manifest: key '{where}{name}' is not {length} hex digits")
    return value


def _manifest_from_doc(cls: type[Manifest], doc: Any) -> Manifest:
    """Build a Manifest from parsed JSON, checking every type and bound (ManifestError)."""
    if type(doc) is not dict:
        raise ManifestError(f"invalid manifest: the document is a {type(doc).__name__}, expected an object")
    version = _field(doc, "version", int)
    if version != MANIFEST_VERSION:
        raise ManifestError(f"invalid manifest: key 'version' is {version} (this burstfs reads {MANIFEST_VERSION})")
    key = _field(doc, "key", str)
    if not key:
        raise ManifestError("invalid manifest: key 'key' is empty")
    raw_chunks = _field(doc, "chunks", list)
    if len(raw_chunks) > MAX_MANIFEST_CHUNKS:
        raise ManifestError(f"invalid manifest for {key}: key 'chunks' has more than {MAX_MANIFEST_CHUNKS} entries")
    chunks = []
    for index, raw in enumerate(raw_chunks):
        where = f"chunks[{index}]."
        if type(raw) is not dict:
            raise ManifestError(f"invalid manifest for {key}: key 'chunks[{index}]' is {type(raw).__name__}, expected object")
        chunks.append(ChunkInfo(_hex_field(raw, "xxh3", 16, where), _field(raw, "codec", str, where),
                                _field(raw, "stored_size", int, where)))  # fmt: skip
    mode = _field(doc, "mode", int)
    if not 0 <= mode < 1 << 32:
        raise ManifestError(f"invalid manifest for {key}: key 'mode' is out of range")
    generation = _field(doc, "generation", int)
    if generation < 0:
        raise ManifestError(f"invalid manifest for {key}: key 'generation' is negative")
    manifest = cls(
        key=key,
        size=_field(doc, "size", int),
        chunk_size=_field(doc, "chunk_size", int),
        digest=_hex_field(doc, "digest", 32),
        generation=generation,
        mtime_ns=_field(doc, "mtime_ns", int),
        mode=mode,
        chunks=tuple(chunks),
        version=version,
    )
    problem = manifest._problem()
    if problem:
        raise ManifestError(f"invalid manifest for {key}: {problem}")
    return manifest


def _decode_chunk(key: str, manifest: Manifest, index: int, stored: bytes) -> bytes:
    """Decompress and verify one stored chunk (blocking: called in a thread)."""
    info = manifest.chunks[index]
    start, end = manifest.chunk_range(index)
    data = stored
    problem = None
    if len(stored) != info.stored_size:
        problem = f"stored chunk is {len(stored)} bytes, expected {info.stored_size}"
    elif info.codec == "lz4":
        decompressor = lz4.frame.LZ4FrameDecompressor()
        try:
            data = decompressor.decompress(stored, max_length=end - start)
            if not decompressor.eof:
                problem = "lz4 frame longer than the chunk"
        except RuntimeError as exc:
            problem = f"lz4 frame unreadable: {exc}"
    if problem is None and len(data) != end - start:
        problem = f"chunk is {len(data)} bytes, expected {end - start}"
    if problem is None:
        digest = xxhash.xxh3_64_hexdigest(data)
        if digest != info.xxh3:
            problem = f"xxh3 {digest}, expected {info.xxh3}"
    if problem is not None:
        log.error("event=corrupt_data key=%s range=%d-%d chunk=%d problem=%r", key, start, end, index, problem)
        raise CorruptDataError(f"{key}: bytes {start}-{end} do not match their checksum ({problem})")
    return data

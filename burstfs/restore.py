"""Restore: fetching remote files into the local tier, chunk by chunk, verified.

Runs on the mover's asyncio loop.  A read of a file that is not local asks for
the chunks covering it, in one of two plans:

- a file read sequentially from its start (``torch.load``, a rank reading its
  shard, ``burstfs-admin prefetch``) on a remote that prefers it (S3) is
  *streamed*: one GET of the rest of the file, its body written to the tier in
  ~1 MiB pieces as it arrives and each chunk served as soon as it is complete
  and verified.  The stream runs at most as far ahead of its reader as the
  reader has read (up to ``MAX_STREAM_LEAD``), so bytes fetched stay within
  twice the bytes read; a connection lost mid-body is resumed from the first
  byte that has not landed.  One GET per file is what moto wants (it reads the
  whole object for every ranged GET) and costs real S3 nothing per byte;
- any other read (mmap, safetensors ``safe_open``, the zip directory at the end
  of a ``torch.save`` file) fetches the chunks it touches with ranged GETs, and
  a sequential run grows a prefetch window of half as many chunks as it has
  read (up to ``MAX_WINDOW_CHUNKS``; none after a seek), so a random reader
  fetches little more than it touches.

Every chunk is checked against the digests recorded at drain time before a
byte of it is served (a ranged chunk before it lands on the tier; a streamed
chunk as its pieces pass, and it is only marked present once the whole chunk
checked out); fetched chunks stay there, so the next read is local.

What a fetch is verified against, strongest first: the manifest's chunk
digests (whose whole-file digest must match the journal's, for files this node
drained); without a manifest, the journal's own chunk digests, or, if it has
only the whole-file digest, that digest over the whole file before a byte is
served; only objects nobody recorded digests for (other tools, other nodes
without a manifest) are served unverified, and the log says so.

Descriptors: a partly fetched file keeps its data file open only while it is
among the ``max_open_fds`` most recently written ones (an LRU); others are
closed and reopened when their next chunk arrives, so cold reads of many files
cannot exhaust the daemon's descriptors.  A descriptor is closed only once no
``pwrite`` (in a worker thread, which cancellation cannot stop) still uses it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
from collections.abc import Coroutine
from typing import Any

import xxhash

from .errors import CorruptDataError, FsError, RemoteError
from .fileio import pread_full, pwrite_full
from .journal import InodeRow, Journal
from .localtier import LocalTier
from .objects import Manifest, ObjectStore
from .remote.retry import RetryPolicy, describe_error

log = logging.getLogger("burstfs.restore")

# Chunk size for objects without a manifest (written by other tools): large
# enough to amortize a GET, small enough that a random read stays cheap.
UNVERIFIED_CHUNK = 8 * 1024 * 1024
# The ranged prefetch window grows to this many chunks (8 MiB each: 128 MiB ahead),
# enough to keep a fast remote busy; memory use is bounded by `concurrency`.
MAX_WINDOW_CHUNKS = 16
# A stream writes its body to the tier in pieces of this size (one thread hop each).
STREAM_PIECE = 1 << 20
# A stream lands at most this far beyond what its reader has asked for (tier space, not memory).
MAX_STREAM_LEAD = 256 << 20
# Streams at once (each holds one connection); more sequential readers get ranged chunks.
MAX_STREAMS = 8
# A stream that has waited this long for its reader to move on ends (its connection is released).
STREAM_IDLE_S = 20.0
# Ranged GETs in flight for all files together: shared fairly (FIFO) by every
# file being restored, so 8 ranks reading shards each get their share.
FETCH_CONCURRENCY = 16
# Data files of partly fetched files kept open (LRU); the rest are reopened on demand.
MAX_OPEN_FDS = 64
# Read size of the whole-file check of a file known only by its journal digest.
VERIFY_READ_SIZE = 8 << 20
# Written by a drain that compresses: its presence tells readers that listed
# object sizes are stored sizes, not file sizes.
LAYOUT_KEY = ".burstfs/layout.json"
#: Listings answer requests (a lookup miss, an opendir): one attempt, bounded, never
#: the drain's retry budget (8 attempts of up to 60 s each).  A failed listing is
#: tried again by the core after its backoff; the drain keeps its own retries.
LISTING_RETRY = RetryPolicy(attempts=1)
#: A listing attempt (with the manifests a compressed layout needs) gives up after this.
LISTING_ATTEMPT_TIMEOUT_S = 20.0


@dataclasses.dataclass(eq=False)
class _FileFetch:
    ino: int
    key: str
    size: int
    chunk_size: int
    manifest: Manifest | None
    # Without a manifest: the journal's chunk digests, or only its whole-file digest.
    expected_chunks: tuple[str, ...] | None = None
    whole_digest: str | None = None
    verified: bool = False  # whole_digest checked over the complete local file
    present: set[int] = dataclasses.field(default_factory=set)
    in_flight: dict[int, asyncio.Task[None]] = dataclasses.field(default_factory=dict)  # ranged chunk fetches
    window: int = 0  # ranged prefetch, in chunks beyond the last read
    next_offset: int = 0
    run_start: int = 0  # where the current sequential run began
    stream: _Stream | None = None
    contiguous: int = 0  # chunks present from the start without a gap
    fd: int | None = None
    fd_users: int = 0  # pwrites in flight on fd (in threads)
    closed: bool = False  # forgotten or finished: the fd goes once its users are done
    verifying: asyncio.Future[None] | None = None

    @property
    def chunks(self) -> int:
        return (self.size + self.chunk_size - 1) // self.chunk_size

    @property
    def streamable(self) -> bool:
        """Stored bytes are the file's bytes (no compressed chunk): a stream can land them as they come."""
        return self.manifest is None or all(c.codec == "raw" for c in self.manifest.chunks)

    def chunk_start(self, index: int) -> int:
        return min(index * self.chunk_size, self.size)

    @property
    def verification(self) -> str:
        if self.manifest is not None:
            return "manifest"
        if self.expected_chunks is not None:
            return "journal_chunks"
        return "journal_digest" if self.whole_digest else "none"


@dataclasses.dataclass(eq=False)
class _Stream:
    """One streaming GET of chunks ``[next_chunk, end_chunk)`` of a file."""

    next_chunk: int  # the chunk landing now
    end_chunk: int
    limit: int  # no chunk starting at or beyond this offset is started (the reader's end plus its lead)
    moved: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # limit raised, or the stream must stop
    waiters: dict[int, asyncio.Future[None]] = dataclasses.field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    landed_bytes: int = 0  # of the chunk landing now, already on the tier and hashed
    hasher: xxhash.xxh3_64 = dataclasses.field(default_factory=xxhash.xxh3_64)  # of those bytes
    skipping: bool = False  # the chunk landing now is present or fetched by a ranged GET: read past it

    def extend(self, limit: int) -> None:
        if limit > self.limit:
            self.limit = limit
            self.moved.set()


class RestoreService:
    """Fetches remote-only (evicted or listed) files into the local tier."""

    def __init__(
        self,
        store: ObjectStore,
        journal: Journal,
        tier: LocalTier,
        concurrency: int = FETCH_CONCURRENCY,
        max_open_fds: int = MAX_OPEN_FDS,
    ) -> None:
        self.store = store
        self.journal = journal
        self.tier = tier
        self.fetched_bytes = 0
        self.max_open_fds = max(1, max_open_fds)
        self._slots = asyncio.Semaphore(concurrency)
        self.max_streams = MAX_STREAMS
        self._streams = 0
        self._files: dict[int, _FileFetch] = {}
        self._opening: dict[int, asyncio.Future[_FileFetch]] = {}
        self._open_fds: collections.OrderedDict[int, _FileFetch] = collections.OrderedDict()  # LRU, oldest first
        self._compressed: bool | None = None
        self.listing_retry = LISTING_RETRY
        self._tasks = OwnedTasks()  # every chunk fetch, prefetches included: aclose() ends them
        self.listing_timeout = LISTING_ATTEMPT_TIMEOUT_S
        self.stream_idle_s = STREAM_IDLE_S
        self.stream_piece = STREAM_PIECE

    def warm(self) -> None:
        """Prepare the remote's client and a connection now (the mover starts), not in the first read."""
        self._tasks.start(self.store.remote.warm())

    @property
    def open_fds(self) -> int:
        """Data files this service holds open now (bounded by ``max_open_fds`` plus writes in flight)."""
        return len(self._open_fds)

    async def list_dir(self, dir_key: str) -> tuple[list[tuple[str, int, float]], list[str]]:
        """(name, size, mtime) of files and names of subdirectories under ``dir_key``.

        A listing gives stored sizes; when the remote holds compressed objects
        (see :data:`LAYOUT_KEY`), the file sizes come from their manifests.
        """
        try:
            return await asyncio.wait_for(self._list_dir_once(dir_key), self.listing_timeout)
        except TimeoutError:
            raise RemoteError(
                f"list {dir_key or '/'}: remote {self.store.remote.url} did not answer within "
                f"{self.listing_timeout:.0f}s",
                kind="unavailable",
            ) from None

    async def _list_dir_once(self, dir_key: str) -> tuple[list[tuple[str, int, float]], list[str]]:
        """list_dir's one attempt (``listing_retry``), without a bound of its own."""
        remote = self.store.remote
        files, subdirs = await self.listing_retry.call(remote, remote.list_dir, dir_key, what=f"list {dir_key or '/'}")
        prefix = f"{dir_key}/" if dir_key else ""
        sizes = {info.key: info.size for info in files}
        if await self._compressed_layout():

            async def logical_size(key: str) -> None:
                async with self._slots:
                    manifest = await self.store.fetch_manifest(key)
                if manifest is not None:
                    sizes[key] = manifest.size

            await asyncio.gather(*(logical_size(info.key) for info in files))
        return [(info.key[len(prefix) :], sizes[info.key], info.mtime) for info in files], subdirs

    async def _compressed_layout(self) -> bool:
        if self._compressed is None:
            remote = self.store.remote
            head = await self.listing_retry.call(remote, remote.head, LAYOUT_KEY, what="head layout")
            self._compressed = head is not None
        return self._compressed

    async def ensure_local(self, ino: int, offset: int, length: int) -> int:
        """Make bytes [offset, offset+length) local.

        Returns how many bytes from the start of the file are now local without a
        gap (the file's size once it is all here), so the caller can serve reads
        below that without asking again.
        """
        fetch = await self._fetch_state(ino)
        if fetch.size == 0:
            return await self._complete(fetch)
        end = min(offset + length, fetch.size)
        whole = offset == 0 and end >= fetch.size  # a prefetch, or a file opened for writing
        if fetch.whole_digest is not None:
            # Only the whole file can be checked: fetch all of it before serving a byte.
            offset, end, whole = 0, fetch.size, True
        first, last = offset // fetch.chunk_size, max(offset, end - 1) // fetch.chunk_size
        # Sequential: where the last read ended, or further on inside the gap-free
        # local prefix (the core serves reads there without asking).
        if not (offset == fetch.next_offset or fetch.next_offset < offset <= self._contiguous(fetch)):
            fetch.run_start = offset
        fetch.next_offset = end
        run = end - fetch.run_start
        # Beyond this read, a stream or the ranged window goes as far as this run has read already:
        # a reader that stops (at the end of a tensor) has fetched at most about twice what it read.
        ahead = run if run > length else 0
        lead = fetch.size if whole else min(ahead, MAX_STREAM_LEAD)
        stream = fetch.stream
        at_stream = stream is not None and fetch.chunk_start(first) <= stream.limit  # a read the stream is serving
        if (
            self._streaming(fetch)
            and (whole or at_stream or fetch.run_start < fetch.chunk_size)
            and self._stream_to(fetch, first, end + lead)
        ):
            fetch.window = 0
        else:
            fetch.window = min(ahead // 2 // fetch.chunk_size, MAX_WINDOW_CHUNKS)  # prefetches can outlive the reader
            for i in range(last + 1, min(last + 1 + fetch.window, fetch.chunks)):
                self._chunk(fetch, i)  # prefetch: not awaited
        needed = [self._chunk(fetch, i) for i in range(first, min(last, fetch.chunks - 1) + 1)]
        await asyncio.gather(*needed)
        return await self._complete(fetch)

    def _contiguous(self, fetch: _FileFetch) -> int:
        if fetch.whole_digest is not None and not fetch.verified:
            return 0  # nothing is served before the whole file checked out
        while fetch.contiguous < fetch.chunks and fetch.contiguous in fetch.present:
            fetch.contiguous += 1
        return min(fetch.contiguous * fetch.chunk_size, fetch.size)

    async def _fetch_state(self, ino: int) -> _FileFetch:
        if ino in self._files:
            return self._files[ino]
        if ino in self._opening:
            return await asyncio.shield(self._opening[ino])
        future: asyncio.Future[_FileFetch] = asyncio.get_running_loop().create_future()
        self._opening[ino] = future
        try:
            fetch = await self._open(ino)
            self._files[ino] = fetch
            future.set_result(fetch)
            return fetch
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._opening[ino]

    async def _open(self, ino: int) -> _FileFetch:
        row = await asyncio.to_thread(self.journal.fetch_row, ino)
        if row is None or not row.remote_key:
            raise FsError(errno.EIO, f"inode {ino} has no remote object to fetch")
        manifest = await self.store.fetch_manifest(row.remote_key)
        if manifest is None:
            fetch = self._without_manifest(row)
        else:
            if row.digest and manifest.digest != row.digest:
                log.error(
                    "event=corrupt_data key=%s ino=%d problem=%r",
                    row.remote_key,
                    ino,
                    f"manifest digest {manifest.digest}, journal {row.digest}",
                )
                raise CorruptDataError(
                    f"remote object {row.remote_key} changed since it was drained "
                    f"(digest {manifest.digest}, journal {row.digest})"
                )
            fetch = _FileFetch(ino, row.remote_key, manifest.size, manifest.chunk_size, manifest)
        await asyncio.to_thread(self._create_data_file, ino, fetch.size)
        return fetch

    def _without_manifest(self, row: InodeRow) -> _FileFetch:
        """Fetch state for an object without a manifest: verified by the journal's digests if it has them."""
        assert row.remote_key is not None
        if not row.digest:
            log.warning("event=unverified_object key=%s note=no burstfs digests, served unverified", row.remote_key)
            return _FileFetch(row.ino, row.remote_key, row.size, UNVERIFIED_CHUNK, None)
        chunks = _journal_chunks(row)
        if chunks is not None:
            assert row.chunk_size is not None
            log.warning("event=manifest_missing key=%s verify=journal_chunks", row.remote_key)
            return _FileFetch(row.ino, row.remote_key, row.size, row.chunk_size, None, expected_chunks=chunks)
        log.warning(
            "event=manifest_missing key=%s verify=journal_digest note=whole file fetched before serving", row.remote_key
        )
        return _FileFetch(row.ino, row.remote_key, row.size, UNVERIFIED_CHUNK, None, whole_digest=row.digest)

    def _create_data_file(self, ino: int, size: int) -> None:
        """The sparse data file the chunks land in (blocking: run in a thread)."""
        fd = self.tier.open_data(ino, create=True)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    # -- descriptors ------------------------------------------------------------------

    def _acquire_fd(self, fetch: _FileFetch) -> int:
        """The data file's descriptor for one pwrite, opened if the LRU dropped it."""
        if fetch.closed:
            raise FsError(errno.ESTALE, f"{fetch.key}: the file went away during its fetch")
        if fetch.fd is None:
            fetch.fd = self.tier.open_data(fetch.ino)  # a local open: cheap enough for the loop
        fetch.fd_users += 1
        self._open_fds[fetch.ino] = fetch
        self._open_fds.move_to_end(fetch.ino)
        self._trim_fds()
        return fetch.fd

    def _release_fd(self, fetch: _FileFetch) -> None:
        fetch.fd_users -= 1
        if fetch.fd_users == 0 and fetch.closed:
            self._close_fd(fetch)
        else:
            self._trim_fds()

    def _trim_fds(self) -> None:
        """Close the least recently used idle descriptors beyond ``max_open_fds``."""
        excess = len(self._open_fds) - self.max_open_fds
        if excess <= 0:
            return
        for fetch in [f for f in self._open_fds.values() if f.fd_users == 0][:excess]:
            self._close_fd(fetch)

    def _close_fd(self, fetch: _FileFetch) -> None:
        if self._open_fds.get(fetch.ino) is fetch:
            del self._open_fds[fetch.ino]
        if fetch.fd is not None:
            fd, fetch.fd = fetch.fd, None
            os.close(fd)

    async def _write(
        self, fetch: _FileFetch, data: bytes | memoryview, offset: int, hasher: xxhash.xxh3_64 | None = None
    ) -> None:
        """pwrite ``data`` (and hash it into ``hasher``) in a thread; the descriptor stays open
        until that thread is done, even if this task is cancelled (forget) meanwhile."""
        fd = self._acquire_fd(fetch)
        try:
            write = asyncio.ensure_future(asyncio.to_thread(_write_hashed, fd, data, offset, hasher))
        except BaseException:
            self._release_fd(fetch)
            raise

        def done(future: asyncio.Future[None]) -> None:
            self._release_fd(fetch)
            if not future.cancelled():
                future.exception()  # retrieved here if the awaiting task was cancelled

        write.add_done_callback(done)
        await asyncio.shield(write)

    # -- chunks -----------------------------------------------------------------------

    def _chunk(self, fetch: _FileFetch, index: int) -> asyncio.Future[None]:
        """A future for chunk ``index`` landing: done, a ranged fetch, or the stream passing it."""
        if index in fetch.present:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        task = fetch.in_flight.get(index)
        if task is not None:
            return task
        stream = fetch.stream
        if (
            stream is not None
            and stream.next_chunk <= index < stream.end_chunk
            and fetch.chunk_start(index) < stream.limit
        ):
            waiter = stream.waiters.get(index)
            if waiter is None:
                waiter = stream.waiters[index] = asyncio.get_running_loop().create_future()
            return waiter
        task = self._tasks.start(self._fetch_chunk(fetch, index))
        fetch.in_flight[index] = task
        return task

    # -- streams ----------------------------------------------------------------------

    def _streaming(self, fetch: _FileFetch) -> bool:
        return self.store.remote.prefers_streams and fetch.streamable

    def _stream_to(self, fetch: _FileFetch, first: int, limit: int) -> bool:
        """Have a stream land the chunks from ``first`` on, up to the chunk starting below ``limit``.

        Extends the file's stream (chunks it already passed that are missing are
        fetched ranged by :meth:`_chunk`); otherwise starts one from the first
        missing chunk to the end of the file.  False when every stream slot is
        taken: the caller fetches ranged chunks instead.
        """
        limit = min(limit, fetch.size)
        if fetch.stream is not None:
            fetch.stream.extend(limit)
            return True
        start = first
        while start < fetch.chunks and (start in fetch.present or start in fetch.in_flight):
            start += 1
        if start >= fetch.chunks or fetch.chunk_start(start) >= limit:
            return True  # everything up to the limit is here or on its way
        if self._streams >= self.max_streams:
            return False
        stream = fetch.stream = _Stream(next_chunk=start, end_chunk=fetch.chunks, limit=limit)
        self._streams += 1
        try:
            stream.task = self._tasks.start(self._run_stream(fetch, stream))
        except BaseException:
            self._streams -= 1
            if fetch.stream is stream:
                fetch.stream = None
            raise
        stream.task.add_done_callback(functools.partial(self._stream_ended, fetch, stream))
        return True

    def _stream_ended(self, fetch: _FileFetch, stream: _Stream, task: asyncio.Task[None]) -> None:
        """Give the slot back; readers still waiting get its error, or (it went idle) a ranged fetch each."""
        self._streams -= 1
        if fetch.stream is stream:
            fetch.stream = None
        error = None if task.cancelled() else task.exception()
        for index, waiter in stream.waiters.items():
            if waiter.done():
                continue
            if task.cancelled() or (error is None and fetch.closed):
                waiter.cancel()
            elif error is not None:
                waiter.set_exception(error)
                waiter.exception()  # retrieved: a reader that went away leaves no warning
            else:
                self._chunk(fetch, index).add_done_callback(functools.partial(_pass_outcome, waiter))

    async def _run_stream(self, fetch: _FileFetch, stream: _Stream) -> None:
        """Land the stream's chunks, resuming after temporary failures from the first byte not landed."""
        remote, retry = self.store.remote, self.store.retry
        failures, landed_at_failure = 0, -1
        while stream.next_chunk < stream.end_chunk:
            position = fetch.chunk_start(stream.next_chunk) + stream.landed_bytes
            try:
                if not await self._stream_body(fetch, stream, position):
                    return  # the reader went idle, or the rest is here
            except Exception as exc:
                if not remote.is_temp_failure(exc):
                    raise
                here = fetch.chunk_start(stream.next_chunk) + stream.landed_bytes
                failures = 1 if here != landed_at_failure else failures + 1  # progress restarts the count
                landed_at_failure = here
                what = f"get {fetch.key} bytes {here}-{fetch.chunk_start(stream.end_chunk)}"
                if failures >= retry.attempts:
                    raise RemoteError(
                        f"{what}: remote {remote.url} unavailable after {failures} attempts: {describe_error(exc)}",
                        kind="unavailable",
                    ) from exc
                delay = retry.backoff(failures)
                log.warning(
                    "event=stream_resumed key=%s offset=%d attempt=%d delay=%.2f error=%r",
                    fetch.key,
                    here,
                    failures,
                    delay,
                    describe_error(exc),
                )
                await asyncio.sleep(delay)

    async def _stream_body(self, fetch: _FileFetch, stream: _Stream, position: int) -> bool:
        """One GET from ``position`` to the end of the stream's chunks; True if it must be resumed.

        Each piece is written and hashed (one thread hop) as it arrives; a chunk is
        marked present only once all of it landed and its digest matched.  A chunk
        that is already present, or being fetched by a ranged GET, is read past.
        """
        end = fetch.chunk_start(stream.end_chunk)
        pieces = self.store.remote.stream_range(fetch.key, position, end, self.stream_piece)
        async with contextlib.aclosing(pieces):
            async for piece in pieces:
                view = memoryview(piece)
                while view:
                    index = stream.next_chunk
                    chunk_start = fetch.chunk_start(index)
                    if stream.landed_bytes == 0:
                        stream.skipping = index in fetch.present or index in fetch.in_flight
                        stream.hasher.reset()
                    at = chunk_start + stream.landed_bytes
                    take, view = view[: fetch.chunk_start(index + 1) - at], view[fetch.chunk_start(index + 1) - at :]
                    if not stream.skipping:
                        await self._write(fetch, take, at, stream.hasher)
                        self.fetched_bytes += len(take)
                    stream.landed_bytes += len(take)
                    if at + len(take) < fetch.chunk_start(index + 1):
                        continue
                    if not stream.skipping:
                        self._check_digest(fetch, index, stream.hasher.hexdigest())
                        fetch.present.add(index)
                    waiter = stream.waiters.pop(index, None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
                    stream.next_chunk, stream.landed_bytes = index + 1, 0
                    if stream.next_chunk >= stream.end_chunk:
                        return False
                    if not await self._stream_may_go_on(fetch, stream):
                        return False
        here = fetch.chunk_start(stream.next_chunk) + stream.landed_bytes
        log.error(
            "event=corrupt_data key=%s ino=%d range=%d-%d problem=%r",
            fetch.key,
            fetch.ino,
            here,
            end,
            "object too short",
        )
        raise CorruptDataError(f"{fetch.key}: the remote object ends at byte {here}, expected {end}")

    async def _stream_may_go_on(self, fetch: _FileFetch, stream: _Stream) -> bool:
        """Wait (the GET stays open) until the reader lets the next chunk start; False once idle."""
        while fetch.chunk_start(stream.next_chunk) >= stream.limit:
            stream.moved.clear()
            try:
                await asyncio.wait_for(stream.moved.wait(), self.stream_idle_s)
            except TimeoutError:
                log.info("event=stream_idle key=%s offset=%d", fetch.key, fetch.chunk_start(stream.next_chunk))
                return False
        return True

    def _check_digest(self, fetch: _FileFetch, index: int, digest: str) -> None:
        """A chunk's xxh3-64 against the recorded one (CorruptDataError, logged, if it differs)."""
        if fetch.manifest is not None:
            expected: str | None = fetch.manifest.chunks[index].xxh3
        elif fetch.expected_chunks is not None:
            expected = fetch.expected_chunks[index]
        else:
            return  # checked over the whole file at the end, or nobody recorded digests
        if digest == expected:
            return
        start, end = fetch.chunk_start(index), fetch.chunk_start(index + 1)
        log.error(
            "event=corrupt_data key=%s ino=%d range=%d-%d chunk=%d problem=%r",
            fetch.key,
            fetch.ino,
            start,
            end,
            index,
            f"xxh3 {digest}, expected {expected} ({fetch.verification})",
        )
        if fetch.manifest is None:
            raise CorruptDataError(
                f"{fetch.key}: bytes {start}-{end} do not match the checksum journaled when it was drained "
                f"(xxh3 {digest}, expected {expected}; the remote object has no manifest)"
            )
        raise CorruptDataError(
            f"{fetch.key}: bytes {start}-{end} do not match their checksum (xxh3 {digest}, expected {expected})"
        )

    async def _fetch_chunk(self, fetch: _FileFetch, index: int) -> None:
        start = index * fetch.chunk_size
        end = min(start + fetch.chunk_size, fetch.size)
        try:
            async with self._slots:  # held until the chunk is on the tier: bounds fetch memory
                if fetch.manifest is not None:
                    data = await self.store.read_chunk(fetch.key, fetch.manifest, index)
                else:
                    data = await self.store.read_range(fetch.key, None, start, end)
                if len(data) != end - start:
                    log.error(
                        "event=corrupt_data key=%s ino=%d range=%d-%d problem=%r",
                        fetch.key,
                        fetch.ino,
                        start,
                        end,
                        f"remote returned {len(data)} bytes",
                    )
                    raise CorruptDataError(f"{fetch.key} bytes {start}-{end}: remote returned {len(data)} bytes")
                if fetch.expected_chunks is not None:
                    await self._check_journal_chunk(fetch, index, data)
                await self._write(fetch, data, start)
            fetch.present.add(index)
            self.fetched_bytes += len(data)
        finally:
            fetch.in_flight.pop(index, None)

    async def _check_journal_chunk(self, fetch: _FileFetch, index: int, data: bytes) -> None:
        self._check_digest(fetch, index, await asyncio.to_thread(xxhash.xxh3_64_hexdigest, data))

    async def _verify_whole(self, fetch: _FileFetch) -> None:
        """Check the complete local copy against the journal's whole-file digest (once, shared)."""
        if fetch.verifying is None:
            fetch.verifying = asyncio.ensure_future(self._hash_whole(fetch))
        verifying = fetch.verifying
        try:
            await asyncio.shield(verifying)
        finally:
            if verifying.done() and fetch.verifying is verifying:
                fetch.verifying = None

    async def _hash_whole(self, fetch: _FileFetch) -> None:
        digest = await asyncio.to_thread(self._local_digest, fetch.ino, fetch.size)
        if digest == fetch.whole_digest:
            fetch.verified = True
            return
        fetch.present.clear()  # refetch on the next read: the remote may have been repaired
        fetch.contiguous = 0
        log.error(
            "event=corrupt_data key=%s ino=%d range=0-%d problem=%r",
            fetch.key,
            fetch.ino,
            fetch.size,
            f"xxh3-128 {digest}, journal {fetch.whole_digest} (no manifest)",
        )
        raise CorruptDataError(
            f"{fetch.key}: bytes 0-{fetch.size} do not match the checksum journaled when it was drained "
            f"(digest {digest}, expected {fetch.whole_digest}; the remote object has no manifest)"
        )

    def _local_digest(self, ino: int, size: int) -> str:
        """xxh3-128 of the fetched data file (blocking: run in a thread)."""
        whole = xxhash.xxh3_128()
        fd = self.tier.open_data(ino)
        try:
            offset = 0
            while offset < size:
                data = pread_full(fd, min(VERIFY_READ_SIZE, size - offset), offset)
                if not data:
                    break
                whole.update(data)
                offset += len(data)
        finally:
            os.close(fd)
        return whole.hexdigest()

    async def _complete(self, fetch: _FileFetch) -> int:
        """The contiguous local prefix; the file is recorded local once all chunks are (and checked out)."""
        if len(fetch.present) < fetch.chunks:
            return self._contiguous(fetch)
        if fetch.whole_digest is not None and not fetch.verified:
            await self._verify_whole(fetch)
        if self._files.get(fetch.ino) is not fetch:  # completed by a concurrent reader, or forgotten
            return self._contiguous(fetch) if not fetch.closed else fetch.size
        del self._files[fetch.ino]
        fetch.closed = True
        if fetch.fd_users == 0:
            self._close_fd(fetch)
        manifest = fetch.manifest
        if manifest is None:
            self.journal.finish_fetch(fetch.ino, fetch.size)
        else:
            self.journal.finish_fetch(
                fetch.ino,
                fetch.size,
                digest=manifest.digest,
                chunk_size=manifest.chunk_size,
                chunks=[c.xxh3 for c in manifest.chunks],
            )
        log.info("event=fetched key=%s bytes=%d verified=%s", fetch.key, fetch.size, fetch.verification)
        return fetch.size

    def forget(self, ino: int) -> None:
        """Drop fetch state of a file that went away (unlinked or evicted again).

        In-flight chunk fetches are cancelled; a pwrite already running in a
        thread keeps the descriptor until it returns (then it is closed).
        """
        fetch = self._files.pop(ino, None)
        if fetch is None:
            return
        fetch.closed = True
        for task in list(fetch.in_flight.values()):
            task.cancel()
        if fetch.stream is not None and fetch.stream.task is not None:
            fetch.stream.task.cancel()
        if fetch.fd_users == 0:
            self._close_fd(fetch)

    async def aclose(self) -> None:
        """End every chunk fetch (prefetches included) and close the descriptors (the mover stops).

        A pwrite already running in a thread keeps its descriptor until it returns.
        """
        for ino in list(self._files):
            self.forget(ino)
        await self._tasks.aclose()
        for fetch in list(self._open_fds.values()):
            fetch.closed = True
            if fetch.fd_users == 0:
                self._close_fd(fetch)


class OwnedTasks:
    """The tasks of one owner on one loop: started here, all cancelled and awaited by aclose().

    Unlike asyncio.TaskGroup, one task's failure does not cancel the others: a
    failed chunk fetch is an error for the readers that await it, not for every
    fetch of every file.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        if self._closed:  # a fetch asked for while the mover stops: EIO, as while it is down
            coro.close()
            raise FsError(errno.EIO, "the mover is stopping")
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the awaiting readers re-raise it, none may be left to

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _pass_outcome(waiter: asyncio.Future[None], source: asyncio.Future[None]) -> None:
    """Settle ``waiter`` as ``source`` settled."""
    if waiter.done():
        return
    if source.cancelled():
        waiter.cancel()
    elif source.exception() is not None:
        waiter.set_exception(source.exception())  # type: ignore[arg-type]
        waiter.exception()
    else:
        waiter.set_result(None)


def _write_hashed(fd: int, data: bytes | memoryview, offset: int, hasher: xxhash.xxh3_64 | None) -> None:
    """pwrite all of ``data``, then hash it (blocking: run in a thread)."""
    pwrite_full(fd, data, offset)
    if hasher is not None:
        hasher.update(data)


def _journal_chunks(row: InodeRow) -> tuple[str, ...] | None:
    """The journal's per-chunk digests of ``row``, if they are present and cover its size."""
    if not row.chunks or not row.chunk_size or row.chunk_size <= 0:
        return None
    try:
        chunks = json.loads(row.chunks)
    except (ValueError, RecursionError):
        return None
    if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
        return None
    if len(chunks) != -(-row.size // row.chunk_size):
        return None
    return tuple(chunks)

"""Restore: fetching remote files into the local tier, chunk by chunk, verified.

Runs on the mover's asyncio loop.  A read of a file that is not local asks for
the chunks covering it; a sequential reader grows a prefetch window ahead of
itself (doubling per sequential read, back to one chunk on a seek — the shape
of mountpoint-s3's prefetcher), so a ``torch.load`` streams at the remote's
bandwidth while a random reader (safetensors, mmap) fetches only what it
touches.  Every chunk is checked against the digests recorded at drain time
before a byte of it lands on the local tier; fetched chunks stay there, so the
next read is local.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import logging
import os
import time

from .errors import CorruptDataError, FsError
from .journal import DURABLE, EVICTED, REMOTE, Journal
from .localtier import LocalTier
from .objects import Manifest, ObjectStore

log = logging.getLogger("burstfs.restore")

# Chunk size for objects without a manifest (written by other tools): large
# enough to amortize a GET, small enough that a random read stays cheap.
UNVERIFIED_CHUNK = 8 * 1024 * 1024
# The prefetch window grows to this many chunks (8 MiB each: 128 MiB ahead),
# enough to keep a fast remote busy; memory use is bounded by `concurrency`.
MAX_WINDOW_CHUNKS = 16
# Ranged GETs in flight for all files together: shared fairly (FIFO) by every
# file being restored, so 8 ranks reading shards each get their share.
FETCH_CONCURRENCY = 16
# Written by a drain that compresses: its presence tells readers that listed
# object sizes are stored sizes, not file sizes.
LAYOUT_KEY = ".burstfs/layout.json"


@dataclasses.dataclass(eq=False)
class _FileFetch:
    ino: int
    key: str
    size: int
    chunk_size: int
    manifest: Manifest | None
    fd: int
    present: set[int] = dataclasses.field(default_factory=set)
    in_flight: dict[int, asyncio.Task[None]] = dataclasses.field(default_factory=dict)
    window: int = 1
    next_offset: int = 0
    contiguous: int = 0  # chunks present from the start without a gap

    @property
    def chunks(self) -> int:
        return (self.size + self.chunk_size - 1) // self.chunk_size


class RestoreService:
    """Fetches remote-only (evicted or listed) files into the local tier."""

    def __init__(self, store: ObjectStore, journal: Journal, tier: LocalTier,
                 concurrency: int = FETCH_CONCURRENCY) -> None:  # fmt: skip
        self.store = store
        self.journal = journal
        self.tier = tier
        self.fetched_bytes = 0
        self._slots = asyncio.Semaphore(concurrency)
        self._files: dict[int, _FileFetch] = {}
        self._opening: dict[int, asyncio.Future[_FileFetch]] = {}
        self._compressed: bool | None = None

    async def list_dir(self, dir_key: str) -> tuple[list[tuple[str, int, float]], list[str]]:
        """(name, size, mtime) of files and names of subdirectories under ``dir_key``.

        A listing gives stored sizes; when the remote holds compressed objects
        (see :data:`LAYOUT_KEY`), the file sizes come from their manifests.
        """
        remote = self.store.remote
        files, subdirs = await self.store.retry.call(remote, remote.list_dir, dir_key, what=f"list {dir_key or '/'}")
        prefix = f"{dir_key}/" if dir_key else ""
        sizes = {info.key: info.size for info in files}
        if await self._compressed_layout():
            async def logical_size(key: str) -> None:
                async with self._slots:
                    manifest = await self.store.fetch_manifest(key)
                if manifest is not None:
                    sizes[key] = manifest.size

            await asyncio.gather(*(logical_size(info.key) for info in files))
        return [(info.key[len(prefix):], sizes[info.key], info.mtime) for info in files], subdirs

    async def _compressed_layout(self) -> bool:
        if self._compressed is None:
            remote = self.store.remote
            self._compressed = await self.store.retry.call(remote, remote.head, LAYOUT_KEY, what="head layout") is not None
        return self._compressed

    async def ensure_local(self, ino: int, offset: int, length: int) -> int:
        """Make bytes [offset, offset+length) local.

        Returns how many bytes from the start of the file are now local without a
        gap (the file's size once it is all here), so the caller can serve reads
        below that without asking again.
        """
        fetch = await self._fetch_state(ino)
        if fetch.size == 0:
            return self._complete(fetch)
        end = min(offset + length, fetch.size)
        first, last = offset // fetch.chunk_size, max(offset, end - 1) // fetch.chunk_size
        # Sequential: where the last read ended, or further on inside the gap-free
        # local prefix (the core serves reads there without asking).
        if offset == fetch.next_offset or fetch.next_offset < offset <= self._contiguous(fetch):
            fetch.window = min(fetch.window * 2, MAX_WINDOW_CHUNKS)
        else:
            fetch.window = 1
        fetch.next_offset = end
        needed = [self._chunk(fetch, i) for i in range(first, min(last, fetch.chunks - 1) + 1)]
        for i in range(last + 1, min(last + 1 + fetch.window, fetch.chunks)):
            self._chunk(fetch, i)  # prefetch: not awaited
        await asyncio.gather(*needed)
        return self._complete(fetch)

    def _contiguous(self, fetch: _FileFetch) -> int:
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
        row = await asyncio.to_thread(self.journal.inode, ino)
        if row is None or not row.remote_key:
            raise FsError(errno.EIO, f"inode {ino} has no remote object to fetch")
        manifest = await self.store.fetch_manifest(row.remote_key)
        if manifest is None:
            log.warning("event=unverified_object key=%s note=no burstfs digests, served unverified", row.remote_key)
            size, chunk_size = row.size, UNVERIFIED_CHUNK
        else:
            if row.digest and manifest.digest != row.digest:
                raise CorruptDataError(
                    f"remote object {row.remote_key} changed since it was drained "
                    f"(digest {manifest.digest}, journal {row.digest})"
                )
            size, chunk_size = manifest.size, manifest.chunk_size
        path = self.tier.path(ino)
        fd = await asyncio.to_thread(os.open, path, os.O_RDWR | os.O_CREAT, 0o600)
        await asyncio.to_thread(os.ftruncate, fd, size)
        return _FileFetch(ino, row.remote_key, size, chunk_size, manifest, fd)

    def _chunk(self, fetch: _FileFetch, index: int) -> asyncio.Future[None]:
        if index in fetch.present:
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        task = fetch.in_flight.get(index)
        if task is None:
            task = asyncio.create_task(self._fetch_chunk(fetch, index))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # prefetch errors are re-raised to readers
            fetch.in_flight[index] = task
        return task

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
                    raise CorruptDataError(f"{fetch.key} bytes {start}-{end}: remote returned {len(data)} bytes")
                await asyncio.to_thread(os.pwrite, fetch.fd, data, start)
            fetch.present.add(index)
            self.fetched_bytes += len(data)
        finally:
            fetch.in_flight.pop(index, None)

    def _complete(self, fetch: _FileFetch) -> int:
        """The contiguous local prefix; the file is recorded local once all chunks are."""
        if len(fetch.present) < fetch.chunks:
            return self._contiguous(fetch)
        os.close(fetch.fd)
        del self._files[fetch.ino]
        fields: dict[str, object] = {"state": DURABLE, "local_bytes": fetch.size, "updated": time.time()}
        if fetch.manifest is not None:
            fields.update(digest=fetch.manifest.digest, chunk_size=fetch.manifest.chunk_size,
                          chunks=json.dumps([c.xxh3 for c in fetch.manifest.chunks]))  # fmt: skip
        assignments = ", ".join(f"{name}=?" for name in fields)
        self.journal.execute(
            f"UPDATE inodes SET {assignments}, durable_generation=generation WHERE ino=? AND state IN (?, ?)",
            (*fields.values(), fetch.ino, EVICTED, REMOTE),
        )
        log.info("event=fetched key=%s bytes=%d verified=%s", fetch.key, fetch.size, fetch.manifest is not None)
        return fetch.size

    def forget(self, ino: int) -> None:
        """Drop fetch state of a file that went away (unlinked or evicted again)."""
        fetch = self._files.pop(ino, None)
        if fetch is not None:
            for task in fetch.in_flight.values():
                task.cancel()
            os.close(fetch.fd)

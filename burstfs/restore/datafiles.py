"""The tier's data files of files being fetched: created sparse, written in worker threads.

A partly fetched file keeps its data file open only while it is among the
``max_open_fds`` most recently written ones (an LRU); others are closed and
reopened when their next chunk arrives, so cold reads of many files cannot
exhaust the daemon's descriptors.  A descriptor is closed only once no
``pwrite`` (in a worker thread, which cancellation cannot stop) still uses it.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import os
from collections.abc import Callable

import xxhash

from ..errors import FsError
from ..fileio import pread_full, pwrite_full
from ..localtier import LocalTier
from .state import MAX_OPEN_FDS, VERIFY_READ_SIZE, FileFetch


class DataFiles:
    """Data files of the files being fetched, and their descriptors (an LRU of ``max_open_fds``)."""

    def __init__(self, tier: LocalTier, max_open_fds: int = MAX_OPEN_FDS) -> None:
        self.tier = tier
        self.max_open_fds = max(1, max_open_fds)
        self._open_fds: collections.OrderedDict[int, FileFetch] = collections.OrderedDict()  # LRU, oldest first

    @property
    def open_fds(self) -> int:
        """Data files held open now (bounded by ``max_open_fds`` plus writes in flight)."""
        return len(self._open_fds)

    def create(self, ino: int, size: int) -> None:
        """The sparse data file the chunks land in (blocking: run in a thread)."""
        fd = self.tier.open_data(ino, create=True)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def _acquire_fd(self, fetch: FileFetch) -> int:
        """The data file's descriptor for one pwrite, opened if the LRU dropped it."""
        if fetch.closed:
            raise FsError(errno.ESTALE, f"{fetch.key}: the file went away during its fetch")
        if fetch.fd is None:
            fetch.fd = self.tier.open_data(fetch.ino)  # a local open: cheap enough for the loop
        fetch.fd_users += 1
        fetch.pwrites_idle.clear()
        self._open_fds[fetch.ino] = fetch
        self._open_fds.move_to_end(fetch.ino)
        self._trim_fds()
        return fetch.fd

    def _release_fd(self, fetch: FileFetch) -> None:
        fetch.fd_users -= 1
        if fetch.fd_users == 0:
            fetch.pwrites_idle.set()
        if fetch.fd_users == 0 and fetch.closed:
            self.close_fd(fetch)
        else:
            self._trim_fds()

    def _trim_fds(self) -> None:
        """Close the least recently used idle descriptors beyond ``max_open_fds``."""
        excess = len(self._open_fds) - self.max_open_fds
        if excess <= 0:
            return
        for fetch in [f for f in self._open_fds.values() if f.fd_users == 0][:excess]:
            self.close_fd(fetch)

    def close_fd(self, fetch: FileFetch) -> None:
        if self._open_fds.get(fetch.ino) is fetch:
            del self._open_fds[fetch.ino]
        if fetch.fd is not None:
            fd, fetch.fd = fetch.fd, None
            os.close(fd)

    async def write(
        self, fetch: FileFetch, data: bytes | memoryview, offset: int, hasher: xxhash.xxh3_64 | None = None
    ) -> None:
        """pwrite ``data`` (and hash it into ``hasher``) in a thread; the descriptor stays open
        until that thread is done, even if this task is cancelled (forget) meanwhile."""
        await self._in_thread(fetch, functools.partial(_write_hashed, data=data, offset=offset, hasher=hasher))

    async def write_all(self, fetch: FileFetch, pieces: list[tuple[int, bytes | memoryview]]) -> None:
        """pwrite each ``(offset, data)`` of ``pieces``, all in one thread: a ranged GET's chunks
        land with one hop to a worker thread, not one each (on two busy cores every hop is a
        wait for the GIL and a wake of the loop)."""
        await self._in_thread(fetch, functools.partial(_write_pieces, pieces=pieces))

    async def _in_thread(self, fetch: FileFetch, job: Callable[[int], None]) -> None:
        """``job(fd)`` on ``fetch``'s data file in a thread (see :meth:`write`)."""
        fd = self._acquire_fd(fetch)
        try:
            write = asyncio.ensure_future(asyncio.to_thread(job, fd))
        except BaseException:
            self._release_fd(fetch)
            raise

        def done(future: asyncio.Future[None]) -> None:
            self._release_fd(fetch)
            if not future.cancelled():
                future.exception()  # retrieved here if the awaiting task was cancelled

        write.add_done_callback(done)
        await asyncio.shield(write)

    def close_all(self) -> None:
        """Close every descriptor no pwrite uses (the mover stops); the others close when theirs return."""
        for fetch in list(self._open_fds.values()):
            fetch.closed = True
            if fetch.fd_users == 0:
                self.close_fd(fetch)

    def local_digest(self, ino: int, size: int) -> str:
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


def _write_hashed(fd: int, *, data: bytes | memoryview, offset: int, hasher: xxhash.xxh3_64 | None) -> None:
    """pwrite all of ``data``, then hash it (blocking: run in a thread)."""
    pwrite_full(fd, data, offset)
    if hasher is not None:
        hasher.update(data)


def _write_pieces(fd: int, *, pieces: list[tuple[int, bytes | memoryview]]) -> None:
    """pwrite each ``(offset, data)`` (blocking: run in a thread)."""
    for offset, data in pieces:
        pwrite_full(fd, data, offset)

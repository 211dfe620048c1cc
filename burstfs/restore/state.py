"""Restore state: what is known about one file being fetched, and the tasks that fetch it.

Shared by the service (``service.py``: the ranged plan), the streaming plan
(``stream.py``), the tier's data files (``datafiles.py``) and verification
(``verify.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import FsError
from ..objects import Manifest
from ..remote.retry import RetryPolicy

if TYPE_CHECKING:
    from .stream import EarlyGet

# Chunk size for objects without a manifest (written by other tools): large
# enough to amortize a GET, small enough that a random read stays cheap.
UNVERIFIED_CHUNK = 8 * 1024 * 1024
# The ranged prefetch window grows to this many bytes ahead, enough to keep a fast
# remote busy; memory use is bounded by `concurrency` ranged GETs of objects.RANGED_RUN_BYTES.
MAX_WINDOW_BYTES = 128 << 20
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
#: A prefix found without that mark is looked at again, at a listing, after this long.
LAYOUT_RECHECK_S = 5.0
#: Listings answer requests (a lookup miss, an opendir): a few quick tries (~3 s of backoff
#: in all: one 503 SlowDown on a fresh node's first listing of a checkpoint failed its whole
#: restore with EIO), within LISTING_ATTEMPT_TIMEOUT_S, never the drain's retry budget
#: (8 attempts of up to 60 s each).  A listing that fails is tried again by the core after
#: its backoff; the drain keeps its own retries.
LISTING_RETRY = RetryPolicy(attempts=6, budget=5.0)
#: Reads answer requests too (a read of a file that is not local waits for them): retried
#: while the remote refuses or drops them (503s, resets), but not for longer than this in all,
#: then EIO (a black-holed remote costs the S3 read timeout per attempt).
READ_RETRY = RetryPolicy(budget=30.0)
#: For this long after the remote left the open of a file's fetch (or a read) unanswered, reads
#: of that file fail at once with the same error (the kernel retries a failed readahead right away),
#: unless the remote answered another fetch since.
UNANSWERED_MEMO_S = 10.0
#: A read whose chunks make no progress for this long fails (EIO): each request has its own
#: retries, and a manifest, then a chunk, then its retry each waiting out a silent remote
#: made one read(2) take 100-120 s.  Progress (any chunk landing) restarts the wait: a
#: whole-file fetch of a large file on a slow remote is not cut short.
READ_STALL_S = READ_RETRY.budget or 30.0
#: A listing (all its tries, with the manifests a compressed layout needs) gives up after this.
LISTING_ATTEMPT_TIMEOUT_S = 20.0


@dataclasses.dataclass(eq=False)
class FileFetch:
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
    stream: Stream | None = None
    contiguous: int = 0  # chunks present from the start without a gap
    fd: int | None = None
    fd_users: int = 0  # pwrites in flight on fd (in threads)
    pwrites_idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set while fd_users == 0
    closed: bool = False  # forgotten or finished: the fd goes once its users are done
    verifying: asyncio.Future[None] | None = None
    recorded: asyncio.Future[None] | None = None  # the journal record of the finished fetch
    early: EarlyGet | None = None  # the first stream's GET, sent beside the manifest's (stream.py)

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
class Stream:
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
    progressed_at: float = 0.0  # loop time of the last byte landed (or of the reader letting the stream go on)
    stall_guard: asyncio.Timeout | None = None  # of the GET under way: expires READ_STALL_S after progressed_at
    refetched: set[int] = dataclasses.field(default_factory=set)  # chunks that did not match once

    def extend(self, limit: int) -> None:
        if limit > self.limit:
            self.limit = limit
            self.moved.set()

    def progressed(self) -> None:
        """Bytes landed (or the reader let the stream go on): the stall bound starts again."""
        self.progressed_at = asyncio.get_running_loop().time()
        if self.stall_guard is not None:
            self.stall_guard.reschedule(self.progressed_at + READ_STALL_S)

    def waiting_for_reader(self) -> None:
        """The stream waits for its reader, not for the remote: no stall bound meanwhile."""
        if self.stall_guard is not None:
            self.stall_guard.reschedule(None)


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


def pass_outcome(waiter: asyncio.Future[None], source: asyncio.Future[None]) -> None:
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

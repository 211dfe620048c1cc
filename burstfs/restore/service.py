"""The restore service: a read of a file that is not local, made local chunk by chunk.

It keeps per-file fetch state (``state.FileFetch``), picks the plan for each
read (a stream, ``stream.py``, or ranged GETs with a prefetch window, here),
and records a file local once all of it landed and checked out (``verify.py``).
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from ..errors import CorruptDataError, FsError, ManifestError, RemoteError
from ..hooks import ListedFile, Listing
from ..journal import InodeRow, Journal
from ..journal.thread import JournalCall
from ..localtier import LocalTier
from ..objects import RANGED_RUN_BYTES, Manifest, ObjectStore
from .datafiles import DataFiles
from .state import (
    FETCH_CONCURRENCY,
    LAYOUT_KEY,
    LAYOUT_RECHECK_S,
    LISTING_ATTEMPT_TIMEOUT_S,
    LISTING_RETRY,
    MAX_OPEN_FDS,
    MAX_STREAM_LEAD,
    MAX_WINDOW_BYTES,
    READ_STALL_S,
    UNANSWERED_MEMO_S,
    FileFetch,
    OwnedTasks,
)
from .stream import EarlyGet, Streams
from .verify import check_journal_chunk, note_refetch, verify_whole, without_manifest

log = logging.getLogger("burstfs.restore")

P = ParamSpec("P")
T = TypeVar("T")


async def call_inline(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """A journal call on the calling thread: for a service without a journal thread (tests)."""
    return fn(*args, **kwargs)


#: How many completed fetches RestoreService remembers (for readaheads that arrive late).
COMPLETED_MEMO = 4096


class RestoreService:
    """Fetches remote-only (evicted or listed) files into the local tier."""

    def __init__(
        self,
        store: ObjectStore,
        journal: Journal,
        tier: LocalTier,
        concurrency: int = FETCH_CONCURRENCY,
        max_open_fds: int = MAX_OPEN_FDS,
        db: JournalCall = call_inline,
    ) -> None:
        self.store = store
        self.journal = journal
        self._db = db  # the mover's journal thread: its calls run in order, never on the loop
        self.tier = tier
        self.data_files = DataFiles(tier, max_open_fds)
        self._ranged_bytes = 0  # landed by ranged GETs (streams count their own)
        self._slots = asyncio.Semaphore(concurrency)
        self._files: dict[int, FileFetch] = {}
        self._opening: dict[int, asyncio.Future[FileFetch]] = {}
        # Opens of a fetch the remote did not answer (within READ_RETRY's budget), and when: the
        # kernel asks again at once (a failed readahead, then the read itself), and each ask
        # would wait the whole budget again.
        self._unanswered: dict[int, tuple[float, RemoteError]] = {}
        # The _open in progress of an ino holds its token here; forget() revokes it, and a revoked
        # open neither creates the data file nor registers a fetch (the file went away or was
        # replaced meanwhile).  Its data file being created in a thread: let_go() waits for that.
        self._open_tokens: dict[int, object] = {}
        # Fetches completed lately: ino -> (size, the journal record's task).  A kernel readahead
        # asked before the first read's answer marked the file local arrives after the fetch
        # completed, and must not open a second fetch of the whole file.  Bounded (the race is
        # milliseconds wide); forget() drops an entry (the file was evicted or replaced).
        self._completed: dict[int, tuple[int, asyncio.Future[None]]] = {}
        self._creating: dict[int, asyncio.Future[None]] = {}
        self._compressed: bool | None = None
        self._layout_checked_at = -LAYOUT_RECHECK_S
        self.listing_retry = LISTING_RETRY
        self._tasks = OwnedTasks()  # every chunk fetch, prefetches included: aclose() ends them
        self.listing_timeout = LISTING_ATTEMPT_TIMEOUT_S
        self.streams = Streams(store, self.data_files, self._tasks, self._chunk)

    def warm(self) -> None:
        """Prepare the remote's client and a connection now (the mover starts), not in the first read."""
        self._tasks.start(self.store.remote.warm())

    @property
    def open_fds(self) -> int:
        """Data files this service holds open now (bounded by ``max_open_fds`` plus writes in flight)."""
        return self.data_files.open_fds

    @property
    def fetched_bytes(self) -> int:
        """Bytes landed on the tier by fetches, ranged and streamed."""
        return self._ranged_bytes + self.streams.fetched_bytes

    async def list_dir(self, dir_key: str) -> Listing:
        """The files (name, size, mtime, etag) and names of subdirectories under ``dir_key``.

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

    async def objects_deleted(self, keys: list[str]) -> set[str]:
        """Of ``keys`` (objects a listing no longer shows), those whose manifest is gone too:
        a delete by burstfs (another node's) removes both; an object gone alone was lost
        (a lifecycle rule, an operator), and its file is kept here for verify to report."""
        gone = set()
        for key in keys:
            try:
                if await self.store.fetch_manifest(key) is None:
                    gone.add(key)
            except ManifestError:
                continue  # unreadable, but there: not a delete
        return gone

    async def _list_dir_once(self, dir_key: str) -> Listing:
        """list_dir's tries (``listing_retry``), without a bound of its own."""
        remote = self.store.remote
        (files, subdirs), compressed = await asyncio.gather(
            self.listing_retry.call(remote, remote.list_dir, dir_key, what=f"list {dir_key or '/'}"),
            self._compressed_layout(),
        )
        prefix = f"{dir_key}/" if dir_key else ""
        sizes = {info.key: info.size for info in files}
        if compressed:

            async def logical_size(key: str) -> None:
                async with self._slots:
                    manifest = await self.store.fetch_manifest(key)
                # An object of another length than its manifest stores keeps its own size: its
                # read fails as an uncompressed one's does (bytes appended were served unseen).
                if manifest is not None and sum(c.stored_size for c in manifest.chunks) == sizes[key]:
                    sizes[key] = manifest.size

            await asyncio.gather(*(logical_size(info.key) for info in files))
        return [ListedFile(info.key[len(prefix) :], sizes[info.key], info.mtime, info.etag) for info in files], subdirs

    async def _compressed_layout(self) -> bool:
        """Whether a drain that compresses wrote to this prefix (its mark is never removed).  A
        "no" is asked again after LAYOUT_RECHECK_S: a node may start compressing on a prefix this
        mount listed before (its listings then gave stored sizes for good, every read EIO)."""
        now = asyncio.get_running_loop().time()
        if not self._compressed and now >= self._layout_checked_at + LAYOUT_RECHECK_S:
            remote = self.store.remote
            head = await self.listing_retry.call(remote, remote.head, LAYOUT_KEY, what="head layout")
            self._compressed, self._layout_checked_at = head is not None, now
        return bool(self._compressed)

    async def ensure_local(self, ino: int, offset: int, length: int) -> int:
        """Make bytes [offset, offset+length) local.

        Returns how many bytes from the start of the file are now local without a
        gap (the file's size once it is all here), so the caller can serve reads
        below that without asking again.
        """
        self._raise_if_unanswered(ino)
        completed = self._completed.get(ino)
        if completed is not None:
            size, recorded = completed
            if not recorded.done() or (not recorded.cancelled() and recorded.exception() is None):
                await asyncio.shield(recorded)
                return size
            del self._completed[ino]  # its record failed: fetch it again
        opened = asyncio.get_running_loop().time()
        fetch = await self._opened(ino, offset)
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
        wanted = range(first, min(last, fetch.chunks - 1) + 1)
        if (
            self.streams.streaming(fetch)
            and (whole or at_stream or fetch.run_start < fetch.chunk_size)
            and self.streams.stream_to(fetch, first, end + lead)
        ):
            fetch.window = 0
            needed = self._chunks(fetch, wanted.start, wanted.stop)
        else:
            needed = self._chunks(fetch, wanted.start, wanted.stop)
            # Prefetch (not awaited; it can outlive the reader): half of what this run has read.
            fetch.window = min(ahead // 2, MAX_WINDOW_BYTES) // fetch.chunk_size
            self._chunks(fetch, last + 1, min(last + 1 + fetch.window, fetch.chunks))
        if fetch.early is not None and fetch.stream is None:  # no stream of this file wants its GET
            fetch.early.drop()
            fetch.early = None
        outcomes = await self._landed(ino, fetch, needed, READ_STALL_S - (asyncio.get_running_loop().time() - opened))
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        # A ranged GET serves several chunks: another chunk's failure does not fail this read.
        if failed and not all(i in fetch.present for i in wanted):
            if isinstance(failed[0], asyncio.CancelledError) and self._files.get(ino) is not fetch:
                # forget()'s: removed or evicted meanwhile (a prefetch said "the mover stopped")
                raise FsError(errno.ESTALE, f"inode {ino} went away or was replaced during its fetch")
            raise failed[0]
        return await self._complete(fetch)

    async def _opened(self, ino: int, offset: int) -> FileFetch:
        """``_fetch_state`` within READ_STALL_S (its manifest's GET retries on its own; the open
        goes on for the next reader).  ``offset``: where the read that opens it starts."""
        if ino in self._files:
            return self._files[ino]
        opening = asyncio.ensure_future(self._fetch_state(ino, offset))
        try:
            return await asyncio.wait_for(asyncio.shield(opening), READ_STALL_S)
        except TimeoutError:
            opening.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved
            error = RemoteError(
                f"open the fetch of inode {ino}: remote {self.store.remote.url} did not answer within "
                f"{READ_STALL_S:.0f}s",
                kind="unavailable",
            )
            self._remember_unanswered(ino, error)
            raise error from None

    async def _landed(
        self, ino: int, fetch: FileFetch, needed: list[asyncio.Future[None]], first_wait: float
    ) -> list[BaseException | None]:
        """Wait for ``needed`` (their outcomes, as gather's ``return_exceptions``) while they make
        progress: READ_STALL_S without a chunk landing (``first_wait`` for the first, which
        the open of the fetch already used part of) fails the read and, for UNANSWERED_MEMO_S,
        the file's next reads.  The chunks go on (other readers may share them)."""
        loop = asyncio.get_running_loop()
        pending = set(needed)
        deadline = loop.time() + max(first_wait, 1.0)
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - loop.time()))
            if not done:
                error = RemoteError(
                    f"read {fetch.key}: remote {self.store.remote.url} sent nothing for {READ_STALL_S:.0f}s",
                    kind="unavailable",
                )
                self._remember_unanswered(ino, error)
                raise error
            if any(not f.cancelled() and f.exception() is None for f in done):
                self._unanswered.clear()  # the remote answers again
                deadline = loop.time() + READ_STALL_S  # only a chunk that landed is progress, not one that failed
        return [f.exception() if not f.cancelled() else asyncio.CancelledError() for f in needed]

    def _raise_if_unanswered(self, ino: int) -> None:
        unanswered = self._unanswered.get(ino)
        if unanswered is not None:
            if asyncio.get_running_loop().time() - unanswered[0] < UNANSWERED_MEMO_S:
                raise unanswered[1]
            del self._unanswered[ino]

    def _remember_unanswered(self, ino: int, error: RemoteError) -> None:
        if len(self._unanswered) >= MAX_OPEN_FDS:  # bounded: the oldest go first
            del self._unanswered[next(iter(self._unanswered))]
        self._unanswered[ino] = (asyncio.get_running_loop().time(), error)

    def _contiguous(self, fetch: FileFetch) -> int:
        if fetch.whole_digest is not None and not fetch.verified:
            return 0  # nothing is served before the whole file checked out
        while fetch.contiguous < fetch.chunks and fetch.contiguous in fetch.present:
            fetch.contiguous += 1
        return min(fetch.contiguous * fetch.chunk_size, fetch.size)

    async def _fetch_state(self, ino: int, offset: int) -> FileFetch:
        if ino in self._files:
            return self._files[ino]
        if ino in self._opening:
            return await asyncio.shield(self._opening[ino])
        loop = asyncio.get_running_loop()
        self._raise_if_unanswered(ino)
        future: asyncio.Future[FileFetch] = loop.create_future()
        self._opening[ino] = future
        try:
            fetch = await self._open(ino, offset)
            self._unanswered.clear()  # the remote answers again: no file's read fails for its silence
            self._files[ino] = fetch
            future.set_result(fetch)
            return fetch
        except BaseException as exc:
            if isinstance(exc, RemoteError) and exc.kind == "unavailable":
                self._remember_unanswered(ino, exc)
            future.set_exception(exc)
            future.exception()  # retrieved: waiters re-raise it
            raise
        finally:
            del self._opening[ino]

    async def _open(self, ino: int, offset: int) -> FileFetch:
        token = self._open_tokens[ino] = object()
        try:
            return await self._open_checked(ino, token, offset)
        finally:
            if self._open_tokens.get(ino) is token:
                del self._open_tokens[ino]

    def _still_wanted(self, ino: int, token: object) -> None:
        if self._open_tokens.get(ino) is not token:
            raise FsError(errno.ESTALE, f"inode {ino} went away or was replaced during its fetch")

    async def _open_checked(self, ino: int, token: object, offset: int) -> FileFetch:
        row = await self._db(self.journal.fetch_row, ino)
        if row is None or not row.remote_key:
            raise FsError(errno.EIO, f"inode {ino} has no remote object to fetch")
        early = self._early_get(row.remote_key, row.size, offset)
        try:
            fetch = await self._fetch_for(ino, token, row, row.remote_key)
        except BaseException:
            if early is not None:
                early.drop()
            raise
        fetch.early = early
        return fetch

    def _early_get(self, key: str, size: int, offset: int) -> EarlyGet | None:
        """A read from the start of a file that a stream will fetch: its GET goes out now, beside
        the manifest's (an object of an uncompressed layout: its stored bytes are the file's)."""
        if offset != 0 or size == 0 or self._compressed is not False:
            return None
        return self.streams.early_get(key, size)

    async def _fetch_for(self, ino: int, token: object, row: InodeRow, key: str) -> FileFetch:
        """The fetch state of ``row``'s file (at ``key``), its manifest checked and its data file created."""
        manifest = await self.store.fetch_manifest(key)
        if manifest is None:
            fetch = without_manifest(row)
        else:
            if row.digest and manifest.digest != row.digest:
                log.error(
                    "event=corrupt_data key=%s ino=%d problem=%r",
                    key,
                    ino,
                    f"manifest digest {manifest.digest}, journal {row.digest}",
                )
                raise CorruptDataError(
                    f"remote object {key} changed since it was drained (digest {manifest.digest}, journal {row.digest})"
                )
            if manifest.size != row.size:
                await self._raise_if_listed_before(key, ino, row.size, manifest)
            if manifest.size != row.size:
                # A listing's size is the object's: an object cut short at a chunk boundary
                # would read as a shorter file whose every chunk checks out.
                problem = f"remote object {key} is {row.size} bytes, its manifest says {manifest.size}"
                log.error("event=corrupt_data key=%s ino=%d problem=%r", key, ino, problem)
                raise CorruptDataError(problem)
            # Verified (and fetched) by block where the manifest lists blocks: a random read
            # costs a 1 MiB block, not a whole part-sized chunk.
            by_blocks = manifest.by_blocks()
            fetch = FileFetch(ino, key, by_blocks.size, by_blocks.chunk_size, by_blocks)
        self._still_wanted(ino, token)
        creating = asyncio.ensure_future(asyncio.to_thread(self.data_files.create, ino, fetch.size))
        self._creating[ino] = creating
        creating.add_done_callback(lambda done: self._creating.pop(ino) if self._creating.get(ino) is done else None)
        await asyncio.shield(creating)  # a cancelled opener leaves the thread to let_go()'s wait
        self._still_wanted(ino, token)
        return fetch

    async def _raise_if_listed_before(self, key: str, ino: int, listed: int, manifest: Manifest) -> None:
        """EIO, logged as what it is, for a file whose listing predates its object: listed at its
        stored size before the prefix held compressed objects, or rewritten by its owner since
        (the object now matches its manifest; an ERROR "corrupt_data" was a false alarm).  The
        next listing knows better.  Anything else is for the caller to call corrupt."""
        stored = sum(c.stored_size for c in manifest.chunks)
        if listed == stored:
            self._compressed = True
            problem = f"{key} was listed at its compressed size {listed}; it is {manifest.size} bytes"
        elif (head := await self.store.head(key)) is not None and head.size == stored:
            problem = f"{key} was rewritten on the remote since it was listed ({listed} bytes, now {manifest.size})"
        else:
            return
        log.warning("event=listed_size_stale key=%s ino=%d problem=%r", key, ino, problem)
        raise FsError(errno.EIO, f"{problem}: list its directory again (after --list-ttl)")

    # -- chunks -----------------------------------------------------------------------

    def _chunk(self, fetch: FileFetch, index: int) -> asyncio.Future[None]:
        """A future for chunk ``index`` landing: done, a ranged fetch, or the stream passing it."""
        return self._chunks(fetch, index, index + 1)[0]

    def _chunks(self, fetch: FileFetch, start: int, stop: int) -> list[asyncio.Future[None]]:
        """Futures for chunks ``[start, stop)`` landing; the missing ones no fetch or stream
        covers yet are fetched by ranged GETs of up to RANGED_RUN_BYTES of consecutive chunks."""
        futures: list[asyncio.Future[None]] = []
        run: list[int] = []
        longest = max(1, RANGED_RUN_BYTES // fetch.chunk_size)
        for index in range(start, stop):
            underway = self._underway(fetch, index)
            if underway is None:
                run.append(index)
                if len(run) < longest:
                    continue
            if run:
                futures.append(self._fetch_run(fetch, run[0], run[-1] + 1))
                run = []
            if underway is not None:
                futures.append(underway)
        if run:
            futures.append(self._fetch_run(fetch, run[0], run[-1] + 1))
        return futures

    def _underway(self, fetch: FileFetch, index: int) -> asyncio.Future[None] | None:
        """Chunk ``index`` done, being fetched or passed by the stream: a future for it; else None."""
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
        return None

    def _fetch_run(self, fetch: FileFetch, first: int, stop: int) -> asyncio.Task[None]:
        task = self._tasks.start(self._fetch_chunks(fetch, first, stop))
        for index in range(first, stop):
            fetch.in_flight[index] = task
        return task

    async def _fetch_chunks(self, fetch: FileFetch, first: int, stop: int) -> None:
        """Chunks ``[first, stop)`` by one ranged GET (those that did not match: by one more);
        each that checks out lands and is present, then the first one that did not raises
        (CorruptDataError)."""
        problem: BaseException | None = None
        try:
            async with self._slots:  # held until the chunks are on the tier: bounds fetch memory
                chunks = await self._read_chunks(fetch, first, stop)
                bad = [index for index, data in chunks if isinstance(data, CorruptDataError)]
                if bad:
                    for index in bad:
                        note_refetch(fetch, index)
                    again = dict(await self._read_chunks(fetch, bad[0], bad[-1] + 1))
                    chunks = [(index, again[index] if index in bad else data) for index, data in chunks]
                good = [(index, data) for index, data in chunks if not isinstance(data, BaseException)]
                problem = next((data for _, data in chunks if isinstance(data, BaseException)), None)
                await self.data_files.write_all(fetch, [(fetch.chunk_start(index), data) for index, data in good])
                for index, data in good:
                    fetch.present.add(index)
                    self._ranged_bytes += len(data)
        finally:
            for index in range(first, stop):
                fetch.in_flight.pop(index, None)
        if problem is not None:
            raise problem

    async def _read_chunks(
        self, fetch: FileFetch, first: int, stop: int
    ) -> list[tuple[int, bytes | memoryview | CorruptDataError]]:
        """Each chunk's verified bytes, or why it is not right."""
        start, end = fetch.chunk_start(first), fetch.chunk_start(stop)
        if fetch.manifest is not None:
            chunks = await self.store.read_chunks(fetch.key, fetch.manifest, first, stop)
            return list(zip(range(first, stop), chunks, strict=True))
        data = memoryview(await self.store.read_range(fetch.key, None, start, end))
        out: list[tuple[int, bytes | memoryview | CorruptDataError]] = []
        for index in range(first, stop):
            at, to = fetch.chunk_start(index) - start, fetch.chunk_start(index + 1) - start
            piece = data[at:to]
            try:
                if len(piece) != to - at:
                    log.error(
                        "event=corrupt_data key=%s ino=%d range=%d-%d problem=%r",
                        fetch.key,
                        fetch.ino,
                        at + start,
                        to + start,
                        f"remote returned {len(piece)} bytes",
                    )
                    raise CorruptDataError(
                        f"{fetch.key} bytes {at + start}-{to + start}: remote returned {len(piece)} bytes"
                    )
                if fetch.expected_chunks is not None:
                    await check_journal_chunk(fetch, index, piece)
            except CorruptDataError as exc:
                out.append((index, exc))
                continue
            out.append((index, piece))
        return out

    async def _complete(self, fetch: FileFetch) -> int:
        """The contiguous local prefix; the file is recorded local once all chunks are (and checked out)."""
        if len(fetch.present) < fetch.chunks:
            return self._contiguous(fetch)
        if fetch.whole_digest is not None and not fetch.verified:
            await verify_whole(fetch, self.data_files)
        if self._files.get(fetch.ino) is not fetch:  # completed by a concurrent reader, or forgotten
            if not fetch.closed:
                return self._contiguous(fetch)
            if fetch.recorded is not None:
                await asyncio.shield(fetch.recorded)  # no reader learns the file is local before the journal
            return fetch.size
        del self._files[fetch.ino]
        fetch.closed = True
        if fetch.fd_users == 0:
            self.data_files.close_fd(fetch)
        # On the journal thread, in order with the mover's other journal calls; owned by the service,
        # so a reader that goes away does not drop it.  No reader learns the file is local (and so
        # nothing can evict it, and forget it here) before the record landed.
        fetch.recorded = self._tasks.start(self._record_fetched(fetch))
        if len(self._completed) >= COMPLETED_MEMO:
            del self._completed[next(iter(self._completed))]
        self._completed[fetch.ino] = (fetch.size, fetch.recorded)
        await asyncio.shield(fetch.recorded)
        return fetch.size

    async def _record_fetched(self, fetch: FileFetch) -> None:
        """Record ``fetch``'s file local (with the manifest's digests, if any), on the journal thread."""
        manifest = fetch.manifest
        if manifest is None:
            await self._db(self.journal.finish_fetch, fetch.ino, fetch.size)
        else:
            await self._db(
                self.journal.finish_fetch,
                fetch.ino,
                fetch.size,
                digest=manifest.digest,
                chunk_size=manifest.chunk_size,
                chunks=[c.xxh3 for c in manifest.chunks],
            )
        log.info("event=fetched key=%s bytes=%d verified=%s", fetch.key, fetch.size, fetch.verification)

    def forget(self, ino: int) -> None:
        """Drop fetch state of a file that went away (unlinked or evicted again).

        In-flight chunk fetches are cancelled; a pwrite already running in a
        thread keeps the descriptor until it returns (then it is closed).  An
        open of its fetch in progress is revoked.
        """
        self._open_tokens.pop(ino, None)
        self._unanswered.pop(ino, None)
        self._completed.pop(ino, None)
        fetch = self._files.pop(ino, None)
        if fetch is None:
            return
        fetch.closed = True
        if fetch.early is not None:
            fetch.early.drop()
            fetch.early = None
        for task in list(fetch.in_flight.values()):
            task.cancel()
        if fetch.stream is not None and fetch.stream.task is not None:
            fetch.stream.task.cancel()
        if fetch.fd_users == 0:
            self.data_files.close_fd(fetch)

    async def let_go(self, ino: int) -> None:
        """forget ``ino``, and return once no fetch of it can write its data file again: the
        core is about to replace that file's bytes in place (a remote file emptied by
        ``O_TRUNC``).  Waits only for local work (a data file being created, pwrites in
        threads); an open of a fetch still waiting on the remote is revoked, not awaited."""
        fetch = self._files.get(ino)
        self.forget(ino)
        creating = self._creating.get(ino)
        if creating is not None:
            await asyncio.wait([creating])
        if fetch is not None and fetch.fd_users:  # a pwrite thread is still writing (milliseconds)
            await fetch.pwrites_idle.wait()

    async def aclose(self) -> None:
        """End every chunk fetch (prefetches included) and close the descriptors (the mover stops).

        A pwrite already running in a thread keeps its descriptor until it returns.
        """
        for ino in list(self._files):
            self.forget(ino)
        await self._tasks.aclose()
        self.data_files.close_all()

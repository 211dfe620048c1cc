"""The streaming plan: one GET per file read sequentially, landed as it arrives.

A file read sequentially from its start on a remote that prefers it (S3) is
fetched by one GET of the rest of the file, its body written to the tier in
pieces as it arrives and each chunk served as soon as it is complete and
verified.  The stream runs at most as far ahead of its reader as the service
lets it (its ``limit``), waits (the GET open) for the reader to move on, ends
once idle, and resumes a cut body from the first byte that has not landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from ..errors import CorruptDataError, RemoteError
from ..objects import ObjectStore
from ..remote.retry import describe_error
from .datafiles import DataFiles
from .state import (
    MAX_STREAMS,
    READ_STALL_S,
    STREAM_IDLE_S,
    STREAM_PIECE,
    FileFetch,
    OwnedTasks,
    Stream,
    pass_outcome,
)
from .verify import check_digest, note_refetch

log = logging.getLogger("burstfs.restore")


class EarlyGet:
    """The GET a cold file's first stream sends, sent beside the file's manifest GET: a
    sequential read from the start then waits one round trip for its first byte, not two.
    Taken by that stream (its errors are the stream's, retried as its own GET's), else dropped:
    by the read that planned otherwise, or after READ_STALL_S (its reader went away before
    planning; it held a stream slot and a connection)."""

    def __init__(self, streams: Streams, key: str, end: int) -> None:
        self.streams, self.remote, self.end = streams, streams.store.remote, end
        self._state = "sent"  # then "taken" or "dropped"
        self._released = False
        streams.early += 1  # a stream slot until taken or dropped
        self.task: asyncio.Task[Any] = asyncio.ensure_future(self.remote.open_range(key, 0, end))
        self.task.add_done_callback(self._settled)
        self._expiry = asyncio.get_running_loop().call_later(READ_STALL_S, self.drop)

    def take(self) -> asyncio.Task[Any] | None:
        """The GET, now its stream's (awaited and closed by ``stream_range``); None if dropped."""
        if self._state != "sent":
            return None
        self._state = "taken"
        self._ended()
        return self.task

    def drop(self) -> None:
        """Nobody will read it: cancel it, or close its connection."""
        if self._state != "sent":
            return
        self._state = "dropped"
        self._ended()
        if not self.task.done():
            self.task.cancel()
        elif not self.task.cancelled() and self.task.exception() is None:
            self._release()

    def _ended(self) -> None:
        self._expiry.cancel()
        self.streams.early -= 1

    def _settled(self, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is None and self._state == "dropped":  # else retrieved
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.remote.close_range(self.task.result())


class Streams:
    """The file streams of one restore service, at most ``max_streams`` at once (one connection each)."""

    def __init__(
        self,
        store: ObjectStore,
        data_files: DataFiles,
        tasks: OwnedTasks,
        chunk: Callable[[FileFetch, int], asyncio.Future[None]],
    ) -> None:
        self.store = store
        self.data_files = data_files
        self._tasks = tasks
        self._chunk = chunk  # the service's future for a chunk: a ranged fetch once no stream passes it
        self.max_streams = MAX_STREAMS
        self.active = 0
        self.early = 0  # EarlyGets sent and not yet taken or dropped: they count against max_streams
        self.idle_s = STREAM_IDLE_S
        self.piece = STREAM_PIECE
        self.fetched_bytes = 0

    def streaming(self, fetch: FileFetch) -> bool:
        return self.store.remote.prefers_streams and fetch.streamable

    def early_get(self, key: str, size: int) -> EarlyGet | None:
        """A cold file's stream GET sent ahead (its manifest's GET on its way), if a slot is free."""
        if not self.store.remote.prefers_streams or self.active + self.early >= self.max_streams:
            return None
        return EarlyGet(self, key, size)

    def stream_to(self, fetch: FileFetch, first: int, limit: int) -> bool:
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
        if self.active >= self.max_streams:
            return False
        stream = fetch.stream = Stream(next_chunk=start, end_chunk=fetch.chunks, limit=limit)
        self.active += 1
        try:
            stream.task = self._tasks.start(self._run_stream(fetch, stream))
        except BaseException:
            self.active -= 1
            if fetch.stream is stream:
                fetch.stream = None
            raise
        stream.task.add_done_callback(functools.partial(self._stream_ended, fetch, stream))
        return True

    def _stream_ended(self, fetch: FileFetch, stream: Stream, task: asyncio.Task[None]) -> None:
        """Give the slot back; readers still waiting get its error, or (it went idle) a ranged fetch each."""
        self.active -= 1
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
                self._chunk(fetch, index).add_done_callback(functools.partial(pass_outcome, waiter))

    async def _run_stream(self, fetch: FileFetch, stream: Stream) -> None:
        """Land the stream's chunks, resuming after temporary failures from the first byte not landed."""
        remote, retry = self.store.remote, self.store.retry
        failures, landed_at_failure = 0, -1
        loop = asyncio.get_running_loop()
        stream.progressed_at = loop.time()
        while stream.next_chunk < stream.end_chunk:
            position = fetch.chunk_start(stream.next_chunk) + stream.landed_bytes
            # Bounded from the last byte that landed, across resumes: a GET that hangs after a
            # cut waits out no read timeout beyond READ_STALL_S of silence in all.
            guard = stream.stall_guard = asyncio.timeout_at(stream.progressed_at + READ_STALL_S)
            try:
                async with guard:
                    if not await self._stream_body(fetch, stream, position):
                        return  # the reader went idle, or the rest is here
            except Exception as exc:
                here = fetch.chunk_start(stream.next_chunk) + stream.landed_bytes
                what = f"get {fetch.key} bytes {here}-{fetch.chunk_start(stream.end_chunk)}"
                if guard.expired():
                    raise RemoteError(
                        f"{what}: remote {remote.url} sent nothing for {READ_STALL_S:.0f}s", kind="unavailable"
                    ) from exc
                if not remote.is_temp_failure(exc):
                    raise
                failures = 1 if here != landed_at_failure else failures + 1  # progress restarts the count
                landed_at_failure = here
                delay = retry.backoff(failures)
                spent = retry.budget is not None and loop.time() - stream.progressed_at + delay >= retry.budget
                if failures >= retry.attempts or spent:
                    raise RemoteError(
                        f"{what}: remote {remote.url} unavailable after {failures} attempts: {describe_error(exc)}",
                        kind="unavailable",
                    ) from exc
                log.warning(
                    "event=stream_resumed key=%s offset=%d attempt=%d delay=%.2f error=%r",
                    fetch.key,
                    here,
                    failures,
                    delay,
                    describe_error(exc),
                )
                await asyncio.sleep(delay)

    async def _stream_body(self, fetch: FileFetch, stream: Stream, position: int) -> bool:
        """One GET from ``position`` to the end of the stream's chunks; True if it must be resumed.

        Each piece is written and hashed (one thread hop) as it arrives; a chunk is
        marked present only once all of it landed and its digest matched (one that did not
        is streamed once more before it is called corrupt).  A chunk
        that is already present, or being fetched by a ranged GET, is read past.
        """
        end = fetch.chunk_start(stream.end_chunk)
        early, fetch.early = fetch.early, None
        opened = None
        if early is not None and position == 0 and end == early.end:
            opened = early.take()
        elif early is not None:
            early.drop()
        pieces = self.store.remote.stream_range(fetch.key, position, end, self.piece, opened)
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
                        await self.data_files.write(fetch, take, at, stream.hasher)
                        self.fetched_bytes += len(take)
                    stream.landed_bytes += len(take)
                    stream.progressed()
                    if at + len(take) < fetch.chunk_start(index + 1):
                        continue
                    if not stream.skipping:
                        try:
                            check_digest(fetch, index, stream.hasher.hexdigest())
                        except CorruptDataError:
                            if index in stream.refetched:
                                raise
                            stream.refetched.add(index)
                            note_refetch(fetch, index)
                            stream.landed_bytes = 0
                            return True  # resumed from the chunk's first byte
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

    async def _stream_may_go_on(self, fetch: FileFetch, stream: Stream) -> bool:
        """Wait (the GET stays open) until the reader lets the next chunk start; False once idle."""
        while fetch.chunk_start(stream.next_chunk) >= stream.limit:
            stream.moved.clear()
            stream.waiting_for_reader()
            try:
                await asyncio.wait_for(stream.moved.wait(), self.idle_s)
            except TimeoutError:
                log.info("event=stream_idle key=%s offset=%d", fetch.key, fetch.chunk_start(stream.next_chunk))
                return False
            finally:
                stream.progressed()
        return True

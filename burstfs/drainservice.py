"""Runs the mover beside the FUSE front and gives the core its drain and fetch hooks.

The mover lives on its own asyncio loop in a thread, so uploads, fetches,
hashing and compression never run on the trio request loop.  The core only ever
calls the thread-safe methods below; :func:`_on_mover_loop` runs a coroutine on
the mover's loop and wakes the waiting trio task when it is done, without
parking a thread per request.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import trio

from .errors import FsError
from .journal import DURABLE, EVICTED, FAILED, INCOMPLETE, Journal
from .mover import Mover

log = logging.getLogger("burstfs.drain")

T = TypeVar("T")

# fsync(2) in --fsync remote mode polls the journal this often while it waits.
DURABLE_POLL_S = 0.05


class DrainService:
    """The mover's thread, plus the ``DrainHooks`` the core calls."""

    def __init__(self, mover: Mover, journal: Journal, *, fsync_timeout: float = 600.0) -> None:
        self.mover = mover
        self._journal = journal
        self._fsync_timeout = fsync_timeout
        self._thread = threading.Thread(target=self._run, name="burstfs-mover", daemon=True)
        self.crashed: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            asyncio.run(self.mover.run())
        except BaseException as exc:  # reported in status; staged data stays journaled
            self.crashed = exc
            log.exception("event=mover_crashed")

    def wait_ready(self, timeout: float = 30.0) -> None:
        if not self.mover.wait_ready(timeout):
            raise RuntimeError("the mover did not start")

    def stop(self, timeout: float = 30.0) -> None:
        self.mover.stop()
        self._thread.join(timeout)

    # -- DrainHooks ---------------------------------------------------------------

    def file_closed(self) -> None:
        self.mover.wake()

    def namespace_changed(self) -> None:
        self.mover.namespace_changed()

    async def wait_durable(self, ino: int, generation: int) -> None:
        """fsync in ``--fsync remote`` mode: wait for this generation, EIO if it cannot be."""
        self.mover.drain_now()
        with trio.move_on_after(self._fsync_timeout):
            while True:
                rows = await trio.to_thread.run_sync(
                    self._journal.query,
                    "SELECT state, durable_generation, error FROM inodes WHERE ino=?",
                    (ino,),
                )
                if not rows:
                    return  # unlinked meanwhile: nothing left to make durable
                state, durable_generation, error = rows[0]
                if state in (DURABLE, EVICTED) and (durable_generation or 0) >= generation:
                    return
                if state in (FAILED, INCOMPLETE):
                    raise FsError(errno.EIO, f"cannot become durable ({state}): {error}")
                if self.crashed is not None:
                    raise FsError(errno.EIO, f"the mover stopped: {self.crashed}")
                if self.mover.stats.halted is not None:
                    raise FsError(errno.EIO, f"drain halted: {self.mover.stats.halted}")
                await trio.sleep(DURABLE_POLL_S)
        raise FsError(errno.EIO, f"not durable after {self._fsync_timeout:.0f}s")

    # -- Fetcher ------------------------------------------------------------------

    async def ensure_local(self, ino: int, offset: int, size: int) -> int:
        assert self.mover.restore is not None
        return await self._on_mover_loop(self.mover.restore.ensure_local(ino, offset, size))

    async def list_dir(self, dir_key: str) -> tuple[list[tuple[str, int, float]], list[str]]:
        assert self.mover.restore is not None
        return await self._on_mover_loop(self.mover.restore.list_dir(dir_key))

    def forget(self, ino: int) -> None:
        loop, restore = self.mover.loop, self.mover.restore
        if loop is not None and restore is not None:
            loop.call_soon_threadsafe(restore.forget, ino)

    @property
    def fetched_bytes(self) -> int:
        return self.mover.restore.fetched_bytes if self.mover.restore else 0

    async def _on_mover_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self.mover.loop
        if loop is None or self.crashed is not None:
            coro.close()
            raise FsError(errno.EIO, "the mover is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()

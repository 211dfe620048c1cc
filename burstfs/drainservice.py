"""Runs the mover beside the FUSE front and gives the core its drain and fetch hooks.

The mover lives on its own asyncio loop in a thread, so uploads, fetches,
hashing and compression never run on the trio request loop.  The thread's
lifetime is bound to the daemon's trio nursery (:meth:`DrainService.run`:
started before the mount answers requests, stopped and joined when the nursery
ends).  Every call from trio into the mover goes through one of two paths:
:meth:`DrainService.on_mover_loop` runs a coroutine on the mover's loop and
wakes the waiting trio task when it is done, without parking a thread per
request; :meth:`DrainService.call_soon` runs a plain function there (wake-ups,
``drain --now``, forgetting a fetch), so mover state is only ever touched by
the mover's own thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import trio

from .errors import BurstfsError, CorruptDataError, FsError, RemoteError, RemoteNotFound
from .hooks import Listing
from .journal import BROKEN, DONE, Journal
from .latest import find_latest, missing_root
from .mover import Mover

log = logging.getLogger("burstfs.drain")

T = TypeVar("T")

# fsync(2) in --fsync remote mode polls the journal this often while it waits.
DURABLE_POLL_S = 0.05
# user.burstfs.latest of a directory: the longest its getxattr waits for the remote, and how
# many newer checkpoints it passed over it names (an xattr holds at most 64 KiB).
LATEST_XATTR_S = 30.0
LATEST_SKIPPED_SHOWN = 20
# A mover that died is restarted after this many seconds, doubling per crash up to the cap;
# a mover that ran this long before it died starts the backoff over.
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 60.0
RESTART_STABLE_S = 300.0
# After an intent record did not land within the close's bound, closes do not wait for one for this long.
INTENT_LATE_QUIET_S = 30.0


class DrainService:
    """The mover's thread, plus the ``DrainHooks`` the core calls.

    A mover that dies is restarted (bounded backoff); meanwhile reads and writes
    of local files go on, fetches fail with EIO, and status says why.
    """

    def __init__(
        self, mover: Mover, journal: Journal, *, fsync_timeout: float = 600.0, intent_wait: float = 1.0
    ) -> None:
        """``intent_wait``: the longest a close waits for its directory's intent record (--remote-wait)."""
        self.mover = mover
        self._journal = journal
        self._fsync_timeout = fsync_timeout
        self._intent_wait = intent_wait
        self._intents_late_until = 0.0
        self._thread = threading.Thread(target=self._run, name="burstfs-mover", daemon=True)
        self._stop = threading.Event()
        self.last_crash: BaseException | None = None
        self.restarts = 0

    @property
    def crashed(self) -> BaseException | None:
        """The error that killed the mover, while it is down (None once it runs again)."""
        return None if self.mover.running else self.last_crash

    def start(self) -> None:
        self._thread.start()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the mover's thread for as long as this task: ``await nursery.start(drain.run)``.

        Started (and ready) before ``task_status.started()``; when the nursery is
        cancelled the mover is stopped and its thread joined before this returns.
        """
        self.start()
        try:
            await trio.to_thread.run_sync(self.wait_ready, abandon_on_cancel=True)
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.stop)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                asyncio.run(self.mover.run())
                return  # stopped
            except BaseException as exc:  # reported in status; staged data stays journaled
                self.last_crash = exc
                if self._stop.is_set():
                    log.error("event=mover_crashed while=stopping error=%r", exc)
                    return
                if time.monotonic() - started > RESTART_STABLE_S:
                    failures = 0
                delay = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**failures)
                failures += 1
                log.exception("event=mover_crashed restart_in=%.1f restarts=%d", delay, self.restarts)
            if self._stop.wait(delay):
                return
            self.restarts += 1
            log.info("event=mover_restart restarts=%d", self.restarts)

    def wait_ready(self, timeout: float = 30.0) -> None:
        if not self.mover.wait_ready(timeout):
            crash = f": it failed with {self.last_crash!r}" if self.last_crash is not None else ""
            raise BurstfsError(f"the mover did not start within {timeout:.0f}s{crash} (see burstfs.log in the cache)")

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self.mover.stop()
        self._thread.join(timeout)

    # -- DrainHooks ---------------------------------------------------------------

    # The hooks of every close run on the FUSE thread: what they touch is thread-safe (a
    # lock, or one dict operation), so they take no hop to the mover's loop but its wake.

    def file_closed(self) -> None:
        self.mover.wake()

    def namespace_changed(self) -> None:
        self.call_soon(self.mover.namespace_changed)

    def drain_now(self) -> None:
        """Skip the drain delay and any retry backoff (``burstfs-admin drain --now``, fsync)."""
        self.call_soon(self.mover.drain_now)

    def probe_now(self) -> None:
        """A halted drain looks at the remote now, not at its next HALT_PROBE_S (a wait that
        finds it halted: the remote may have been fixed since)."""
        self.call_soon(self.mover.wake)

    async def retry_failed(self) -> int:
        """Requeue failed files and lift a halt, on the mover's loop; how many were requeued."""

        return await self.on_mover_loop(self.mover.retry_failed())

    def announced_in(self, dir_key: str) -> bool:
        return self.mover.groups.announced_in(dir_key)

    def writing_in(self, ino: int, dir_key: str, name: bytes) -> None:
        self.mover.bursts.opened(ino)
        self.mover.groups.writing_in(ino, dir_key, name)

    def hold_drain(self, ino: int, generation: int) -> None:
        self.mover.bursts.touch()
        self.mover.hold_drain(ino, generation)

    def release_drain(self, ino: int) -> None:
        self.mover.bursts.released(ino)
        self.mover.release_drain(ino)

    def stamp_close(self, ino: int, generation: int, stamp: tuple[int, int]) -> None:
        self.mover.close_stamps[ino] = (generation, stamp)

    async def closed_in(self, ino: int, dir_key: str, name: bytes) -> None:
        """close(2) of ``ino`` in ``dir_key``: it joins this node's round there, and the close
        gives the round's intent record up to ``intent_wait`` to land, so that a marker written
        after the framework's barrier already sees this node.  Never fails: local speed is the
        promise; a late intent still holds this node's own marker.  A round whose intent is
        already out is joined right here: no hop to the mover's loop (~2 ms per small file while
        it drains)."""
        if self.mover.groups.joined_announced(ino, dir_key, name):
            return
        self.writing_in(ino, dir_key, name)  # a close after the round's done starts the next
        await self._intents_published([dir_key])

    async def renamed_in(self, files: list[tuple[int, str, bytes]]) -> None:
        """Files ``(ino, dir_key, name)`` renamed into place join this node's rounds there as
        closes would, with one bounded wait for all their intents (a tree of step directories
        renamed at once waits no longer than one close).  Not as writers: no release follows a
        rename, and a file taken for open would hold large uploads back (bursts.py)."""
        waiting: set[str] = set()
        for ino, dir_key, name in files:
            if not self.mover.groups.joined_announced(ino, dir_key, name):
                self.mover.groups.writing_in(ino, dir_key, name)
                waiting.add(dir_key)
        if waiting:
            await self._intents_published(sorted(waiting))

    async def _intents_published(self, dir_keys: list[str]) -> None:
        """Wait for the intents of ``dir_keys`` (bounded by ``intent_wait`` for all of them)."""
        if self._intent_wait <= 0 or time.monotonic() < self._intents_late_until:
            return  # a late intent means a sick remote: closes do not each pay the bound again
        published = False
        deadline = trio.current_time() + self._intent_wait
        with trio.move_on_at(deadline):  # a busy mover loop counts against the bound too
            try:
                for dir_key in dir_keys:
                    left = max(0.0, deadline - trio.current_time())
                    if not await self.on_mover_loop(self.mover.groups.wait_intent(dir_key, left)):
                        break
                else:
                    published = True
            except FsError:  # the mover is down: the intents go out once it is back
                pass
        if not published:
            self._intents_late_until = time.monotonic() + INTENT_LATE_QUIET_S
            log.warning("event=intent_late dir=%s waited=%.1f", dir_keys[0], self._intent_wait)

    async def abandon(self, dir_key: str) -> tuple[str, list[dict[str, object]]]:
        """``burstfs-admin abandon``: give up the checkpoint in ``dir_key`` (see CommitGroups.abandon):
        the directory given up, and the intents it waited for."""
        remote = self.mover.remote
        if remote is None:
            raise FsError(errno.EIO, "the mover is not running")
        given_up, waiting = await self.on_mover_loop(self.mover.groups.abandon(remote, dir_key))
        self.call_soon(self.mover.wake)
        return given_up, [{"node": w.node, "dir": w.dir_key, "round": w.round, "intent_time": w.since} for w in waiting]

    async def wait_durable(self, ino: int, generation: int) -> None:
        """fsync in ``--fsync remote`` mode: wait for this generation, EIO if it cannot be."""
        self.drain_now()
        with trio.move_on_after(self._fsync_timeout):
            while True:
                names = await trio.to_thread.run_sync(self._journal.names_of, ino)  # hard links: each name
                durable = all(row.state in DONE and (row.durable_generation or 0) >= generation for row in names)
                # ... and, renamed since its upload, at its current path (no names: unlinked, nothing to wait for)
                if durable and not await trio.to_thread.run_sync(self._journal.moving, ino):
                    return
                for row in names:
                    if row.state in BROKEN:
                        raise FsError(errno.EIO, f"cannot become durable ({row.state}): {row.error}")
                if self.crashed is not None:
                    raise FsError(errno.EIO, f"the mover stopped: {self.crashed}")
                if self.mover.stats.halted is not None:
                    raise FsError(errno.EIO, f"drain halted: {self.mover.stats.halted}")
                await trio.sleep(DURABLE_POLL_S)
        raise FsError(errno.EIO, f"not durable after {self._fsync_timeout:.0f}s")

    # -- Fetcher ------------------------------------------------------------------

    async def ensure_local(self, ino: int, offset: int, size: int) -> int:
        assert self.mover.restore is not None
        try:
            return await self.on_mover_loop(self.mover.restore.ensure_local(ino, offset, size))
        except CorruptDataError as exc:  # status lists it (the log has event=corrupt_data)
            self.mover.stats.read_error(str(exc))
            raise
        except RemoteNotFound as exc:  # listed (or drained), then deleted behind our back: not ENOENT
            log.error("event=remote_object_gone ino=%d error=%s", ino, exc)
            self.mover.stats.read_error(str(exc))
            raise FsError(errno.EIO, f"its remote object is gone: {exc}") from exc
        except RemoteError as exc:  # a restore-only node drains nothing: status says it from here
            self.mover.stats.read_failed(f"read of inode {ino}", str(exc))
            raise

    def commit_markers(self) -> tuple[str, ...]:
        return tuple(self.mover.options.commit_markers)  # immutable options: read from any thread

    async def latest_under(self, dir_key: str) -> str:
        remote = self.mover.remote
        if remote is None:
            raise FsError(errno.EIO, "no remote is configured")
        missing = missing_root(remote.url)
        if missing is not None:
            log.warning("event=latest_failed dir=%s error=%s", dir_key or "/", missing)
            raise FsError(errno.EIO, missing)
        try:
            found, skipped = await self.on_mover_loop(asyncio.wait_for(find_latest(remote, dir_key), LATEST_XATTR_S))
        except TimeoutError:
            log.warning("event=latest_failed dir=%s error=no answer within %.0fs", dir_key or "/", LATEST_XATTR_S)
            raise FsError(errno.ETIMEDOUT, f"the remote did not answer within {LATEST_XATTR_S:.0f}s") from None
        except BurstfsError as exc:
            log.warning("event=latest_failed dir=%s error=%s", dir_key or "/", exc)
            raise FsError(errno.EIO, f"the remote cannot be read: {exc}") from exc
        document = {
            "remote": str(remote.url),
            "dir": found.dir if found else None,
            "step": found.step if found else None,
            "marker": found.marker if found else None,
            "committed_at": found.committed_at if found else None,
            "files": found.files if found else 0,
            "skipped": [{"dir": d, "reason": r[:300]} for d, r in skipped[:LATEST_SKIPPED_SHOWN]],
        }
        return json.dumps(document)

    async def list_dir(self, dir_key: str) -> Listing:
        assert self.mover.restore is not None
        return await self.on_mover_loop(self.mover.restore.list_dir(dir_key))

    async def objects_deleted(self, keys: list[str]) -> set[str]:
        assert self.mover.restore is not None
        return await self.on_mover_loop(self.mover.restore.objects_deleted(keys))

    def listing_failed(self, dir_key: str, reason: str) -> None:
        self.mover.stats.read_failed(f"list {dir_key or '/'}", reason)

    def forget(self, ino: int) -> None:
        restore = self.mover.restore
        if restore is not None:
            self.call_soon(restore.forget, ino)

    async def let_go(self, ino: int) -> None:
        restore = self.mover.restore
        if restore is None:
            return  # no mover yet: no fetch
        try:
            await self.on_mover_loop(restore.let_go(ino))
        except FsError:
            return  # the mover is down: nothing of it fetches

    @property
    def fetched_bytes(self) -> int:
        return self.mover.restore.fetched_bytes if self.mover.restore else 0

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the mover's loop, from any thread.  While the mover is down
        (between restarts, before the start) no thread runs mover code: ``fn`` runs here."""
        loop = self.mover.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(fn, *args)
                return
            except RuntimeError:  # the loop closed after we looked: the mover is down
                pass
        fn(*args)

    async def on_mover_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the mover's loop and wait for it from trio (EIO while the mover is down)."""
        loop = self.mover.loop
        if loop is None or self.crashed is not None:
            coro.close()
            raise FsError(errno.EIO, "the mover is not running")
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        try:
            future = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError:  # the loop closed after we looked: the mover is down
            coro.close()
            raise FsError(errno.EIO, "the mover is not running") from None
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        try:
            return future.result()
        except concurrent.futures.CancelledError:  # the mover stopped or died during the request
            raise FsError(errno.EIO, "the mover stopped") from None

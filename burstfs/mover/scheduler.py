"""The mover's loop: what drains next (close order, commit markers, backoff), claims, and the pass.

See the package docstring for the contract; ``upload.py`` drains one claimed
file, ``keymoves.py`` deletes and moves objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from ..commitgroups import CommitGroups
from ..config import DrainOptions, RemoteURL, S3Options, default_node_id, is_commit_marker
from ..errors import HALT, RemoteError, error_scope
from ..journal import InodeRow, Journal
from ..journal.thread import JournalThread
from ..localtier import LocalTier
from ..objects import ObjectStore
from ..remote import Remote, open_remote
from ..restore import LAYOUT_KEY, READ_RETRY, RestoreService
from ..status import LOCAL_TIER_KIND
from . import timing
from .bursts import WriterBursts
from .keymoves import KeyMoves
from .stats import MoverStats
from .upload import FileDrain

log = logging.getLogger("burstfs.mover")


def _task_error_left(loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
    """A task's error nobody awaited (a read's listing that failed as the loop stopped): one
    log line for the remote's errors, which say all in their message; a traceback for the rest."""
    exc = context.get("exception")
    if isinstance(exc, RemoteError):
        log.warning("event=task_error_left context=%r error=%s", context.get("message"), exc)
    else:
        loop.default_exception_handler(context)


P = ParamSpec("P")
T = TypeVar("T")


class Mover:
    """Drains one cache directory to its remote."""

    def __init__(
        self,
        cache_dir: Path,
        remote_url: RemoteURL,
        s3: S3Options,
        options: DrainOptions,
        *,
        remote: Remote | None = None,
    ) -> None:
        """``remote``: use this remote instead of opening ``remote_url`` (tests wrap one to inject faults)."""
        self.cache_dir = Path(cache_dir)
        self.remote_url = remote_url
        self.s3 = s3
        self.options = options
        self.journal = Journal(self.cache_dir)
        self._journal_open = True
        self._journal_thread: JournalThread | None = None
        self.tier_paths = LocalTier(self.cache_dir)
        self.stats = MoverStats()
        self.remote: Remote | None = remote
        self._own_remote = remote is None
        self.store: ObjectStore | None = None
        self.restore: RestoreService | None = None
        self._ready = threading.Event()  # set once the loop, remote and restore exist
        self._drained_to = False  # a file of this cache is durable on this remote (journal meta)
        self._wakeup: asyncio.Event | None = None
        self._wake_pending = False  # a wake is on its way, or the event is set: see wake()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._main: asyncio.Task[None] | None = None  # the task of run(), cancelled by stop()
        self._leaving = False  # run() is in its cleanup: stop() cancels nothing any more
        self._stopping = False
        self.in_flight: dict[int, str] = {}  # ino -> key its upload holds
        self.not_before: dict[int, float] = {}  # ino -> earliest retry time
        self.held_open: dict[int, int] = {}  # ino -> generation closed while another writer stays open
        # ino -> (generation, its data file's (size, mtime_ns) when journaled): FileDrain._written_since
        self.close_stamps: dict[int, tuple[int, tuple[int, int]]] = {}
        self._skip_delay = False
        self._small_uploads: set[asyncio.Task[None]] = set()  # run()'s small-file pool, for upload_ended
        # With --drain-delay, a pass that found no staged file old enough: until then (monotonic) no pass
        # reads the queue again (each read scans every staged file; passes follow every close).
        self._none_due_until = 0.0
        self._next_prune = 0.0
        self._next_stale_abort = 0.0
        self.bursts = WriterBursts()  # touched by the FUSE thread (DrainService)
        self.uploads = FileDrain(self)
        self.key_moves = KeyMoves(self)
        self.durable_listeners: list[Callable[[int, float], None]] = []  # (bytes, seconds) of each durable file
        self.node_id = options.node_id or default_node_id()
        self.groups = CommitGroups(self.node_id, self.journal, self.is_marker_name, self.wake, self.db, self.stats)

    def on_durable(self, listener: Callable[[int, float], None]) -> None:
        """Call ``listener(bytes, seconds)`` on the mover thread for each file made durable
        (seconds: from the start of its upload); register before the mover starts."""
        self.durable_listeners.append(listener)

    # -- thread-safe controls (called from the FUSE thread or the control socket) ----

    def wake(self) -> None:
        """Wake the loop; a no-op (never an error) if the mover stopped or died.

        One hop per pass: the event stays set until the next pass begins (which clears
        ``_wake_pending`` with it), so the wakes of a burst of closes after the first cost
        nothing.  Each was a hop to the mover's thread, and on 2 cores the FUSE thread then
        waited for the GIL while the mover ran (~17% of a small file's requests)."""
        loop, wakeup = self._loop, self._wakeup
        if loop is None or wakeup is None or self._wake_pending:
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(wakeup.set)
        except RuntimeError:  # the loop is closed: a close or rename must not fail for it
            self._wake_pending = False

    def upload_ended(self, size: int) -> None:
        """(Mover thread.) An upload of a ``size``-byte file ended, its task still in its pool:
        wake the loop to refill -- for a small file only once SMALL_REFILL of the pool's slots
        are free.  Until then the next upload to end, a close or the idle rescan wakes it."""
        busy = len(self._small_uploads) - 1  # the ending task leaves its pool after this
        if size <= timing.SMALL_FILE_BYTES and busy > timing.SMALL_FILES_IN_FLIGHT - timing.SMALL_REFILL:
            return
        self.wake()

    def namespace_changed(self) -> None:
        self.key_moves.changed()
        self.wake()

    def hold_drain(self, ino: int, generation: int) -> None:
        """(Any thread.) ``generation`` of ``ino`` was journaled by a close(2) whose file may still be open
        for writing (a dup'd descriptor: ``cmd > file`` in a shell, a forked child; another
        open): it drains only after :meth:`release_drain`.  Uploading it sooner would send a
        snapshot taken mid-write and call the file durable while bytes still land.  Kept in
        memory only: after a crash no writer is left and the generation drains."""
        self.held_open[ino] = generation

    def release_drain(self, ino: int) -> None:
        """(Any thread.) The last writable open of ``ino`` was released, or it was fsync'd: it may drain,
        and large uploads held back for this writer (bursts.py) may start."""
        self.held_open.pop(ino, None)
        self.wake()

    def drain_now(self) -> None:
        """Skip any configured delay and retry backoff."""
        self._skip_delay = True
        self.not_before.clear()
        self.key_moves.retry_now()
        self.groups.retry_now()
        self.wake()

    async def retry_failed(self) -> int:
        """Requeue failed files and lift a halt (on the mover's loop); returns how many files were requeued."""
        count = await self.db(self.journal.drain.retry_failed)
        self.stats.halted = None
        self.drain_now()
        return count

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def running(self) -> bool:
        return self._ready.is_set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def stop(self) -> None:
        """Stop the loop now (any thread): a pass waiting on a sick remote (an intent record
        retried for 30 s) is cancelled, not waited for; what it left half done is what a
        crash leaves, and the next start recovers it."""
        self._stopping = True
        loop, main = self._loop, self._main
        if loop is None or main is None:
            return
        try:
            loop.call_soon_threadsafe(self._cancel_main, main)
        except RuntimeError:  # the loop closed after we looked
            pass

    def _cancel_main(self, main: asyncio.Task[None]) -> None:
        """On the loop: a cancel that arrives once run() saw ``_stopping`` and left its loop would
        hit its cleanup (the uploads' cancellation, the journal's close) instead."""
        if not self._leaving:
            main.cancel()

    async def db(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """A journal call, on the journal thread (the loop goes on meanwhile): the one way the
        mover's parts reach the journal while it runs."""
        assert self._journal_thread is not None
        return await self._journal_thread.call(fn, *args, **kwargs)

    def drain_memory(self) -> int:
        """The drain's memory budget, bytes of file data held at once (docs/CONFIGURATION.md):
        ``max_files`` uploads of ``concurrency`` parts each (or one part plus one chunk, if
        larger) and the small files' pool, each byte held once."""
        assert self.store is not None
        per_file = self.store.upload_memory(self.options.part_size, self.options.concurrency)
        return self.options.max_files * per_file + timing.SMALL_FILES_IN_FLIGHT * timing.SMALL_FILE_BYTES

    # -- main loop ---------------------------------------------------------------

    async def run(self, *, until_idle: bool = False) -> None:
        """Drain until stopped (or, with ``until_idle``, until nothing is left to drain).

        May be called again after it returned or raised (the daemon restarts a dead mover).
        """
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_task_error_left)
        self._main = asyncio.current_task()
        self._leaving = False
        self._wake_pending = False  # a wake for the loop before a restart never reached it
        self._wakeup = asyncio.Event()
        self._journal_thread = JournalThread()
        if not self._journal_open:
            self.journal = await self.db(Journal, self.cache_dir)
            self._journal_open = True
        if self.remote is None:
            self.remote = open_remote(
                self.remote_url,
                self.s3,
                max_connections=self.options.max_files * self.options.concurrency + timing.SMALL_FILES_IN_FLIGHT + 4,
            )
        self._hook_uploads(self.remote)
        self._drained_to = await self.db(self.journal.drained_to, str(self.remote_url))
        if self._drained_to:
            self.remote.expect_established()
        self.store = ObjectStore(
            self.remote,
            on_upload_started=self._upload_started,
            on_upload_ended=self._upload_ended,
            health=self.stats,
            node_id=self.node_id,
        )
        log.info("event=drain_budget bytes=%d", self.drain_memory())
        # Reads answer requests: their own store, with a bounded retry budget (restore/state.py).
        self.restore = RestoreService(ObjectStore(self.remote, READ_RETRY), self.journal, self.tier_paths, db=self.db)
        self.restore.warm()
        self.groups.journal = self.journal
        await self.groups.load()
        self.in_flight.clear()
        self.key_moves.restart()
        tasks: set[asyncio.Task[None]] = set()
        small = self._small_uploads = set()  # the tasks of small files (their own pool)
        gate: asyncio.Task[None] | None = None
        failures = 0
        self._ready.set()
        try:
            await self._recover()
            await self._abort_stale_uploads()
            await self._record_layout()
            gate = asyncio.create_task(self.groups.poll(self.remote))  # cancelled with the uploads below
            while not self._stopping:
                self._wake_pending = False  # with the event: a wake from now on is for this pass
                self._wakeup.clear()
                await asyncio.sleep(timing.COALESCE_S)  # a burst of closes becomes one pass
                if self.stats.halted is not None and not await self._probe_remote():
                    if until_idle:  # `burstfs drain`: a halt ends it (exit 1) once its uploads ended
                        await asyncio.gather(*tasks, return_exceptions=True)
                        raise RemoteError(self.stats.halted, kind="halted")
                    await self._sleep(timing.HALT_PROBE_S)
                    continue
                try:
                    await self.groups.step(self.remote)  # intents go out at once: closes may wait for them
                    if (absorb := self._burst_wait()) > 0:
                        await asyncio.sleep(absorb)  # not woken by each close: they are the burst
                        continue
                    if not tasks:  # no upload in flight: every recorded one is left over
                        await self._retry_stale_uploads()
                    await self.key_moves.process_deletes()
                    await self._prune_events()
                    await self.key_moves.relocate_renamed()
                    large_slots = self.options.max_files - (len(tasks) - len(small))
                    if self.bursts.recent_writer():  # no large upload starts while a new writer works
                        large_slots = 0
                    for row, key, intent, started in await self._claim(
                        await self._eligible(large_slots, timing.SMALL_FILES_IN_FLIGHT - len(small))
                    ):
                        task = asyncio.create_task(self.uploads.run(row, key, intent, started))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                        if row.size <= timing.SMALL_FILE_BYTES:
                            small.add(task)
                            task.add_done_callback(small.discard)
                    if until_idle and not tasks and not await self._has_pending_work():
                        break
                    failures = 0
                except Exception as exc:  # never the end of the drain: log, back off, go on
                    failures += 1
                    if isinstance(exc, sqlite3.Error):  # the journal, on the tier (full): not a bug, not the remote
                        log.error("event=mover_pass_failed failures=%d kind=local_tier error=%s", failures, exc)
                        self.stats.error(LOCAL_TIER_KIND, f"journal on the local tier: {exc}")
                    else:
                        log.exception("event=mover_pass_failed failures=%d", failures)
                        self.stats.error("internal", f"mover pass failed: {exc!r}")
                    if until_idle and failures >= 10:
                        raise
                    await self._sleep(timing.PASS_ERROR_BACKOFF_S)
                    continue
                if until_idle and not tasks and self.stats.halted is not None:
                    raise RemoteError(self.stats.halted, kind="halted")
                await self._sleep(timing.IDLE_RESCAN_S)
        except asyncio.CancelledError:
            if not self._stopping:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]  # stop(): the end, not a crash
        finally:
            self._leaving = True
            self._ready.clear()
            if gate is not None:
                tasks.add(gate)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.restore is not None:
                await self.restore.aclose()  # its fetches end with this loop, its descriptors close
            with contextlib.suppress(Exception):
                await self.remote.close()
            if self._own_remote:
                self.remote = None
            thread, self._journal_thread = self._journal_thread, None
            try:
                with contextlib.suppress(Exception):
                    await thread.call(self.journal.close)
            finally:  # also when cancelled here: the thread ends (after a call in progress)
                self._journal_open = False
                thread.close()
                self._loop = None

    def _hook_uploads(self, remote: Remote) -> None:
        """Remotes that start multipart uploads of their own (S3 copies) record them too."""
        if hasattr(remote, "on_upload_started") and hasattr(remote, "on_upload_ended"):
            setattr(remote, "on_upload_started", self._upload_started)  # noqa: B010 (not in Remote)
            setattr(remote, "on_upload_ended", self._upload_ended)  # noqa: B010

    async def _upload_started(self, key: str, upload_id: str) -> None:
        await self.db(self.journal.drain.upload_started, key, upload_id)

    async def _upload_ended(self, upload_id: str) -> None:
        await self.db(self.journal.drain.upload_ended, upload_id)

    def _burst_wait(self) -> float:
        """How long new uploads wait for the writers' burst to pause (burstfs/mover/bursts.py):
        not at all when hurried (``drain --now``, fsync) or when the tier is filling up."""
        if self._skip_delay or self._stopping:
            return 0.0
        wait = self.bursts.absorbing()
        if wait > 0:
            tier = os.statvfs(self.cache_dir)
            if tier.f_blocks and tier.f_bavail / tier.f_blocks < timing.BURST_MIN_FREE:
                return 0.0
        return wait

    async def _sleep(self, seconds: float) -> None:
        assert self._wakeup is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), seconds)

    async def _recover(self) -> None:
        """Uploads cut short by a crash start again from their staged bytes."""
        requeued = await self.db(self.journal.drain.recover)
        if requeued:
            log.info("event=drain_recover requeued=%d", requeued)

    async def _abort_stale_uploads(self) -> None:
        """Abort the multipart uploads this cache started and never finished (never another node's)."""
        assert self.store is not None
        try:
            aborted = await self.store.abort_stale_uploads(await self.db(self.journal.drain.own_uploads))
        except RemoteError as exc:
            if error_scope(exc) == HALT:
                self.halt(exc)
            else:
                self.stats.error(exc.kind, str(exc))
            return
        if aborted:
            log.info("event=stale_uploads_aborted count=%d", aborted)

    async def _retry_stale_uploads(self) -> None:
        """Abort again the uploads whose abort failed (call only while none is in flight)."""
        if time.monotonic() < self._next_stale_abort or not await self.db(self.journal.drain.own_uploads):
            return
        self._next_stale_abort = time.monotonic() + timing.STALE_UPLOAD_RETRY_S
        await self._abort_stale_uploads()

    async def _prune_events(self) -> None:
        """Keep the event log bounded on long runs (status and `journal` read the recent end)."""
        if time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + timing.EVENT_PRUNE_EVERY_S
        await self.db(self.journal.prune_events, timing.EVENTS_KEPT)

    async def _record_layout(self) -> None:
        """Tell readers of this prefix that object sizes may be compressed sizes."""
        if self.options.compress is None:
            return
        assert self.store is not None
        remote = self.store.remote
        layout = json.dumps({"compress": self.options.compress}).encode()
        try:
            await self.store.retry.call(remote, remote.put_object, LAYOUT_KEY, layout, what="put layout")
        except RemoteError as exc:
            self.halt(exc)

    async def note_durable(self) -> None:
        """A file became durable: the first one marks the remote as this cache's (a restart
        then refuses a stand-in without burstfs' marks, see ``Remote.expect_established``)."""
        if not self._drained_to:
            self._drained_to = True
            await self.db(self.journal.mark_drained_to, str(self.remote_url))

    async def _probe_remote(self) -> bool:
        assert self.remote is not None
        try:
            await self.remote.check()
        except Exception as exc:  # still down: stay halted, say why in the status
            self.stats.halted = str(exc)
            return False
        log.info("event=drain_resumed remote=%s", self.remote_url)
        self.stats.halted = None
        return True

    def halt(self, exc: BaseException) -> None:
        if self.stats.halted is None:
            log.error("event=drain_halted remote=%s error=%s", self.remote_url, exc)
        self.stats.halted = str(exc)
        self.stats.error(getattr(exc, "kind", "remote"), str(exc))

    # -- choosing what to drain: close order, commit markers, backoff ---------------------

    async def _has_pending_work(self) -> bool:
        """Files to drain, deletes queued, commit records to publish, or objects to move after
        a rename (but not the moves that failed for that file alone: retried, never waited for)."""
        if await self.db(self.journal.drain.has_work) or await self.groups.has_work():
            return True
        moves = await self.db(self.journal.keys.relocation_candidates)
        return any(not self.key_moves.failed(ino) for ino, _, _ in moves)

    def is_marker_name(self, name: str) -> bool:
        return is_commit_marker(name, self.options.commit_markers)

    async def _eligible(self, large_slots: int, small_slots: int) -> list[InodeRow]:
        """Staged files in close order, respecting commit markers (invariant 5), delay and backoff:
        at most ``large_slots`` larger than SMALL_FILE_BYTES and ``small_slots`` smaller ones.

        One journal call reads the candidates and what holds each marker back; the
        choice among them (in flight, backing off, other nodes' intents) is made here,
        on the loop that owns that state.
        """
        slots = max(0, large_slots) + max(0, small_slots)
        if slots <= 0 or self.stats.halted is not None:
            return []
        free = {True: small_slots, False: large_slots}  # is small -> slots left
        refused = False  # a row waits for room in its pool (the drain is not idle then)
        now = time.time()
        delay = 0.0 if self._skip_delay else self.options.delay
        if delay > 0 and time.monotonic() < self._none_due_until:
            return []
        # This runs after every close and upload: read enough rows to fill the free slots past
        # the files backing off (and a few blocked markers or files closed again while their
        # upload is in flight), not the whole queue.  A file in flight is not staged: not read.
        limit = slots + len(self.not_before) + 32

        # An incomplete file never becomes durable, so it holds a later marker back for good.
        def is_marker(row: InodeRow) -> bool:
            return self.is_marker_name(os.fsdecode(row.name))

        chosen: list[InodeRow] = []
        candidates = await self.db(self.journal.drain.candidates, limit, closed_before=now - delay, is_marker=is_marker)
        if not candidates and delay > 0:
            # A file closed from now on is due ``delay`` later; one made staged again with an
            # older close (a requeue, a retry) waits at most this long past its due time.
            self._none_due_until = time.monotonic() + min(delay, timing.IDLE_RESCAN_S)
        for candidate in candidates:
            row = candidate.row
            if row.ino in self.in_flight or self.not_before.get(row.ino, 0) > now:
                continue
            if self.held_open.get(row.data_ino) == row.generation:  # every name of a file held open
                continue
            if is_marker(row) and candidate.marker_key is not None:
                gate = await self.groups.gate_dir(row, candidate.marker_key, self.tier_paths.path(row.data_ino))
                if self.groups.is_abandoned(row, candidate.marker_key, gate):
                    # Never published: failed, so that wait and unmount --wait stop waiting for it.
                    await self.db(self.journal.drain.abandon, row.ino, row.generation)
                    continue
                # A marker waits for every node with an intent under its gate, and for the files its index
                # names to be in their nodes' done records (docs/SEMANTICS.md "Many nodes").
                local = self.tier_paths.path(row.data_ino)
                if self.groups.holds(row, gate) or await self.groups.index_holds(
                    row, candidate.marker_key, local, gate
                ):
                    continue
                self.groups.approve(row, gate)
            if is_marker(row) and candidate.marker_blocked:
                continue
            small = row.size <= timing.SMALL_FILE_BYTES
            if free[small] <= 0:
                refused = True
                continue
            free[small] -= 1
            chosen.append(row)
            if len(chosen) >= slots:
                break
        if not chosen and not refused:  # nothing left to hurry (a full pool is not that)
            self._skip_delay = False
        return chosen

    async def _claim(self, rows: list[InodeRow]) -> list[tuple[InodeRow, str, int, float]]:
        """Take each row's key for its upload (one journal call), or leave it staged while another
        inode holds the key; returns ``(row, key, intent, started)`` of the claimed ones.

        Runs on the main loop, between deletes and relocations, so no delete or
        move of a key can be under way; an upload then holds its key
        (``upload_key`` and ``in_flight``) until it is recorded or given up.
        """
        if not rows:
            return []
        started = time.time()
        drain = self.journal.drain

        def claim_all() -> list[tuple[str, int] | int | None]:
            return [drain.claim(row.ino, row.generation) for row in rows]

        claimed: list[tuple[InodeRow, str, int, float]] = []
        for row, outcome in zip(rows, await self.db(claim_all), strict=True):
            if outcome is None:
                continue
            if isinstance(outcome, int):
                # Another file's object still sits at this key (a rename not yet moved on the
                # remote), or another file is uploading to it: that goes first.
                log.info("event=drain_wait_key ino=%d holder=%d", row.ino, outcome)
                self.key_moves.want(outcome)
                self.not_before[row.ino] = started + timing.KEY_BUSY_RETRY_S
                continue
            key, intent = outcome
            self.in_flight[row.ino] = key
            claimed.append((row, key, intent, started))
        return claimed

    # -- draining one file ------------------------------------------------------------

"""The mover: drains staged files to the remote, in close order, verified.

It runs on its own asyncio loop (aiobotocore is asyncio) in a thread of the
daemon, or alone as ``burstfs drain --cache DIR``.  It talks to the front only
through the journal: it picks ``staged`` rows, marks them ``draining``, uploads
the generation it read, and marks it ``durable`` only if that generation is
still current (every transition of ``journal.drain`` is conditional on the
generation it was computed for), so a close racing an upload always wins and
the file simply drains again.

Contract (see docs/SEMANTICS.md):
- oldest close first; at most ``max_files`` files in flight, each with at most
  ``concurrency`` parts in memory;
- a commit marker (DCP ``.metadata``, ``latest``...) starts only when every file
  closed before it under its directory is durable;
- temporary remote failures retry with backoff (in the object layer) and then
  requeue the file; an error that belongs to one object (a name too long, an
  invalid key) fails that file only; any other permanent one halts the drain
  with the error in the status until the remote answers again (one place
  decides: :func:`burstfs.errors.error_scope`); data always stays staged;
- unlinked files' objects are deleted, renamed durable files are moved with a
  server-side copy, and a key another inode owns or is uploading to is never
  written, moved onto or deleted (the journal's ownership protocol: an upload
  holds its key in ``upload_key`` from its claim until it is recorded);
- a per-file problem (a corrupt manifest, a bug hit by one file) fails or skips
  that file, never the loop.

Serialization: claims, deletes and relocations are decided one at a time on
the main loop; only uploads run concurrently, each holding its key.  Every
journal call runs on the mover's journal thread (``JournalThread``), never on
the loop; a loop that would ask many small questions asks one batched call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

from .commitgroups import CommitGroups
from .config import DrainOptions, RemoteURL, S3Options, default_node_id, is_commit_marker
from .errors import HALT, OBJECT, CorruptDataError, RemoteError, UploadCancelled, error_scope
from .journal import InodeRow, Journal
from .journal.thread import JournalThread
from .localtier import LocalTier
from .objects import FileDigests, ObjectStore
from .remote import INTERNAL_DIR, Remote, open_remote
from .restore import LAYOUT_KEY, RestoreService

log = logging.getLogger("burstfs.mover")

P = ParamSpec("P")
T = TypeVar("T")

# The journal's event log keeps this many recent events (checked every 10 minutes).
EVENTS_KEPT = 200_000
EVENT_PRUNE_EVERY_S = 600.0
# After a wake-up, let more closes arrive before scanning the journal: a burst of
# small files costs a few passes instead of one per close.
COALESCE_S = 0.005
# How long the loop sleeps when nothing wakes it: bounds the delay of retries
# and of re-probing a halted remote without busy-looping.
IDLE_RESCAN_S = 1.0
# A halted drain (permanent error such as a missing bucket) re-probes the remote this often.
HALT_PROBE_S = 15.0
# A multipart upload whose abort failed is aborted again this often while nothing uploads
# (not only at the next start: an unfinished upload holds storage on the remote).
STALE_UPLOAD_RETRY_S = 30.0
# Requeued files wait this long per failed attempt (capped), so a flapping remote is not hammered.
REQUEUE_BACKOFF_S = 2.0
REQUEUE_BACKOFF_MAX_S = 60.0
# A file waiting for a key another inode holds (uploading, or not yet moved away) looks again after this.
KEY_BUSY_RETRY_S = 0.5
# A file/directory clash on a file remote is retried this many times (with the
# requeue backoff) before the file fails: the clashing object may be one of ours
# that a queued delete or move is about to take away.
KEY_CONFLICT_RETRIES = 5
# A relocation that failed for one file is retried after this (doubling, capped).
RELOCATE_BACKOFF_S = 5.0
RELOCATE_BACKOFF_MAX_S = 600.0
# Besides the subtrees renames touched, every durable file's key is checked this often.
RELOCATE_FULL_SCAN_S = 600.0
# A checksum mismatch with no journaled change is retried this many times (a writer
# still holding the file open) before the file is declared corrupt.
MISMATCH_RETRIES = 3
# An unexpected error in a pass of the loop: wait this long, then go on.
PASS_ERROR_BACKOFF_S = 2.0
# Parked objects of a rename cycle (a→b, b→a) wait here until their target frees up.
PARK_PREFIX = f"{INTERNAL_DIR}/moving/"
# _relocate_one's answer when the remote (not one file) failed: end the pass.
_STOP = -1


@dataclasses.dataclass
class MoverStats:
    """Counters for status and metrics (read from other threads; plain ints are safe)."""

    files_drained: int = 0
    bytes_drained: int = 0
    bytes_drained_recent: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256)
    )
    errors_by_kind: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # (time recorded, kind, message): the kind says what failed (``unavailable``: the
    # remote did not answer after retries) without matching message text.
    recent_errors: collections.deque[tuple[float, str, str]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=20)
    )
    #: When the current run of failures began: the first failed attempt of the first
    #: error recorded since the drain last made progress (None: no failure since).
    trouble_since: float | None = None
    drain_latencies: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=1024)
    )
    halted: str | None = None  # the permanent error that stopped the drain

    def throughput(self, window: float = 30.0) -> float:
        """Bytes per second drained over the last ``window`` seconds."""
        now = time.time()
        recent = [(t, n) for t, n in list(self.bytes_drained_recent) if now - t <= window]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / max(window if len(recent) > 1 else 1.0, now - recent[0][0], 1.0)

    def error(self, kind: str, message: str, *, first_attempt: float | None = None) -> None:
        """Record a failure of ``kind``.  ``first_attempt``: when the failing request
        first failed (before its retries), if the caller knows; else now."""
        now = time.time()
        self.errors_by_kind[kind] += 1
        self.recent_errors.append((now, kind, message))
        started = now if first_attempt is None else min(first_attempt, now)
        last_progress = self.bytes_drained_recent[-1][0] if self.bytes_drained_recent else 0.0
        if self.trouble_since is None or self.trouble_since <= last_progress:  # a new run of failures
            self.trouble_since = started
        else:
            self.trouble_since = min(self.trouble_since, started)


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
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._in_flight: dict[int, str] = {}  # ino -> key its upload holds
        self._not_before: dict[int, float] = {}  # ino -> earliest retry time
        self._mismatches: dict[tuple[int, int], int] = {}  # (ino, generation) -> checksum mismatches seen
        self._skip_delay = False
        self._next_prune = 0.0
        self._next_stale_abort = 0.0
        # Relocation bookkeeping: a full scan at start (and now and then), otherwise
        # only the subtrees of renames journaled since `_rename_seq`.
        self._relocate_needed = True
        self._relocate_full = True
        self._next_full_scan = 0.0
        self._rename_seq = 0
        self._relocate_roots: set[int] = set()
        self._relocate_retry: dict[int, float] = {}  # ino -> earliest retry of its relocation
        self._relocate_failures: dict[int, int] = {}
        self._delete_retry: dict[str, float] = {}  # key -> earliest retry of its delete
        self._durable_listeners: list[Callable[[int, float], None]] = []  # (bytes, seconds) of each durable file
        self.node_id = options.node_id or default_node_id()
        self.groups = CommitGroups(self.node_id, self.journal, self._is_marker_name, self.wake, self._db)

    def on_durable(self, listener: Callable[[int, float], None]) -> None:
        """Call ``listener(bytes, seconds)`` on the mover thread for each file made durable
        (seconds: from the start of its upload); register before the mover starts."""
        self._durable_listeners.append(listener)

    # -- thread-safe controls (called from the FUSE thread or the control socket) ----

    def wake(self) -> None:
        """Wake the loop; a no-op (never an error) if the mover stopped or died."""
        loop, wakeup = self._loop, self._wakeup
        if loop is None or wakeup is None:
            return
        try:
            loop.call_soon_threadsafe(wakeup.set)
        except RuntimeError:  # the loop is closed: a close or rename must not fail for it
            pass

    def namespace_changed(self) -> None:
        self._relocate_needed = True
        self.wake()

    def drain_now(self) -> None:
        """Skip any configured delay and retry backoff."""
        self._skip_delay = True
        self._not_before.clear()
        self._relocate_retry = dict.fromkeys(self._relocate_retry, 0.0)
        self.wake()

    async def retry_failed(self) -> int:
        """Requeue failed files and lift a halt (on the mover's loop); returns how many files were requeued."""
        count = await self._db(self.journal.drain.retry_failed)
        self.stats.halted = None
        self.drain_now()
        return count

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def running(self) -> bool:
        return self._ready.is_set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    async def _db(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """A journal call, on the journal thread (the loop goes on meanwhile)."""
        assert self._journal_thread is not None
        return await self._journal_thread.call(fn, *args, **kwargs)

    # -- main loop ---------------------------------------------------------------

    async def run(self, *, until_idle: bool = False) -> None:
        """Drain until stopped (or, with ``until_idle``, until nothing is left to drain).

        May be called again after it returned or raised (the daemon restarts a dead mover).
        """
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._journal_thread = JournalThread()
        if not self._journal_open:
            self.journal = await self._db(Journal, self.cache_dir)
            self._journal_open = True
        if self.remote is None:
            self.remote = open_remote(
                self.remote_url, self.s3, max_connections=self.options.max_files * self.options.concurrency + 4
            )
        self._hook_uploads(self.remote)
        self.store = ObjectStore(
            self.remote, on_upload_started=self._upload_started, on_upload_ended=self._upload_ended
        )
        self.restore = RestoreService(self.store, self.journal, self.tier_paths)
        self.restore.warm()
        self.groups.journal = self.journal
        await self.groups.load()
        self._in_flight.clear()
        self._relocate_needed = self._relocate_full = True
        tasks: set[asyncio.Task[None]] = set()
        gate: asyncio.Task[None] | None = None
        failures = 0
        self._ready.set()
        try:
            await self._recover()
            await self._abort_stale_uploads()
            await self._record_layout()
            gate = asyncio.create_task(self.groups.poll(self.remote))  # cancelled with the uploads below
            while not self._stopping:
                self._wakeup.clear()
                await asyncio.sleep(COALESCE_S)  # a burst of closes becomes one pass
                if self.stats.halted is not None and not await self._probe_remote():
                    await self._sleep(HALT_PROBE_S)
                    continue
                try:
                    await self.groups.step(self.remote)
                    if not tasks:  # no upload in flight: every recorded one is left over
                        await self._retry_stale_uploads()
                    await self._process_deletes()
                    await self._prune_events()
                    await self._relocate_renamed()
                    for row in await self._eligible(self.options.max_files - len(tasks)):
                        claimed = await self._claim(row)
                        if claimed is None:
                            continue
                        task = asyncio.create_task(self._drain_file(row, *claimed))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    if until_idle and not tasks and not await self._has_pending_work():
                        break
                    failures = 0
                except Exception as exc:  # never the end of the drain: log, back off, go on
                    failures += 1
                    log.exception("event=mover_pass_failed failures=%d", failures)
                    self.stats.error("internal", f"mover pass failed: {exc!r}")
                    if until_idle and failures >= 10:
                        raise
                    await self._sleep(PASS_ERROR_BACKOFF_S)
                    continue
                if until_idle and not tasks and self.stats.halted is not None:
                    raise RemoteError(self.stats.halted, kind="halted")
                await self._sleep(IDLE_RESCAN_S)
        finally:
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
            with contextlib.suppress(Exception):
                await self._db(self.journal.close)
            self._journal_open = False
            thread, self._journal_thread = self._journal_thread, None
            await asyncio.to_thread(thread.close)  # the call in progress, if any, ends first
            self._loop = None

    def _hook_uploads(self, remote: Remote) -> None:
        """Remotes that start multipart uploads of their own (S3 copies) record them too."""
        if hasattr(remote, "on_upload_started") and hasattr(remote, "on_upload_ended"):
            setattr(remote, "on_upload_started", self._upload_started)  # noqa: B010 (not in Remote)
            setattr(remote, "on_upload_ended", self._upload_ended)  # noqa: B010

    async def _upload_started(self, key: str, upload_id: str) -> None:
        await self._db(self.journal.drain.upload_started, key, upload_id)

    async def _upload_ended(self, upload_id: str) -> None:
        await self._db(self.journal.drain.upload_ended, upload_id)

    async def _sleep(self, seconds: float) -> None:
        assert self._wakeup is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), seconds)

    async def _recover(self) -> None:
        """Uploads cut short by a crash start again from their staged bytes."""
        requeued = await self._db(self.journal.drain.recover)
        if requeued:
            log.info("event=drain_recover requeued=%d", requeued)

    async def _abort_stale_uploads(self) -> None:
        """Abort the multipart uploads this cache started and never finished (never another node's)."""
        assert self.store is not None
        try:
            aborted = await self.store.abort_stale_uploads(await self._db(self.journal.drain.own_uploads))
        except RemoteError as exc:
            if error_scope(exc) == HALT:
                self._halt(exc)
            else:
                self.stats.error(exc.kind, str(exc))
            return
        if aborted:
            log.info("event=stale_uploads_aborted count=%d", aborted)

    async def _retry_stale_uploads(self) -> None:
        """Abort again the uploads whose abort failed (call only while none is in flight)."""
        if time.monotonic() < self._next_stale_abort or not await self._db(self.journal.drain.own_uploads):
            return
        self._next_stale_abort = time.monotonic() + STALE_UPLOAD_RETRY_S
        await self._abort_stale_uploads()

    async def _prune_events(self) -> None:
        """Keep the event log bounded on long runs (status and `journal` read the recent end)."""
        if time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + EVENT_PRUNE_EVERY_S
        await self._db(self.journal.prune_events, EVENTS_KEPT)

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
            self._halt(exc)

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

    def _halt(self, exc: BaseException) -> None:
        if self.stats.halted is None:
            log.error("event=drain_halted remote=%s error=%s", self.remote_url, exc)
        self.stats.halted = str(exc)
        self.stats.error(getattr(exc, "kind", "remote"), str(exc))

    # -- choosing what to drain -------------------------------------------------------

    async def _has_pending_work(self) -> bool:
        return await self._db(self.journal.drain.has_work) or await self.groups.has_work()

    def _is_marker_name(self, name: str) -> bool:
        return is_commit_marker(name, self.options.commit_markers)

    async def _eligible(self, slots: int) -> list[InodeRow]:
        """Staged files in close order, respecting commit markers (invariant 5), delay and backoff.

        One journal call reads the candidates and what holds each marker back; the
        choice among them (in flight, backing off, other nodes' intents) is made here,
        on the loop that owns that state.
        """
        if slots <= 0 or self.stats.halted is not None:
            return []
        now = time.time()
        delay = 0.0 if self._skip_delay else self.options.delay
        # This runs after every close: read enough rows to fill the free slots past the
        # files in flight or backing off (and a few blocked markers), not the whole queue.
        limit = slots + len(self._in_flight) + len(self._not_before) + 32

        # An incomplete file never becomes durable, so it holds a later marker back for good.
        def is_marker(row: InodeRow) -> bool:
            return self._is_marker_name(os.fsdecode(row.name))

        chosen: list[InodeRow] = []
        for candidate in await self._db(
            self.journal.drain.candidates, limit, closed_before=now - delay, is_marker=is_marker
        ):
            row = candidate.row
            if row.ino in self._in_flight or self._not_before.get(row.ino, 0) > now:
                continue
            if is_marker(row):
                # A marker waits for every node with an intent under its directory (docs/SEMANTICS.md "Many nodes").
                if candidate.marker_key is not None and self.groups.holds(row, candidate.marker_key):
                    continue
                if candidate.marker_blocked:
                    continue
            chosen.append(row)
            if len(chosen) >= slots:
                break
        if not chosen:
            self._skip_delay = False
        return chosen

    async def _claim(self, row: InodeRow) -> tuple[str, int, float] | None:
        """Take ``row``'s key for its upload, or leave it staged while another inode holds the key.

        Runs on the main loop, between deletes and relocations, so no delete or
        move of the key can be under way; the upload then holds the key
        (``upload_key`` and ``_in_flight``) until it is recorded or given up.
        """
        started = time.time()
        claimed = await self._db(self.journal.drain.claim, row.ino, row.generation)
        if claimed is None:
            return None
        if isinstance(claimed, int):
            # Another file's object still sits at this key (a rename not yet moved on the
            # remote), or another file is uploading to it: that goes first.
            log.info("event=drain_wait_key ino=%d holder=%d", row.ino, claimed)
            self._relocate_roots.add(claimed)
            self._relocate_needed = True
            self._not_before[row.ino] = started + KEY_BUSY_RETRY_S
            return None
        key, intent = claimed
        self._in_flight[row.ino] = key
        return key, intent, started

    # -- draining one file ------------------------------------------------------------

    async def _drain_file(self, row: InodeRow, key: str, intent: int, started: float) -> None:
        ino, generation = row.ino, row.generation
        try:
            digests = self._journaled_digests(row)
            assert self.store is not None
            manifest = await self.store.upload_file(
                key,
                self.tier_paths.path(row.data_ino),
                digests,
                chunk_size=self.options.part_size,
                generation=generation,
                mtime_ns=row.mtime_ns,
                mode=row.mode,
                concurrency=self.options.concurrency,
                compress=self.options.compress,
                cancel_check=functools.partial(self._db, self.journal.drain.superseded, ino, generation),
            )
            if digests is None:  # taken during the upload: journal them for verify and the xattr
                await self._db(
                    self.journal.drain.record_digests,
                    ino,
                    generation,
                    manifest.digest,
                    [c.xxh3 for c in manifest.chunks],
                    manifest.chunk_size,
                )
            if await self._finish(row, key, manifest.size, started, intent) and self._is_marker_name(
                os.fsdecode(row.name)
            ):
                self.groups.marker_durable(row, key, manifest.size, manifest.digest)
        except (asyncio.CancelledError, UploadCancelled) as exc:
            await self._requeue(ino, generation, None)  # stopping, or the file changed: drains again
            if isinstance(exc, asyncio.CancelledError):
                raise
        except CorruptDataError as exc:
            if await self._changed_under_upload(row):
                log.info("event=drain_superseded ino=%d generation=%d reason=%r", ino, generation, str(exc))
                await self._requeue(ino, generation, None)  # rewritten under us: drains again, not corrupt
            else:
                await self._fail(ino, generation, exc)
        except RemoteError as exc:
            scope = error_scope(exc)
            if scope == OBJECT and await self._db(self.journal.drain.superseded, ino, generation):
                await self._requeue(ino, generation, None)  # renamed or changed meanwhile: try the new key/bytes
            elif exc.kind == "key_conflict" and row.attempts < KEY_CONFLICT_RETRIES:
                # A file remote's file/directory clash may be this node's own object on its way
                # out (a delete or a move still queued): try again before failing the file.
                await self._requeue(ino, generation, exc)
            elif scope == OBJECT:  # this object only: the file fails, the drain goes on
                await self._fail(ino, generation, exc)
            else:
                await self._requeue(ino, generation, exc)
                if scope == HALT:
                    self._halt(exc)
        except FileNotFoundError as exc:
            if await self._db(self.journal.drain.superseded, ino, generation):
                await self._requeue(ino, generation, None)  # unlinked under us: nothing to drain
            else:
                await self._fail(ino, generation, exc)
        except Exception as exc:
            log.exception("event=drain_bug ino=%d", ino)
            if await self._changed_under_upload(row):
                await self._requeue(ino, generation, None)
            else:
                await self._fail(ino, generation, exc)
        finally:
            self._in_flight.pop(ino, None)
            self.wake()

    def _journaled_digests(self, row: InodeRow) -> FileDigests | None:
        """The digests journaled at close for this generation, if taken in the drain's chunk size."""
        if row.digest and row.chunk_size == self.options.part_size:
            return FileDigests(row.size, row.chunk_size, row.chunk_digests(), row.digest)
        return None

    async def _changed_under_upload(self, row: InodeRow) -> bool:
        """True if the file was (or may be being) rewritten since ``row`` was closed: superseded, not corrupt.

        A newer close, an unlink or a writer (``writing``) is in the journal; a
        staged file whose size or mtime moved has a writer the journal has not
        seen yet (a handle still open).  Bit rot moves neither; a mismatch that
        keeps coming back without any change is corruption after a few tries.
        """
        if await self._db(self.journal.drain.superseded, row.ino, row.generation):
            return True
        try:
            st = os.stat(self.tier_paths.path(row.data_ino))
        except FileNotFoundError:
            return False
        if st.st_size == row.size and st.st_mtime_ns <= row.mtime_ns:
            return False
        seen = self._mismatches.get((row.ino, row.generation), 0) + 1
        self._mismatches[(row.ino, row.generation)] = seen
        if seen > MISMATCH_RETRIES:
            return False
        self._not_before[row.ino] = time.time() + REQUEUE_BACKOFF_S * seen
        return True

    async def _finish(self, row: InodeRow, key: str, size: int, started: float, intent: int) -> bool:
        """Record the upload (True if it was); the ``intent`` row stays as a delete request if the file went away."""
        detail = f"key={key} generation={row.generation} size={size}"
        if not await self._db(self.journal.drain.finish_upload, row.ino, row.generation, key, intent, detail):
            log.info("event=upload_superseded ino=%d key=%s generation=%d", row.ino, key, row.generation)
            return False
        self._mismatches.pop((row.ino, row.generation), None)
        if await self._db(self.journal.path_of, row.ino) != key:  # renamed during the upload: move the object
            self._relocate_roots.add(row.ino)
            self._relocate_needed = True
        latency = time.time() - started
        self.stats.files_drained += 1
        self.stats.bytes_drained += size
        self.stats.bytes_drained_recent.append((time.time(), size))
        self.stats.drain_latencies.append(latency)
        for listener in self._durable_listeners:
            listener(size, latency)
        self._not_before.pop(row.ino, None)
        log.info("event=durable key=%s generation=%d bytes=%d seconds=%.3f", key, row.generation, size, latency)
        return True

    async def _requeue(self, ino: int, generation: int, exc: BaseException | None) -> None:
        attempts = 0
        if exc is not None:
            self.stats.error(getattr(exc, "kind", "remote"), str(exc))
            attempts = await self._db(self.journal.drain.attempts, ino) + 1
            delay = min(REQUEUE_BACKOFF_MAX_S, REQUEUE_BACKOFF_S * 2 ** (attempts - 1))
            self._not_before[ino] = time.time() + delay
            log.warning("event=drain_retry ino=%d attempts=%d delay=%.1f error=%s", ino, attempts, delay, exc)
        await self._db(self.journal.drain.requeue, ino, generation, str(exc) if exc else None, attempts)

    async def _fail(self, ino: int, generation: int, exc: BaseException) -> None:
        if isinstance(exc, CorruptDataError):
            kind = "corrupt"
        elif isinstance(exc, RemoteError):
            kind = exc.kind
        else:
            kind = "internal"
        message = str(exc) or repr(exc)
        self.stats.error(kind, message)
        self._mismatches.pop((ino, generation), None)
        if await self._db(self.journal.drain.fail, ino, generation, message):
            log.error("event=drain_failed ino=%d generation=%d kind=%s error=%s", ino, generation, kind, message)
        else:
            await self._db(self.journal.drain.requeue, ino, generation, None, 0)

    # -- namespace changes -------------------------------------------------------------

    async def _process_deletes(self) -> None:
        """Delete objects of unlinked or replaced files (never a key another inode owns or uploads to)."""
        assert self.store is not None
        now = time.time()
        # One read of the queue with each key's holder: no claim or move runs during this
        # pass, and an upload in flight holds its key from its claim on, so a key free
        # now stays free until its delete.
        pending = await self._db(self.journal.keys.pending_deletes_held, 500)
        owned = [
            row_id
            for row_id, key, _, holder in pending
            if holder is not None
            and holder not in self._in_flight
            and key not in self._in_flight.values()
            and self._delete_retry.get(key, 0.0) <= now
        ]
        if owned:  # live files own these keys now: nothing to delete
            await self._db(self.journal.keys.drop_deletes, owned)
        for row_id, key, reason, holder in pending:
            if holder is not None or key in self._in_flight.values() or self._delete_retry.get(key, 0.0) > now:
                continue
            try:
                await self.store.delete(key)
            except Exception as exc:
                if not isinstance(exc, RemoteError):  # a bug hit by this key: retried later, not lost
                    log.exception("event=remote_delete_bug key=%s", key)
                    self.stats.error("internal", f"delete {key}: {exc!r}")
                    self._delete_retry[key] = now + RELOCATE_BACKOFF_S
                    continue
                scope = error_scope(exc)
                if scope == OBJECT:  # no object can exist (or be removed) under such a key: the request is void
                    log.warning("event=remote_delete_skipped key=%s reason=%s error=%s", key, reason, exc)
                    self.stats.error(exc.kind, f"delete {key}: {exc}")
                    await self._db(self.journal.keys.drop_delete, row_id)
                    continue
                if scope == HALT:
                    self._halt(exc)
                else:
                    self.stats.error(exc.kind, str(exc))
                return
            self._delete_retry.pop(key, None)
            await self._db(self.journal.keys.drop_delete, row_id)
            log.info("event=remote_delete key=%s reason=%s", key, reason)

    async def _relocate_renamed(self) -> None:
        """Durable files whose path changed move with a server-side copy; their old key is queued for deletion.

        Only the subtrees renamed since the last pass are walked (plus files whose
        move is due for a retry); the whole namespace at start and every
        RELOCATE_FULL_SCAN_S.
        """
        now = time.time()
        due = [ino for ino, at in self._relocate_retry.items() if at <= now]
        if now >= self._next_full_scan:
            self._relocate_full = True
        if not (self._relocate_needed or self._relocate_full or due):
            return
        self._relocate_needed = False  # before reading the events: a rename committed meanwhile sets it again
        roots: set[int] | None
        if self._relocate_full:
            self._rename_seq = await self._db(self.journal.latest_event_seq)
            roots = None
            self._relocate_full = False
            self._next_full_scan = now + RELOCATE_FULL_SCAN_S
        else:
            renamed, self._rename_seq = await self._db(self.journal.renamed_since, self._rename_seq)
            roots = {*renamed, *due, *self._relocate_roots}
        self._relocate_roots.clear()
        for ino in due:
            self._relocate_retry.pop(ino, None)
        for ino, key in await self._db(self.journal.keys.drop_stale_keys, roots, frozenset(self._in_flight)):
            log.info("event=stale_key ino=%d key=%s action=delete", ino, key)
        candidates = await self._db(self.journal.keys.relocation_candidates, roots)
        pending = list(dict.fromkeys(ino for ino, _, _ in candidates))
        for _ in range(len(pending) + 2):  # each round moves or parks at least one file, or ends the pass
            pending = [ino for ino in pending if ino not in self._relocate_retry]
            blocked: dict[int, int] = {}
            progressed = False
            for ino in pending:
                result = await self._relocate_one(ino)
                if result == _STOP:
                    return  # the remote is down or halted: try again on a later pass
                if result is None:
                    progressed = True
                else:
                    blocked[ino] = result
            if not blocked:
                return
            if not progressed:
                cycle = await self._db(self.journal.keys.rename_cycle, blocked)
                if cycle is None:
                    for ino in blocked:  # waiting for an upload or another file's move
                        self._relocate_retry[ino] = time.time() + KEY_BUSY_RETRY_S
                    return
                if await self._park(cycle) == _STOP:
                    return
            pending = list(blocked)
        for ino in pending:
            self._relocate_retry.setdefault(ino, time.time() + KEY_BUSY_RETRY_S)

    async def _relocate_one(self, ino: int) -> int | None:
        """Move one file's object to its path: None if moved (or nothing to do, or failed for
        this file only), the inode holding the target key if it must wait, _STOP if the
        remote failed (end the pass)."""
        assert self.store is not None
        if ino in self._in_flight:
            return None
        move = await self._db(self.journal.keys.relocation, ino)
        if move is None:
            return None
        path, old_key, holder = move
        if holder is not None:
            return holder
        try:
            await self.store.rename(old_key, path, delete_source=False)
        except Exception as exc:
            return await self._relocation_failed(ino, old_key, path, exc)
        moved = await self._db(self.journal.keys.finish_relocation, ino, old_key, path)
        self._relocate_failures.pop(ino, None)
        log.info("event=remote_rename from=%s to=%s recorded=%s", old_key, path, moved)
        return None

    async def _relocation_failed(self, ino: int, old_key: str, path: str, exc: BaseException) -> int | None:
        """A failed move is that file's problem (retried later, or re-uploaded), unless the remote is down."""
        scope = error_scope(exc)
        if isinstance(exc, RemoteError) and scope != OBJECT:
            self.stats.error(exc.kind, str(exc))
            self._relocate_roots.add(ino)
            self._relocate_needed = True
            if scope == HALT:
                self._halt(exc)
            return _STOP
        if not isinstance(exc, (RemoteError, CorruptDataError)):
            log.exception("event=relocate_bug ino=%d from=%s to=%s", ino, old_key, path)
        message = f"cannot move {old_key} to {path}: {exc!r}"
        self.stats.error("relocate", message)
        await self._db(self.journal.set_error, ino, message)
        if await self._db(self.journal.keys.restage_durable, ino, old_key):  # still local: upload it again at its path
            log.error("event=relocate_failed ino=%d from=%s to=%s action=reupload error=%r", ino, old_key, path, exc)
            self.wake()
            return None
        failures = self._relocate_failures.get(ino, 0) + 1
        self._relocate_failures[ino] = failures
        delay = min(RELOCATE_BACKOFF_MAX_S, RELOCATE_BACKOFF_S * 2 ** (failures - 1))
        self._relocate_retry[ino] = time.time() + delay
        log.error("event=relocate_failed ino=%d from=%s to=%s retry_in=%.0f error=%r", ino, old_key, path, delay, exc)
        return None

    async def _park(self, ino: int) -> int | None:
        """Move ``ino``'s object to a private key so that the key it holds frees up."""
        assert self.store is not None
        target = await self._db(self.journal.keys.relocation_target, ino)
        if target is None:
            return None
        _, old_key = target
        parked = f"{PARK_PREFIX}{ino}"
        try:
            await self.store.rename(old_key, parked, delete_source=False)
        except Exception as exc:
            return await self._relocation_failed(ino, old_key, parked, exc)
        await self._db(self.journal.keys.finish_relocation, ino, old_key, parked)
        log.info("event=remote_rename_parked from=%s to=%s", old_key, parked)
        return None

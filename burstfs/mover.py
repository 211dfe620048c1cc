"""The mover: drains staged files to the remote, in close order, verified.

It runs on its own asyncio loop (aiobotocore is asyncio) in a thread of the
daemon, or alone as ``burstfs drain --cache DIR``.  It talks to the front only
through the journal: it picks ``staged`` rows, marks them ``draining``, uploads
the generation it read, and marks it ``durable`` only if that generation is
still current (``UPDATE ... WHERE generation=?``), so a close racing an upload
always wins and the file simply drains again.

Contract (see docs/SEMANTICS.md):
- oldest close first; at most ``max_files`` files in flight, each with at most
  ``concurrency`` parts in memory;
- a commit marker (DCP ``.metadata``, ``latest``...) starts only when every file
  closed before it under its directory is durable;
- temporary remote failures retry with backoff (in the object layer) and then
  requeue the file; a permanent one halts the drain with the error in the
  status until the remote answers again; data always stays staged;
- unlinked files' objects are deleted, renamed durable files are moved with a
  server-side copy, and no delete ever removes a key a live file now owns.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .config import DrainOptions, RemoteURL, S3Options, is_commit_marker
from .errors import CorruptDataError, RemoteError, UploadCancelled
from .journal import DRAINING, DURABLE, EVICTED, FAILED, INCOMPLETE, ROOT_INO, STAGED, WRITING, InodeRow, Journal
from .localtier import LocalTier
from .objects import FileDigests, ObjectStore
from .remote import Remote, open_remote
from .restore import LAYOUT_KEY, RestoreService

log = logging.getLogger("burstfs.mover")

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
# Requeued files wait this long per failed attempt (capped), so a flapping remote is not hammered.
REQUEUE_BACKOFF_S = 2.0
REQUEUE_BACKOFF_MAX_S = 60.0

# A commit marker waits for every earlier-closed file in these states (an
# incomplete file never becomes durable, so it holds the marker back for good).
_PENDING_STATES = (STAGED, DRAINING, FAILED, INCOMPLETE, WRITING)


@dataclasses.dataclass
class MoverStats:
    """Counters for status and metrics (read from other threads; plain ints are safe)."""

    files_drained: int = 0
    bytes_drained: int = 0
    bytes_drained_recent: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256)
    )
    errors_by_kind: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    recent_errors: collections.deque[tuple[float, str]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=20)
    )
    drain_latencies: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=1024))
    halted: str | None = None  # the permanent error that stopped the drain

    def throughput(self, window: float = 30.0) -> float:
        """Bytes per second drained over the last ``window`` seconds."""
        now = time.time()
        recent = [(t, n) for t, n in list(self.bytes_drained_recent) if now - t <= window]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / max(window if len(recent) > 1 else 1.0, now - recent[0][0], 1.0)

    def error(self, kind: str, message: str) -> None:
        self.errors_by_kind[kind] += 1
        self.recent_errors.append((time.time(), message))


class Mover:
    """Drains one cache directory to its remote."""

    def __init__(
        self, cache_dir: Path, remote_url: RemoteURL, s3: S3Options, options: DrainOptions,
        *, remote: Remote | None = None,
    ) -> None:
        """``remote``: use this remote instead of opening ``remote_url`` (tests wrap one to inject faults)."""
        self.cache_dir = Path(cache_dir)
        self.remote_url = remote_url
        self.s3 = s3
        self.options = options
        self.journal = Journal(self.cache_dir)
        self.tier_paths = LocalTier(self.cache_dir)
        self.stats = MoverStats()
        self.remote: Remote | None = remote
        self.store: ObjectStore | None = None
        self.restore: RestoreService | None = None
        self._ready = threading.Event()  # set once the loop, remote and restore exist
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._relocate_needed = True
        self._in_flight: dict[int, str] = {}  # ino -> key being uploaded
        self._not_before: dict[int, float] = {}  # ino -> earliest retry time
        self._skip_delay = False
        self._next_prune = 0.0
        self.on_durable: Callable[[int, float], None] | None = None  # (bytes, seconds): metrics hook

    # -- thread-safe controls (called from the FUSE thread or the control socket) ----

    def wake(self) -> None:
        if self._loop is not None and self._wakeup is not None:
            self._loop.call_soon_threadsafe(self._wakeup.set)

    def namespace_changed(self) -> None:
        self._relocate_needed = True
        self.wake()

    def drain_now(self) -> None:
        """Skip any configured delay and retry backoff."""
        self._skip_delay = True
        self._not_before.clear()
        self.wake()

    def retry_failed(self) -> int:
        """Requeue failed files and lift a halt; returns how many files were requeued."""
        count = self.journal.execute(
            "UPDATE inodes SET state=?, attempts=0, error=NULL WHERE state=?", (STAGED, FAILED)
        )
        self.stats.halted = None
        self.drain_now()
        return count

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def stop(self) -> None:
        self._stopping = True
        self.wake()

    # -- main loop ---------------------------------------------------------------

    async def run(self, *, until_idle: bool = False) -> None:
        """Drain until stopped (or, with ``until_idle``, until nothing is left to drain)."""
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        if self.remote is None:
            self.remote = open_remote(
                self.remote_url, self.s3, max_connections=self.options.max_files * self.options.concurrency + 4
            )
        self.store = ObjectStore(self.remote)
        self.restore = RestoreService(self.store, self.journal, self.tier_paths)
        self._ready.set()
        tasks: set[asyncio.Task[None]] = set()
        try:
            self._recover()
            await self._abort_stale_uploads()
            await self._record_layout()
            while not self._stopping:
                self._wakeup.clear()
                await asyncio.sleep(COALESCE_S)  # a burst of closes becomes one pass
                if self.stats.halted is not None:
                    if not await self._probe_remote():
                        await self._sleep(HALT_PROBE_S)
                        continue
                await self._process_deletes()
                self._prune_events()
                if self._relocate_needed:
                    self._relocate_needed = False
                    await self._relocate_renamed()
                for row in self._eligible(self.options.max_files - len(tasks)):
                    self._in_flight[row.ino] = ""
                    task = asyncio.create_task(self._drain_file(row))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if until_idle and not tasks and not self._has_pending_work():
                    break
                if until_idle and not tasks and self.stats.halted is not None:
                    raise RemoteError(self.stats.halted, kind="halted")
                await self._sleep(IDLE_RESCAN_S)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.remote.close()
            self.journal.close()

    async def _sleep(self, seconds: float) -> None:
        assert self._wakeup is not None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), seconds)

    def _recover(self) -> None:
        """Uploads cut short by a crash start again from their staged bytes."""
        requeued = self.journal.execute("UPDATE inodes SET state=? WHERE state=?", (STAGED, DRAINING))
        if requeued:
            log.info("event=drain_recover requeued=%d", requeued)

    async def _abort_stale_uploads(self) -> None:
        assert self.store is not None
        try:
            await self.store.abort_stale_uploads()
        except RemoteError as exc:
            self._halt(exc)

    def _prune_events(self) -> None:
        """Keep the event log bounded on long runs (status and `journal` read the recent end)."""
        if time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + EVENT_PRUNE_EVERY_S
        self.journal.execute("DELETE FROM events WHERE seq <= (SELECT MAX(seq) FROM events) - ?", (EVENTS_KEPT,))

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

    def _has_pending_work(self) -> bool:
        rows = self.journal.query(
            "SELECT COUNT(*) FROM inodes WHERE kind='file' AND parent!=0 AND state IN (?, ?)", (STAGED, DRAINING)
        )
        return bool(rows[0][0]) or bool(self.journal.query("SELECT 1 FROM remote_deletes LIMIT 1"))

    def _eligible(self, slots: int) -> list[InodeRow]:
        """Staged files in close order, respecting commit markers, delay and backoff."""
        if slots <= 0 or self.stats.halted is not None:
            return []
        now = time.time()
        delay = 0.0 if self._skip_delay else self.options.delay
        # This runs after every close: read enough rows to fill the free slots past the
        # files in flight or backing off (and a few blocked markers), not the whole queue.
        limit = slots + len(self._in_flight) + len(self._not_before) + 32
        chosen: list[InodeRow] = []
        for row in self.journal.inodes(
            "WHERE state=? AND kind='file' AND parent!=0 AND updated <= ? ORDER BY close_seq LIMIT ?",
            (STAGED, now - delay, limit),
        ):
            if row.ino in self._in_flight or self._not_before.get(row.ino, 0) > now:
                continue
            if is_commit_marker(os.fsdecode(row.name), self.options.commit_markers) and self._blocks_marker(row):
                continue
            chosen.append(row)
            if len(chosen) >= slots:
                break
        if not chosen:
            self._skip_delay = False
        return chosen

    def _blocks_marker(self, marker: InodeRow) -> bool:
        """True while a file closed before ``marker`` under its directory is not durable."""
        rows = self.journal.query(
            """WITH RECURSIVE sub(ino) AS (
                   SELECT ino FROM inodes WHERE parent=? AND ino!=?
                   UNION SELECT i.ino FROM inodes i JOIN sub ON i.parent=sub.ino)
               SELECT COUNT(*) FROM inodes WHERE ino IN sub AND ino!=? AND kind='file'
                   AND state IN (?, ?, ?, ?, ?) AND close_seq > 0 AND close_seq < ?""",
            (marker.parent, ROOT_INO, marker.ino, *_PENDING_STATES, marker.close_seq),
        )
        return bool(rows[0][0])

    # -- draining one file ------------------------------------------------------------

    async def _drain_file(self, row: InodeRow) -> None:
        ino, generation = row.ino, row.generation
        started = time.time()
        try:
            changed = self.journal.execute(
                "UPDATE inodes SET state=?, updated=? WHERE ino=? AND generation=? AND state=?",
                (DRAINING, started, ino, generation, STAGED),
            )
            key = self.journal.path_of(ino)
            if not changed or key is None:
                return
            if self.journal.query("SELECT 1 FROM inodes WHERE remote_key=? AND ino!=? AND parent!=0", (key, ino)):
                # Another file's object still sits at this key (a rename not yet
                # moved on the remote): move it first, then upload.
                self._relocate_needed = True
                self._requeue(ino, generation, None)
                self._not_before[ino] = time.time() + 1.0
                return
            self._in_flight[ino] = key
            # Recorded before a byte goes up: if the daemon dies before _finish, the
            # next delete pass removes the orphan (unless a live file owns the key)
            # and no listing resurrects it.
            intent = self.journal.insert("INSERT INTO remote_deletes (key, reason) VALUES (?, 'upload')", (key,))
            digests = self._journaled_digests(row)
            assert self.store is not None
            manifest = await self.store.upload_file(
                key, self.tier_paths.path(ino), digests, chunk_size=self.options.part_size, generation=generation,
                mtime_ns=row.mtime_ns, mode=row.mode, concurrency=self.options.concurrency,
                compress=self.options.compress, cancel_check=lambda: self._superseded(ino, generation),
            )  # fmt: skip
            if digests is None:  # taken during the upload: journal them for verify and the xattr
                self.journal.execute(
                    "UPDATE inodes SET digest=?, chunks=?, chunk_size=? WHERE ino=? AND generation=?",
                    (manifest.digest, json.dumps([c.xxh3 for c in manifest.chunks]), manifest.chunk_size,
                     ino, generation),
                )  # fmt: skip
            self._finish(row, key, manifest.size, started, intent)
        except (asyncio.CancelledError, UploadCancelled) as exc:
            self._requeue(ino, generation, None)  # stopping, or the file changed: drains again
            if isinstance(exc, asyncio.CancelledError):
                raise
        except CorruptDataError as exc:
            if self._superseded(ino, generation):
                self._requeue(ino, generation, None)  # changed under us: drains again
            else:
                self._fail(ino, generation, exc)
        except RemoteError as exc:
            self._requeue(ino, generation, exc)
            if exc.kind != "unavailable":
                self._halt(exc)
        except FileNotFoundError as exc:
            if self._superseded(ino, generation):
                self._requeue(ino, generation, None)  # unlinked under us: nothing to drain
            else:
                self._fail(ino, generation, exc)
        except Exception as exc:
            log.exception("event=drain_bug ino=%d", ino)
            self._fail(ino, generation, exc)
        finally:
            self._in_flight.pop(ino, None)
            self.wake()

    def _journaled_digests(self, row: InodeRow) -> FileDigests | None:
        """The digests journaled at close for this generation, if taken in the drain's chunk size."""
        if row.digest and row.chunk_size == self.options.part_size:
            return FileDigests(row.size, row.chunk_size, row.chunk_digests(), row.digest)
        return None

    def _superseded(self, ino: int, generation: int) -> bool:
        rows = self.journal.query("SELECT generation, parent FROM inodes WHERE ino=?", (ino,))
        return not rows or rows[0][0] != generation or rows[0][1] == 0

    def _finish(self, row: InodeRow, key: str, size: int, started: float, intent: int) -> None:
        """Record the upload; the ``intent`` row stays as a delete request if the file went away."""
        old_key = row.remote_key
        if old_key and old_key != key:  # renamed before this upload: the old object goes
            self.journal.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'replaced')", (old_key,))
        recorded = self.journal.execute(
            "UPDATE inodes SET state=?, remote_key=?, durable_generation=?, error=NULL, attempts=0, updated=? "
            "WHERE ino=? AND generation=? AND state=?",
            (DURABLE, key, row.generation, time.time(), row.ino, row.generation, DRAINING),
        )
        if not recorded:
            # Changed during the upload: the object is this file's until the next
            # generation replaces it (its intent row is dropped as owned).  Unlinked:
            # the intent row makes the delete pass remove the object.
            self.journal.execute("UPDATE inodes SET remote_key=? WHERE ino=? AND parent!=0", (key, row.ino))
            return
        self.journal.apply([
            ("DELETE FROM remote_deletes WHERE id=?", (intent,)),
            self.journal.log_event(row.ino, "durable", f"key={key} generation={row.generation} size={size}"),
        ])  # fmt: skip
        if self.journal.path_of(row.ino) != key:  # renamed during the upload: move the object
            self._relocate_needed = True
        latency = time.time() - started
        self.stats.files_drained += 1
        self.stats.bytes_drained += size
        self.stats.bytes_drained_recent.append((time.time(), size))
        self.stats.drain_latencies.append(latency)
        if self.on_durable is not None:
            self.on_durable(size, latency)
        self._not_before.pop(row.ino, None)
        log.info("event=durable key=%s generation=%d bytes=%d seconds=%.3f", key, row.generation, size, latency)

    def _requeue(self, ino: int, generation: int, exc: BaseException | None) -> None:
        attempts = 0
        if exc is not None:
            self.stats.error(getattr(exc, "kind", "remote"), str(exc))
            rows = self.journal.query("SELECT attempts FROM inodes WHERE ino=?", (ino,))
            attempts = (rows[0][0] if rows else 0) + 1
            delay = min(REQUEUE_BACKOFF_MAX_S, REQUEUE_BACKOFF_S * 2 ** (attempts - 1))
            self._not_before[ino] = time.time() + delay
            log.warning("event=drain_retry ino=%d attempts=%d delay=%.1f error=%s", ino, attempts, delay, exc)
        self.journal.execute(
            "UPDATE inodes SET state=?, attempts=?, error=? WHERE ino=? AND generation=? AND state=?",
            (STAGED, attempts, str(exc) if exc else None, ino, generation, DRAINING),
        )

    def _fail(self, ino: int, generation: int, exc: BaseException) -> None:
        self.stats.error("corrupt" if isinstance(exc, CorruptDataError) else "internal", str(exc))
        log.error("event=drain_failed ino=%d generation=%d error=%s", ino, generation, exc)
        self.journal.apply([
            ("UPDATE inodes SET state=?, error=? WHERE ino=? AND generation=?", (FAILED, str(exc), ino, generation)),
            self.journal.log_event(ino, "failed", str(exc)),
        ])  # fmt: skip

    # -- namespace changes -------------------------------------------------------------

    async def _process_deletes(self) -> None:
        """Delete objects of unlinked or replaced files (never a key a live file owns)."""
        assert self.store is not None
        in_flight_keys = set(self._in_flight.values())
        for row_id, key in self.journal.query("SELECT id, key FROM remote_deletes ORDER BY id LIMIT 500"):
            if key in in_flight_keys:
                continue
            owned = self.journal.query("SELECT 1 FROM inodes WHERE remote_key=? AND parent!=0 LIMIT 1", (key,))
            try:
                if not owned:
                    await self.store.delete(key)
                    log.info("event=remote_delete key=%s", key)
            except RemoteError as exc:
                self._halt(exc) if exc.kind != "unavailable" else self.stats.error(exc.kind, str(exc))
                return
            self.journal.execute("DELETE FROM remote_deletes WHERE id=?", (row_id,))

    async def _relocate_renamed(self) -> None:
        """Durable files whose path changed move with a server-side copy, then a delete."""
        assert self.store is not None
        rows = self.journal.query(
            """WITH RECURSIVE paths(ino, path) AS (
                   SELECT ino, CAST(name AS TEXT) FROM inodes WHERE parent=? AND ino!=?
                   UNION ALL SELECT i.ino, paths.path || '/' || CAST(i.name AS TEXT)
                   FROM inodes i JOIN paths ON i.parent=paths.ino)
               SELECT i.ino, paths.path, i.remote_key FROM inodes i JOIN paths USING (ino)
               WHERE i.kind='file' AND i.remote_key IS NOT NULL AND i.remote_key != paths.path
                   AND i.state IN (?, ?)""",
            (ROOT_INO, ROOT_INO, DURABLE, EVICTED),
        )
        for ino, path, old_key in rows:
            try:
                await self.store.rename(old_key, path)
            except RemoteError as exc:
                self._relocate_needed = True
                self.stats.error(exc.kind, str(exc))
                if exc.kind != "unavailable":
                    self._halt(exc)
                return
            self.journal.apply([
                ("UPDATE inodes SET remote_key=? WHERE ino=? AND remote_key=?", (path, ino, old_key)),
                self.journal.log_event(ino, "moved", f"{old_key} -> {path}"),
            ])  # fmt: skip
            log.info("event=remote_rename from=%s to=%s", old_key, path)

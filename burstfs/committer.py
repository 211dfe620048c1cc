"""Group commit of journal records from the FUSE request loop.

Requests hand their journal records to :meth:`GroupCommitter.commit` and wait.
One background task applies everything that arrived since the previous commit
in a single SQLite transaction, so a thousand concurrent closes cost a handful of
commits.  The request loop never waits for the journal: a small batch commits on
it only when the journal is free at once (no lock to wait for; its WAL append is
cheaper than the hop to a thread, which was most of a small file's close), and
anything else (a large batch, a busy journal, a WAL checkpoint, which fsyncs)
runs in a worker thread.

A request changes the in-memory namespace before it commits (so concurrent
requests see each other's changes at once and still share a transaction) and
hands in an ``undo`` that restores exactly what it changed.  When a transaction
fails, nothing of it is in the journal: the committer runs the undos of that
batch and of the batch that filled while it ran (whose records may build on it),
newest first, before any other task runs, so memory again equals the journal,
and every waiter gets the error as an errno (ENOSPC for a full disk).

Records nobody needs on disk before the request returns (a new file's row: only
its close, an fsync or a crash-visible change must find it there) are
deferred (:meth:`GroupCommitter.defer`): they ride with the next commit anybody
waits for, or go out on their own after ``DEFER_S``.  A small file then costs one commit (its
close), and creates in one directory no longer queue behind each other's commits.
"""

from __future__ import annotations

import errno
import logging
import math
from collections.abc import Callable, Sequence

import trio

from .errors import FsError, to_errno
from .journal import Journal, Op

log = logging.getLogger("burstfs.committer")

Undo = Callable[[], None]

#: Deferred records are committed at most this long after they were queued.
DEFER_S = 0.1
#: Batches of at most this many records may commit on the request loop (a few SQLite rows:
#: tens of microseconds, without waiting for a lock); larger ones always go to a thread.
INLINE_MAX_OPS = 32


class Batch:
    """The records of one transaction; ``error`` is set if it was not committed."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.undos: list[Undo] = []
        self.done = trio.Event()
        self.error: BaseException | None = None

    def fail(self, error: BaseException) -> None:
        """Nothing of this batch was committed: undo its memory changes, newest first."""
        self.error = error
        for undo in reversed(self.undos):
            try:
                undo()
            except Exception:  # an undo must not stop the others
                log.exception("event=undo_failed")
        self.undos.clear()
        self.done.set()


class GroupCommitter:
    """Applies journal records in batches; ``commit`` returns once they are durable."""

    def __init__(self, journal: Journal, on_disk_full: Callable[[], bool] | None = None) -> None:
        """``on_disk_full()`` frees room for the journal (blocking; True if it did): a batch that
        failed on a full disk is tried once more after it."""
        self._journal = journal
        self._on_disk_full = on_disk_full
        self._batch = Batch()
        self._wakeup = trio.Event()  # something is queued
        self._urgent = trio.Event()  # somebody waits for the queued records
        self._deadline = math.inf  # when deferred records go out on their own
        self._applying = False  # a transaction is in flight
        self.commits = 0  # number of transactions, for tests and metrics
        self.failures = 0  # transactions that failed (their changes were undone)

    async def commit(self, ops: Sequence[Op], *, sync: bool = False, undo: Undo | None = None) -> None:
        """Queue ``ops`` and wait until the transaction holding them is committed.

        ``undo`` restores the memory changes these records describe; it runs (in
        the committer task) if they are not committed.  Raises FsError then.
        ``sync`` also fsyncs the journal's WAL (fsync(2) on a persistent tier).
        """
        batch = self._batch
        batch.ops.extend(ops)
        if undo is not None:
            batch.undos.append(undo)
        self._wakeup.set()
        self._urgent.set()
        await batch.done.wait()
        if batch.error is not None:
            code = to_errno(batch.error)
            raise FsError(code, f"journal commit failed: {batch.error}") from batch.error
        if sync:
            await trio.to_thread.run_sync(self._journal.sync)

    def enqueue(self, ops: Sequence[Op]) -> None:
        """Queue ``ops`` for the next commit without waiting for it (records whose
        loss is harmless: they are dropped if that commit fails)."""
        self._batch.ops.extend(ops)
        self._wakeup.set()
        self._urgent.set()

    def defer(self, ops: Sequence[Op], undo: Undo, *, within: float = DEFER_S) -> Batch:
        """Queue ``ops`` without waiting or hurrying: they go out with the next :meth:`commit`
        (in order: later records may build on them) or ``within`` seconds from now.  If their
        transaction fails, ``undo`` runs and the returned batch's ``error`` says why: the
        caller must look before it reports success for anything built on them."""
        batch = self._batch
        batch.ops.extend(ops)
        batch.undos.append(undo)
        self._deadline = min(self._deadline, trio.current_time() + within)
        self._wakeup.set()
        return batch

    async def settle(self) -> None:
        """Commit the deferred records now: a reader of the journal is about to look (status,
        ``burstfs-admin wait``: a file just created is being written, not absent)."""
        if self._batch.ops or self._applying:  # the next commit comes after the one in flight
            await self.commit([])

    def pending(self) -> int:
        return len(self._batch.ops)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The committer task; runs until cancelled, flushing what is queued first."""
        task_status.started()
        try:
            while True:
                await self._wakeup.wait()
                with trio.move_on_at(self._deadline):
                    await self._urgent.wait()
                await self._flush()
        finally:
            with trio.CancelScope(shield=True):
                if self._batch.ops:
                    await self._flush()

    async def _apply(self, ops: list[Op]) -> None:
        """One transaction; on a full disk, once more after ``on_disk_full`` freed room (an
        unlink that frees the tier must not fail for want of the room it frees)."""
        try:
            await self._commit_once(ops)
        except Exception as exc:
            if to_errno(exc) != errno.ENOSPC or self._on_disk_full is None:
                raise
            if not await trio.to_thread.run_sync(self._on_disk_full):
                raise
            await trio.to_thread.run_sync(self._journal.apply, ops)
        if self._journal.checkpoint_due:  # a checkpoint fsyncs: never on the request loop
            await trio.to_thread.run_sync(self._journal.checkpoint)

    async def _commit_once(self, ops: list[Op]) -> None:
        """A small batch commits here when the journal is free at once (a thread hop costs more
        than its transaction); a large one, or one that would wait for a lock, in a thread."""
        if len(ops) <= INLINE_MAX_OPS and self._journal.try_apply(ops):
            return
        await trio.to_thread.run_sync(self._journal.apply, ops)

    async def _flush(self) -> None:
        self._wakeup, self._urgent, self._deadline = trio.Event(), trio.Event(), math.inf
        batch, self._batch = self._batch, Batch()
        try:
            # Shielded: once taken off the queue, a batch is committed or failed, never
            # dropped by a cancellation (trio checks for one before the thread starts).
            with trio.CancelScope(shield=True):
                self._applying = True
                try:
                    await self._apply(batch.ops)
                finally:
                    self._applying = False
        except Exception as exc:
            self.failures += 1
            # The batch that filled meanwhile may build on this one (a file created in
            # a directory made here): it fails too, and is undone first.
            later, self._batch = self._batch, Batch()
            log.error(
                "event=commit_failed records=%d later_records=%d errno=%s error=%s",
                len(batch.ops),
                len(later.ops),
                to_errno(exc),
                exc,
            )
            later.fail(exc)
            batch.fail(exc)
            return
        self.commits += 1
        batch.undos.clear()
        batch.done.set()

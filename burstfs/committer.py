"""Group commit of journal records from the FUSE request loop.

Requests hand their journal records to :meth:`GroupCommitter.commit` and wait.
One background task applies everything that arrived since the previous commit
in a single SQLite transaction, in a worker thread, so the request loop never
blocks on disk and a thousand concurrent closes cost a handful of commits.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from .journal import Journal, Op


class _Batch:
    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.done = trio.Event()
        self.error: BaseException | None = None


class GroupCommitter:
    """Applies journal records in batches; ``commit`` returns once they are durable."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        self._batch = _Batch()
        self._wakeup = trio.Event()
        self.commits = 0  # number of transactions, for tests and metrics

    async def commit(self, ops: Sequence[Op], *, sync: bool = False) -> None:
        """Queue ``ops`` and wait until the transaction holding them is committed.

        ``sync`` also fsyncs the journal's WAL (fsync(2) on a persistent tier).
        """
        batch = self._batch
        batch.ops.extend(ops)
        self._wakeup.set()
        await batch.done.wait()
        if batch.error is not None:
            raise batch.error
        if sync:
            await trio.to_thread.run_sync(self._journal.sync)

    def enqueue(self, ops: Sequence[Op]) -> None:
        """Queue ``ops`` for the next commit without waiting for it."""
        self._batch.ops.extend(ops)
        self._wakeup.set()

    def pending(self) -> int:
        return len(self._batch.ops)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The committer task; runs until cancelled, flushing what is queued first."""
        task_status.started()
        try:
            while True:
                await self._wakeup.wait()
                await self._flush()
        finally:
            with trio.CancelScope(shield=True):
                if self._batch.ops:
                    await self._flush()

    async def _flush(self) -> None:
        self._wakeup = trio.Event()
        batch, self._batch = self._batch, _Batch()
        try:
            await trio.to_thread.run_sync(self._journal.apply, batch.ops)
            self.commits += 1
        except Exception as exc:  # surfaced to every waiter of this batch as EIO
            batch.error = exc
        batch.done.set()

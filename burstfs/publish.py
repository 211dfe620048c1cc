"""What a file's changes journal, from the front's side.

The first change after a close journals the file as ``writing`` before any byte
lands (a crash then flags it incomplete); a close of a changed file journals a
new generation with its streaming digests, queued to drain (or ``incomplete``
when bytes may be missing); a file reopened for writing through passthrough and
left unchanged gets its state from before back.
"""

from __future__ import annotations

import itertools

import trio

from .committer import GroupCommitter
from .journal import Op, close_ops, mark_writing_op, unchanged_close_op
from .nodes import Inode, Undo


class Publisher:
    """Builds and commits the journal records of file changes (not namespace changes)."""

    def __init__(self, committer: GroupCommitter, first_close_seq: int) -> None:
        self.committer = committer
        self._next_close_seq = itertools.count(first_close_seq)  # the drain's order of closes

    async def mark_writing(self, inode: Inode) -> None:
        """The first change after a close is journaled, so a crash flags the file incomplete.

        Concurrent first writers wait for that one record: none writes a byte
        before it is committed, and if it fails, none has (the next one retries).
        """
        while inode.marking is not None:
            await inode.marking.wait()
        if inode.dirty:
            return
        inode.dirty = True
        if inode.new:  # a new file's row says `writing` since create
            return
        marking = inode.marking = trio.Event()

        def undo() -> None:
            inode.dirty = False

        try:
            await self.committer.commit([mark_writing_op(inode.ino)], undo=undo)
        finally:
            inode.marking = None
            marking.set()

    def close_ops(self, inode: Inode, undo: Undo, *, writer_left: bool) -> list[Op]:
        """Journal a changed file as closed: a new generation, queued to drain.

        A file that may lack bytes (a lost write, a crash) is journaled
        ``incomplete`` instead: it stays local and never drains until it is
        emptied and written again.  Once no writer is left the streaming digests
        are dropped (kilobytes per file: a million closed files must not keep
        them); a later append leaves the hashing to the drain.
        """
        before = (inode.dirty, inode.new, inode.generation, inode.digests)

        def reopen() -> None:
            inode.dirty, inode.new, inode.generation, inode.digests = before

        undo.add(reopen)
        inode.dirty = inode.new = False
        inode.generation += 1
        seq = next(self._next_close_seq)
        digests = inode.digests.result(inode.size) if inode.digests is not None else None
        if not writer_left:
            inode.digests = None
        return close_ops(
            inode.ino,
            generation=inode.generation,
            close_seq=seq,
            size=inode.size,
            mtime_ns=inode.mtime_ns,
            ctime_ns=inode.ctime_ns,
            digest=digests.digest if digests else None,
            chunks=digests.chunks if digests else None,
            chunk_size=digests.chunk_size if digests else None,
            incomplete=inode.incomplete or None,
        )

    def publish_ops(self, inode: Inode, undo: Undo, *, writer_left: bool) -> list[Op]:
        """What a close journals: a new generation, or, for a file opened for
        writing through passthrough and left unchanged, its state from before."""
        direct = inode.direct
        if direct is None or not direct.reopened_clean:
            return self.close_ops(inode, undo, writer_left=writer_left)
        dirty = inode.dirty

        def reopen() -> None:
            inode.dirty, direct.reopened_clean = dirty, True

        undo.add(reopen)
        inode.dirty = direct.reopened_clean = False
        return [unchanged_close_op(inode.ino)]

    @staticmethod
    def unpublished(inode: Inode) -> bool:
        """Changed since its last journaled close, or new and never closed.

        Not ``generation == 0``: files listed from the remote, and files left
        incomplete by a crash, have that too but are not new.
        """
        return inode.dirty or inode.new

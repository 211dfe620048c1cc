"""The journal records of the FUSE front, written without a mount (shared by the journal and mover tests).

:class:`JournalTree` writes rows the way core.py and namespace.py do, through the
journal's own operation builders (creates, closes, renames, unlinks), so a test
can interleave them with the mover's transitions at exact points.
"""

from __future__ import annotations

import itertools
import os
import stat
import time
from pathlib import Path

from burstfs.journal import (
    META,
    ROOT_INO,
    FileState,
    InodeRow,
    Journal,
    Op,
    close_ops,
    event_op,
    insert_inode_op,
    unlink_ops,
    update_inode_op,
)
from burstfs.localtier import LocalTier
from burstfs.objects import compute_digests


class JournalTree:
    """A namespace journaled the way the front journals it; data files on ``cache``'s tier."""

    def __init__(self, journal: Journal, cache: Path, *, chunk_size: int = 5 << 20) -> None:
        self.journal = journal
        self.tier = LocalTier(cache)
        self.chunk_size = chunk_size
        self._ino = itertools.count(ROOT_INO + 1)
        self._seq = itertools.count(journal.max_close_seq() + 1)
        self._insert(ROOT_INO, ROOT_INO, b"", "dir", META)

    def _insert(self, ino: int, parent: int, name: bytes, kind: str, state: FileState) -> int:
        now = time.time_ns()
        mode = stat.S_IFDIR | 0o755 if kind == "dir" else stat.S_IFREG | 0o644
        row = InodeRow(
            ino=ino,
            parent=parent,
            name=name,
            kind=kind,
            mode=mode,
            uid=0,
            gid=0,
            atime_ns=now,
            mtime_ns=now,
            ctime_ns=now,
            state=state,
            updated=time.time(),
        )
        self.journal.apply([insert_inode_op(row)])
        return ino

    def new(self, parent: int, name: str, kind: str, state: FileState) -> int:
        """A row of ``kind`` in ``state`` (e.g. a ``remote`` file a listing found)."""
        return self._insert(next(self._ino), parent, name.encode(), kind, state)

    def mkdir(self, name: str, parent: int = ROOT_INO) -> int:
        return self.new(parent, name, "dir", META)

    def create(self, name: str, parent: int = ROOT_INO) -> int:
        return self.new(parent, name, "file", FileState.WRITING)

    def close(self, ino: int, size: int = 10, *, digests: bool = True) -> int:
        """A journaled close (invariant 1) of the row's current bytes: returns the new generation.

        With a data file on the tier its size, mtime and (with ``digests``) its
        close-time digests are journaled; without one, ``size`` and no digests.
        """
        row = self.row(ino)
        path = self.tier.path(ino)
        mtime_ns = row.mtime_ns
        digest, chunks, chunk_size = None, None, None
        if path.exists():
            st = path.stat()
            size, mtime_ns = st.st_size, st.st_mtime_ns
            if digests:
                d = compute_digests(path, self.chunk_size)
                digest, chunks, chunk_size = d.digest, list(d.chunks), self.chunk_size
        generation = row.generation + 1
        self.journal.apply(
            close_ops(
                ino,
                generation=generation,
                close_seq=next(self._seq),
                size=size,
                mtime_ns=mtime_ns,
                ctime_ns=row.ctime_ns,
                digest=digest,
                chunks=chunks,
                chunk_size=chunk_size,
                incomplete=None,
            )
        )
        return generation

    def write_file(self, name: str, parent: int = ROOT_INO) -> tuple[int, int]:
        """A file created and closed (10 bytes, no data file): ``(ino, generation)``."""
        ino = self.create(name, parent)
        return ino, self.close(ino)

    def write(self, name: str, data: bytes, parent: int = ROOT_INO) -> int:
        """A file written with ``data`` on the tier and closed with its digests."""
        ino = self.create(name, parent)
        self.rewrite(ino, data)
        return ino

    def rewrite(self, ino: int, data: bytes, *, digests: bool = True) -> None:
        """Write ``data`` and close: a new generation, staged (with close-time digests)."""
        self.tier.path(ino).write_bytes(data)
        self.close(ino, digests=digests)

    def unlink(self, ino: int) -> None:
        """unlink(2) of a file still open (the row stays, parent 0, until its last release)."""
        self.journal.apply(unlink_ops(ino, self.row(ino).name, time.time_ns()))

    def rename(self, ino: int, new_name: str, new_parent: int = ROOT_INO) -> None:
        """rename(2), replacing (unlinking) a file already at the new name."""
        ops: list[Op] = []
        target = self.journal.child(new_parent, new_name.encode())
        if target is not None:
            ops += unlink_ops(target.ino, target.name, time.time_ns())
        old = self.row(ino).name
        ops += [
            update_inode_op(ino, parent=new_parent, name=new_name.encode()),
            event_op(ino, "rename", f"{os.fsdecode(old)} -> {new_name}"),
        ]
        self.journal.apply(ops)

    def durable(self, ino: int, generation: int) -> str:
        """The mover's claim and recorded upload of ``generation``: returns its key."""
        claimed = self.journal.drain.claim(ino, generation)
        assert isinstance(claimed, tuple), claimed
        key, intent = claimed
        assert self.journal.drain.finish_upload(ino, generation, key, intent, "test")
        return key

    def row(self, ino: int) -> InodeRow:
        row = self.journal.inode(ino)
        assert row is not None
        return row

    def state(self, ino: int) -> FileState:
        return self.row(ino).state

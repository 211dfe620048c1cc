"""The journal: every state change of the namespace and of each file, in SQLite (WAL).

The journal is the contract between the FUSE front and the mover.  The front
records creates, closes, renames and unlinks (the operations of ``ops.py``,
applied in one transaction by the group committer); the mover records digests,
uploads and evictions through ``journal.drain`` and ``journal.keys``.  After a
crash, the namespace and the drain queue are rebuilt from here alone.

Concurrency: one :class:`Journal` object per connection.  The front owns one
(used from one worker thread at a time), the mover owns another (used from its
journal thread); SQLite serializes the writers (``busy_timeout``), and mover
updates are conditional on the generation they were computed for, so a racing
close always wins.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .connection import Database
from .drain import ABANDONED_MARKER, DrainQueue
from .keys import KeyOwnership
from .ops import EMPTIED_DIR, KNOWN_DIR, event_op, released_object_ops, set_meta_op
from .rows import INODE_SELECT, ROOT_INO, InodeRow, Op, row_from_values
from .states import CLOSED_UNDRAINED, DONE, DURABLE, EVICTED, FAILED, NOT_LOCAL, UNDRAINED, FileState, state_marks

#: The meta key naming the remote this cache drained a file to: a remote that lacks the marks
#: burstfs leaves there is then not a new one (``Remote.expect_established``).
_DRAINED_TO = "drained_to"


class Journal:
    """A connection to the journal database in ``cache_dir``: the namespace's rows, meta,
    events and the local tier's records; ``drain`` and ``keys`` for the mover."""

    def __init__(self, cache_dir: Path, *, readonly: bool = False) -> None:
        self._db = Database(cache_dir, readonly=readonly)
        self.path = self._db.path
        self.drain = DrainQueue(self._db)
        self.keys = KeyOwnership(self._db)

    @property
    def database(self) -> Database:
        """The connection behind every part of this journal (tests reach the raw connection here)."""
        return self._db

    def close(self) -> None:
        self._db.close()

    # -- generic access -------------------------------------------------------------

    def apply(self, ops: Iterable[Op]) -> None:
        """Run ``ops`` in one transaction (the group commit)."""
        self._db.apply(ops)

    def try_apply(self, ops: Sequence[Op]) -> bool:
        """``apply`` if nobody else is writing to the journal right now; never waits (False: nothing done)."""
        return self._db.try_apply(ops)

    @property
    def checkpoint_due(self) -> bool:
        """True once commits by ``try_apply`` grew the WAL enough to ``checkpoint`` it."""
        return self._db.checkpoint_due

    def checkpoint(self) -> None:
        """Fold the WAL into the database file (blocking: a worker thread's job)."""
        self._db.checkpoint()

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._db.query(sql, params)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement in its own transaction; returns the number of rows changed."""
        return self._db.execute(sql, params)

    def sync(self) -> None:
        """fsync the WAL so that committed records survive a power loss too."""
        self._db.sync()

    # -- meta ---------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        rows = self.query("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else None

    def set_meta(self, key: str, value: str) -> None:
        self.apply([set_meta_op(key, value)])

    def drained_to(self, remote: str) -> bool:
        """Whether a file of this cache became durable on ``remote`` (``mark_drained_to``)."""
        return self.get_meta(_DRAINED_TO) == remote

    def mark_drained_to(self, remote: str) -> None:
        self.set_meta(_DRAINED_TO, remote)

    def set_metas(self, items: Iterable[tuple[str, str]]) -> None:
        """Several meta rows in one transaction."""
        self.apply(set_meta_op(key, value) for key, value in items)

    def drop_metas(self, keys: Iterable[str]) -> None:
        """Remove these meta rows, in one transaction."""
        self.apply(("DELETE FROM meta WHERE key=?", (key,)) for key in keys)

    def meta_items(self, prefix: str) -> list[tuple[str, str]]:
        """Every ``(key, value)`` of the meta table whose key starts with ``prefix``."""
        rows = self.query(
            "SELECT key, value FROM meta WHERE key >= ? AND key < ? ORDER BY key", (prefix, prefix + "\U0010ffff")
        )
        return [(str(k), str(v)) for k, v in rows]

    # -- events ---------------------------------------------------------------------

    def log_event(self, ino: int | None, event: str, detail: str = "") -> Op:
        return event_op(ino, event, detail)

    def events(self, since: float = 0.0, limit: int = 1000) -> list[tuple[float, int | None, str, str]]:
        return self.query(
            "SELECT time, ino, event, detail FROM events WHERE time >= ? ORDER BY seq DESC LIMIT ?",
            (since, limit),
        )[::-1]

    def prune_events(self, keep: int) -> None:
        """Drop all but the newest ``keep`` events."""
        self.execute("DELETE FROM events WHERE seq <= (SELECT MAX(seq) FROM events) - ?", (keep,))

    def latest_event_seq(self) -> int:
        return int(self.query("SELECT COALESCE(MAX(seq), 0) FROM events")[0][0])

    def renamed_since(self, seq: int) -> tuple[list[int], int]:
        """Inodes renamed after event ``seq``, and the newest event seq seen."""
        latest = self.latest_event_seq()
        rows = self.query("SELECT ino FROM events WHERE seq > ? AND seq <= ? AND event='rename'", (seq, latest))
        return [int(ino) for (ino,) in rows if ino is not None], max(seq, latest)

    def last_closed_at(self, ino: int) -> float | None:
        """Time of the newest ``closed`` event of ``ino``, scanning back from the end of the log."""
        rows = self.query("SELECT time FROM events WHERE ino=? AND event='closed' ORDER BY seq DESC LIMIT 1", (ino,))
        return float(rows[0][0]) if rows else None

    # -- inodes -------------------------------------------------------------------

    def inodes(self, where: str = "", params: Sequence[Any] = ()) -> list[InodeRow]:
        return [row_from_values(values) for values in self.query(f"{INODE_SELECT} {where}", params)]

    def inode(self, ino: int) -> InodeRow | None:
        rows = self.inodes("WHERE ino=?", (ino,))
        return rows[0] if rows else None

    def xattrs(self) -> Iterator[tuple[int, bytes, bytes]]:
        yield from self.query("SELECT ino, name, value FROM xattrs")

    def held_closes(self) -> dict[int, tuple[int, float]]:
        """ino -> (generation, wall time) of closes journaled before their open file's release."""
        rows = self.query("SELECT ino, generation, flushed_at FROM held_closes")
        return {int(ino): (int(generation), float(at)) for ino, generation, at in rows}

    def path_of(self, ino: int) -> str | None:
        """The file's path relative to the mount root, or None if it is unlinked."""
        with self._db.lock:
            return self._db.path_locked(ino)

    def paths_of(self, inos: Iterable[int]) -> list[str | None]:
        """:meth:`path_of` of each of ``inos``, read at once."""
        with self._db.lock:
            return [self._db.path_locked(ino) for ino in inos]

    def child(self, parent: int, name: bytes) -> InodeRow | None:
        """The linked inode called ``name`` in the directory ``parent``."""
        rows = self.inodes("WHERE parent=? AND name=? AND parent!=0", (parent, name))
        return rows[0] if rows else None

    def subtree(self, ino: int) -> list[InodeRow]:
        """``ino`` and every inode below it (the root's own row is not walked into again)."""
        return self.inodes(
            """WHERE ino IN (WITH RECURSIVE sub(ino) AS (
                    SELECT ? UNION SELECT i.ino FROM inodes i JOIN sub ON i.parent=sub.ino WHERE i.ino!=?)
                SELECT ino FROM sub)""",
            (ino, ROOT_INO),
        )

    def names_of(self, ino: int) -> list[InodeRow]:
        """The rows of every name ``ino`` has: its own (if still linked) and its hard links'."""
        return self.inodes("WHERE (ino=? OR link_of=?) AND parent!=0 ORDER BY ino", (ino, ino))

    def state_row(self, ino: int) -> InodeRow | None:
        """The row whose drain state stands for the file (``user.burstfs.*``): its own, or,
        with hard links, that of the name least far along (the file is durable once every name is)."""
        names = self.names_of(ino)
        behind = [row for row in names if row.state not in DONE]
        return behind[0] if behind else names[0] if names else self.inode(ino)

    def moving(self, ino: int) -> bool:
        """Whether a name of ``ino`` has its object at an older name (renamed after its upload):
        durable, but not yet where a restore of its path looks."""
        names = self.names_of(ino)
        with self._db.lock:
            return any(
                row.state in DONE and row.remote_key not in (None, self._db.path_locked(row.ino)) for row in names
            )

    def set_error(self, ino: int, error: str | None) -> None:
        """A note on a file for status (e.g. why its object could not be moved)."""
        self.execute("UPDATE inodes SET error=? WHERE ino=?", (error, ino))

    def max_close_seq(self) -> int:
        return int(self.query("SELECT COALESCE(MAX(close_seq), 0) FROM inodes")[0][0])

    # -- status queries (a live daemon and a stopped mount's read-only journal alike) ----

    def state_counts(self) -> dict[FileState, tuple[int, int]]:
        """{state: (files, bytes)} of the linked files, for the states that have any."""
        rows = self.query(
            "SELECT state, COUNT(*), COALESCE(SUM(size), 0) FROM inodes WHERE kind='file' AND parent!=0 GROUP BY state"
        )
        return {FileState(state): (int(files), int(nbytes)) for state, files, nbytes in rows}

    def known_dirs(self) -> set[int]:
        """Directories whose entries this cache knows (``ops.KNOWN_DIR``, ``ops.EMPTIED_DIR``)."""
        return {
            int(ino)
            for (ino,) in self.query(
                "SELECT ino FROM inodes WHERE kind='dir' AND listed_version IN (?, ?)", (KNOWN_DIR, EMPTIED_DIR)
            )
        }

    def emptied_dirs(self) -> dict[int, int]:
        """ino -> mtime_ns of the directories a listing emptied (``ops.EMPTIED_DIR``)."""
        rows = self.query(
            "SELECT ino, mtime_ns FROM inodes WHERE kind='dir' AND parent!=0 AND listed_version=?", (EMPTIED_DIR,)
        )
        return {int(ino): int(mtime) for ino, mtime in rows}

    def abandoned_markers(self) -> tuple[int, int]:
        """(files, bytes) of the markers of abandoned checkpoints (failed, never published)."""
        files, nbytes = self.query(
            "SELECT COUNT(*), COALESCE(SUM(size), 0) FROM inodes"
            " WHERE kind='file' AND parent!=0 AND state=? AND error=?",
            (FAILED, ABANDONED_MARKER),
        )[0]
        return int(files), int(nbytes)

    def undrained(self) -> dict[str, tuple[int, int]]:
        """{state: (files, bytes)} of files not yet durable; they stay staged in the cache."""
        return {state: counts for state, counts in self.state_counts().items() if state in UNDRAINED}

    def local_bytes_by_file(self) -> list[tuple[int, int]]:
        """``(ino, local_bytes)`` of the linked files with bytes on the local tier."""
        rows = self.query("SELECT ino, local_bytes FROM inodes WHERE kind='file' AND parent!=0 AND local_bytes>0")
        return [(int(ino), int(local)) for ino, local in rows]

    def oldest_closed_undrained(self) -> tuple[int, float] | None:
        """``(ino, updated)`` of the file first in close order among CLOSED_UNDRAINED, or None."""
        marks, states = state_marks(CLOSED_UNDRAINED)
        rows = self.query(
            f"SELECT ino, updated FROM inodes WHERE kind='file' AND parent!=0 AND state IN ({marks}) "
            "ORDER BY close_seq LIMIT 1",
            states,
        )
        return (int(rows[0][0]), float(rows[0][1])) if rows else None

    # -- the local tier (invariant 7) and fetches ------------------------------------------

    def evictable(self) -> list[tuple[int, int]]:
        """``(ino, close_seq)`` of files whose local copy is what the remote holds under
        every name (each name's row ``durable``, ``durable_generation = generation``):
        invariant 7's candidates.  ``ino`` is the data's inode, also for hard links."""
        rows = self.query(
            "SELECT COALESCE(link_of, ino) AS data, MAX(close_seq) FROM inodes WHERE kind='file' AND parent!=0 "
            "GROUP BY data HAVING SUM(CASE WHEN state=? AND durable_generation=generation THEN 0 ELSE 1 END)=0",
            (DURABLE,),
        )
        return [(int(ino), int(close_seq)) for ino, close_seq in rows]

    def evict(self, ino: int, generation: int) -> bool:
        """``durable`` → ``evicted`` (every name of the file) if ``generation`` is still the
        durable one under each name; False otherwise."""
        with self._db.transaction() as db:
            undrained = db.execute(
                "SELECT COUNT(*) FROM inodes WHERE (ino=? OR link_of=?) AND parent!=0 "
                "AND NOT (state=? AND generation=? AND durable_generation=generation)",
                (ino, ino, DURABLE, generation),
            ).fetchone()[0]
            if undrained:
                return False
            return bool(
                db.execute(
                    "UPDATE inodes SET state=?, local_bytes=0 WHERE (ino=? OR link_of=?) AND generation=?",
                    (EVICTED, ino, ino, generation),
                ).rowcount
            )

    def finish_fetch(
        self,
        ino: int,
        size: int,
        *,
        digest: str | None = None,
        chunks: Sequence[str] | None = None,
        chunk_size: int | None = None,
    ) -> None:
        """A NOT_LOCAL file fetched whole: ``durable`` and local (with the manifest's digests, if any).
        An unlinked one, fetched for the reader that still has it open, lets its object go."""
        fields: dict[str, object] = {"state": DURABLE, "updated": time.time()}
        if digest is not None:
            fields.update(digest=digest, chunk_size=chunk_size, chunks=json.dumps(list(chunks or ())))
        assignments = ", ".join(f"{name}=?" for name in fields)
        marks, states = state_marks(NOT_LOCAL)
        # Every name of the file (hard links) holds the same bytes; the inode's own row counts them.
        self.apply(
            [
                (
                    f"UPDATE inodes SET {assignments}, local_bytes=CASE WHEN ino=? THEN ? ELSE 0 END, "
                    f"durable_generation=generation WHERE (ino=? OR link_of=?) AND state IN ({marks})",
                    (*fields.values(), ino, size, ino, ino, *states),
                ),
                *released_object_ops(ino),
            ]
        )

    def fetch_row(self, ino: int) -> InodeRow | None:
        """The row a fetch of ``ino`` reads: its own, with the key of a name that holds its
        bytes when its own name is gone (a hard link outlived it; every name holds the same bytes)."""
        row = self.inode(ino)
        if row is None or row.remote_key:
            return row
        marks, states = state_marks(DONE)
        keys = self.query(
            f"SELECT remote_key FROM inodes WHERE link_of=? AND parent!=0 AND remote_key IS NOT NULL "
            f"AND state IN ({marks}) AND durable_generation=generation LIMIT 1",
            (ino, *states),
        )
        if keys:
            row.remote_key = str(keys[0][0])
        return row

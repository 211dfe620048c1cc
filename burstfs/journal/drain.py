"""The drain queue: which staged file drains next, and the transitions of one upload.

``Journal.drain`` (one per connection).  Every transition is conditional on the
generation the mover read (DESIGN-NOTES invariant 3): a close racing an upload
bumps the generation, the update matches nothing, and the file drains again.
Each method is one transaction, so a racing close, rename or unlink is seen whole.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence

from .connection import Database
from .ops import event_op
from .rows import INODE_SELECT, ROOT_INO, InodeRow, row_from_values
from .states import DRAINING, DURABLE, FAILED, NOT_YET_DURABLE, QUEUED, STAGED, state_marks

#: The error of a commit marker whose checkpoint was given up (``burstfs-admin abandon``).
ABANDONED_MARKER = "checkpoint abandoned (burstfs-admin abandon): this marker is never published"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A staged file that may drain next; for a commit marker, what holds it back."""

    row: InodeRow
    marker_key: str | None = None  # a marker's key (its path), None for other files
    marker_blocked: bool = False  # a marker with a file closed before it under its directory not durable


class DrainQueue:
    """Claims, uploads recorded, requeues and failures, commit-marker order, multipart uploads."""

    def __init__(self, database: Database) -> None:
        self._db = database

    # -- choosing what to drain (invariant 5) ----------------------------------------------

    def has_work(self) -> bool:
        """True while a file is QUEUED or a remote delete is pending."""
        marks, states = state_marks(QUEUED)
        rows = self._db.query(
            f"SELECT COUNT(*) FROM inodes WHERE kind='file' AND parent!=0 AND state IN ({marks})", states
        )
        return bool(rows[0][0]) or bool(self._db.query("SELECT 1 FROM remote_deletes LIMIT 1"))

    def candidates(self, limit: int, *, closed_before: float, is_marker: Callable[[InodeRow], bool]) -> list[Candidate]:
        """The first ``limit`` staged files last changed at or before ``closed_before``, in close
        order, read at once; for each commit marker (``is_marker``, a pure function of the row)
        its key and whether an earlier close under its directory holds it back."""
        found: list[Candidate] = []
        for row in self.staged(limit, closed_before=closed_before):
            if is_marker(row):
                with self._db.lock:
                    key = self._db.path_locked(row.ino)
                found.append(Candidate(row, marker_key=key, marker_blocked=self.blocks_marker(row)))
            else:
                found.append(Candidate(row))
        return found

    def staged(self, limit: int, *, closed_before: float) -> list[InodeRow]:
        """The first ``limit`` staged files (close order) last changed at or before ``closed_before``."""
        rows = self._db.query(
            f"{INODE_SELECT} WHERE state=? AND kind='file' AND parent!=0 AND updated <= ? ORDER BY close_seq LIMIT ?",
            (STAGED, closed_before, limit),
        )
        return [row_from_values(values) for values in rows]

    def blocks_marker(self, marker: InodeRow) -> bool:
        """True while a file under the marker's directory closed before it is NOT_YET_DURABLE.

        An abandoned marker is no such file: its checkpoint was given up, and a later marker
        above it (``latest`` beside the step directories) publishes the next checkpoint."""
        marks, states = state_marks(NOT_YET_DURABLE)
        rows = self._db.query(
            f"""WITH RECURSIVE sub(ino) AS (
                   SELECT ino FROM inodes WHERE parent=? AND ino!=?
                   UNION SELECT i.ino FROM inodes i JOIN sub ON i.parent=sub.ino)
               SELECT COUNT(*) FROM inodes WHERE ino IN sub AND ino!=? AND kind='file'
                   AND state IN ({marks}) AND close_seq > 0 AND close_seq < ?
                   AND NOT (state=? AND error IS ?)""",
            (marker.parent, ROOT_INO, marker.ino, *states, marker.close_seq, FAILED, ABANDONED_MARKER),
        )
        return bool(rows[0][0])

    # -- one upload (invariants 3 and 6) -----------------------------------------------------

    def claim(self, ino: int, generation: int) -> tuple[str, int] | int | None:
        """Mark ``generation`` of ``ino`` draining to its current path and record the intent.

        Returns ``(key, intent_id)``; an ``int``, the inode that holds the key (the
        upload must wait); or None if the file changed, went away or is not staged.
        The intent row makes the delete pass remove the object if the upload is
        cut short (crash) or the file is unlinked before the upload is recorded.
        """
        with self._db.transaction() as db:
            key = self._db.path_locked(ino)
            if key is None:
                return None
            holder = self._db.holder_locked(key, ino)
            if holder is not None:
                return holder
            changed = db.execute(
                "UPDATE inodes SET state=?, upload_key=?, updated=? WHERE ino=? AND generation=? AND state=? "
                "AND parent!=0",
                (DRAINING, key, time.time(), ino, generation, STAGED),
            ).rowcount
            if not changed:
                return None
            intent = db.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'upload')", (key,)).lastrowid
            return key, int(intent or 0)

    def superseded(self, ino: int, generation: int) -> bool:
        """True if ``generation`` of ``ino`` is no longer the one to drain: a newer close,
        a writer at work (``writing``), or an unlink."""
        rows = self._db.query("SELECT generation, parent, state FROM inodes WHERE ino=?", (ino,))
        return not rows or rows[0][0] != generation or rows[0][1] == 0 or rows[0][2] != DRAINING

    def record_digests(self, ino: int, generation: int, digest: str, chunks: Sequence[str], chunk_size: int) -> None:
        """Digests the drain took of ``generation`` (for verify and the xattr); a newer close keeps its own.
        The same bytes under every name of the file: its other names' rows get them too."""
        self._db.execute(
            "UPDATE inodes SET digest=?, chunks=?, chunk_size=? WHERE generation=? AND (ino=? OR link_of=? "
            "OR ino=(SELECT link_of FROM inodes WHERE ino=?) OR link_of=(SELECT link_of FROM inodes WHERE ino=?))",
            (digest, json.dumps(list(chunks)), chunk_size, generation, ino, ino, ino, ino),
        )

    def finish_upload(self, ino: int, generation: int, key: str, intent: int, detail: str) -> bool:
        """Record ``generation`` of ``ino`` as durable at ``key``; False if it changed or was unlinked.

        Recorded: the file's previous object (another key) is queued for deletion
        and the intent row dropped.  Changed meanwhile but still linked: the file
        keeps ``key`` as its object until its next generation replaces it.
        Unlinked (or gone): nothing marks the key owned, so the intent row stays
        and the delete pass removes the object.
        """
        with self._db.transaction() as db:
            row = db.execute("SELECT parent, remote_key FROM inodes WHERE ino=?", (ino,)).fetchone()
            db.execute("UPDATE inodes SET upload_key=NULL WHERE ino=?", (ino,))
            if row is None or row[0] == 0:
                return False
            old_key = row[1]
            recorded = db.execute(
                "UPDATE inodes SET state=?, remote_key=?, durable_generation=?, error=NULL, attempts=0, updated=? "
                "WHERE ino=? AND generation=? AND state=? AND parent!=0",
                (DURABLE, key, generation, time.time(), ino, generation, DRAINING),
            ).rowcount
            if not recorded:
                db.execute("UPDATE inodes SET remote_key=? WHERE ino=?", (key, ino))
            if old_key and old_key != key:
                db.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'replaced')", (old_key,))
            db.execute("DELETE FROM remote_deletes WHERE id=?", (intent,))
            if recorded:
                db.execute(*event_op(ino, "durable", detail))
            return bool(recorded)

    def attempts(self, ino: int) -> int:
        """Failed upload attempts of ``ino`` so far (0 if it is gone)."""
        rows = self._db.query("SELECT attempts FROM inodes WHERE ino=?", (ino,))
        return int(rows[0][0]) if rows else 0

    def requeue(self, ino: int, generation: int, error: str | None, attempts: int) -> None:
        """Back to ``staged`` (if still this draining generation); the upload no longer holds its key."""
        with self._db.transaction() as db:
            db.execute(
                "UPDATE inodes SET state=?, attempts=?, error=? WHERE ino=? AND generation=? AND state=?",
                (STAGED, attempts, error, ino, generation, DRAINING),
            )
            db.execute("UPDATE inodes SET upload_key=NULL WHERE ino=?", (ino,))

    def fail(self, ino: int, generation: int, error: str) -> bool:
        """Mark this draining generation ``failed`` with ``error``; False if the file changed meanwhile."""
        with self._db.transaction() as db:
            failed = db.execute(
                "UPDATE inodes SET state=?, error=? WHERE ino=? AND generation=? AND state=?",
                (FAILED, error, ino, generation, DRAINING),
            ).rowcount
            db.execute("UPDATE inodes SET upload_key=NULL WHERE ino=?", (ino,))
            if failed:
                db.execute(*event_op(ino, "failed", error))
            return bool(failed)

    def abandon(self, ino: int, generation: int) -> bool:
        """Mark this staged generation of a marker whose checkpoint was abandoned ``failed``
        (ABANDONED_MARKER) without draining it; False if the file changed meanwhile."""
        with self._db.transaction() as db:
            failed = db.execute(
                "UPDATE inodes SET state=?, error=? WHERE ino=? AND generation=? AND state=?",
                (FAILED, ABANDONED_MARKER, ino, generation, STAGED),
            ).rowcount
            if failed:
                db.execute(*event_op(ino, "failed", ABANDONED_MARKER))
            return bool(failed)

    def retry_failed(self) -> int:
        """Every failed file staged again with a fresh retry budget; returns how many.  An
        abandoned checkpoint's marker stays failed: it is never published, even by ``retry``."""
        return self._db.execute(
            "UPDATE inodes SET state=?, attempts=0, error=NULL WHERE state=? AND error IS NOT ?",
            (STAGED, FAILED, ABANDONED_MARKER),
        )

    def recover(self) -> int:
        """After a restart nothing is in flight: draining files are staged again."""
        with self._db.transaction() as db:
            db.execute("UPDATE inodes SET upload_key=NULL WHERE upload_key IS NOT NULL")
            return int(db.execute("UPDATE inodes SET state=? WHERE state=?", (STAGED, DRAINING)).rowcount)

    # -- multipart uploads this cache started ---------------------------------------------

    def upload_started(self, key: str, upload_id: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO uploads VALUES (?, ?, ?)", (upload_id, key, time.time()))

    def upload_ended(self, upload_id: str) -> None:
        self._db.execute("DELETE FROM uploads WHERE upload_id=?", (upload_id,))

    def own_uploads(self) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of multipart uploads this cache started and did not finish."""
        return [(str(k), str(u)) for u, k in self._db.query("SELECT upload_id, key FROM uploads ORDER BY started")]

"""Who owns which remote key (DESIGN-NOTES invariant 6): deletes, relocations, stale keys.

``Journal.keys`` (one per connection).  A key belongs to at most one inode: the
live inode whose ``remote_key`` it is, or the inode whose upload is writing to
it (``upload_key``).  No upload, relocation or delete touches a key another
inode holds.  Each method is one transaction, so a racing close, rename or
unlink is seen whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Container, Iterable

from .connection import Database
from .ops import event_op
from .rows import ROOT_INO
from .states import DONE, DURABLE, FAILED, QUEUED, RESTAGED, STAGED, state_marks

# Every directory at or below a seed directory (a named one: ``parent != 0``).
_SUBTREE = """WITH RECURSIVE tree(ino) AS (
       SELECT ? UNION ALL SELECT i.ino FROM inodes i JOIN tree ON i.parent=tree.ino WHERE i.kind='dir')"""
#: Queued deletes of removed, replaced or moved files' objects; not the intents ('upload',
#: 'move') that uploads and moves in flight leave for their own crash cleanup.
_REMOVALS = "reason NOT IN ('upload', 'move')"
#: What a wait waits for besides the files: the removals, and the intent of an upload whose
#: file was unlinked while it ran (no linked file uploads to its key): a CompleteMultipartUpload
#: answered after the unlink leaves an object that only that intent's delete removes.
_WAITED_DELETES = (
    f"({_REMOVALS} OR (reason='upload' AND NOT EXISTS "
    "(SELECT 1 FROM inodes WHERE inodes.upload_key=remote_deletes.key AND inodes.parent!=0)))"
)
# Every file at or below a seed ``(ino, path)``, with its path: the walk behind relocations.
_PATHS_BELOW = """WITH RECURSIVE paths(ino, path) AS (
       SELECT ?, ?
       UNION ALL SELECT i.ino, paths.path || '/' || CAST(i.name AS TEXT)
       FROM inodes i JOIN paths ON i.parent=paths.ino)"""


class KeyOwnership:
    """The remote keys this node owns, gives up and moves."""

    def __init__(self, database: Database) -> None:
        self._db = database

    def holder(self, key: str, other_than: int = 0) -> int | None:
        """The inode (not ``other_than``) that owns ``key`` (live ``remote_key``) or is uploading to it."""
        with self._db.lock:
            return self._db.holder_locked(key, other_than)

    def owned_under(self, dir_key: str) -> set[str]:
        """Keys below ``dir_key`` ("" = everywhere) this node owns (some inode's ``remote_key``)
        or is deleting: a listing must not resurrect them.  A key range, so the
        ``remote_key`` and ``remote_deletes(key)`` indexes serve it."""
        if not dir_key:
            rows = self._db.query(
                "SELECT remote_key FROM inodes WHERE remote_key IS NOT NULL UNION SELECT key FROM remote_deletes"
            )
        else:
            low, high = f"{dir_key}/", f"{dir_key}0"  # '0' sorts right after '/'
            rows = self._db.query(
                "SELECT remote_key FROM inodes WHERE remote_key >= ? AND remote_key < ? "
                "UNION SELECT key FROM remote_deletes WHERE key >= ? AND key < ?",
                (low, high, low, high),
            )
        return {str(row[0]) for row in rows}

    def durable_at_path_in(self, dir_ino: int, dir_key: str) -> dict[bytes, int]:
        """name -> generation of the files directly in ``dir_ino`` (path ``dir_key``) whose
        current generation is durable with its object at their path: read before a listing,
        each of them was on the remote then, so one missing from it was deleted since."""
        prefix = f"{dir_key}/" if dir_key else ""
        marks, done = state_marks(DONE)
        rows = self._db.query(
            f"SELECT name, generation, remote_key FROM inodes WHERE parent=? AND kind='file' AND link_of IS NULL "
            f"AND state IN ({marks}) AND durable_generation=generation AND remote_key IS NOT NULL",
            (dir_ino, *done),
        )
        return {bytes(name): int(gen) for name, gen, key in rows if key == prefix + os.fsdecode(bytes(name))}

    def all_on_remote(self, dir_inos: Iterable[int]) -> set[int]:
        """Of the directories ``dir_inos``, those whose files (at any depth; maybe none, below
        directories emptied so) are all on the remote (DONE: none waiting to drain, being
        written or failed): a directory gone from the remote's listing with such files only
        was deleted there (by another node)."""
        marks, done = state_marks(DONE)
        found: set[int] = set()
        with self._db.lock:
            for ino in set(dir_inos):
                total, on_remote = self._db.connection.execute(
                    f"{_SUBTREE} SELECT count(*), coalesce(sum(i.state IN ({marks})), 0) "
                    f"FROM inodes i JOIN tree ON i.parent=tree.ino WHERE i.kind='file'",
                    (ino, *done),
                ).fetchone()
                if total == on_remote:
                    found.add(ino)
        return found

    # -- the delete queue --------------------------------------------------------------------

    def pending_deletes(self, limit: int) -> list[tuple[int, str, str]]:
        """``(id, key, reason)`` of queued remote deletes, oldest first."""
        return [
            (int(i), str(k), str(r))
            for i, k, r in self._db.query("SELECT id, key, reason FROM remote_deletes ORDER BY id LIMIT ?", (limit,))
        ]

    def pending_deletes_held(
        self, limit: int, skip_keys: Container[str] = frozenset(), also: Iterable[int] = ()
    ) -> list[tuple[int, str, str, str | None, int | None]]:
        """``(id, key, reason, version, holder)`` of queued remote deletes, oldest first, with the
        inode that holds each key (owns it or uploads to it; None: free to delete), read at once;
        ``version``: the listed version of another node's file (the only one to delete).
        Keys in ``skip_keys`` (the uploads in flight, each with its intent here) are left out
        before their holder is looked up: a drain of many small files has dozens.  The requests
        ``also`` (ids) come with the first ``limit`` wherever they are in the queue."""
        extra = list(also)
        with self._db.lock:
            rows = self._db.connection.execute(
                "SELECT id, key, reason, version FROM remote_deletes ORDER BY id LIMIT ?", (limit,)
            ).fetchall()
            for start in range(0, len(extra), 500):  # under SQLite's limit of bound parameters
                batch = extra[start : start + 500]
                rows += self._db.connection.execute(
                    f"SELECT id, key, reason, version FROM remote_deletes WHERE id IN ({', '.join('?' * len(batch))})",
                    batch,
                ).fetchall()
            return [
                (int(i), str(k), str(r), v, self._db.holder_locked(str(k), 0))
                for i, k, r, v in sorted(set(rows))
                if k not in skip_keys
            ]

    def deletes_queued_under(self, rel: str) -> set[str]:
        """Keys whose remote delete is still queued, at or below ``rel`` ("" = everywhere) or
        the old objects of files moved to a key there (the remote shows a renamed checkpoint
        only once its old name is gone): those of removed, replaced or moved files, and the
        intents of uploads whose file was unlinked meanwhile; not the intents of uploads and
        moves of live files (those files are not durable yet: a wait waits for them anyway)."""
        with self._db.lock:
            if not rel:
                rows = self._db.connection.execute(
                    f"SELECT key, reason FROM remote_deletes WHERE {_WAITED_DELETES}"
                ).fetchall()
            else:
                low, high = f"{rel}/", f"{rel}0"  # '0' sorts right after '/'
                rows = self._db.connection.execute(
                    f"SELECT key, reason FROM remote_deletes WHERE (key=? OR (key >= ? AND key < ?) "
                    f"OR (reason='moved' AND (version=? OR (version >= ? AND version < ?)))) AND {_WAITED_DELETES}",
                    (rel, low, high, rel, low, high),
                ).fetchall()
            # The intent of a failed attempt of a file still at that path: its next upload there
            # replaces whatever the attempt left, and the wait waits for that file anyway.
            return {str(key) for key, reason in rows if reason != "upload" or self._file_at_locked(str(key)) is None}

    def removals_after(self, request_id: int) -> list[tuple[int, str]]:
        """``(id, key)`` of the removals queued after request ``request_id``, oldest first: the
        mover reads each once (a full queue is read once per run, not once per pass)."""
        rows = self._db.query(
            f"SELECT id, key FROM remote_deletes WHERE id > ? AND {_REMOVALS} ORDER BY id", (request_id,)
        )
        return [(int(i), str(k)) for i, k in rows]

    def still_queued(self, request_ids: Iterable[int]) -> set[int]:
        """Which of ``request_ids`` are still in the delete queue."""
        ids = list(request_ids)
        found: set[int] = set()
        for start in range(0, len(ids), 500):  # under SQLite's limit of bound parameters
            batch = ids[start : start + 500]
            rows = self._db.query(f"SELECT id FROM remote_deletes WHERE id IN ({', '.join('?' * len(batch))})", batch)
            found.update(int(row[0]) for row in rows)
        return found

    def dirs_holding(self, dir_keys: Iterable[str], wanted: Callable[[str], bool]) -> set[str]:
        """Of the directories ``dir_keys`` ("" = the root), those holding a file whose name
        ``wanted`` accepts and whose object is on the remote (it has a remote key)."""
        found: set[str] = set()
        with self._db.lock:
            db = self._db.connection
            for dir_key in set(dir_keys):
                ino = self._dir_at_locked(dir_key)
                if ino is None:
                    continue
                names = db.execute(
                    "SELECT name FROM inodes WHERE parent=? AND parent!=0 AND kind='file' AND remote_key IS NOT NULL",
                    (ino,),
                )
                if any(wanted(os.fsdecode(bytes(name))) for (name,) in names):
                    found.add(dir_key)
        return found

    def pointers_being_replaced(self, names: Iterable[str]) -> dict[str, str]:
        """``{dir: pointer key}`` for each file named one of ``names`` (``latest``, Megatron's
        tracker) closed here and not drained yet: the remote's object at that name, if any, is an
        older version (rewritten in place, or replaced by a rename: the old object stays until
        the new one lands) and names an older step.  (Not one open for writing: a writer that
        keeps it open would hold every delete below it for as long.)"""
        wanted = [os.fsencode(name) for name in names]
        if not wanted:
            return {}
        marks, queued = state_marks(QUEUED)
        with self._db.lock:
            rows = self._db.connection.execute(
                f"SELECT ino FROM inodes WHERE kind='file' AND parent!=0 "
                f"AND name IN ({', '.join('?' * len(wanted))}) AND state IN ({marks})",
                (*wanted, *queued),
            ).fetchall()
            paths = [self._db.path_locked(int(ino)) for (ino,) in rows]
        return {path.rpartition("/")[0]: path for path in paths if path is not None}

    def to_be_overwritten(self, keys: Iterable[str]) -> set[str]:
        """Of ``keys``, those at whose path a file closed here waits to drain, or failed to, or
        is durable under another key (its object is to be moved there): its own object goes
        there, so the old one's delete waits (an atomic replace of ``latest`` by rename left the
        remote with no ``latest`` until the new one drained; with a ``latest.tmp`` drained before
        the rename, or a new ``latest`` given up by ``abandon``, it still did).  A version that
        never drains leaves the old object, as a rewrite in place does."""
        marks, waiting = state_marks(QUEUED | {FAILED})
        done_marks, done = state_marks(DONE)
        found: set[str] = set()
        with self._db.lock:
            for key in set(keys):
                dir_key, _, name = key.rpartition("/")
                parent = self._dir_at_locked(dir_key)
                if (
                    parent is not None
                    and self._db.connection.execute(
                        f"SELECT 1 FROM inodes WHERE parent=? AND name=? AND kind='file' AND (state IN ({marks}) "
                        f"OR (state IN ({done_marks}) AND remote_key IS NOT NULL AND remote_key!=?))",
                        (parent, os.fsencode(name), *waiting, *done, key),
                    ).fetchone()
                ):
                    found.add(key)
        return found

    def _dir_at_locked(self, dir_key: str) -> int | None:
        """The directory at ``dir_key`` ("" = the root), if there is one."""
        ino = ROOT_INO
        for part in filter(None, dir_key.split("/")):
            row = self._db.connection.execute(
                "SELECT ino FROM inodes WHERE parent=? AND name=? AND parent!=0 AND kind='dir'",
                (ino, os.fsencode(part)),
            ).fetchone()
            if row is None:
                return None
            ino = int(row[0])
        return ino

    def _file_at_locked(self, key: str) -> int | None:
        """The file linked at path ``key``, if there is one."""
        dir_key, _, name = key.rpartition("/")
        parent = self._dir_at_locked(dir_key)
        if parent is None:
            return None
        row = self._db.connection.execute(
            "SELECT ino FROM inodes WHERE parent=? AND name=? AND kind='file'", (parent, os.fsencode(name))
        ).fetchone()
        return None if row is None else int(row[0])

    def removals_queued(self) -> int:
        """Queued deletes of removed, replaced or moved files' objects; not the intents of
        uploads and moves in flight (``upload``, ``move``: their own crash cleanup)."""
        rows = self._db.query(f"SELECT count(*) FROM remote_deletes WHERE {_REMOVALS}")
        return int(rows[0][0])

    def drop_delete(self, request_id: int) -> None:
        self._db.execute("DELETE FROM remote_deletes WHERE id=?", (request_id,))

    def drop_deletes(self, request_ids: Iterable[int]) -> None:
        """Forget these delete requests (their keys are live files' again), in one transaction."""
        with self._db.transaction() as db:
            for request_id in request_ids:
                db.execute("DELETE FROM remote_deletes WHERE id=?", (request_id,))

    # -- objects that must follow a rename ------------------------------------------------------

    def _seeds_locked(self, roots: Iterable[int] | None) -> list[tuple[int, str]]:
        """``(ino, path)`` to walk from: ``roots`` (None: the root's children)."""
        if roots is None:
            return self._db.top_level_locked()
        return [(ino, path) for ino in set(roots) if ino != ROOT_INO and (path := self._db.path_locked(ino))]

    def relocation_candidates(self, roots: Iterable[int] | None = None) -> list[tuple[int, str, str]]:
        """``(ino, path, remote_key)`` of durable files whose object is not at their path.

        ``roots``: only files at or below these inodes (the subtrees a rename
        touched), instead of walking the whole namespace.
        """
        found: list[tuple[int, str, str]] = []
        marks, movable = state_marks(DONE)
        with self._db.lock:
            for ino, path in self._seeds_locked(roots):
                rows = self._db.connection.execute(
                    f"""{_PATHS_BELOW}
                       SELECT i.ino, paths.path, i.remote_key FROM inodes i JOIN paths USING (ino)
                       WHERE i.kind='file' AND i.remote_key IS NOT NULL AND i.remote_key != paths.path
                           AND i.state IN ({marks})""",
                    (ino, path, *movable),
                ).fetchall()
                found.extend((int(i), str(p), str(k)) for i, p, k in rows)
        return found

    def relocation_target(self, ino: int) -> tuple[str, str] | None:
        """``(path, remote_key)`` if ``ino`` is durable and its object still has to move."""
        marks, movable = state_marks(DONE)
        with self._db.lock:
            row = self._db.connection.execute(
                f"SELECT remote_key FROM inodes WHERE ino=? AND parent!=0 AND kind='file' AND state IN ({marks})",
                (ino, *movable),
            ).fetchone()
            path = self._db.path_locked(ino)
        if row is None or row[0] is None or path is None or row[0] == path:
            return None
        return path, str(row[0])

    def relocation(self, ino: int) -> tuple[str, str, int | None] | None:
        """``(path, remote_key, holder)`` if ``ino``'s object still has to move to its path;
        ``holder``: the inode that holds the path's key meanwhile (the move must wait), or None."""
        target = self.relocation_target(ino)
        if target is None:
            return None
        path, old_key = target
        return path, old_key, self.holder(path, other_than=ino)

    def rename_cycle(self, blocked: dict[int, int]) -> int | None:
        """A file in a cycle of moves (a→b while b→a), if any: it is parked to break the cycle.

        ``blocked``: file -> the inode that holds the key it must move to.  Follows
        "waits for the holder of its target" from each blocked file; a cycle also
        closes through a staged file whose upload waits for the key this file still holds.
        """
        for start in blocked:
            chain, ino = [start], blocked[start]
            while ino in blocked and ino not in chain:
                chain.append(ino)
                ino = blocked[ino]
            if ino in chain:
                return ino
            with self._db.lock:
                target = self._db.path_locked(ino)
            held = {self.relocation_target(member) for member in chain}
            if target is not None and any(t is not None and t[1] == target for t in held):
                return next(m for m in chain if (t := self.relocation_target(m)) and t[1] == target)
        return None

    def intend_move(self, new_key: str) -> int:
        """Before a copy to ``new_key``: its intent, a queued delete of ``new_key`` that
        ``finish_relocation`` drops.  A crash after the copy and before that record leaves a
        copy nobody owns (the file may even be renamed back meanwhile); the delete pass then
        removes it, or spares it if a live file owns the key by then.  No delete pass runs
        during the copy (both run on the mover's main loop, one after the other)."""
        with self._db.transaction() as db:
            intent = db.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'move')", (new_key,)).lastrowid
            return int(intent or 0)

    def finish_relocation(self, ino: int, old_key: str, new_key: str, intent: int) -> bool:
        """After copying ``old_key`` to ``new_key``: the file owns ``new_key``; the old object goes.

        If the file was unlinked (or its object changed) during the copy, the copy
        at ``new_key`` is nobody's: its delete is queued instead (the delete pass
        spares it if a live file owns that key by then).  The copy's ``intent`` goes.
        """
        with self._db.transaction() as db:
            db.execute("DELETE FROM remote_deletes WHERE id=?", (intent,))
            moved = db.execute(
                "UPDATE inodes SET remote_key=?, error=NULL WHERE ino=? AND remote_key=? AND parent!=0",
                (new_key, ino, old_key),
            ).rowcount
            gone = old_key if moved else new_key
            # ``version``: where the object moved to (``deletes_queued_under``).
            db.execute(
                "INSERT INTO remote_deletes (key, reason, version) VALUES (?, 'moved', ?)",
                (gone, new_key if moved else None),
            )
            if moved:
                db.execute(*event_op(ino, "moved", f"{old_key} -> {new_key}"))
            return bool(moved)

    def restage_durable(self, ino: int, remote_key: str) -> bool:
        """A durable local file whose object cannot be moved uploads again to its path."""
        return bool(
            self._db.execute(
                "UPDATE inodes SET state=?, attempts=0 WHERE ino=? AND state=? AND remote_key=? AND parent!=0",
                (STAGED, ino, DURABLE, remote_key),
            )
        )

    # -- keys given up by files renamed while not durable -------------------------------------

    def stale_keys(self, roots: Iterable[int] | None = None) -> list[tuple[int, str]]:
        """``(ino, remote_key)`` of files (at or below ``roots``; None: all) that were renamed
        while not durable (staged again, incomplete, failed): their object is an older
        version at a name that no longer exists here, and nothing will move it."""
        found: list[tuple[int, str]] = []
        marks, restaged = state_marks(RESTAGED)
        with self._db.lock:
            for root, path in self._seeds_locked(roots):
                rows = self._db.connection.execute(
                    f"""{_PATHS_BELOW}
                       SELECT i.ino, i.remote_key FROM inodes i JOIN paths USING (ino)
                       WHERE i.kind='file' AND i.remote_key IS NOT NULL AND i.remote_key != paths.path
                           AND i.state IN ({marks})""",
                    (root, path, *restaged),
                ).fetchall()
                found.extend((int(i), str(k)) for i, k in rows)
        return found

    def drop_stale(self, ino: int, key: str) -> bool:
        """The file no longer owns ``key`` (see :meth:`stale_keys`); its object is queued for deletion.
        Its next upload goes to its path."""
        marks, restaged = state_marks(RESTAGED)
        with self._db.transaction() as db:
            dropped = db.execute(
                f"UPDATE inodes SET remote_key=NULL WHERE ino=? AND remote_key=? AND parent!=0 AND state IN ({marks})",
                (ino, key, *restaged),
            ).rowcount
            if dropped:
                db.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'stale')", (key,))
                db.execute(*event_op(ino, "stale_key", key))
            return bool(dropped)

    def drop_stale_keys(self, roots: Iterable[int] | None, in_flight: frozenset[int]) -> list[tuple[int, str]]:
        """:meth:`drop_stale` for every stale key at or below ``roots`` of a file not ``in_flight``
        (an upload in flight decides its key itself); returns ``(ino, key)`` of those dropped."""
        return [(ino, key) for ino, key in self.stale_keys(roots) if ino not in in_flight and self.drop_stale(ino, key)]

"""The journal: every state change of the namespace and of each file, in SQLite (WAL).

The journal is the contract between the FUSE front and the mover.  The front
records creates, closes, renames and unlinks; the mover records digests,
uploads and evictions.  After a crash, the namespace and the drain queue are
rebuilt from here alone.

Durability: WAL mode with ``synchronous=NORMAL`` survives a crash of the daemon
(the WAL is written before a commit returns); ``sync()`` additionally fsyncs the
WAL for fsync(2) callers who want power-loss safety on a persistent tier.

Concurrency: one :class:`Journal` object per connection.  The front owns one
(used from a single committer thread at a time), the mover owns another; SQLite
serializes the writers (``busy_timeout``), and mover updates are conditional on
the generation they were computed for, so a racing close always wins.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError

#: 2: inodes.upload_key, the uploads table, indexes on remote_key/upload_key and remote_deletes(key).
#: 3: inodes.link_of (hard links: one row per extra name; an older burstfs would take them for files).
SCHEMA_VERSION = 3
ROOT_INO = 1


class FileState(enum.StrEnum):
    """The ``state`` column, in the order a checkpoint file normally walks through the states.

    A ``str`` enum: the stored values stay the plain strings, rows compare equal
    to them, and members go into SQL parameters as they are.
    """

    WRITING = "writing"  # open and changed since its last journaled close
    STAGED = "staged"  # closed and journaled; waiting to drain
    DRAINING = "draining"  # an upload of this generation is in flight
    DURABLE = "durable"  # the remote holds this generation; a local copy exists
    EVICTED = "evicted"  # durable, local copy dropped to make room
    REMOTE = "remote"  # known only from a remote listing (another node wrote it)
    FAILED = "failed"  # the drain hit a permanent error; data stays staged
    INCOMPLETE = "incomplete"  # open for writing when the daemon died, or lost a write: not drained
    META = "meta"  # directories and symlinks: nothing to drain


WRITING = FileState.WRITING
STAGED = FileState.STAGED
DRAINING = FileState.DRAINING
DURABLE = FileState.DURABLE
EVICTED = FileState.EVICTED
REMOTE = FileState.REMOTE
FAILED = FileState.FAILED
INCOMPLETE = FileState.INCOMPLETE
META = FileState.META

# The named sets of file states; every module asks these, none spells its own.
#: Every state a file (not a directory or symlink) can be in, in display order.
FILE_STATES: tuple[FileState, ...] = tuple(s for s in FileState if s is not META)
#: The remote holds the file's object: nothing left to wait for (and the object follows a
#: rename: a listed file renamed here moves too, else its key would stay held and block a
#: new file at the old name for good).
DONE = frozenset({DURABLE, EVICTED, REMOTE})
#: Not (yet) on the remote: holds back a commit marker closed after it, and is what
#: ``burstfs-admin wait`` waits for (an incomplete file never becomes durable on its own).
NOT_YET_DURABLE = frozenset(FILE_STATES) - DONE
#: Will not drain without someone acting (``burstfs-admin retry``, rewriting the file).
BROKEN = frozenset({FAILED, INCOMPLETE})
#: Not yet durable and staying in the cache for a later drain (what unmount reports and
#: ``unmount --wait`` waits for): NOT_YET_DURABLE less ``incomplete``, which never drains.
UNDRAINED = NOT_YET_DURABLE - {INCOMPLETE}
#: Closed and journaled but not yet durable: status's "undrained" (a file being written is not counted).
CLOSED_UNDRAINED = UNDRAINED - {WRITING}
#: Waiting to drain or draining: the drain queue.
QUEUED = frozenset({STAGED, DRAINING})
#: No complete local copy: reads fetch from the remote.
NOT_LOCAL = frozenset({EVICTED, REMOTE})


def _marks(states: Iterable[FileState]) -> tuple[str, tuple[FileState, ...]]:
    """``"?, ?, ..."`` and the parameters for ``state IN (...)`` over ``states``."""
    ordered = tuple(sorted(states))
    return ", ".join("?" * len(ordered)), ordered


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS inodes (
    ino INTEGER PRIMARY KEY,
    parent INTEGER NOT NULL,          -- 0 once unlinked (kept only while open)
    name BLOB NOT NULL,
    kind TEXT NOT NULL,               -- file | dir | symlink
    mode INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    size INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    target BLOB,                      -- symlink target
    state TEXT NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,   -- bumped by every journaled close of a changed file
    close_seq INTEGER NOT NULL DEFAULT 0,    -- global order of closes: oldest drains first
    digest TEXT,                      -- xxh3-128 of `generation` (NULL until hashed)
    chunk_size INTEGER,
    chunks TEXT,                      -- JSON list of per-chunk xxh3-64 digests
    remote_key TEXT,                  -- key of the object the remote holds for this file
    durable_generation INTEGER,       -- generation the remote holds
    error TEXT,                       -- last drain error (state failed) or note
    attempts INTEGER NOT NULL DEFAULT 0,
    updated REAL NOT NULL DEFAULT 0,
    local_bytes INTEGER NOT NULL DEFAULT 0   -- bytes present on the local tier
);
CREATE UNIQUE INDEX IF NOT EXISTS inodes_by_name ON inodes(parent, name) WHERE parent != 0;
CREATE INDEX IF NOT EXISTS inodes_by_state ON inodes(state, close_seq);
CREATE TABLE IF NOT EXISTS xattrs (
    ino INTEGER NOT NULL, name BLOB NOT NULL, value BLOB NOT NULL, PRIMARY KEY (ino, name)
);
CREATE TABLE IF NOT EXISTS remote_deletes (    -- objects to remove (unlinked or replaced files)
    id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL, reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS uploads (           -- multipart uploads this cache started, not yet finished
    upload_id TEXT PRIMARY KEY, key TEXT NOT NULL, started REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    ino INTEGER,
    event TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
"""

# Added after version 1 (ALTER TABLE at open: existing journals keep working).
_ADDED_COLUMNS = (
    # The key an upload of this file is writing to (set while `draining`): no other
    # inode may upload to, relocate onto or delete that key meanwhile.
    ("inodes", "upload_key", "TEXT"),
    # Hard links: a row per extra name of a file, with its own drain state and key;
    # ``link_of`` is the inode (row) that holds the file's attributes and its data file.
    ("inodes", "link_of", "INTEGER"),
)
_INDEXES = """
CREATE INDEX IF NOT EXISTS inodes_by_remote_key ON inodes(remote_key) WHERE remote_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS inodes_by_upload_key ON inodes(upload_key) WHERE upload_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS remote_deletes_by_key ON remote_deletes(key);
CREATE INDEX IF NOT EXISTS inodes_by_link ON inodes(link_of) WHERE link_of IS NOT NULL;
"""

INODE_COLUMNS = (
    "ino",
    "parent",
    "name",
    "kind",
    "mode",
    "uid",
    "gid",
    "size",
    "atime_ns",
    "mtime_ns",
    "ctime_ns",
    "target",
    "state",
    "generation",
    "close_seq",
    "digest",
    "chunk_size",
    "chunks",
    "remote_key",
    "durable_generation",
    "error",
    "attempts",
    "updated",
    "local_bytes",
    "link_of",
)


@dataclasses.dataclass(kw_only=True)
class InodeRow:
    """One row of the ``inodes`` table, as stored (built by keyword only: 25 fields)."""

    ino: int
    parent: int
    name: bytes
    kind: str
    mode: int
    uid: int
    gid: int
    size: int = 0
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes | None = None
    state: FileState
    generation: int = 0
    close_seq: int = 0
    digest: str | None = None
    chunk_size: int | None = None
    chunks: str | None = None
    remote_key: str | None = None
    durable_generation: int | None = None
    error: str | None = None
    attempts: int = 0
    updated: float = 0.0
    local_bytes: int = 0
    link_of: int | None = None  # an extra name (hard link) of this inode: its data file and attributes

    @property
    def data_ino(self) -> int:
        """The inode whose data file holds this row's bytes (``data/<ino>``)."""
        return self.link_of if self.link_of is not None else self.ino

    def chunk_digests(self) -> tuple[str, ...]:
        return tuple(json.loads(self.chunks)) if self.chunks else ()


Op = tuple[str, Sequence[Any]]


def _row(values: Sequence[Any]) -> InodeRow:
    fields = dict(zip(INODE_COLUMNS, values, strict=True))
    fields["state"] = FileState(fields["state"])
    return InodeRow(**fields)


class Journal:
    """A connection to the journal database in ``cache_dir``."""

    def __init__(self, cache_dir: Path, *, readonly: bool = False) -> None:
        self.path = Path(cache_dir) / "journal.db"
        if readonly:
            uri = f"file:{self.path}?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        else:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=30000")
        self._lock = threading.Lock()
        if not readonly:
            self._migrate()

    def _migrate(self) -> None:
        """Create or upgrade the schema; refuse a journal written by a newer burstfs."""
        with self._lock:
            self._db.executescript(_SCHEMA)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
                found = int(row[0]) if row else SCHEMA_VERSION
                if found > SCHEMA_VERSION:
                    raise ConfigError(
                        f"{self.path} has journal schema {found}; this burstfs reads up to {SCHEMA_VERSION}"
                    )
                for table, column, decl in _ADDED_COLUMNS:
                    present = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
                    if column not in present:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
                for statement in filter(None, (s.strip() for s in _INDEXES.split(";"))):
                    self._db.execute(statement)
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- generic access -------------------------------------------------------------

    def apply(self, ops: Iterable[Op]) -> None:
        """Run ``ops`` in one transaction (the group commit)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in ops:
                    self._db.execute(sql, params)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement in its own transaction; returns the number of rows changed."""
        with self._lock:
            return self._db.execute(sql, params).rowcount

    def insert(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One INSERT in its own transaction; returns the new row's id."""
        with self._lock:
            cursor = self._db.execute(sql, params)
            return int(cursor.lastrowid or 0)

    def sync(self) -> None:
        """fsync the WAL so that committed records survive a power loss too."""
        wal = Path(f"{self.path}-wal")
        if wal.exists():
            fd = os.open(wal, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- meta ---------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        rows = self.query("SELECT value FROM meta WHERE key=?", (key,))
        return rows[0][0] if rows else None

    def set_meta(self, key: str, value: str) -> None:
        self.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def meta_items(self, prefix: str) -> list[tuple[str, str]]:
        """Every ``(key, value)`` of the meta table whose key starts with ``prefix``."""
        rows = self.query(
            "SELECT key, value FROM meta WHERE key >= ? AND key < ? ORDER BY key", (prefix, prefix + "\U0010ffff")
        )
        return [(str(k), str(v)) for k, v in rows]

    # -- inodes -------------------------------------------------------------------

    def inodes(self, where: str = "", params: Sequence[Any] = ()) -> list[InodeRow]:
        sql = f"SELECT {', '.join(INODE_COLUMNS)} FROM inodes {where}"
        return [_row(values) for values in self.query(sql, params)]

    def inode(self, ino: int) -> InodeRow | None:
        rows = self.inodes("WHERE ino=?", (ino,))
        return rows[0] if rows else None

    def xattrs(self) -> Iterator[tuple[int, bytes, bytes]]:
        yield from self.query("SELECT ino, name, value FROM xattrs")

    def path_of(self, ino: int) -> str | None:
        """The file's path relative to the mount root, or None if it is unlinked."""
        with self._lock:
            return self._path_locked(ino)

    def max_close_seq(self) -> int:
        return int(self.query("SELECT COALESCE(MAX(close_seq), 0) FROM inodes")[0][0])

    def undrained(self) -> dict[str, tuple[int, int]]:
        """{state: (files, bytes)} of files not yet durable; they stay staged in the cache."""
        return {state: counts for state, counts in self.state_counts().items() if state in UNDRAINED}

    def state_counts(self) -> dict[FileState, tuple[int, int]]:
        """{state: (files, bytes)} of the linked files, for the states that have any."""
        rows = self.query(
            "SELECT state, COUNT(*), COALESCE(SUM(size), 0) FROM inodes WHERE kind='file' AND parent!=0 GROUP BY state"
        )
        return {FileState(state): (int(files), int(nbytes)) for state, files, nbytes in rows}

    def log_event(self, ino: int | None, event: str, detail: str = "") -> Op:
        return event_op(ino, event, detail)

    def events(self, since: float = 0.0, limit: int = 1000) -> list[tuple[float, int | None, str, str]]:
        return self.query(
            "SELECT time, ino, event, detail FROM events WHERE time >= ? ORDER BY seq DESC LIMIT ?",
            (since, limit),
        )[::-1]

    # -- status queries (a live daemon and a stopped mount's read-only journal alike) ----

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

    def last_closed_at(self, ino: int) -> float | None:
        """Time of the newest ``closed`` event of ``ino``, scanning back from the end of the log."""
        rows = self.query("SELECT time FROM events WHERE ino=? AND event='closed' ORDER BY seq DESC LIMIT 1", (ino,))
        return float(rows[0][0]) if rows else None

    def local_bytes_by_file(self) -> list[tuple[int, int]]:
        """``(ino, local_bytes)`` of the linked files with bytes on the local tier."""
        rows = self.query("SELECT ino, local_bytes FROM inodes WHERE kind='file' AND parent!=0 AND local_bytes>0")
        return [(int(ino), int(local)) for ino, local in rows]

    def oldest_closed_undrained(self) -> tuple[int, float] | None:
        """``(ino, updated)`` of the file first in close order among CLOSED_UNDRAINED, or None."""
        marks, states = _marks(CLOSED_UNDRAINED)
        rows = self.query(
            f"SELECT ino, updated FROM inodes WHERE kind='file' AND parent!=0 AND state IN ({marks}) "
            "ORDER BY close_seq LIMIT 1",
            states,
        )
        return (int(rows[0][0]), float(rows[0][1])) if rows else None

    # -- the drain queue ---------------------------------------------------------------

    def has_drain_work(self) -> bool:
        """True while a file is QUEUED or a remote delete is pending."""
        marks, states = _marks(QUEUED)
        rows = self.query(f"SELECT COUNT(*) FROM inodes WHERE kind='file' AND parent!=0 AND state IN ({marks})", states)
        return bool(rows[0][0]) or bool(self.query("SELECT 1 FROM remote_deletes LIMIT 1"))

    def eligible(
        self,
        slots: int,
        limit: int,
        *,
        closed_before: float,
        is_marker: Callable[[InodeRow], bool],
        skip: Callable[[InodeRow], bool] = lambda row: False,
    ) -> list[InodeRow]:
        """Up to ``slots`` staged files to drain next, in close order (invariant 5).

        Reads the first ``limit`` staged files last changed at or before
        ``closed_before``; passes over those ``skip`` names (in flight, backing
        off) and the commit markers (``is_marker``) that ``blocks_marker`` holds back.
        """
        chosen: list[InodeRow] = []
        for row in self.inodes(
            "WHERE state=? AND kind='file' AND parent!=0 AND updated <= ? ORDER BY close_seq LIMIT ?",
            (STAGED, closed_before, limit),
        ):
            if skip(row):
                continue
            if is_marker(row) and self.blocks_marker(row):
                continue
            chosen.append(row)
            if len(chosen) >= slots:
                break
        return chosen

    def blocks_marker(self, marker: InodeRow) -> bool:
        """True while a file under the marker's directory closed before it is NOT_YET_DURABLE."""
        marks, states = _marks(NOT_YET_DURABLE)
        rows = self.query(
            f"""WITH RECURSIVE sub(ino) AS (
                   SELECT ino FROM inodes WHERE parent=? AND ino!=?
                   UNION SELECT i.ino FROM inodes i JOIN sub ON i.parent=sub.ino)
               SELECT COUNT(*) FROM inodes WHERE ino IN sub AND ino!=? AND kind='file'
                   AND state IN ({marks}) AND close_seq > 0 AND close_seq < ?""",
            (marker.parent, ROOT_INO, marker.ino, *states, marker.close_seq),
        )
        return bool(rows[0][0])

    def retry_failed(self) -> int:
        """Every failed file staged again with a fresh retry budget; returns how many."""
        return self.execute("UPDATE inodes SET state=?, attempts=0, error=NULL WHERE state=?", (STAGED, FAILED))

    def attempts(self, ino: int) -> int:
        """Failed upload attempts of ``ino`` so far (0 if it is gone)."""
        rows = self.query("SELECT attempts FROM inodes WHERE ino=?", (ino,))
        return int(rows[0][0]) if rows else 0

    def record_digests(self, ino: int, generation: int, digest: str, chunks: Sequence[str], chunk_size: int) -> None:
        """Digests the drain took of ``generation`` (for verify and the xattr); a newer close keeps its own.
        The same bytes under every name of the file: its other names' rows get them too."""
        self.execute(
            "UPDATE inodes SET digest=?, chunks=?, chunk_size=? WHERE generation=? AND (ino=? OR link_of=? "
            "OR ino=(SELECT link_of FROM inodes WHERE ino=?) OR link_of=(SELECT link_of FROM inodes WHERE ino=?))",
            (digest, json.dumps(list(chunks)), chunk_size, generation, ino, ino, ino, ino),
        )

    def prune_events(self, keep: int) -> None:
        """Drop all but the newest ``keep`` events."""
        self.execute("DELETE FROM events WHERE seq <= (SELECT MAX(seq) FROM events) - ?", (keep,))

    # -- the local tier ----------------------------------------------------------------

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
        with self._transaction() as db:
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
        """A NOT_LOCAL file fetched whole: ``durable`` and local (with the manifest's digests, if any)."""
        fields: dict[str, object] = {"state": DURABLE, "updated": time.time()}
        if digest is not None:
            fields.update(digest=digest, chunk_size=chunk_size, chunks=json.dumps(list(chunks or ())))
        assignments = ", ".join(f"{name}=?" for name in fields)
        marks, states = _marks(NOT_LOCAL)
        # Every name of the file (hard links) holds the same bytes; the inode's own row counts them.
        self.execute(
            f"UPDATE inodes SET {assignments}, local_bytes=CASE WHEN ino=? THEN ? ELSE 0 END, "
            f"durable_generation=generation WHERE (ino=? OR link_of=?) AND state IN ({marks})",
            (*fields.values(), ino, size, ino, ino, *states),
        )

    def fetch_row(self, ino: int) -> InodeRow | None:
        """The row a fetch of ``ino`` reads: its own, with the key of a name that holds its
        bytes when its own name is gone (a hard link outlived it; every name holds the same bytes)."""
        row = self.inode(ino)
        if row is None or row.remote_key:
            return row
        marks, states = _marks(DONE)
        keys = self.query(
            f"SELECT remote_key FROM inodes WHERE link_of=? AND parent!=0 AND remote_key IS NOT NULL "
            f"AND state IN ({marks}) AND durable_generation=generation LIMIT 1",
            (ino, *states),
        )
        if keys:
            row.remote_key = str(keys[0][0])
        return row

    def state_row(self, ino: int) -> InodeRow | None:
        """The row whose drain state stands for the file (``user.burstfs.*``): its own, or,
        with hard links, that of the name least far along (the file is durable once every name is)."""
        names = self.names_of(ino)
        behind = [row for row in names if row.state not in DONE]
        return behind[0] if behind else names[0] if names else self.inode(ino)

    def names_of(self, ino: int) -> list[InodeRow]:
        """The rows of every name ``ino`` has: its own (if still linked) and its hard links'."""
        return self.inodes("WHERE (ino=? OR link_of=?) AND parent!=0 ORDER BY ino", (ino, ino))

    # -- restore listings --------------------------------------------------------------

    def keys_owned_under(self, dir_key: str) -> set[str]:
        """Keys below ``dir_key`` ("" = everywhere) this node owns (some inode's ``remote_key``)
        or is deleting: a listing must not resurrect them.  A key range, so the
        ``remote_key`` and ``remote_deletes(key)`` indexes serve it."""
        if not dir_key:
            rows = self.query(
                "SELECT remote_key FROM inodes WHERE remote_key IS NOT NULL UNION SELECT key FROM remote_deletes"
            )
        else:
            low, high = f"{dir_key}/", f"{dir_key}0"  # '0' sorts right after '/'
            rows = self.query(
                "SELECT remote_key FROM inodes WHERE remote_key >= ? AND remote_key < ? "
                "UNION SELECT key FROM remote_deletes WHERE key >= ? AND key < ?",
                (low, high, low, high),
            )
        return {str(row[0]) for row in rows}

    # -- the mover's ownership protocol ------------------------------------------------
    #
    # A key belongs to at most one inode: the live inode whose ``remote_key`` it is,
    # or the inode whose upload is writing to it (``upload_key``).  No upload,
    # relocation or delete touches a key another inode holds.  Each method below
    # is one transaction, so a racing close, rename or unlink is seen whole.

    def _path_locked(self, ino: int) -> str | None:
        parts: list[str] = []
        while ino != ROOT_INO:
            row = self._db.execute("SELECT parent, name FROM inodes WHERE ino=?", (ino,)).fetchone()
            if row is None or row[0] == 0:
                return None
            parts.append(os.fsdecode(row[1]))
            ino = row[0]
        return "/".join(reversed(parts))

    def _holder_locked(self, key: str, other_than: int) -> int | None:
        row = self._db.execute(
            "SELECT ino FROM inodes WHERE remote_key=? AND parent!=0 AND ino!=? "
            "UNION ALL SELECT ino FROM inodes WHERE upload_key=? AND ino!=? LIMIT 1",
            (key, other_than, key, other_than),
        ).fetchone()
        return int(row[0]) if row else None

    def key_holder(self, key: str, other_than: int = 0) -> int | None:
        """The inode (not ``other_than``) that owns ``key`` (live ``remote_key``) or is uploading to it."""
        with self._lock:
            return self._holder_locked(key, other_than)

    def _transaction(self) -> Any:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) under the connection lock."""
        journal = self

        class _Tx:
            def __enter__(self) -> sqlite3.Connection:
                journal._lock.acquire()
                try:
                    journal._db.execute("BEGIN IMMEDIATE")
                except BaseException:
                    journal._lock.release()
                    raise
                return journal._db

            def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
                try:
                    journal._db.execute("ROLLBACK" if exc_type is not None else "COMMIT")
                finally:
                    journal._lock.release()

        return _Tx()

    def claim_for_drain(self, ino: int, generation: int) -> tuple[str, int] | int | None:
        """Mark ``generation`` of ``ino`` draining to its current path and record the intent.

        Returns ``(key, intent_id)``; an ``int``, the inode that holds the key (the
        upload must wait); or None if the file changed, went away or is not staged.
        The intent row makes the delete pass remove the object if the upload is
        cut short (crash) or the file is unlinked before the upload is recorded.
        """
        with self._transaction() as db:
            key = self._path_locked(ino)
            if key is None:
                return None
            holder = self._holder_locked(key, ino)
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

    def finish_upload(self, ino: int, generation: int, key: str, intent: int, detail: str) -> bool:
        """Record ``generation`` of ``ino`` as durable at ``key``; False if it changed or was unlinked.

        Recorded: the file's previous object (another key) is queued for deletion
        and the intent row dropped.  Changed meanwhile but still linked: the file
        keeps ``key`` as its object until its next generation replaces it.
        Unlinked (or gone): nothing marks the key owned, so the intent row stays
        and the delete pass removes the object.
        """
        with self._transaction() as db:
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

    def requeue(self, ino: int, generation: int, error: str | None, attempts: int) -> None:
        """Back to ``staged`` (if still this draining generation); the upload no longer holds its key."""
        with self._transaction() as db:
            db.execute(
                "UPDATE inodes SET state=?, attempts=?, error=? WHERE ino=? AND generation=? AND state=?",
                (STAGED, attempts, error, ino, generation, DRAINING),
            )
            db.execute("UPDATE inodes SET upload_key=NULL WHERE ino=?", (ino,))

    def fail(self, ino: int, generation: int, error: str) -> bool:
        """Mark this draining generation ``failed`` with ``error``; False if the file changed meanwhile."""
        with self._transaction() as db:
            failed = db.execute(
                "UPDATE inodes SET state=?, error=? WHERE ino=? AND generation=? AND state=?",
                (FAILED, error, ino, generation, DRAINING),
            ).rowcount
            db.execute("UPDATE inodes SET upload_key=NULL WHERE ino=?", (ino,))
            if failed:
                db.execute(*event_op(ino, "failed", error))
            return bool(failed)

    def recover_drains(self) -> int:
        """After a restart nothing is in flight: draining files are staged again."""
        with self._transaction() as db:
            db.execute("UPDATE inodes SET upload_key=NULL WHERE upload_key IS NOT NULL")
            return int(db.execute("UPDATE inodes SET state=? WHERE state=?", (STAGED, DRAINING)).rowcount)

    def superseded(self, ino: int, generation: int) -> bool:
        """True if ``generation`` of ``ino`` is no longer the one to drain: a newer close,
        a writer at work (``writing``), or an unlink."""
        rows = self.query("SELECT generation, parent, state FROM inodes WHERE ino=?", (ino,))
        return not rows or rows[0][0] != generation or rows[0][1] == 0 or rows[0][2] != DRAINING

    def pending_deletes(self, limit: int) -> list[tuple[int, str, str]]:
        """``(id, key, reason)`` of queued remote deletes, oldest first."""
        return [
            (int(i), str(k), str(r))
            for i, k, r in self.query("SELECT id, key, reason FROM remote_deletes ORDER BY id LIMIT ?", (limit,))
        ]

    def drop_delete(self, request_id: int) -> None:
        self.execute("DELETE FROM remote_deletes WHERE id=?", (request_id,))

    def relocation_candidates(self, roots: Iterable[int] | None = None) -> list[tuple[int, str, str]]:
        """``(ino, path, remote_key)`` of durable files whose object is not at their path.

        ``roots``: only files at or below these inodes (the subtrees a rename
        touched), instead of walking the whole namespace.
        """
        with self._lock:
            if roots is None:
                seeds = [
                    (int(ino), os.fsdecode(name))
                    for ino, name in self._db.execute(
                        "SELECT ino, name FROM inodes WHERE parent=? AND ino!=?", (ROOT_INO, ROOT_INO)
                    )
                ]
            else:
                seeds = [(ino, path) for ino in set(roots) if (path := self._path_locked(ino))]
            found: list[tuple[int, str, str]] = []
            marks, movable = _marks(DONE)
            for ino, path in seeds:
                rows = self._db.execute(
                    f"""WITH RECURSIVE paths(ino, path) AS (
                           SELECT ?, ?
                           UNION ALL SELECT i.ino, paths.path || '/' || CAST(i.name AS TEXT)
                           FROM inodes i JOIN paths ON i.parent=paths.ino)
                       SELECT i.ino, paths.path, i.remote_key FROM inodes i JOIN paths USING (ino)
                       WHERE i.kind='file' AND i.remote_key IS NOT NULL AND i.remote_key != paths.path
                           AND i.state IN ({marks})""",
                    (ino, path, *movable),
                ).fetchall()
                found.extend((int(i), str(p), str(k)) for i, p, k in rows)
            return found

    def relocation_target(self, ino: int) -> tuple[str, str] | None:
        """``(path, remote_key)`` if ``ino`` is durable and its object still has to move."""
        with self._lock:
            marks, movable = _marks(DONE)
            row = self._db.execute(
                f"SELECT remote_key FROM inodes WHERE ino=? AND parent!=0 AND kind='file' AND state IN ({marks})",
                (ino, *movable),
            ).fetchone()
            path = self._path_locked(ino)
        if row is None or row[0] is None or path is None or row[0] == path:
            return None
        return path, str(row[0])

    def stale_keys(self, roots: Iterable[int] | None = None) -> list[tuple[int, str]]:
        """``(ino, remote_key)`` of files (at or below ``roots``; None: all) that were renamed
        while not durable (staged again, incomplete, failed): their object is an older
        version at a name that no longer exists here, and nothing will move it."""
        found: list[tuple[int, str]] = []
        with self._lock:
            if roots is None:
                seeds = [
                    (int(ino), os.fsdecode(name))
                    for ino, name in self._db.execute(
                        "SELECT ino, name FROM inodes WHERE parent=? AND ino!=?", (ROOT_INO, ROOT_INO)
                    )
                ]
            else:
                seeds = [(ino, path) for ino in set(roots) if ino != ROOT_INO and (path := self._path_locked(ino))]
            for root, path in seeds:
                rows = self._db.execute(
                    """WITH RECURSIVE paths(ino, path) AS (
                           SELECT ?, ?
                           UNION ALL SELECT i.ino, paths.path || '/' || CAST(i.name AS TEXT)
                           FROM inodes i JOIN paths ON i.parent=paths.ino)
                       SELECT i.ino, i.remote_key FROM inodes i JOIN paths USING (ino)
                       WHERE i.kind='file' AND i.remote_key IS NOT NULL AND i.remote_key != paths.path
                           AND i.state IN (?, ?, ?)""",
                    (root, path, STAGED, INCOMPLETE, FAILED),
                ).fetchall()
                found.extend((int(i), str(k)) for i, k in rows)
        return found

    def drop_stale_key(self, ino: int, key: str) -> bool:
        """The file no longer owns ``key`` (see :meth:`stale_keys`); its object is queued for deletion.
        Its next upload goes to its path."""
        with self._transaction() as db:
            dropped = db.execute(
                "UPDATE inodes SET remote_key=NULL WHERE ino=? AND remote_key=? AND parent!=0 AND state IN (?, ?, ?)",
                (ino, key, STAGED, INCOMPLETE, FAILED),
            ).rowcount
            if dropped:
                db.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'stale')", (key,))
                db.execute(*self.log_event(ino, "stale_key", key))
            return bool(dropped)

    def finish_relocation(self, ino: int, old_key: str, new_key: str) -> bool:
        """After copying ``old_key`` to ``new_key``: the file owns ``new_key``; the old object goes.

        If the file was unlinked (or its object changed) during the copy, the copy
        at ``new_key`` is nobody's: its delete is queued instead (the delete pass
        spares it if a live file owns that key by then).
        """
        with self._transaction() as db:
            moved = db.execute(
                "UPDATE inodes SET remote_key=? WHERE ino=? AND remote_key=? AND parent!=0", (new_key, ino, old_key)
            ).rowcount
            gone = old_key if moved else new_key
            db.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, 'moved')", (gone,))
            if moved:
                db.execute(*event_op(ino, "moved", f"{old_key} -> {new_key}"))
            return bool(moved)

    def set_error(self, ino: int, error: str | None) -> None:
        """A note on a file for status (e.g. why its object could not be moved)."""
        self.execute("UPDATE inodes SET error=? WHERE ino=?", (error, ino))

    def restage_durable(self, ino: int, remote_key: str) -> bool:
        """A durable local file whose object cannot be moved uploads again to its path."""
        return bool(
            self.execute(
                "UPDATE inodes SET state=?, attempts=0 WHERE ino=? AND state=? AND remote_key=? AND parent!=0",
                (STAGED, ino, DURABLE, remote_key),
            )
        )

    def latest_event_seq(self) -> int:
        return int(self.query("SELECT COALESCE(MAX(seq), 0) FROM events")[0][0])

    def renamed_since(self, seq: int) -> tuple[list[int], int]:
        """Inodes renamed after event ``seq``, and the newest event seq seen."""
        latest = self.latest_event_seq()
        rows = self.query("SELECT ino FROM events WHERE seq > ? AND seq <= ? AND event='rename'", (seq, latest))
        return [int(ino) for (ino,) in rows if ino is not None], max(seq, latest)

    # -- multipart uploads this cache started ---------------------------------------------

    def upload_started(self, key: str, upload_id: str) -> None:
        self.execute("INSERT OR REPLACE INTO uploads VALUES (?, ?, ?)", (upload_id, key, time.time()))

    def upload_ended(self, upload_id: str) -> None:
        self.execute("DELETE FROM uploads WHERE upload_id=?", (upload_id,))

    def own_uploads(self) -> list[tuple[str, str]]:
        """``(key, upload_id)`` of multipart uploads this cache started and did not finish."""
        return [(str(k), str(u)) for u, k in self.query("SELECT upload_id, key FROM uploads ORDER BY started")]


def insert_inode_op(row: InodeRow) -> Op:
    values = dataclasses.astuple(row)
    marks = ", ".join("?" * len(values))
    return (f"INSERT OR REPLACE INTO inodes ({', '.join(INODE_COLUMNS)}) VALUES ({marks})", values)


def update_inode_op(ino: int, **fields: Any) -> Op:
    assignments = ", ".join(f"{name}=?" for name in fields)
    return (f"UPDATE inodes SET {assignments} WHERE ino=?", (*fields.values(), ino))


# -- records the front's group committer applies (core.py builds none of its own SQL) ----


def event_op(ino: int | None, event: str, detail: str = "") -> Op:
    return ("INSERT INTO events (time, ino, event, detail) VALUES (?, ?, ?, ?)", (time.time(), ino, event, detail))


def update_file_op(ino: int, **fields: Any) -> Op:
    """``update_inode_op`` for the rows of every name of the file (its hard links too):
    what its bytes are (state, generation, digests) is the same under each name."""
    assignments = ", ".join(f"{name}=?" for name in fields)
    return (f"UPDATE inodes SET {assignments} WHERE ino=? OR link_of=?", (*fields.values(), ino, ino))


def mark_writing_op(ino: int) -> Op:
    """The first change after a close (invariant 2): ``writing`` until the next close, under every name."""
    return update_file_op(ino, state=WRITING, updated=time.time())


def close_ops(
    ino: int,
    *,
    generation: int,
    close_seq: int,
    size: int,
    mtime_ns: int,
    ctime_ns: int,
    digest: str | None,
    chunks: Sequence[str] | None,
    chunk_size: int | None,
    incomplete: str | None,
) -> list[Op]:
    """A changed file closed (invariant 1): a new generation, ``staged`` to drain with its
    digests, or ``incomplete`` (with the reason) when it may lack bytes."""
    state = INCOMPLETE if incomplete else STAGED
    return [
        update_file_op(
            ino,
            state=state,
            generation=generation,
            close_seq=close_seq,
            size=size,
            mtime_ns=mtime_ns,
            ctime_ns=ctime_ns,
            digest=digest,
            chunks=json.dumps(list(chunks)) if chunks is not None else None,
            chunk_size=chunk_size,
            error=incomplete,
            attempts=0,
            updated=time.time(),
        ),
        update_inode_op(ino, local_bytes=size),
        event_op(
            ino,
            "closed" if state == STAGED else "incomplete",
            f"generation={generation} size={size} {incomplete or ''}".rstrip(),
        ),
    ]


def unchanged_close_op(ino: int) -> Op:
    """A file opened for writing and closed unchanged: back to the state it had (``durable``
    if the remote holds its generation, else ``staged``)."""
    return (
        "UPDATE inodes SET state=CASE WHEN durable_generation=generation THEN ? ELSE ? END "
        "WHERE (ino=? OR link_of=?) AND state=?",
        (DURABLE, STAGED, ino, ino, WRITING),
    )


def recovered_incomplete_ops(ino: int, size: int, error: str) -> list[Op]:
    """At start-up: a file the stopped daemon had open for writing is ``incomplete``."""
    return [
        update_file_op(ino, state=INCOMPLETE, size=size, error=error, updated=time.time()),
        update_inode_op(ino, local_bytes=size),
        event_op(ino, "incomplete", "open for writing at crash"),
    ]


def unlink_ops(ino: int, name: bytes, ctime_ns: int) -> list[Op]:
    """``ino`` loses its name; its object (if any) is queued for deletion (invariant 6)."""
    return [
        (
            "INSERT INTO remote_deletes (key, reason) SELECT remote_key, 'unlink' FROM inodes "
            "WHERE ino=? AND remote_key IS NOT NULL",
            (ino,),
        ),
        update_inode_op(ino, parent=0, remote_key=None, ctime_ns=ctime_ns),
        event_op(ino, "unlink", os.fsdecode(name)),
    ]


def link_ops(row: int, ino: int, parent: int, name: bytes, ctime_ns: int) -> list[Op]:
    """``ino`` gets another name (a hard link): row ``row`` in ``parent``, with no object yet.

    The new name drains the file's current generation to its own key (``staged``),
    unless the file is being written or incomplete: then it waits, like the others.
    """
    marks, states = _marks({WRITING, INCOMPLETE, META})
    columns = [
        c
        for c in INODE_COLUMNS
        if c
        not in (
            "ino",
            "parent",
            "name",
            "remote_key",
            "durable_generation",
            "attempts",
            "local_bytes",
            "link_of",
            "state",
            "updated",
        )
    ]
    return [
        (
            f"INSERT INTO inodes (ino, parent, name, state, updated, link_of, {', '.join(columns)}) "
            f"SELECT ?, ?, ?, CASE WHEN state IN ({marks}) THEN state ELSE ? END, ?, ino, {', '.join(columns)} "
            "FROM inodes WHERE ino=?",
            (row, parent, name, *states, STAGED, time.time(), ino),
        ),
        update_inode_op(ino, ctime_ns=ctime_ns),
        event_op(row, "link", f"{os.fsdecode(name)} of inode {ino}"),
    ]


def unlink_name_ops(row: int, name: bytes) -> list[Op]:
    """A hard link's name goes: its row goes, its object (if any) is queued for deletion."""
    return [
        (
            "INSERT INTO remote_deletes (key, reason) SELECT remote_key, 'unlink' FROM inodes "
            "WHERE ino=? AND remote_key IS NOT NULL",
            (row,),
        ),
        ("DELETE FROM inodes WHERE ino=? AND link_of IS NOT NULL", (row,)),
        event_op(row, "unlink", os.fsdecode(name)),
    ]


def forget_listed_ops(ino: int, name: bytes, ctime_ns: int) -> list[Op]:
    """A listed file that vanished from the remote: dropped here, nothing deleted there."""
    return [
        update_inode_op(ino, parent=0, remote_key=None, ctime_ns=ctime_ns),
        event_op(ino, "forgotten", os.fsdecode(name)),
    ]


def drop_unlinked_ops(ino: int) -> list[Op]:
    """An unlinked inode nothing references any more: its row and xattrs go."""
    return [("DELETE FROM inodes WHERE ino=? AND parent=0", (ino,)), ("DELETE FROM xattrs WHERE ino=?", (ino,))]


def set_xattr_op(ino: int, name: bytes, value: bytes) -> Op:
    return ("INSERT OR REPLACE INTO xattrs VALUES (?, ?, ?)", (ino, name, value))


def remove_xattr_op(ino: int, name: bytes) -> Op:
    return ("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name))


def set_meta_op(key: str, value: str) -> Op:
    return ("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

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
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
ROOT_INO = 1

# File states, in the order a checkpoint file normally walks through them.
WRITING = "writing"  # open and changed since its last journaled close
STAGED = "staged"  # closed and journaled; waiting to drain
DRAINING = "draining"  # an upload of this generation is in flight
DURABLE = "durable"  # the remote holds this generation; a local copy exists
EVICTED = "evicted"  # durable, local copy dropped to make room
REMOTE = "remote"  # known only from a remote listing (another node wrote it)
FAILED = "failed"  # the drain hit a permanent error; data stays staged
INCOMPLETE = "incomplete"  # open for writing when the daemon died, or lost a write: not drained
FILE_STATES = (WRITING, STAGED, DRAINING, DURABLE, EVICTED, REMOTE, FAILED, INCOMPLETE)
NOT_LOCAL_STATES = (EVICTED, REMOTE)
META = "meta"  # directories and symlinks: nothing to drain

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
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    ino INTEGER,
    event TEXT NOT NULL,
    detail TEXT NOT NULL DEFAULT ''
);
"""

INODE_COLUMNS = (
    "ino", "parent", "name", "kind", "mode", "uid", "gid", "size", "atime_ns", "mtime_ns",
    "ctime_ns", "target", "state", "generation", "close_seq", "digest", "chunk_size", "chunks",
    "remote_key", "durable_generation", "error", "attempts", "updated", "local_bytes",
)  # fmt: skip


@dataclasses.dataclass
class InodeRow:
    """One row of the ``inodes`` table, as stored."""

    ino: int
    parent: int
    name: bytes
    kind: str
    mode: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes | None
    state: str
    generation: int
    close_seq: int
    digest: str | None
    chunk_size: int | None
    chunks: str | None
    remote_key: str | None
    durable_generation: int | None
    error: str | None
    attempts: int
    updated: float
    local_bytes: int

    def chunk_digests(self) -> tuple[str, ...]:
        return tuple(json.loads(self.chunks)) if self.chunks else ()


Op = tuple[str, Sequence[Any]]


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
            self._db.executescript(_SCHEMA)
            self._db.execute(
                "INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
            )

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

    # -- inodes -------------------------------------------------------------------

    def inodes(self, where: str = "", params: Sequence[Any] = ()) -> list[InodeRow]:
        sql = f"SELECT {', '.join(INODE_COLUMNS)} FROM inodes {where}"
        return [InodeRow(*row) for row in self.query(sql, params)]

    def inode(self, ino: int) -> InodeRow | None:
        rows = self.inodes("WHERE ino=?", (ino,))
        return rows[0] if rows else None

    def xattrs(self) -> Iterator[tuple[int, bytes, bytes]]:
        yield from self.query("SELECT ino, name, value FROM xattrs")

    def path_of(self, ino: int) -> str | None:
        """The file's path relative to the mount root, or None if it is unlinked."""
        parts: list[str] = []
        with self._lock:
            while ino != ROOT_INO:
                row = self._db.execute("SELECT parent, name FROM inodes WHERE ino=?", (ino,)).fetchone()
                if row is None or row[0] == 0:
                    return None
                parts.append(os.fsdecode(row[1]))
                ino = row[0]
        return "/".join(reversed(parts))

    def max_close_seq(self) -> int:
        return int(self.query("SELECT COALESCE(MAX(close_seq), 0) FROM inodes")[0][0])

    def undrained(self) -> dict[str, tuple[int, int]]:
        """{state: (files, bytes)} of files not yet durable; they stay staged in the cache."""
        rows = self.query(
            "SELECT state, COUNT(*), COALESCE(SUM(size), 0) FROM inodes WHERE kind='file' AND parent!=0 "
            "AND state IN (?, ?, ?, ?) GROUP BY state",
            (WRITING, STAGED, DRAINING, FAILED),
        )
        return {state: (int(files), int(nbytes)) for state, files, nbytes in rows}

    def log_event(self, ino: int | None, event: str, detail: str = "") -> Op:
        return ("INSERT INTO events (time, ino, event, detail) VALUES (?, ?, ?, ?)",
                (time.time(), ino, event, detail))  # fmt: skip

    def events(self, since: float = 0.0, limit: int = 1000) -> list[tuple[float, int | None, str, str]]:
        return self.query(
            "SELECT time, ino, event, detail FROM events WHERE time >= ? ORDER BY seq DESC LIMIT ?",
            (since, limit),
        )[::-1]


def insert_inode_op(row: InodeRow) -> Op:
    values = dataclasses.astuple(row)
    marks = ", ".join("?" * len(values))
    return (f"INSERT OR REPLACE INTO inodes ({', '.join(INODE_COLUMNS)}) VALUES ({marks})", values)


def update_inode_op(ino: int, **fields: Any) -> Op:
    assignments = ", ".join(f"{name}=?" for name in fields)
    return (f"UPDATE inodes SET {assignments} WHERE ino=?", (*fields.values(), ino))

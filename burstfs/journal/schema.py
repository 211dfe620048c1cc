"""The journal's tables, the ``schema_version`` check at open, and the migrations to the current version.

Version 1 is the base DDL below; each later version is one entry of ``MIGRATIONS``
(columns added with ALTER TABLE, indexes), so an existing journal keeps working
after an upgrade and a journal written by a newer burstfs is refused at open.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ..errors import ConfigError

SCHEMA_VERSION = 5

_BASE_SCHEMA = """
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


class _Migration:
    """The change from the previous version: columns to add (if missing) and statements to run."""

    def __init__(self, columns: tuple[tuple[str, str, str], ...], statements: tuple[str, ...]) -> None:
        self.columns = columns
        self.statements = statements

    def apply(self, db: sqlite3.Connection) -> None:
        for table, column, decl in self.columns:
            present = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
        for statement in self.statements:
            db.execute(statement)


#: version -> the migration that reaches it from the version before.
MIGRATIONS: dict[int, _Migration] = {
    # The key an upload of this file is writing to (set while `draining`): no other inode may
    # upload to, relocate onto or delete that key meanwhile; the multipart uploads this cache
    # started; indexes for the per-file key lookups.
    2: _Migration(
        (("inodes", "upload_key", "TEXT"),),
        (
            "CREATE TABLE IF NOT EXISTS uploads (upload_id TEXT PRIMARY KEY, key TEXT NOT NULL, started REAL NOT NULL)",
            "CREATE INDEX IF NOT EXISTS inodes_by_remote_key ON inodes(remote_key) WHERE remote_key IS NOT NULL",
            "CREATE INDEX IF NOT EXISTS inodes_by_upload_key ON inodes(upload_key) WHERE upload_key IS NOT NULL",
            "CREATE INDEX IF NOT EXISTS remote_deletes_by_key ON remote_deletes(key)",
        ),
    ),
    # Hard links: a row per extra name of a file, with its own drain state and key; ``link_of``
    # is the inode (row) that holds the file's attributes and its data file.  An older burstfs
    # would take those rows for files of their own.
    3: _Migration(
        (("inodes", "link_of", "INTEGER"),),
        ("CREATE INDEX IF NOT EXISTS inodes_by_link ON inodes(link_of) WHERE link_of IS NOT NULL",),
    ),
    # Closes journaled before the open file's release (FLUSH comes first; a forked child's exec
    # or a dup closed sends one too while the writer goes on): until the last writer's release
    # the tier may lack writes still in the kernel's cache (recovery.py).  An older burstfs
    # would drain such a file as closed.
    4: _Migration(
        (),
        (
            "CREATE TABLE IF NOT EXISTS held_closes "
            "(ino INTEGER PRIMARY KEY, generation INTEGER NOT NULL, flushed_at REAL NOT NULL)",
        ),
    ),
    # Another node's file as this node listed it (``listed_version``: the object's etag, or its
    # mtime where the remote has none), carried into its delete request when it is unlinked
    # here: a delete spares an object its owner rewrote since (an older burstfs would not).
    # (A 'moved' request's ``version`` is the key its object moved to: what a wait for that
    # path waits for too.)
    5: _Migration((("inodes", "listed_version", "TEXT"), ("remote_deletes", "version", "TEXT")), ()),
}


def _recorded_version(db: sqlite3.Connection) -> int | None:
    try:
        row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
    except sqlite3.OperationalError:  # no meta table: nothing written yet
        return None
    return int(row[0]) if row else None


def _refuse_newer(found: int | None, path: Path) -> None:
    if found is not None and found > SCHEMA_VERSION:
        raise ConfigError(
            f"{path} has journal schema {found}; this burstfs reads up to {SCHEMA_VERSION}: a newer burstfs "
            "wrote this cache, and what it staged is still there. Mount it with that version, or drain it "
            "with that version first (burstfs drain --cache DIR --now), then use this one"
        )


def check_readable(db: sqlite3.Connection, path: Path) -> None:
    """A read-only open: refuse a journal written by a newer burstfs (its rows may mean more)."""
    _refuse_newer(_recorded_version(db), path)


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Create or upgrade the schema in one transaction; refuse a journal written by a newer burstfs.

    A journal without a recorded version is a new one (the base DDL, version 1).
    Migrations are idempotent (a column is added only if missing), so a journal
    whose upgrade was cut short is completed on the next open.
    """
    db.executescript(_BASE_SCHEMA)
    db.execute("BEGIN IMMEDIATE")
    try:
        found = _recorded_version(db)
        _refuse_newer(found, path)
        for version in range(2, SCHEMA_VERSION + 1):
            if found is None or version > found:
                MIGRATIONS[version].apply(db)
        db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")

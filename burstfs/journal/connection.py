"""One SQLite connection to the journal, shared by the journal's parts under one lock.

Durability: WAL mode with ``synchronous=NORMAL`` survives a crash of the daemon
(the WAL is written before a commit returns); :meth:`Database.sync` additionally
fsyncs the WAL for fsync(2) callers who want power-loss safety on a persistent tier.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import BurstfsError
from .rows import ROOT_INO, Op
from .schema import check_readable, migrate


class Database:
    """The connection, its lock and transactions; the helpers every part of the journal uses.

    ``connection`` is looked up at each use (the reference-model tests swap in one
    that fails at a simulated crash).
    """

    def __init__(self, cache_dir: Path, *, readonly: bool = False) -> None:
        self.path = Path(cache_dir) / "journal.db"
        if readonly:
            self._open(readonly=True)
            return
        try:
            self._open(readonly=False)
        except sqlite3.DatabaseError as exc:  # a mount or `burstfs drain`: one line, and what to do
            raise BurstfsError(_unusable(self.path, exc)) from exc

    def _open(self, *, readonly: bool) -> None:
        if readonly:
            uri = f"file:{self.path}?mode=ro"
            self.connection = sqlite3.connect(uri, uri=True, check_same_thread=False, isolation_level=None)
        else:
            self.connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("PRAGMA synchronous=NORMAL")
        self.connection.execute("PRAGMA busy_timeout=30000")
        self.lock = threading.Lock()
        try:
            with self.lock:
                if readonly:
                    check_readable(self.connection, self.path)
                else:
                    migrate(self.connection, self.path)
        except BaseException:
            self.connection.close()
            raise

    def close(self) -> None:
        with self.lock:
            self.connection.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error) under the connection lock."""
        with self.lock:
            db = self.connection
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            try:
                db.execute("COMMIT")
            except BaseException:  # a full disk, an I/O error: end the transaction, or every later BEGIN fails
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    def apply(self, ops: Iterable[Op]) -> None:
        """Run ``ops`` in one transaction (the group commit)."""
        with self.transaction() as db:
            for sql, params in ops:
                db.execute(sql, params)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.connection.execute(sql, params).fetchall()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement in its own transaction; returns the number of rows changed."""
        with self.lock:
            return self.connection.execute(sql, params).rowcount

    def sync(self) -> None:
        """fsync the WAL so that committed records survive a power loss too."""
        wal = Path(f"{self.path}-wal")
        if wal.exists():
            fd = os.open(wal, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- helpers for callers that hold the lock ------------------------------------------

    def path_locked(self, ino: int) -> str | None:
        """The path of ``ino`` below the root, or None if it (or a parent) is unlinked."""
        parts: list[str] = []
        while ino != ROOT_INO:
            row = self.connection.execute("SELECT parent, name FROM inodes WHERE ino=?", (ino,)).fetchone()
            if row is None or row[0] == 0:
                return None
            parts.append(os.fsdecode(row[1]))
            ino = row[0]
        return "/".join(reversed(parts))

    def holder_locked(self, key: str, other_than: int) -> int | None:
        """The inode (not ``other_than``) that owns ``key`` (live ``remote_key``) or is uploading to it."""
        row = self.connection.execute(
            "SELECT ino FROM inodes WHERE remote_key=? AND parent!=0 AND ino!=? "
            "UNION ALL SELECT ino FROM inodes WHERE upload_key=? AND ino!=? LIMIT 1",
            (key, other_than, key, other_than),
        ).fetchone()
        return int(row[0]) if row else None

    def top_level_locked(self) -> list[tuple[int, str]]:
        """``(ino, name)`` of the root's children: the seeds of a walk over the whole namespace."""
        return [
            (int(ino), os.fsdecode(name))
            for ino, name in self.connection.execute(
                "SELECT ino, name FROM inodes WHERE parent=? AND ino!=?", (ROOT_INO, ROOT_INO)
            )
        ]


def _unusable(path: Path, exc: sqlite3.DatabaseError) -> str:
    """Why the journal at ``path`` cannot be opened for writing, and what to do."""
    if "full" in str(exc):
        return f"journal {path}: {exc}: the cache's file system is full; make room on it (or grow it) and try again"
    return (
        f"journal {path} cannot be used ({exc}): it is damaged; move the cache dir aside and mount with a new "
        "one (files that were durable are on the remote; each file in its data/ holds one file's bytes)"
    )

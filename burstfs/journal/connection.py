"""One SQLite connection to the journal, shared by the journal's parts under one lock.

Durability: WAL mode with ``synchronous=NORMAL`` survives a crash of the daemon
(the WAL is written before a commit returns); :meth:`Database.sync` additionally
fsyncs the WAL for fsync(2) callers who want power-loss safety on a persistent tier.

A small commit can run on the caller's thread without waiting (:meth:`Database.try_apply`):
it either finds the journal free at once or does nothing.  WAL checkpoints (which copy pages
and fsync the database file) are never left to SQLite's automatic checkpoint at commit, which
would run one on whichever thread commits: a blocking transaction runs one after every
``CHECKPOINT_EVERY_COMMITS`` commits, and a caller of ``try_apply`` runs
:meth:`Database.checkpoint` in a worker thread once :attr:`Database.checkpoint_due`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import BurstfsError
from .rows import ROOT_INO, Op
from .schema import check_readable, migrate

log = logging.getLogger("burstfs.journal")

#: How long a writer waits for another connection's write transaction before it fails.
BUSY_TIMEOUT_MS = 30000
#: The WAL is folded into the database file after about this many commits (a close writes about
#: seven pages: some 4 MiB, as SQLite's own automatic checkpoint would let it grow).
CHECKPOINT_EVERY_COMMITS = 150


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
            self.connection.execute("PRAGMA wal_autocheckpoint=0")
        self.connection.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        self.lock = threading.Lock()
        self._commits_since_checkpoint = 0
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
            with _committed(db):
                yield db
            self._commits_since_checkpoint += 1
            if self.checkpoint_due:
                self._checkpoint_locked()

    def apply(self, ops: Iterable[Op]) -> None:
        """Run ``ops`` in one transaction (the group commit)."""
        with self.transaction() as db:
            _run(db, ops)

    def try_apply(self, ops: Iterable[Op]) -> bool:
        """Run ``ops`` in one transaction if nobody else is writing to the journal, without
        waiting for anybody (neither this journal's lock nor another connection's write
        transaction): False, and nothing done, if somebody is."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            db = self.connection
            db.execute("PRAGMA busy_timeout=0")
            try:
                db.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                if exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_BUSY:  # extended codes too
                    return False
                raise
            finally:
                db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            with _committed(db):
                _run(db, ops)
            self._commits_since_checkpoint += 1  # never a checkpoint here: see checkpoint_due
            return True
        finally:
            self.lock.release()

    @property
    def checkpoint_due(self) -> bool:
        """True once enough commits went into the WAL that it is time to :meth:`checkpoint`."""
        return self._commits_since_checkpoint >= CHECKPOINT_EVERY_COMMITS

    def checkpoint(self) -> None:
        """Copy what the WAL holds into the database file (as far as no reader needs it), so
        the WAL does not grow without bound.  Blocking: a worker thread's job."""
        with self.lock:
            self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        """Never raises: the commits before it are done, and a caller told otherwise would
        apply them again.  One that fails (a full disk) is tried again after as many commits."""
        self._commits_since_checkpoint = 0
        try:
            self.connection.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        except sqlite3.Error as exc:
            log.warning("event=journal_checkpoint_failed path=%s error=%s", self.path, exc)

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self.lock:
            return self.connection.execute(sql, params).fetchall()

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """One statement in its own transaction; returns the number of rows changed."""
        with self.lock:
            changed = self.connection.execute(sql, params).rowcount
            self._commits_since_checkpoint += 1
            return changed

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
        """The inode (not ``other_than``) that owns ``key`` (its ``remote_key``: a live file's, or
        an unlinked one's still read through an open handle) or is uploading to it."""
        row = self.connection.execute(
            "SELECT ino FROM inodes WHERE remote_key=? AND ino!=? "
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


@contextlib.contextmanager
def _committed(db: sqlite3.Connection) -> Iterator[None]:
    """Around the body of a transaction begun on ``db``: COMMIT after it, ROLLBACK on error."""
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    try:
        db.execute("COMMIT")
    except BaseException:  # a full disk, an I/O error: end the transaction, or every later BEGIN fails
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _run(db: sqlite3.Connection, ops: Iterable[Op]) -> None:
    for sql, params in ops:
        db.execute(sql, params)


def _unusable(path: Path, exc: sqlite3.DatabaseError) -> str:
    """Why the journal at ``path`` cannot be opened for writing, and what to do."""
    if "full" in str(exc):
        return f"journal {path}: {exc}: the cache's file system is full; make room on it (or grow it) and try again"
    return (
        f"journal {path} cannot be used ({exc}): it is damaged; move the cache dir aside and mount with a new "
        "one (files that were durable are on the remote; each file in its data/ holds one file's bytes)"
    )

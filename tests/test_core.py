"""BurstCore in-process, without FUSE: the semantics the mount is built on.

Each test drives a core over a temp cache dir with ``trio.run`` and checks both
what the caller sees (return values, errnos) and what the journal recorded,
since the journal is what a restart and the mover rely on.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import sqlite3
import stat
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from burstfs import namespace as namespace_module
from burstfs import reaper
from burstfs.committer import DEFER_S
from burstfs.config import DrainOptions, S3Options, TierOptions, parse_remote_url
from burstfs.core import BurstCore
from burstfs.drainservice import DrainService
from burstfs.errors import BurstfsError
from burstfs.journal import INCOMPLETE, ROOT_INO, STAGED, WRITING, Journal, set_meta_op
from burstfs.mover import Mover

RENAME_NOREPLACE = 1  # linux/fs.h, the values pyfuse3 passes through
RENAME_EXCHANGE = 2
UID, GID = os.getuid(), os.getgid()


@asynccontextmanager
async def open_core(
    cache: Path, capacity: TierOptions | None = None, journal: Journal | None = None
) -> AsyncIterator[BurstCore]:
    """A core with its committer running, closed (not crashed) at exit."""
    journal = journal or Journal(cache)
    core = BurstCore(cache, journal, capacity=capacity or TierOptions())
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(core.committer.run)
            await nursery.start(core.reaper.run)
            yield core
            nursery.cancel_scope.cancel()
    finally:
        core.close()
        journal.close()


def run(cache: Path, body: Callable[[BurstCore], Awaitable[Any]], capacity: TierOptions | None = None) -> Any:
    async def main() -> Any:
        async with open_core(cache, capacity) as core:
            return await body(core)

    return trio.run(main)


def db_rows(cache: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the journal with a separate connection, as an operator (or the mover) would."""
    db = sqlite3.connect(cache / "journal.db")
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


class raises_errno:
    """``with raises_errno(errno.X): ...`` for errors the core raises (FsError, NoSpaceError...)."""

    def __init__(self, code: int) -> None:
        self.code = code

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        assert exc is not None, f"expected {errno.errorcode[self.code]}, nothing was raised"
        assert isinstance(exc, BurstfsError), f"expected an errno, got {exc!r}"
        assert exc.errno == self.code, f"expected {errno.errorcode[self.code]}, got {errno.errorcode.get(exc.errno)}"
        return True


async def write_file(core: BurstCore, parent: int, name: bytes, data: bytes) -> int:
    """create + write + close, then the kernel forgets the inode; returns its number."""
    fh, inode = await core.create(parent, name, 0o644, os.O_WRONLY, UID, GID)
    if data:
        assert await core.write(fh, 0, data) == len(data)
    await core.flush(fh)
    await core.release(fh)
    core.forget(inode.ino, inode.lookups)
    return inode.ino


async def read_all(core: BurstCore, ino: int) -> bytes:
    fh = await core.open(ino, os.O_RDONLY)
    try:
        return await core.read(fh, 0, core.namespace.inode(ino).size + 10)
    finally:
        await core.release(fh)


def test_create_write_read_flush_is_journaled(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> int:
        fh, inode = await core.create(ROOT_INO, b"model.pt", 0o640, os.O_WRONLY, UID, GID)
        # Created: journaled with the next commit, at most DEFER_S later, as a file being written.
        assert db_rows(tmp_path, "SELECT state, size FROM inodes WHERE name=?", (b"model.pt",)) == []
        await trio.sleep(DEFER_S * 1.5)
        assert db_rows(tmp_path, "SELECT state, size FROM inodes WHERE name=?", (b"model.pt",)) == [(WRITING, 0)]
        await core.write(fh, 0, b"hello ")
        await core.write(fh, 6, b"world" * 20000)  # >= 64 KiB: goes through a worker thread
        assert inode.size == 6 + 100000
        await core.flush(fh)
        rows = db_rows(tmp_path, "SELECT state, size, generation, kind, mode FROM inodes WHERE ino=?", (inode.ino,))
        assert rows == [(STAGED, 100006, 1, "file", stat.S_IFREG | 0o640)]
        await core.release(fh)
        assert await read_all(core, inode.ino) == b"hello " + b"world" * 20000
        # Reading does not change the journal; a second unchanged close does not either.
        fh = await core.open(inode.ino, os.O_RDWR)
        await core.flush(fh)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT generation FROM inodes WHERE ino=?", (inode.ino,)) == [(1,)]
        assert core.tier.path(inode.ino).read_bytes() == b"hello " + b"world" * 20000
        return inode.ino

    ino = run(tmp_path, body)
    events = [e for (e,) in db_rows(tmp_path, "SELECT event FROM events WHERE ino=?", (ino,))]
    assert events == ["closed"]


def test_a_small_file_costs_one_journal_commit(tmp_path: Path) -> None:
    """create + write + close of a new file: its row rides with the close's commit."""

    async def body(core: BurstCore) -> None:
        before = core.committer.commits
        for i in range(50):
            fh, _ = await core.create(ROOT_INO, f"f{i}".encode(), 0o644, os.O_WRONLY, UID, GID)
            await core.write(fh, 0, b"x" * 4096)
            await core.flush(fh)
            await core.release(fh)
        assert core.committer.commits - before <= 50
        rows = db_rows(tmp_path, "SELECT state, size FROM inodes WHERE kind='file'")
        assert rows == [(STAGED, 4096)] * 50

    run(tmp_path, body)


def test_empty_new_file_is_journaled_at_close(tmp_path: Path) -> None:
    """close(2) returns after FLUSH; RELEASE comes later, so FLUSH must journal a new file."""

    async def body(core: BurstCore) -> None:
        fh, inode = await core.create(ROOT_INO, b"empty", 0o644, os.O_WRONLY, UID, GID)
        await core.flush(fh)
        assert db_rows(tmp_path, "SELECT state, generation FROM inodes WHERE ino=?", (inode.ino,)) == [(STAGED, 1)]
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state, generation FROM inodes WHERE ino=?", (inode.ino,)) == [(STAGED, 1)]
        fh, synced = await core.create(ROOT_INO, b"synced", 0o644, os.O_WRONLY, UID, GID)
        await core.fsync(fh, datasync=False)  # fsync of a new, still empty file publishes it too
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (synced.ino,)) == [(STAGED,)]
        await core.release(fh)

    run(tmp_path, body)


def test_rewrite_after_close_bumps_generation(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"one")
        fh = await core.open(ino, os.O_WRONLY)
        await core.write(fh, 0, b"two")
        # The first change after a close is journaled before the write returns.
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (ino,)) == [(WRITING,)]
        await core.release(fh)  # release without flush still journals the close
        assert db_rows(tmp_path, "SELECT state, generation FROM inodes WHERE ino=?", (ino,)) == [(STAGED, 2)]
        assert await read_all(core, ino) == b"two"

    run(tmp_path, body)


class FakeBackingFiles:
    """Stands in for the kernel's passthrough registry: the test writes the data file itself."""

    def __init__(self) -> None:
        self.open_ids: set[int] = set()
        self._next = 0

    def open(self, fd: int) -> int:
        self._next += 1
        self.open_ids.add(self._next)
        return self._next

    def close(self, backing_id: int) -> None:
        self.open_ids.remove(backing_id)


def test_passthrough_writes_are_published_by_every_close(tmp_path: Path) -> None:
    """Bytes written through passthrough never reach the core: each close(2) (FLUSH)
    reads size and times off the data file and journals them before it returns,
    also when a dup'd descriptor wrote after an earlier close."""

    async def body(core: BurstCore) -> None:
        backing = FakeBackingFiles()
        core.io_paths.backing = backing
        fh, inode = await core.create(ROOT_INO, b"shard", 0o644, os.O_WRONLY, 0, 0)
        assert core.backing_id(fh) in backing.open_ids
        data = tmp_path / "data" / f"{inode.ino:016x}"
        with open(data, "r+b") as f:
            f.write(b"a" * 1000)
        assert core.getattr(inode.ino).size == 1000
        await core.flush(fh)  # close of a dup
        assert db_rows(tmp_path, "SELECT state, size, generation FROM inodes WHERE ino=?", (inode.ino,)) == [
            (STAGED, 1000, 1)
        ]
        with open(data, "r+b") as f:
            f.seek(1000)
            f.write(b"b" * 500)
        await core.flush(fh)  # the last close(2): published before it returns
        assert db_rows(tmp_path, "SELECT state, size, generation FROM inodes WHERE ino=?", (inode.ino,)) == [
            (STAGED, 1500, 2)
        ]
        await core.release(fh)
        assert not backing.open_ids  # the backing id goes with the last direct handle
        # Reopened for writing and closed unchanged: the previous state comes back.
        fh = await core.open(inode.ino, os.O_RDWR)
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (inode.ino,)) == [(WRITING,)]
        await core.flush(fh)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state, generation FROM inodes WHERE ino=?", (inode.ino,)) == [(STAGED, 2)]

    run(tmp_path, body)


class ListingFetcher:
    """A remote that only lists: ``listing`` maps a directory key to (files, subdirectories)."""

    def __init__(self, listing: dict[str, tuple[list[tuple[str, int, float]], list[str]]]) -> None:
        self.listing = listing

    async def ensure_local(self, ino: int, offset: int, size: int) -> int:
        raise AssertionError("nothing is fetched here")

    async def list_dir(self, dir_key: str) -> tuple[list[tuple[str, int, float]], list[str]]:
        return self.listing.get(dir_key, ([], []))

    def listing_failed(self, dir_key: str, reason: str) -> None:
        pass

    def forget(self, ino: int) -> None:
        pass

    async def let_go(self, ino: int) -> None:
        pass


def test_listing_does_not_resurrect_a_renamed_directory(tmp_path: Path) -> None:
    """Until the drain moves the objects of a renamed directory, the remote still
    lists the old name: it holds this node's keys, so it is not merged back."""

    async def body(core: BurstCore) -> None:
        logs = await core.mkdir(ROOT_INO, b"logs", 0o755, 0, 0)
        deep = await core.mkdir(logs.ino, b"deep", 0o755, 0, 0)
        ino = await write_file(core, deep.ino, b"0.txt", b"log line")
        core.journal.execute("UPDATE inodes SET remote_key=? WHERE ino=?", ("logs/deep/0.txt", ino))  # drained
        await core.rename(logs.ino, b"deep", logs.ino, b"moved", 0)
        core.links.fetcher = ListingFetcher({"logs": ([], ["deep", "other"])})
        logs.listed_at = -1e9  # the listing's TTL has run out
        assert await core.listings.refresh(logs)
        assert sorted(logs.children) == [b"moved", b"other"]  # type: ignore[arg-type]

    run(tmp_path, body)


def test_a_directory_renamed_onto_one_of_other_nodes_files_replaces_it_here_only(tmp_path: Path) -> None:
    """Each node renames its own temp directory to the step's name; a listing may have shown
    another node's renamed one first.  The rename replaces what was only listed here (nothing
    is deleted on the remote) and the next listing shows those files in the new directory.
    Anything of this node's in the target (a file, an empty directory made here), or a file
    being read from the remote, is ENOTEMPTY."""

    async def body(core: BurstCore) -> None:
        core.links.fetcher = ListingFetcher(
            {"": ([], ["ck"]), "ck": ([("a.bin", 10, 1.0)], ["sub"]), "ck/sub": ([("b.bin", 5, 1.0)], [])}
        )
        root = core.namespace.inode(ROOT_INO)
        assert await core.listings.refresh(root)
        ck = core.namespace.inode(root.children[b"ck"])  # type: ignore[index]
        assert await core.listings.refresh(ck)
        assert await core.listings.refresh(core.namespace.inode(ck.children[b"sub"]))  # type: ignore[index]
        tmp = await core.mkdir(ROOT_INO, b"tmp", 0o755, 0, 0)
        await write_file(core, tmp.ino, b"mine.bin", b"mine")
        mine = await core.mkdir(ck.ino, b"made-here", 0o755, 0, 0)
        with raises_errno(errno.ENOTEMPTY):
            await core.rename(ROOT_INO, b"tmp", ROOT_INO, b"ck", 0)
        await core.rmdir(ck.ino, b"made-here")
        assert mine.parent == 0
        reader = await core.open(ck.children[b"a.bin"], os.O_RDONLY)  # type: ignore[index]
        with raises_errno(errno.ENOTEMPTY):  # it reads from the remote: its key stays known
            await core.rename(ROOT_INO, b"tmp", ROOT_INO, b"ck", 0)
        await core.release(reader)
        await core.rename(ROOT_INO, b"tmp", ROOT_INO, b"ck", 0)
        assert sorted(root.children) == [b"ck"]  # type: ignore[arg-type]
        assert sorted(tmp.children) == [b"mine.bin"]  # type: ignore[arg-type]
        assert db_rows(tmp_path, "SELECT key FROM remote_deletes") == []
        assert db_rows(tmp_path, "SELECT count(*) FROM inodes WHERE parent != 0") == [(3,)]  # /, ck, mine.bin
        tmp.listed_at = -1e9
        assert await core.listings.refresh(tmp)
        assert sorted(tmp.children) == [b"a.bin", b"mine.bin", b"sub"]  # type: ignore[arg-type]
        # A file of this node's in the target: ENOTEMPTY, as on any file system.
        await core.mkdir(ROOT_INO, b"other", 0o755, 0, 0)
        with raises_errno(errno.ENOTEMPTY):
            await core.rename(ROOT_INO, b"other", ROOT_INO, b"ck", 0)

    run(tmp_path, body)


def test_open_trunc_and_truncate(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"0123456789")
        fh = await core.open(ino, os.O_WRONLY | os.O_TRUNC)
        assert core.namespace.inode(ino).size == 0
        await core.write(fh, 4, b"xy")  # a hole before: zeros
        await core.release(fh)
        assert await read_all(core, ino) == b"\0\0\0\0xy"
        # truncate(2) on a path (no handle): a complete change, journaled as a close.
        await core.setattr(ino, size=3)
        assert db_rows(tmp_path, "SELECT state, size, generation FROM inodes WHERE ino=?", (ino,)) == [(STAGED, 3, 3)]
        await core.setattr(ino, size=8)
        assert await read_all(core, ino) == b"\0\0\0\0\0\0\0\0"
        with raises_errno(errno.EISDIR):
            await core.setattr(ROOT_INO, size=0)

    run(tmp_path, body)


def test_read_only_open_with_trunc_is_a_complete_change(tmp_path: Path) -> None:
    """Linux truncates on open(O_RDONLY | O_TRUNC); nothing will close it as a writer."""

    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"old bytes")
        fh = await core.open(ino, os.O_RDONLY | os.O_TRUNC)
        assert core.namespace.inode(ino).size == 0
        assert db_rows(tmp_path, "SELECT state, size, generation FROM inodes WHERE ino=?", (ino,)) == [(STAGED, 0, 2)]
        await core.release(fh)
        assert await core.getxattr(ino, b"user.burstfs.state") == STAGED.encode()

    run(tmp_path, body)


def test_a_file_that_lost_a_write_is_incomplete_not_staged(tmp_path: Path) -> None:
    """Tier full of undrained data: ENOSPC after the timeout, and the short file never drains."""

    async def body(core: BurstCore) -> None:
        await write_file(core, ROOT_INO, b"first", b"a" * 3000)  # not durable: nothing to evict
        fh, inode = await core.create(ROOT_INO, b"second", 0o644, os.O_WRONLY, UID, GID)
        await core.write(fh, 0, b"b" * 1000)
        with raises_errno(errno.ENOSPC):
            await core.write(fh, 1000, b"b" * 1000)
        await core.flush(fh)
        await core.release(fh)
        row = db_rows(tmp_path, "SELECT state, size, error FROM inodes WHERE ino=?", (inode.ino,))
        # Its size is the writer's (the kernel keeps that size whatever we say): the lost
        # bytes are a hole on the tier, read as zeros, and the file never drains.
        assert row == [(INCOMPLETE, 2000, "a write failed with ENOSPC")]
        assert core.tier.path(inode.ino).read_bytes() == b"b" * 1000 + b"\0" * 1000
        assert await core.getxattr(inode.ino, b"user.burstfs.error") == b"a write failed with ENOSPC"
        # Emptied and written again in full, it is an ordinary closed file (also when it was
        # empty already: O_TRUNC still counts).
        fh = await core.open(inode.ino, os.O_WRONLY)
        await core.setattr(inode.ino, size=0, fh=fh)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (inode.ino,)) == [(STAGED,)]
        fh = await core.open(inode.ino, os.O_WRONLY)
        with raises_errno(errno.ENOSPC):
            await core.write(fh, 0, b"b" * 5000)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (inode.ino,)) == [(INCOMPLETE,)]
        assert core.namespace.inode(inode.ino).size == 5000
        await core.unlink(ROOT_INO, b"first")  # frees its 3000 bytes
        fh = await core.open(inode.ino, os.O_WRONLY | os.O_TRUNC)
        await core.write(fh, 0, b"c" * 2000)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state, size, error FROM inodes WHERE ino=?", (inode.ino,)) == [
            (STAGED, 2000, None)
        ]

    run(tmp_path, body, TierOptions(cache_size=4000, evict="none", full_timeout=0.2))


def test_a_stopping_mount_fails_writes_waiting_for_room_at_once(tmp_path: Path) -> None:
    """SIGTERM while a write waited on a tier full of undrained data (remote down): the daemon
    stopped only once the write's --full-timeout ran out (58 s), since the FUSE loop waits for
    every request.  stop_waiting() fails the waiting write with ENOSPC now, and later ones too."""

    async def body(core: BurstCore) -> None:
        await write_file(core, ROOT_INO, b"first", b"a" * 3000)  # not durable: nothing to evict
        fh, _ = await core.create(ROOT_INO, b"second", 0o644, os.O_WRONLY, UID, GID)
        failed_after: list[float] = []

        async def blocked_write() -> None:
            started = trio.current_time()
            with raises_errno(errno.ENOSPC):
                await core.write(fh, 0, b"b" * 2000)
            failed_after.append(trio.current_time() - started)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_write)
            await trio.sleep(0.3)
            assert not failed_after  # waiting for the drain
            core.capacity.stop_waiting()
        assert failed_after and failed_after[0] < 5, failed_after
        with raises_errno(errno.ENOSPC):  # no new wait either
            await core.write(fh, 0, b"c" * 2000)
        await core.release(fh)

    run(tmp_path, body, TierOptions(cache_size=4000, evict="none", full_timeout=60.0))


def test_read_only_handle_cannot_write(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"abc")
        fh = await core.open(ino, os.O_RDONLY)
        with raises_errno(errno.EBADF):
            await core.write(fh, 0, b"x")
        await core.release(fh)
        with raises_errno(errno.EISDIR):
            await core.open(ROOT_INO, os.O_RDONLY)

    run(tmp_path, body)


def test_rename_semantics(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        a = await write_file(core, ROOT_INO, b"a", b"AAA")
        b = await write_file(core, ROOT_INO, b"b", b"BBB")
        # Replace a file: the target's inode goes away, the source takes the name.
        await core.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0)
        assert core.namespace.child(ROOT_INO, b"b").ino == a
        assert b not in core.inodes
        assert not core.tier.path(b).exists()
        with raises_errno(errno.ENOENT):
            core.namespace.child(ROOT_INO, b"a")
        assert await read_all(core, a) == b"AAA"
        assert db_rows(tmp_path, "SELECT ino FROM inodes WHERE name=? AND parent=?", (b"b", ROOT_INO)) == [(a,)]

        d1 = await core.mkdir(ROOT_INO, b"d1", 0o755, UID, GID)
        d2 = await core.mkdir(ROOT_INO, b"d2", 0o755, UID, GID)
        await write_file(core, d2.ino, b"inside", b"x")
        # A directory may replace an empty directory, not a non-empty one.
        with raises_errno(errno.ENOTEMPTY):
            await core.rename(ROOT_INO, b"d1", ROOT_INO, b"d2", 0)
        empty = await core.mkdir(ROOT_INO, b"empty", 0o755, UID, GID)
        await core.rename(ROOT_INO, b"d1", ROOT_INO, b"empty", 0)
        assert core.namespace.child(ROOT_INO, b"empty") is d1
        assert empty.ino not in core.inodes or empty.parent == 0
        # File over directory, directory over file.
        with raises_errno(errno.EISDIR):
            await core.rename(ROOT_INO, b"b", ROOT_INO, b"d2", 0)
        with raises_errno(errno.ENOTDIR):
            await core.rename(ROOT_INO, b"d2", ROOT_INO, b"b", 0)
        # RENAME_NOREPLACE refuses an existing target; RENAME_EXCHANGE is not supported.
        c = await write_file(core, ROOT_INO, b"c", b"C")
        with raises_errno(errno.EEXIST):
            await core.rename(ROOT_INO, b"c", ROOT_INO, b"b", RENAME_NOREPLACE)
        await core.rename(ROOT_INO, b"c", ROOT_INO, b"c2", RENAME_NOREPLACE)
        assert core.namespace.child(ROOT_INO, b"c2").ino == c
        with raises_errno(errno.EINVAL):
            await core.rename(ROOT_INO, b"c2", ROOT_INO, b"b", RENAME_EXCHANGE)
        # A directory into its own subtree.
        sub = await core.mkdir(d2.ino, b"sub", 0o755, UID, GID)
        with raises_errno(errno.EINVAL):
            await core.rename(ROOT_INO, b"d2", sub.ino, b"moved", 0)
        with raises_errno(errno.EINVAL):
            await core.rename(ROOT_INO, b"d2", d2.ino, b"self", 0)
        # Moving a directory keeps its contents and fixes link counts.
        root = core.namespace.inode(ROOT_INO)
        links = root.nlink
        await core.rename(ROOT_INO, b"d2", d1.ino, b"d2", 0)
        assert core.namespace.child(d1.ino, b"d2") is d2
        assert root.nlink == links - 1 and d1.nlink == 3
        assert core.namespace.path_of(core.namespace.child(sub.ino, b"..")) == "empty/d2"
        assert core.namespace.path_of(core.namespace.child(d2.ino, b"inside")) == "empty/d2/inside"
        # Renaming onto itself is a no-op.
        await core.rename(ROOT_INO, b"b", ROOT_INO, b"b", 0)
        assert core.namespace.child(ROOT_INO, b"b").ino == a
        with raises_errno(errno.ENOENT):
            await core.rename(ROOT_INO, b"missing", ROOT_INO, b"x", 0)

    run(tmp_path, body)
    names = {n for (n,) in db_rows(tmp_path, "SELECT name FROM inodes WHERE parent != 0")}
    assert names == {b"", b"b", b"c2", b"empty", b"d2", b"inside", b"sub"}


def test_unlink_rmdir(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        d = await core.mkdir(ROOT_INO, b"d", 0o755, UID, GID)
        await write_file(core, d.ino, b"f", b"data")
        with raises_errno(errno.ENOTEMPTY):
            await core.rmdir(ROOT_INO, b"d")
        with raises_errno(errno.EISDIR):
            await core.unlink(ROOT_INO, b"d")
        with raises_errno(errno.ENOTDIR):
            await core.rmdir(d.ino, b"f")
        await core.unlink(d.ino, b"f")
        await core.rmdir(ROOT_INO, b"d")
        with raises_errno(errno.ENOENT):
            await core.unlink(ROOT_INO, b"d")
        assert core.namespace.inode(ROOT_INO).children == {}

    run(tmp_path, body)


def test_unlink_while_open_then_release_destroys_data(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        fh, inode = await core.create(ROOT_INO, b"tmp", 0o600, os.O_RDWR, UID, GID)
        await core.write(fh, 0, b"still readable")
        await core.unlink(ROOT_INO, b"tmp")
        data_path = core.tier.path(inode.ino)
        # Unlinked but open: the name is gone, the data is still there for the handle.
        with raises_errno(errno.ENOENT):
            core.namespace.child(ROOT_INO, b"tmp")
        assert await core.read(fh, 0, 100) == b"still readable"
        assert db_rows(tmp_path, "SELECT parent FROM inodes WHERE ino=?", (inode.ino,)) == [(0,)]
        await core.flush(fh)  # nothing to publish: no name
        await core.release(fh)
        assert data_path.exists()  # the kernel still holds a lookup reference
        core.forget(inode.ino, inode.lookups)
        assert not data_path.exists()
        assert inode.ino not in core.inodes
        await core.committer.commit([])  # the queued row deletion is applied
        assert db_rows(tmp_path, "SELECT * FROM inodes WHERE ino=?", (inode.ino,)) == []

    run(tmp_path, body)


def test_a_large_file_is_unlinked_off_the_loop_and_counted_until_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing a large data file's pages takes long (170 ms per GiB on tmpfs): its data file is
    moved to the trash at once (the data path is free) and unlinked in a worker thread; its
    bytes count on the tier until it is gone, so a writer is never promised room the tier lacks."""
    unlinking, release = threading.Event(), threading.Event()
    real = reaper.unlink_trashed

    def held(path: Path) -> None:
        unlinking.set()
        release.wait(10)
        real(path)

    monkeypatch.setattr(reaper, "unlink_trashed", held)
    (tmp_path / "trash").mkdir()
    (tmp_path / "trash" / "left-by-a-crash").write_bytes(b"x")

    async def body(core: BurstCore) -> None:
        assert not any((tmp_path / "trash").iterdir())  # emptied at start
        small = await write_file(core, ROOT_INO, b"small", b"s" * 100)
        big = await write_file(core, ROOT_INO, b"big", b"b" * reaper.REAP_BYTES)
        counted = core.capacity.local_bytes
        await core.unlink(ROOT_INO, b"small")
        assert not core.tier.path(small).exists() and core.capacity.local_bytes == counted - 100
        await core.unlink(ROOT_INO, b"big")
        assert not core.tier.path(big).exists()
        await trio.to_thread.run_sync(unlinking.wait, 10)
        assert [p.stat().st_size for p in (tmp_path / "trash").iterdir()] == [reaper.REAP_BYTES]
        assert core.capacity.local_bytes == counted - 100  # still on the tier
        release.set()
        while core.capacity.local_bytes:
            await trio.sleep(0.01)
        assert not any((tmp_path / "trash").iterdir())

    run(tmp_path, body)


def test_group_commit_batches_concurrent_creates(tmp_path: Path) -> None:
    count = 200

    async def body(core: BurstCore) -> tuple[int, int]:
        before = core.committer.commits

        async def one(i: int) -> None:
            await write_file(core, ROOT_INO, f"rank{i:04d}".encode(), b"x" * i)

        async with trio.open_nursery() as nursery:
            for i in range(count):
                nursery.start_soon(one, i)
        return core.committer.commits - before, len(core.namespace.inode(ROOT_INO).children or {})

    commits, files = run(tmp_path, body)
    assert files == count
    # Each file needs two journal records (create, close): 400 without grouping.
    assert commits < count // 4, commits
    rows = db_rows(tmp_path, "SELECT COUNT(*), SUM(size) FROM inodes WHERE state=?", (STAGED,))
    assert rows == [(count, sum(range(count)))]


def test_a_close_while_another_process_writes_the_journal_waits_off_the_request_loop(tmp_path: Path) -> None:
    """A small batch commits on the request loop only when the journal is free at once: one
    that finds another connection's write transaction (``burstfs-admin`` steering the drain)
    waits in a thread, and other requests go on meanwhile."""

    async def body(core: BurstCore) -> int:
        other = sqlite3.connect(tmp_path / "journal.db", check_same_thread=False, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        release = threading.Timer(0.3, other.execute, ("COMMIT",))
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await trio.sleep(0.02)
                ticks += 1

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ticker)
                release.start()
                await write_file(core, ROOT_INO, b"during", b"x" * 4096)
                nursery.cancel_scope.cancel()
        finally:
            release.join()
            other.close()
        return ticks

    ticks = run(tmp_path, body)
    assert ticks >= 5, f"the request loop stood still while the journal was busy ({ticks} ticks)"
    assert db_rows(tmp_path, "SELECT state, size FROM inodes WHERE name=?", (b"during",)) == [(STAGED, 4096)]


@pytest.mark.parametrize("every", [20, 10**9])
def test_the_wal_is_checkpointed_off_the_request_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    """Commits on the request loop never checkpoint (SQLite's automatic checkpoint is off):
    the committer folds the WAL into the database in a thread, so it stays small."""
    from burstfs.journal import connection

    monkeypatch.setattr(connection, "CHECKPOINT_EVERY_COMMITS", every)

    async def body(core: BurstCore) -> int:
        for i in range(600):
            await write_file(core, ROOT_INO, f"f{i}".encode(), b"x")
        return (tmp_path / "journal.db-wal").stat().st_size

    wal_size = run(tmp_path, body)
    pages = wal_size // 4096
    if every == 20:
        assert pages < 400, f"{pages} pages in the WAL of a journal checkpointed every 20 commits"
    else:  # without checkpoints the same run grows it past that: the bound above is real
        assert pages >= 400, pages
    assert db_rows(tmp_path, "SELECT COUNT(*) FROM inodes WHERE kind='file'") == [(600,)]


def test_records_queued_just_before_the_committer_stops_are_committed(tmp_path: Path) -> None:
    """A cancellation that reaches the committer after it took a batch off the queue (but
    before its worker thread started) used to drop that batch: its waiters never woke."""

    async def body(core: BurstCore) -> None:
        core.committer.enqueue([set_meta_op("queued-at-exit", "1")])
        await trio.lowlevel.checkpoint()  # the committer takes the batch; open_core cancels it next

    run(tmp_path, body)
    assert db_rows(tmp_path, "SELECT value FROM meta WHERE key=?", ("queued-at-exit",)) == [("1",)]


def test_recovery_rebuilds_namespace(tmp_path: Path) -> None:
    async def first(core: BurstCore) -> dict[str, Any]:
        d = await core.mkdir(ROOT_INO, b"ckpt", 0o750, UID, GID)
        sub = await core.mkdir(d.ino, b"step_10", 0o755, UID, GID)
        await write_file(core, sub.ino, b"rank0.pt", b"r0" * 1000)
        await write_file(core, sub.ino, b"gone", b"bye")
        await core.unlink(sub.ino, b"gone")
        await write_file(core, d.ino, b"tmp", b"latest=10")
        await core.rename(d.ino, b"tmp", d.ino, b"latest", 0)
        await core.symlink(d.ino, b"current", b"step_10", UID, GID)
        f = core.namespace.child(sub.ino, b"rank0.pt")
        await core.setxattr(f.ino, b"user.step", b"10")
        await core.setattr(f.ino, mode=0o600, mtime_ns=1_000_000_000_123)
        # Left open for writing at the "crash": data written, never closed.
        fh, open_file = await core.create(d.ino, b"partial", 0o644, os.O_WRONLY, UID, GID)
        await core.write(fh, 0, b"half")
        return {"open_ino": open_file.ino, "rank0": f.ino}

    info = run(tmp_path, first)  # core.close() keeps the journal as it is: like a crash
    orphan = tmp_path / "data" / f"{0xFFFFF:016x}"
    orphan.write_bytes(b"no inode owns this")

    async def second(core: BurstCore) -> None:
        d = core.namespace.child(ROOT_INO, b"ckpt")
        assert d.mode == stat.S_IFDIR | 0o750
        assert set(d.children or {}) == {b"step_10", b"latest", b"current", b"partial"}
        sub = core.namespace.child(d.ino, b"step_10")
        assert set(sub.children or {}) == {b"rank0.pt"}
        f = core.namespace.child(sub.ino, b"rank0.pt")
        assert f.ino == info["rank0"]
        assert (f.mode, f.mtime_ns, f.size) == (stat.S_IFREG | 0o600, 1_000_000_000_123, 2000)
        assert await read_all(core, f.ino) == b"r0" * 1000
        assert await core.getxattr(f.ino, b"user.step") == b"10"
        assert await core.getxattr(f.ino, b"user.burstfs.state") == STAGED.encode()
        assert await read_all(core, core.namespace.child(d.ino, b"latest").ino) == b"latest=10"
        assert core.readlink(core.namespace.child(d.ino, b"current").ino) == b"step_10"
        assert d.nlink == 3 and core.namespace.inode(ROOT_INO).nlink == 3
        partial = core.namespace.child(d.ino, b"partial")
        assert await core.getxattr(partial.ino, b"user.burstfs.state") == INCOMPLETE.encode()
        # What reached the local tier is visible, so the incomplete file can be inspected.
        assert partial.size == 4
        assert await read_all(core, partial.ino) == b"half"
        # New inode numbers do not collide with recovered ones.
        fh, new = await core.create(ROOT_INO, b"new", 0o644, os.O_WRONLY, UID, GID)
        await core.release(fh)
        assert new.ino > max(info.values())

    run(tmp_path, second)
    assert not orphan.exists()
    assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (info["open_ino"],)) == [(INCOMPLETE,)]
    events = db_rows(tmp_path, "SELECT event FROM events WHERE ino=?", (info["open_ino"],))
    assert ("incomplete",) in events


def test_only_new_files_are_published_without_a_change(tmp_path: Path) -> None:
    """Opening and closing a file that already has a journal state (here ``incomplete``,
    as after a crash) publishes nothing; its first write is journaled before it lands,
    and it stays incomplete until it is emptied and written again."""

    async def crash_while_writing(core: BurstCore) -> int:
        fh, inode = await core.create(ROOT_INO, b"partial", 0o644, os.O_WRONLY, UID, GID)
        await core.write(fh, 0, b"half")
        return inode.ino

    ino = run(tmp_path, crash_while_writing)

    async def reopen(core: BurstCore) -> None:
        fh = await core.open(ino, os.O_RDWR)
        await core.flush(fh)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (ino,)) == [(INCOMPLETE,)]
        assert await core.getxattr(ino, b"user.burstfs.error") == b"open for writing when the daemon stopped"
        fh = await core.open(ino, os.O_RDWR)
        await core.write(fh, 4, b"more")
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (ino,)) == [(WRITING,)]
        await core.release(fh)  # appending does not make up for what is missing
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (ino,)) == [(INCOMPLETE,)]
        fh = await core.open(ino, os.O_RDWR)
        await core.write(fh, 8, b"!")
        # The daemon dies here, while the file is open for writing.

    run(tmp_path, reopen)

    async def restart(core: BurstCore) -> None:
        assert core.namespace.inode(ino).size == 9
        assert await read_all(core, ino) == b"halfmore!"
        fh = await core.open(ino, os.O_WRONLY | os.O_TRUNC)  # rewritten in full: complete
        await core.write(fh, 0, b"whole")
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state, error FROM inodes WHERE ino=?", (ino,)) == [(STAGED, None)]

    run(tmp_path, restart)


def test_recovery_drops_unlinked_open_files(tmp_path: Path) -> None:
    async def first(core: BurstCore) -> int:
        fh, inode = await core.create(ROOT_INO, b"scratch", 0o600, os.O_RDWR, UID, GID)
        await core.write(fh, 0, b"x" * 100)
        await core.unlink(ROOT_INO, b"scratch")
        return inode.ino  # never released: the daemon "dies" here

    ino = run(tmp_path, first)
    assert (tmp_path / "data" / f"{ino:016x}").exists()

    async def second(core: BurstCore) -> None:
        assert ino not in core.inodes
        assert core.namespace.inode(ROOT_INO).children == {}

    run(tmp_path, second)
    assert not (tmp_path / "data" / f"{ino:016x}").exists()
    assert db_rows(tmp_path, "SELECT * FROM inodes WHERE ino=?", (ino,)) == []


def test_names(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        long = b"n" * 256
        with raises_errno(errno.ENAMETOOLONG):
            await core.create(ROOT_INO, long, 0o644, os.O_WRONLY, UID, GID)
        with raises_errno(errno.ENAMETOOLONG):
            await core.mkdir(ROOT_INO, long, 0o755, UID, GID)
        with raises_errno(errno.ENAMETOOLONG):
            await core.symlink(ROOT_INO, long, b"t", UID, GID)
        with raises_errno(errno.ENAMETOOLONG):
            await core.lookup(ROOT_INO, long)
        await write_file(core, ROOT_INO, b"ok", b"")
        with raises_errno(errno.ENAMETOOLONG):
            await core.rename(ROOT_INO, b"ok", ROOT_INO, long, 0)
        assert core.namespace.child(ROOT_INO, b"ok")  # the failed rename changed nothing
        max_name = b"m" * 255
        await write_file(core, ROOT_INO, max_name, b"fits")
        assert (await core.lookup(ROOT_INO, max_name)).size == 4
        with raises_errno(errno.EEXIST):
            await core.create(ROOT_INO, max_name, 0o644, os.O_WRONLY, UID, GID)
        with raises_errno(errno.EEXIST):
            await core.mkdir(ROOT_INO, b"ok", 0o755, UID, GID)
        with raises_errno(errno.ENOTDIR):
            await core.create(core.namespace.child(ROOT_INO, b"ok").ino, b"x", 0o644, os.O_WRONLY, UID, GID)
        # Only regular files, directories and symlinks.
        with raises_errno(errno.EPERM):
            await core.create(ROOT_INO, b"fifo", stat.S_IFIFO | 0o644, os.O_WRONLY, UID, GID)
        assert set(core.namespace.inode(ROOT_INO).children or {}) == {b"ok", max_name}

    run(tmp_path, body)


def test_names_must_be_utf8(tmp_path: Path) -> None:
    """Object keys are UTF-8: a name that is not is refused (EILSEQ) where it would be made, and
    nothing of it reaches the journal (it once wedged every later drain pass and its unlink)."""

    async def body(core: BurstCore) -> None:
        bad = b"caf\xe9.pt"
        with raises_errno(errno.EILSEQ):
            await core.create(ROOT_INO, bad, 0o644, os.O_WRONLY, UID, GID)
        with raises_errno(errno.EILSEQ):
            await core.mkdir(ROOT_INO, bad, 0o755, UID, GID)
        with raises_errno(errno.EILSEQ):
            await core.symlink(ROOT_INO, bad, b"t", UID, GID)
        ok = await write_file(core, ROOT_INO, b"ok", b"data")
        with raises_errno(errno.EILSEQ):
            await core.rename(ROOT_INO, b"ok", ROOT_INO, bad, 0)
        with raises_errno(errno.EILSEQ):
            await core.link(ok, ROOT_INO, bad)
        with raises_errno(errno.ENOENT):
            await core.lookup(ROOT_INO, bad)
        assert set(core.namespace.inode(ROOT_INO).children or {}) == {b"ok"}

    run(tmp_path, body)
    assert db_rows(tmp_path, "SELECT ino FROM inodes WHERE name=?", (b"caf\xe9.pt",)) == []


def test_names_not_utf8_from_an_older_cache_are_repaired(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache made by a burstfs that let such names in: at recovery each becomes its bytes
    written as \\xNN (unique in its directory), so it can drain, be renamed and be removed."""

    async def older(core: BurstCore) -> None:
        await write_file(core, ROOT_INO, b"caf\\xe9.pt", b"taken")
        await write_file(core, ROOT_INO, b"caf\xe9.pt", b"latin-1")
        await core.mkdir(ROOT_INO, b"d\xff", 0o755, UID, GID)

    with monkeypatch.context() as patched:
        patched.setattr(namespace_module, "check_new_name", lambda parent, name: None)
        run(tmp_path, older)

    async def repaired(core: BurstCore) -> None:
        names = set(core.namespace.inode(ROOT_INO).children or {})
        assert names == {b"caf\\xe9.pt", b"caf\\xe9.pt~1", b"d\\xff"}
        assert await read_all(core, core.namespace.child(ROOT_INO, b"caf\\xe9.pt~1").ino) == b"latin-1"
        await core.rename(ROOT_INO, b"caf\\xe9.pt~1", ROOT_INO, b"cafe.pt", 0)
        await core.unlink(ROOT_INO, b"cafe.pt")
        await core.rmdir(ROOT_INO, b"d\\xff")

    run(tmp_path, repaired)
    assert sorted(r[0] for r in db_rows(tmp_path, "SELECT name FROM inodes WHERE parent=?", (ROOT_INO,))) == [
        b"",
        b"caf\\xe9.pt",
    ]


def test_xattrs(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"abc")
        await core.setxattr(ino, b"user.step", b"42")
        await core.setxattr(ino, b"user.step", b"43")  # replace
        await core.setxattr(ino, b"user.empty", b"")
        assert await core.getxattr(ino, b"user.step") == b"43"
        assert await core.getxattr(ino, b"user.empty") == b""
        assert set(core.listxattr(ino)) == {b"user.step", b"user.empty", b"user.burstfs.state"}
        with raises_errno(errno.ENODATA):
            await core.getxattr(ino, b"user.missing")
        # Only the user namespace; burstfs' own attributes are read-only.
        for name in (b"trusted.x", b"security.x", b"system.x"):
            with raises_errno(errno.ENOTSUP):
                await core.setxattr(ino, name, b"1")
        with raises_errno(errno.EPERM):
            await core.setxattr(ino, b"user.burstfs.state", b"durable")
        with raises_errno(errno.EPERM):
            await core.removexattr(ino, b"user.burstfs.state")
        assert await core.getxattr(ino, b"user.burstfs.state") == b"staged"
        assert await core.getxattr(ino, b"user.burstfs.generation") == b"1"
        with raises_errno(errno.ENODATA):
            await core.getxattr(ino, b"user.burstfs.remote_key")  # not drained
        with raises_errno(errno.ENODATA):
            await core.getxattr(ino, b"user.burstfs.nonsense")
        await core.removexattr(ino, b"user.step")
        with raises_errno(errno.ENODATA):
            await core.removexattr(ino, b"user.step")
        # Directories take user xattrs too; they have no drain state.
        await core.setxattr(ROOT_INO, b"user.dir", b"yes")
        assert await core.getxattr(ROOT_INO, b"user.dir") == b"yes"
        assert core.listxattr(ROOT_INO) == [b"user.dir"]
        with raises_errno(errno.ENODATA):
            await core.getxattr(ROOT_INO, b"user.burstfs.state")
        # While a file is being written its state says so.
        fh = await core.open(ino, os.O_WRONLY)
        await core.write(fh, 3, b"d")
        assert await core.getxattr(ino, b"user.burstfs.state") == b"writing"
        await core.release(fh)
        assert await core.getxattr(ino, b"user.burstfs.generation") == b"2"

    run(tmp_path, body)
    assert db_rows(tmp_path, "SELECT name, value FROM xattrs ORDER BY name") == [
        (b"user.dir", b"yes"),
        (b"user.empty", b""),
    ]


def test_readdir_skips_names_removed_while_the_kernel_holds_their_inodes(tmp_path: Path) -> None:
    """An unlink by path looks the name up first: the kernel's reference keeps the inode
    in the table, and a listing that went by the inode table returned every removed name."""

    async def body(core: BurstCore) -> None:
        for i in range(10):
            await write_file(core, ROOT_INO, f"f{i}".encode(), b"")
        fh = await core.opendir(ROOT_INO)
        for name in (b"f3", b"f7"):
            await core.lookup(ROOT_INO, name)  # the kernel holds it until forget
            await core.unlink(ROOT_INO, name)
        await core.rename(ROOT_INO, b"f8", ROOT_INO, b"moved", 0)  # gone from the snapshot's names
        assert [n for n, _ in core.readdir(fh, 0)] == [f"f{i}".encode() for i in (0, 1, 2, 4, 5, 6, 9)]
        core.releasedir(fh)

    run(tmp_path, body)


def test_readdir_positions_do_not_shift_when_names_are_removed(tmp_path: Path) -> None:
    """Each entry carries the position after it in the opendir snapshot (the kernel's offset
    for its next request): the positions stay those of the snapshot while names go, so a
    listing read a few entries a request returns every remaining name once."""

    async def body(core: BurstCore) -> None:
        names = [f"e{i:03d}".encode() for i in range(60)]
        for name in names:
            await core.mkdir(ROOT_INO, name, 0o755, UID, GID)
        fh = await core.opendir(ROOT_INO)
        seen: list[bytes] = []
        offset = 0
        removed = {name for i, name in enumerate(names) if i > 20 and i % 3 == 0}
        while True:
            page = list(itertools.islice(core.readdir_from(fh, offset), 7))  # a full reply buffer
            if not page:
                break
            seen += [name for _, name, _ in page]
            offset = page[-1][0]
            if removed and len(seen) >= 14:
                for name in sorted(removed):
                    await core.lookup(ROOT_INO, name)
                    await core.rmdir(ROOT_INO, name)
                removed_now, removed = removed, set()
        assert seen == [name for name in names if name not in removed_now]
        # rewinddir starts over at position 0; a name replaced meanwhile comes back once, as it is now.
        before = (await core.lookup(ROOT_INO, b"e001")).ino
        await core.mkdir(ROOT_INO, b"new", 0o755, UID, GID)
        await core.rename(ROOT_INO, b"new", ROOT_INO, b"e001", 0)
        again = list(core.readdir_from(fh, 0))
        assert [name for _, name, _ in again] == seen
        assert [pos for pos, _, _ in again[:3]] == [1, 2, 3] and again[1][2].ino != before
        assert again[1][2].ino == (await core.lookup(ROOT_INO, b"e001")).ino
        core.releasedir(fh)

    run(tmp_path, body)


def test_readdir_snapshot_and_statfs(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        for i in range(50):
            await core.mkdir(ROOT_INO, f"d{i}".encode(), 0o755, UID, GID)
        fh = await core.opendir(ROOT_INO)
        first = core.readdir(fh, 0)
        assert [n for n, _ in first] == [f"d{i}".encode() for i in range(50)]
        assert [n for n, _ in core.readdir(fh, 45)] == [f"d{i}".encode() for i in range(45, 50)]
        # Removed entries disappear from an open listing instead of pointing at nothing.
        await core.rmdir(ROOT_INO, b"d47")
        core.forget(first[47][1].ino, first[47][1].lookups)
        assert [n for n, _ in core.readdir(fh, 45)] == [b"d45", b"d46", b"d48", b"d49"]
        core.releasedir(fh)
        plain = await write_file(core, ROOT_INO, b"plain", b"")
        with raises_errno(errno.ENOTDIR):
            await core.opendir(plain)
        fs = await core.statfs()
        st = os.statvfs(tmp_path)
        assert fs.block_size == st.f_frsize and fs.blocks == st.f_blocks and fs.name_max == 255

    run(tmp_path, body)


def test_umask_free_modes_and_setgid_dirs(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        d = await core.mkdir(ROOT_INO, b"shared", 0o2775, UID, 1234)
        fh, f = await core.create(d.ino, b"f", 0o664, os.O_WRONLY, UID, GID)
        await core.release(fh)
        sub = await core.mkdir(d.ino, b"sub", 0o755, UID, GID)
        assert f.gid == 1234 and sub.gid == 1234
        assert sub.mode & stat.S_ISGID
        await core.setattr(f.ino, uid=1000, gid=1001, atime_ns=5, mtime_ns=7)
        assert (f.uid, f.gid, f.atime_ns, f.mtime_ns) == (1000, 1001, 5, 7)
        assert db_rows(tmp_path, "SELECT uid, gid, atime_ns, mtime_ns FROM inodes WHERE ino=?", (f.ino,)) == [
            (1000, 1001, 5, 7)
        ]

    run(tmp_path, body)


def test_digests_are_computed_as_written_and_journaled_at_close(tmp_path: Path) -> None:
    """Sequential writes (even slightly reordered) need no re-read: close journals the digests."""
    from burstfs.objects import compute_digests

    content = os.urandom((8 << 20) * 2 + 12345)

    async def body(core: BurstCore) -> tuple[int, int]:
        fh, inode = await core.create(ROOT_INO, b"seq.bin", 0o644, os.O_WRONLY, 0, 0)
        blocks = [(o, content[o : o + (1 << 20)]) for o in range(0, len(content), 1 << 20)]
        blocks[0], blocks[1] = blocks[1], blocks[0]  # write-back may deliver out of order
        for offset, block in blocks:
            await core.write(fh, offset, block)
        await core.flush(fh)
        await core.release(fh)
        fh, other = await core.create(ROOT_INO, b"patched.bin", 0o644, os.O_WRONLY, 0, 0)
        await core.write(fh, 0, b"a" * 1000)
        await core.write(fh, 10, b"b")  # an overwrite: digests must come from the drain
        await core.flush(fh)
        await core.release(fh)
        return inode.ino, other.ino

    ino, patched = run(tmp_path, body)
    expected = compute_digests(tmp_path / "data" / f"{ino:016x}", 8 << 20)
    digest, chunks, chunk_size = db_rows(tmp_path, "SELECT digest, chunks, chunk_size FROM inodes WHERE ino=?", (ino,))[
        0
    ]
    assert (digest, chunk_size) == (expected.digest, 8 << 20)
    assert tuple(json.loads(chunks)) == expected.chunks and len(expected.chunks) == 3
    assert db_rows(tmp_path, "SELECT digest FROM inodes WHERE ino=?", (patched,))[0][0] is None


def test_hard_links_share_one_inode_and_journal_a_row_per_name(tmp_path: Path) -> None:
    """link(2): one inode, several names; each extra name is a journal row (``link_of``)
    that drains on its own; a close restages every name; unlink of one name drops only
    that name's row; the last name's unlink destroys the inode as before."""

    async def body(core: BurstCore) -> int:
        ino = await write_file(core, ROOT_INO, b"a", b"v1")
        d = await core.mkdir(ROOT_INO, b"d", 0o755, UID, GID)
        linked = await core.link(ino, d.ino, b"b")
        assert linked.ino == ino and linked.nlink == 2
        assert core.namespace.child(d.ino, b"b") is core.namespace.inode(ino)
        with raises_errno(errno.EEXIST):
            await core.link(ino, ROOT_INO, b"a")
        with raises_errno(errno.EPERM):
            await core.link(d.ino, ROOT_INO, b"dirlink")
        # the new name is staged to drain the current generation; the first name is unchanged
        rows = db_rows(
            tmp_path,
            "SELECT ino, parent, name, state, generation, link_of FROM inodes WHERE ino=? OR link_of=? ORDER BY ino",
            (ino, ino),
        )
        assert [(r[1], r[2], r[3], r[4], r[5]) for r in rows] == [
            (ROOT_INO, b"a", STAGED, 1, None),
            (d.ino, b"b", STAGED, 1, ino),
        ]
        # a write through one name: every name is `writing`, then staged with the new generation
        fh = await core.open(ino, os.O_WRONLY)
        await core.write(fh, 0, b"v2")
        assert {s for (s,) in db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=? OR link_of=?", (ino, ino))} == {
            WRITING
        }
        await core.flush(fh)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state, generation FROM inodes WHERE ino=? OR link_of=?", (ino, ino)) == [
            (STAGED, 2),
            (STAGED, 2),
        ]
        # unlink the first name: the inode lives on under its link, its own row keeps no name
        await core.unlink(ROOT_INO, b"a")
        assert core.namespace.inode(ino).nlink == 1 and await read_all(core, ino) == b"v2"
        assert db_rows(tmp_path, "SELECT parent FROM inodes WHERE ino=?", (ino,)) == [(0,)]
        # rename the link, and link it back under a third name
        await core.rename(d.ino, b"b", ROOT_INO, b"c", 0)
        await core.link(ino, ROOT_INO, b"e")
        assert core.namespace.inode(ino).nlink == 2
        core.forget(ino, core.namespace.inode(ino).lookups)
        return ino

    ino = run(tmp_path, body)

    async def after_restart(core: BurstCore) -> None:
        inode = core.namespace.inode(ino)
        assert (
            inode.nlink == 2
            and core.namespace.child(ROOT_INO, b"c") is inode
            and core.namespace.child(ROOT_INO, b"e") is inode
        )
        assert await read_all(core, ino) == b"v2"
        await core.unlink(ROOT_INO, b"c")
        await core.unlink(ROOT_INO, b"e")
        assert ino not in core.inodes and not core.tier.path(ino).exists()

    run(tmp_path, after_restart)

    async def nothing(core: BurstCore) -> None:
        return None

    run(tmp_path, nothing)  # start-up drops what is left of an inode without names
    assert db_rows(tmp_path, "SELECT COUNT(*) FROM inodes WHERE ino=? OR link_of=?", (ino, ino)) == [(0,)]


def test_rename_over_a_hard_link_and_between_names_of_one_file(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"a", b"shared")
        await core.link(ino, ROOT_INO, b"b")
        other = await write_file(core, ROOT_INO, b"x", b"other")
        await core.rename(ROOT_INO, b"a", ROOT_INO, b"b", 0)  # two names of one file: nothing happens
        assert core.namespace.inode(ino).nlink == 2 and set(core.namespace.inode(ROOT_INO).children) == {
            b"a",
            b"b",
            b"x",
        }
        await core.rename(ROOT_INO, b"x", ROOT_INO, b"b", 0)  # replaces the link name only
        assert core.namespace.inode(ino).nlink == 1 and core.namespace.child(ROOT_INO, b"b").ino == other
        assert await read_all(core, ino) == b"shared"
        # the replaced name's row is gone; the file's own row still names it
        assert db_rows(tmp_path, "SELECT name FROM inodes WHERE link_of=?", (ino,)) == []
        assert db_rows(tmp_path, "SELECT parent, name FROM inodes WHERE ino=?", (ino,)) == [(ROOT_INO, b"a")]

    run(tmp_path, body)


def test_fallocate_default_mode_grows_after_journaling_writing_and_keep_size_only_allocates(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"head")
        fh = await core.open(ino, os.O_RDWR)
        await core.fallocate(fh, 0, 1 << 20, 1)  # FALLOC_FL_KEEP_SIZE: nothing visible changes
        assert core.namespace.inode(ino).size == 4
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (ino,)) == [(STAGED,)]
        await core.fallocate(fh, 0, 8192, 0)
        assert core.namespace.inode(ino).size == 8192 and await core.read(fh, 0, 8) == b"head\0\0\0\0"
        assert db_rows(tmp_path, "SELECT state FROM inodes WHERE ino=?", (ino,)) == [(WRITING,)]
        with raises_errno(errno.EOPNOTSUPP):
            await core.fallocate(fh, 0, 4096, 3)  # punch hole
        with raises_errno(errno.ENOSPC):  # 2 MiB limit, 1 s wait: more than fits
            await core.fallocate(fh, 0, 4 << 20, 0)
        await core.flush(fh)
        await core.release(fh)
        assert db_rows(tmp_path, "SELECT state, size FROM inodes WHERE ino=?", (ino,)) == [(STAGED, 8192)]
        ro = await core.open(ino, os.O_RDONLY)
        with raises_errno(errno.EBADF):
            await core.fallocate(ro, 0, 4096, 0)
        await core.release(ro)

    run(tmp_path, body, TierOptions(cache_size=2 << 20, evict="none", full_timeout=1.0))


def test_a_file_renamed_into_place_does_not_count_as_an_open_writer(tmp_path: Path) -> None:
    """DCP renames ``.metadata.tmp`` onto ``.metadata``: the rename joined the commit round as
    a close does, and with it took the file for one just opened for writing, with no release to
    follow; every large upload then waited out ``WRITER_YIELD_S`` (10 s) after each save."""
    remote = tmp_path / "remote"
    remote.mkdir()
    mover = Mover(tmp_path, parse_remote_url(f"file://{remote}"), S3Options(), DrainOptions())

    async def body(core: BurstCore) -> None:
        service = DrainService(mover, core.journal)
        core.links.drain = service
        service.start()
        try:
            await trio.to_thread.run_sync(service.wait_ready)
            step = await core.mkdir(ROOT_INO, b"step_1", 0o755, UID, GID)
            await write_file(core, step.ino, b"__0_0.distcp", b"s" * 1000)
            await write_file(core, step.ino, b".metadata.tmp", b"m")
            assert not mover.bursts.recent_writer()  # every writer released its file
            await core.rename(step.ino, b".metadata.tmp", step.ino, b".metadata", 0)
            assert not mover.bursts.recent_writer()
        finally:
            await trio.to_thread.run_sync(service.stop)

    run(tmp_path, body)

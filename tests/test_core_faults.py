"""Faults and odd inputs the core must survive exactly (issue 10).

A failed journal commit must leave the namespace exactly as a restart from the
journal shows it; odd remote listings must not break a directory; the streaming
digests must never raise nor lie, whatever order writes arrive in.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from burstfs.objects import StreamingDigests, compute_digests

# -- #20: streaming digests under any write order --------------------------------------------


class SmallTailDigests(StreamingDigests):
    TAIL = 8  # small enough that short generated writes reach past it


writes_strategy = st.lists(
    st.tuples(st.integers(0, 40), st.binary(min_size=0, max_size=16)),
    min_size=1,
    max_size=20,
)


@pytest.mark.parametrize("cls", [StreamingDigests, SmallTailDigests])
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(writes=writes_strategy, chunk_size=st.integers(1, 16), max_pending=st.sampled_from([16, 64, 1 << 20]))
def test_streaming_digests_are_right_or_absent_for_any_writes(
    tmp_path: Path, cls: type[StreamingDigests], writes: list[tuple[int, bytes]], chunk_size: int, max_pending: int
) -> None:
    """Overlapping, reordered writes: result() is the file's digests or None, never an error."""
    final = bytearray()
    stream = cls(chunk_size, max_pending=max_pending)
    for offset, data in writes:
        if offset + len(data) > len(final):
            final.extend(bytes(offset + len(data) - len(final)))
        final[offset : offset + len(data)] = data
        stream.update(offset, data)  # must never raise (was KeyError: EIO on valid writes)
    path = tmp_path / f"f{os.getpid()}"
    path.write_bytes(bytes(final))
    got = stream.result(len(final))
    assert got is None or got == compute_digests(path, chunk_size)


def test_streaming_digests_overwrite_among_pending_writes_is_not_an_error() -> None:
    """The shape seen in the daemon: queued writes released together, the first an overwrite."""
    stream = StreamingDigests(16)
    stream.update(0, b"a" * 8)
    stream.update(12, b"c" * 4)  # ahead: waits
    stream.update(10, b"X" * 4)  # ahead: waits
    stream.update(8, b"b" * 6)  # releases both; the one at 10 overwrites what this wrote
    assert stream.result(16) is None


# -- #3: a failed journal commit leaves no ghost ---------------------------------------------

import threading  # noqa: E402
from collections.abc import Awaitable, Callable, Iterable, Sequence  # noqa: E402
from contextlib import AbstractAsyncContextManager  # noqa: E402
from typing import Any  # noqa: E402

import trio  # noqa: E402
from test_core import db_rows, open_core  # noqa: E402

from burstfs import listings  # noqa: E402
from burstfs.committer import DEFER_S  # noqa: E402
from burstfs.core import BurstCore, Inode  # noqa: E402
from burstfs.errors import THROTTLED, BurstfsError, RemoteError  # noqa: E402
from burstfs.journal import ROOT_INO, Journal, Op  # noqa: E402

UID, GID = os.getuid(), os.getgid()
DISK_FULL = "database or disk is full"


class FlakyJournal(Journal):
    """A journal whose next transactions fail as SQLite does on a full file system.

    ``gate``, when set, is waited for (in the committer's worker thread) before a
    failing transaction raises, so a test can act while that commit is in flight.
    """

    def __init__(self, cache_dir: Path) -> None:
        super().__init__(cache_dir)
        self.fail_next = 0
        self.failed = 0
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def try_apply(self, ops: Sequence[Op]) -> bool:
        """A failing transaction fails on the request loop too, unless the test holds it at
        the gate: that needs the worker thread."""
        if self.fail_next and ops:
            if self.gate is not None:
                return False
            self._fail()
        return super().try_apply(ops)

    def apply(self, ops: Iterable[Op]) -> None:
        ops = list(ops)
        if self.fail_next and ops:
            self._fail()
        super().apply(ops)

    def _fail(self) -> None:
        self.fail_next -= 1
        self.failed += 1
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(10)
        raise sqlite3.OperationalError(DISK_FULL)


def flaky_core(cache: Path) -> AbstractAsyncContextManager[BurstCore]:
    return open_core(cache, journal=FlakyJournal(cache))


def run_flaky(cache: Path, body: Callable[[BurstCore], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        async with flaky_core(cache) as core:
            return await body(core)

    return trio.run(main)


def namespace(core: BurstCore) -> dict[str, tuple[Any, ...]]:
    """Everything a restart must reproduce: path -> attributes, data and generation."""
    out: dict[str, tuple[Any, ...]] = {}

    def walk(inode: Inode, path: str) -> None:
        data = core.tier.path(inode.ino).read_bytes()[: inode.size] if inode.kind == "file" else None
        out[path] = (
            inode.kind,
            inode.mode,
            inode.uid,
            inode.gid,
            inode.size,
            inode.target,
            sorted(inode.xattrs.items()),
            inode.generation,
            data,
        )
        for name, ino in sorted((inode.children or {}).items()):
            walk(core.inodes[ino], f"{path}/{os.fsdecode(name)}")

    walk(core.inodes[ROOT_INO], "")
    assert core.inodes[ROOT_INO].subdirs == sum(
        1
        for ino in core.inodes[ROOT_INO].children.values()
        if core.inodes[ino].kind == "dir"  # type: ignore[union-attr]
    )
    return out


def restarted_namespace(cache: Path) -> dict[str, tuple[Any, ...]]:
    async def body(core: BurstCore) -> dict[str, tuple[Any, ...]]:
        return namespace(core)

    return run_flaky(cache, body)


async def write_file(core: BurstCore, parent: int, name: bytes, data: bytes) -> int:
    fh, inode = await core.create(parent, name, 0o644, os.O_WRONLY, UID, GID)
    if data:
        await core.write(fh, 0, data)
    await core.flush(fh)
    await core.release(fh)
    core.forget(inode.ino, inode.lookups)
    return inode.ino


class fails_with:
    """``async with fails_with(core, errno.ENOSPC): ...``: the next commit fails; so must the call."""

    def __init__(self, core: BurstCore, code: int = errno.ENOSPC) -> None:
        self.core, self.code = core, code

    def __enter__(self) -> None:
        self.core.journal.fail_next = 1  # type: ignore[attr-defined]

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        assert exc is not None, "the call succeeded although its commit failed"
        assert isinstance(exc, BurstfsError), f"expected an errno, got {exc!r}"
        assert exc.errno == self.code, exc
        assert self.core.journal.fail_next == 0  # type: ignore[attr-defined]
        return True


def test_failed_commits_leave_memory_equal_to_the_journal(tmp_path: Path) -> None:
    """create, mkdir, symlink, unlink, rmdir, rename, setattr, xattrs, close: each
    with its commit failing, then the namespace equals what a restart shows."""

    async def body(core: BurstCore) -> dict[str, tuple[Any, ...]]:
        ckpt = await core.mkdir(ROOT_INO, b"ckpt", 0o755, UID, GID)
        keep = await write_file(core, ckpt.ino, b"keep", b"kept bytes")
        old = await write_file(core, ckpt.ino, b"old", b"old bytes")
        await core.setxattr(keep, b"user.step", b"1")
        await core.mkdir(ckpt.ino, b"empty", 0o755, UID, GID)
        before = namespace(core)

        ghost, _ = await core.create(ckpt.ino, b"ghost", 0o644, os.O_WRONLY, UID, GID)  # journaled with its close
        with fails_with(core):
            await core.flush(ghost)
        await core.release(ghost)
        with fails_with(core):
            await core.mkdir(ckpt.ino, b"ghostdir", 0o755, UID, GID)
        with fails_with(core):
            await core.symlink(ckpt.ino, b"ghostlink", b"keep", UID, GID)
        with fails_with(core):
            await core.unlink(ckpt.ino, b"keep")
        with fails_with(core):
            await core.rmdir(ckpt.ino, b"empty")
        with fails_with(core):
            await core.rename(ckpt.ino, b"keep", ckpt.ino, b"old", 0)  # replaces a file
        with fails_with(core):
            await core.rename(ckpt.ino, b"empty", ROOT_INO, b"moved", 0)
        with fails_with(core):
            await core.setattr(keep, mode=0o600, uid=UID, mtime_ns=12345)
        with fails_with(core):
            await core.setattr(old, size=3)  # truncate(2): a close
        with fails_with(core):
            await core.setxattr(keep, b"user.step", b"2")
        with fails_with(core):
            await core.setxattr(keep, b"user.new", b"x")
        with fails_with(core):
            await core.removexattr(keep, b"user.step")
        after = namespace(core)
        # The failed truncate(2) did change the bytes (it must, before journaling the close):
        # they are journaled as being written; everything else is exactly as before.
        assert after.pop("/ckpt/old")[:4] == before.pop("/ckpt/old")[:4]
        assert after == before
        for name in (b"ghost", b"ghostdir", b"ghostlink"):
            try:
                core.namespace.child(ckpt.ino, name)
                raise AssertionError(f"{name!r} is a ghost")
            except BurstfsError as exc:
                assert exc.errno == errno.ENOENT
        # Space is back: the names can be made for real, and nothing of the ghosts remains.
        await write_file(core, ckpt.ino, b"ghost", b"real")
        return namespace(core)

    final = run_flaky(tmp_path, body)
    restarted = restarted_namespace(tmp_path)
    final.pop("/ckpt/old"), restarted.pop("/ckpt/old")  # truncated, not closed: incomplete after restart
    assert restarted == final


def test_failed_close_keeps_the_file_unpublished_and_a_later_close_publishes_it(tmp_path: Path) -> None:
    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"model.pt", b"")
        fh = await core.open(ino, os.O_WRONLY)
        inode = core.namespace.inode(ino)
        await core.write(fh, 0, b"weights")
        with fails_with(core):
            await core.flush(fh)  # close(2) gets ENOSPC
        assert (inode.generation, inode.dirty) == (1, True)  # no generation bump
        with fails_with(core):
            await core.fsync(fh, False)
        assert inode.generation == 1
        await core.flush(fh)  # space is back: the next close publishes it
        await core.release(fh)
        assert inode.generation == 2 and inode.digests is None

    run_flaky(tmp_path, body)
    restarted = restarted_namespace(tmp_path)
    assert restarted["/model.pt"][-2:] == (2, b"weights")


def test_a_release_record_whose_commit_failed_is_tried_again(tmp_path: Path) -> None:
    """A file closed and released while the journal's file system was full: its release record
    rode with a batch that failed, was never tried again, and the next start took the file for
    one still open for writing (``incomplete``: a closed checkpoint that never drains)."""

    async def body(core: BurstCore) -> None:
        fh, _ = await core.create(ROOT_INO, b"f18", 0o644, os.O_WRONLY, UID, GID)
        await core.write(fh, 0, b"closed shard")
        await core.flush(fh)  # close(2) returned: journaled, held until the release
        core.journal.fail_next = 2  # type: ignore[attr-defined]
        await core.release(fh)
        with trio.fail_after(10):
            while core.journal.fail_next or core.journal.held_closes():  # type: ignore[attr-defined]
                await trio.sleep(0.05)
        assert core.journal.failed == 2  # type: ignore[attr-defined]

    run_flaky(tmp_path, body)
    restarted = restarted_namespace(tmp_path)  # a crash now: the file is closed, not incomplete
    assert restarted["/f18"][-2:] == (1, b"closed shard")
    assert db_rows(tmp_path, "SELECT state FROM inodes WHERE name=?", (b"f18",)) == [("staged",)]


@pytest.mark.parametrize("fails", ["with its close", "on its own"])
def test_a_new_file_whose_create_record_fails_is_gone_and_its_close_says_so(tmp_path: Path, fails: str) -> None:
    """A create's record is deferred to the next commit (its close) or DEFER_S: if that
    transaction fails, the name is gone again and close(2) and fsync(2) fail: nobody is
    told a file was saved that the journal never had."""

    async def body(core: BurstCore) -> None:
        journal: FlakyJournal = core.journal  # type: ignore[assignment]
        fh, inode = await core.create(ROOT_INO, b"model.pt", 0o644, os.O_WRONLY, UID, GID)
        await core.write(fh, 0, b"weights")
        journal.fail_next = 1
        if fails == "on its own":
            await trio.sleep(DEFER_S * 3)  # the deferred record went out alone, and failed
            assert journal.fail_next == 0
        for call in (lambda: core.flush(fh), lambda: core.fsync(fh, False), lambda: core.flush(fh)):
            with pytest.raises(BurstfsError) as raised:
                await call()
            assert raised.value.errno == errno.ENOSPC
        await core.release(fh)
        assert inode.generation == 0
        with pytest.raises(BurstfsError):
            core.namespace.child(ROOT_INO, b"model.pt")
        await write_file(core, ROOT_INO, b"other", b"later files are journaled as ever")

    run_flaky(tmp_path, body)
    assert set(restarted_namespace(tmp_path)) == {"", "/other"}
    assert len(list((tmp_path / "data").iterdir())) == 1  # no data file of the lost create


def test_a_failed_commit_also_undoes_what_was_built_on_it(tmp_path: Path) -> None:
    """A file created in a directory whose mkdir is still committing (and then fails)
    must not survive in memory or in the journal."""

    async def body(core: BurstCore) -> None:
        journal: FlakyJournal = core.journal  # type: ignore[assignment]
        journal.gate = threading.Event()
        journal.fail_next = 1
        results: dict[str, BaseException | None] = {}

        async def attempt(what: str, call: Callable[[], Awaitable[Any]]) -> None:
            try:
                await call()
                results[what] = None
            except BurstfsError as exc:
                results[what] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(attempt, "mkdir", lambda: core.mkdir(ROOT_INO, b"d", 0o755, UID, GID))
            await trio.to_thread.run_sync(journal.entered.wait, 10)  # mkdir's commit is in flight
            d = core.namespace.child(ROOT_INO, b"d")  # seen by a lookup meanwhile
            nursery.start_soon(attempt, "create", lambda: write_file(core, d.ino, b"f", b"x"))
            await trio.sleep(0.05)
            journal.gate.set()
        assert isinstance(results["mkdir"], BurstfsError) and results["mkdir"].errno == errno.ENOSPC
        assert isinstance(results["create"], BurstfsError) and results["create"].errno == errno.ENOSPC
        assert set(namespace(core)) == {""}
        assert len(core.inodes) == 1

    run_flaky(tmp_path, body)
    assert set(restarted_namespace(tmp_path)) == {""}
    assert not list((tmp_path / "data").iterdir())  # no data file of a ghost


def test_sqlite_errors_map_to_errnos() -> None:
    from burstfs.errors import to_errno

    assert to_errno(sqlite3.OperationalError(DISK_FULL)) == errno.ENOSPC
    assert to_errno(sqlite3.OperationalError("disk I/O error")) == errno.EIO


# -- remote listings: #4, #7, #11, #19 ---------------------------------------------------------

Listing = tuple[list[tuple[str, int, float]], list[str]]


class FakeRemote:
    """Lists what ``listing`` says; ``during_list`` runs while the remote is being listed
    (another node, or this node's mover, acting meanwhile); counts fetches."""

    def __init__(self, listing: dict[str, Listing]) -> None:
        self.listing = listing
        self.during_list: Callable[[], Awaitable[None]] | None = None
        self.fetches = 0
        self.failed_listings: list[str] = []  # what status was told of

    async def ensure_local(self, ino: int, offset: int, size: int) -> int:
        self.fetches += 1
        raise AssertionError("nothing may be fetched here")

    async def list_dir(self, dir_key: str) -> Listing:
        result = self.listing.get(dir_key, ([], []))
        if self.during_list is not None:
            await self.during_list()
        return result

    def listing_failed(self, dir_key: str, reason: str) -> None:
        self.failed_listings.append(dir_key)

    def forget(self, ino: int) -> None:
        pass

    async def let_go(self, ino: int) -> None:
        pass


def rows(cache: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(cache / "journal.db")
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def listed(core: BurstCore, remote: FakeRemote) -> None:
    core.links.fetcher = remote
    core.listings.ttl = 0


def test_burstfs_is_reserved_at_the_root(tmp_path: Path) -> None:
    """#4: .burstfs at the root is the remote's own (manifests, layout.json): EPERM."""

    async def body(core: BurstCore) -> None:
        await write_file(core, ROOT_INO, b"f", b"x")
        for make in (
            lambda: core.create(ROOT_INO, b".burstfs", 0o644, os.O_WRONLY, UID, GID),
            lambda: core.mkdir(ROOT_INO, b".burstfs", 0o755, UID, GID),
            lambda: core.symlink(ROOT_INO, b".burstfs", b"f", UID, GID),
            lambda: core.rename(ROOT_INO, b"f", ROOT_INO, b".burstfs", 0),
        ):
            try:
                await make()
                raise AssertionError(".burstfs was made at the root")
            except BurstfsError as exc:
                assert exc.errno == errno.EPERM
        sub = await core.mkdir(ROOT_INO, b"sub", 0o755, UID, GID)
        await core.mkdir(sub.ino, b".burstfs", 0o755, UID, GID)  # elsewhere it is an ordinary name
        # A remote .burstfs (file or directory) at the root is never shown.
        listed(core, FakeRemote({"": ([(".burstfs", 3, 1.0), ("other", 2, 1.0)], [".burstfs"])}))
        assert await core.listings.refresh(core.namespace.inode(ROOT_INO))
        assert sorted(core.namespace.inode(ROOT_INO).children) == [b"f", b"other", b"sub"]  # type: ignore[arg-type]

    run_flaky(tmp_path, body)


def test_vanished_listed_files_are_forgotten_not_deleted(tmp_path: Path) -> None:
    """#7: another node deleted and rewrote `latest`; this node must not delete it."""

    async def body(core: BurstCore) -> None:
        remote = FakeRemote({"run": ([("latest", 5, 1.0), ("step1", 5, 1.0)], [])})
        run_dir = await core.mkdir(ROOT_INO, b"run", 0o755, UID, GID)
        listed(core, remote)
        assert await core.listings.refresh(run_dir)
        latest = core.namespace.child(run_dir.ino, b"latest")
        latest.lookups += 1  # the kernel holds it
        remote.listing["run"] = ([("step1", 5, 1.0)], [])  # B deleted it, its new one not yet listed
        assert await core.listings.refresh(run_dir)
        assert sorted(run_dir.children) == [b"step1"]  # type: ignore[arg-type]
        assert rows(tmp_path, "SELECT key FROM remote_deletes") == []
        core.forget(latest.ino, 1)
        assert latest.ino not in core.inodes
        remote.listing["run"] = ([("latest", 6, 2.0), ("step1", 5, 1.0)], [])  # B's new one
        assert await core.listings.refresh(run_dir)
        assert core.namespace.child(run_dir.ino, b"latest").size == 6
        assert rows(tmp_path, "SELECT key FROM remote_deletes") == []

    run_flaky(tmp_path, body)
    assert rows(
        tmp_path, "SELECT name, state, remote_key FROM inodes WHERE parent!=0 AND kind='file' ORDER BY name"
    ) == [(b"latest", "remote", "run/latest"), (b"step1", "remote", "run/step1")]


def test_odd_keys_are_skipped_and_the_rest_is_listed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """#11: a key like run/ckpt//notes.txt (empty name), names with '/' or NUL, '.',
    '..', or over NAME_MAX must not make the directory unlistable."""
    bad_files = ["", "a/b", "x\0y", ".", "..", "n" * 256, "é" * 128]
    bad_dirs = ["", "..", "d/e", "m" * 300]

    async def body(core: BurstCore) -> None:
        remote = FakeRemote(
            {
                "run/ckpt": (
                    [(n, 1, 1.0) for n in bad_files] + [("good", 4, 1.0), ("clash", 1, 1.0), ("inf", 1, float("inf"))],
                    [*bad_dirs, "sub", "clash"],
                )
            }
        )
        run_dir = await core.mkdir(ROOT_INO, b"run", 0o755, UID, GID)
        ckpt = await core.mkdir(run_dir.ino, b"ckpt", 0o755, UID, GID)
        listed(core, remote)
        for _ in range(2):
            assert await core.listings.refresh(ckpt)
            assert sorted(ckpt.children) == [b"clash", b"good", b"sub"]  # type: ignore[arg-type]
        fh = await core.open(core.namespace.child(ckpt.ino, b"good").ino, os.O_RDONLY)  # linked and usable
        await core.release(fh)

    with caplog.at_level("WARNING", logger="burstfs.listings"):
        run_flaky(tmp_path, body)
    skipped = [r.getMessage() for r in caplog.records if "event=listing_entry_skipped" in r.getMessage()]
    assert len(skipped) == len(bad_files) + len(bad_dirs) + 1  # each logged once, over two refreshes
    assert rows(tmp_path, "SELECT COUNT(*) FROM inodes WHERE parent!=0 AND ino!=1") == [(5,)]


def test_a_delete_completing_during_a_listing_does_not_resurrect_the_file(tmp_path: Path) -> None:
    """#19: the mover deletes this node's object while the remote is being listed."""

    async def body(core: BurstCore) -> None:
        ino = await write_file(core, ROOT_INO, b"f", b"old bytes")
        core.journal.execute("UPDATE inodes SET remote_key='f' WHERE ino=?", (ino,))  # drained
        await core.unlink(ROOT_INO, b"f")
        assert rows(tmp_path, "SELECT key FROM remote_deletes") == [("f",)]
        remote = FakeRemote({"": ([("f", 9, 1.0)], [])})  # listed before the delete landed

        async def mover_finishes_the_delete() -> None:
            core.journal.execute("DELETE FROM remote_deletes")

        remote.during_list = mover_finishes_the_delete
        listed(core, remote)
        try:
            await core.lookup(ROOT_INO, b"f")
            raise AssertionError("the deleted file came back")
        except BurstfsError as exc:
            assert exc.errno == errno.ENOENT

    run_flaky(tmp_path, body)


def test_a_file_unlinked_during_a_listing_does_not_come_back(tmp_path: Path) -> None:
    """#19: an upload landed (object listed) but was not journaled yet when the listing
    started; the file is unlinked meanwhile: its tombstone keeps it away."""

    async def body(core: BurstCore) -> None:
        await write_file(core, ROOT_INO, b"g", b"old bytes")
        remote = FakeRemote({"": ([("g", 9, 1.0)], [])})

        async def unlinked_meanwhile() -> None:
            await core.unlink(ROOT_INO, b"g")

        remote.during_list = unlinked_meanwhile
        listed(core, remote)
        assert await core.listings.refresh(core.namespace.inode(ROOT_INO))
        assert b"g" not in core.namespace.inode(ROOT_INO).children  # type: ignore[operator]

    run_flaky(tmp_path, body)


# -- #13, #18b ----------------------------------------------------------------------------------


def test_closed_files_keep_no_streaming_digest_state(tmp_path: Path) -> None:
    """#13: ~6.9 KB per closed file; the digests are journaled, the state is dropped."""

    async def body(core: BurstCore) -> None:
        fh, inode = await core.create(ROOT_INO, b"a", 0o644, os.O_WRONLY, UID, GID)
        await core.write(fh, 0, b"abc")
        await core.flush(fh)
        assert inode.digests is not None  # still open for writing: more may come
        await core.release(fh)
        assert inode.digests is None
        ino = await write_file(core, ROOT_INO, b"b", b"x" * 100)
        await core.setattr(ino, size=0)  # truncate(2) on a path: a close
        assert core.namespace.inode(ino).digests is None
        fh = await core.open(ino, os.O_WRONLY | os.O_APPEND)  # an append after close: the drain hashes
        await core.write(fh, 0, b"more")
        await core.release(fh)
        assert core.namespace.inode(ino).digests is None

    run_flaky(tmp_path, body)
    assert [
        r[0] is not None
        for r in rows(tmp_path, "SELECT digest FROM inodes WHERE name IN (?, ?) ORDER BY name", (b"a", b"b"))
    ] == [True, False]


@pytest.mark.parametrize("how", ["open", "truncate"])
def test_emptying_a_remote_only_file_fetches_nothing(tmp_path: Path, how: str) -> None:
    """#18b: open(O_TRUNC) or truncate(0) of a remote-only file must not download it
    (a corrupt object could otherwise never be overwritten)."""

    async def body(core: BurstCore) -> None:
        remote = FakeRemote({"": ([("corrupt.pt", 1000, 1.0)], [])})
        listed(core, remote)
        inode = await core.lookup(ROOT_INO, b"corrupt.pt")
        assert not inode.local
        if how == "open":
            fh = await core.open(inode.ino, os.O_WRONLY | os.O_TRUNC)
            await core.write(fh, 0, b"fresh")
            await core.flush(fh)
            await core.release(fh)
        else:
            await core.setattr(inode.ino, size=0)
        assert remote.fetches == 0 and inode.local and not inode.listed
        fh = await core.open(inode.ino, os.O_RDONLY)
        assert await core.read(fh, 0, 100) == (b"fresh" if how == "open" else b"")
        await core.release(fh)

    run_flaky(tmp_path, body)
    assert rows(tmp_path, "SELECT state, size, generation FROM inodes WHERE name=?", (b"corrupt.pt",)) == [
        ("staged", 5 if how == "open" else 0, 1)
    ]


def test_a_slow_listing_does_not_hold_a_lookup(tmp_path: Path) -> None:
    """Issue 11: a lookup miss waits a bounded time for the remote listing, then
    answers from what is local; the listing merges when it arrives."""

    async def body(core: BurstCore) -> None:
        await write_file(core, ROOT_INO, b"mine", b"local")  # this node holds entries here
        remote = FakeRemote({"": ([("late", 4, 1.0)], [])})
        release = trio.Event()
        remote.during_list = release.wait  # a remote that does not answer
        listed(core, remote)
        core.listings.ttl = 60
        core.listings.wait = core.listings.first_wait = 0.05
        with trio.fail_after(10):  # without the bound this hangs until the remote answers
            try:
                await core.lookup(ROOT_INO, b"late")
                raise AssertionError("found before the listing arrived")
            except BurstfsError as exc:
                assert exc.errno == errno.ENOENT
            fh = await core.opendir(ROOT_INO)  # answered from local entries too
            assert [name for name, _ in core.readdir(fh, 0)] == [b"mine"]
            core.releasedir(fh)
            release.set()
            while b"late" not in core.namespace.inode(ROOT_INO).children:  # type: ignore[operator]
                await trio.sleep(0.01)
        assert (await core.lookup(ROOT_INO, b"late")).size == 4

    run_flaky(tmp_path, body)


def test_an_unseen_directory_of_the_remote_answers_eio_until_a_listing_lands(tmp_path: Path) -> None:
    """A fresh cache's root, holding nothing here, whose listing does not land: a missing
    name is unknown there, not absent (EIO, not ENOENT); once a listing lands, it is found."""

    async def body(core: BurstCore) -> None:
        remote = FakeRemote({"": ([("ckpt.pt", 4, 1.0)], [])})
        release = trio.Event()
        remote.during_list = release.wait  # a remote that does not answer
        listed(core, remote)
        core.listings.wait = core.listings.first_wait = 0.05
        with trio.fail_after(10):
            for call in (lambda: core.lookup(ROOT_INO, b"ckpt.pt"), lambda: core.opendir(ROOT_INO)):
                with pytest.raises(BurstfsError) as unknown:
                    await call()
                assert unknown.value.errno == errno.EIO
            # The EIO says "see burstfs-admin status": status hears of it now, not only once the
            # listing gives up 30 s later.
            assert remote.failed_listings == [""]
            release.set()
            while b"ckpt.pt" not in core.namespace.inode(ROOT_INO).children:  # type: ignore[operator]
                await trio.sleep(0.01)
        assert (await core.lookup(ROOT_INO, b"ckpt.pt")).size == 4
        with pytest.raises(BurstfsError) as absent:  # listed now: a missing name is absent
            await core.lookup(ROOT_INO, b"other.pt")
        assert absent.value.errno == errno.ENOENT

    run_flaky(tmp_path, body)


def test_a_throttled_listing_does_not_make_other_directories_answer_eio_at_once(tmp_path: Path) -> None:
    """(An acceptance pass.)  After one directory's listing gave up on 503 SlowDown, a lookup
    in every other directory this fresh node had not listed failed EIO at once for 30 s
    without trying (the backoff for a hung remote), though the remote answered again: a
    restore's os.walk then missed whole directories silently.  A throttled listing does not
    set that backoff; a remote that hangs or does not answer still does."""

    async def body(core: BurstCore) -> None:
        remote = FakeRemote({"": ([], ["a", "b"]), "a": ([("x.pt", 4, 1.0)], []), "b": ([("y.pt", 4, 1.0)], [])})
        throttled = ["a"]
        list_dir = remote.list_dir

        async def flaky_list(dir_key: str) -> Any:
            if dir_key in throttled:
                throttled.remove(dir_key)
                raise RemoteError("list a: throttled the requests for 6 attempts", kind=THROTTLED)
            return await list_dir(dir_key)

        remote.list_dir = flaky_list  # type: ignore[method-assign]
        listed(core, remote)
        core.listings.ttl = 60
        with trio.fail_after(10):
            a = await core.lookup(ROOT_INO, b"a")
            b = await core.lookup(ROOT_INO, b"b")
            with pytest.raises(BurstfsError) as failed:
                await core.lookup(a.ino, b"x.pt")
            assert failed.value.errno == errno.EIO
            assert (await core.lookup(b.ino, b"y.pt")).size == 4  # listed, not refused for 30 s

    run_flaky(tmp_path, body)


def test_the_first_listing_of_a_directory_may_take_longer(tmp_path: Path) -> None:
    """A restore node must see what the remote holds: the first listing of a directory
    this node never listed is waited for up to ``listings.first_wait``, later ones only
    up to ``listings.wait``."""

    async def body(core: BurstCore) -> None:
        remote = FakeRemote({"": ([("ckpt.pt", 4, 1.0)], [])})

        async def slow() -> None:
            await trio.sleep(0.3)

        remote.during_list = slow
        listed(core, remote)
        core.listings.ttl = 0
        core.listings.wait, core.listings.first_wait = 0.01, 5.0
        with trio.fail_after(10):
            assert (await core.lookup(ROOT_INO, b"ckpt.pt")).size == 4  # the first listing is waited for
            with pytest.raises(BurstfsError) as missing:  # a later one is not: answered from local entries
                await core.lookup(ROOT_INO, b"other.pt")
            assert missing.value.errno == errno.ENOENT

    run_flaky(tmp_path, body)


def test_listing_memos_let_go_of_checkpoints_removed_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long run lists other nodes' checkpoints and removes the old ones (keep-last-N): the
    memo of a listed file went only when a listing dropped it, and that of a listed directory
    never, so every checkpoint ever seen stayed in the daemon's memory."""
    monkeypatch.setattr(listings, "MEMO_SWEEP_MIN", 8)

    async def body(core: BurstCore) -> None:
        remote = FakeRemote({})
        listed(core, remote)
        for step in range(20):
            name = f"step{step}"
            remote.listing[""] = ([], [name])
            remote.listing[name] = ([(f"shard{i}", 5, 1.0) for i in range(5)], [])
            assert await core.listings.refresh(core.namespace.inode(ROOT_INO))
            directory = core.namespace.child(ROOT_INO, name.encode())
            assert await core.listings.refresh(directory)
            assert len(directory.children) == 5  # type: ignore[arg-type]
            for i in range(5):
                await core.unlink(directory.ino, f"shard{i}".encode())
            await core.rmdir(ROOT_INO, name.encode())
            remote.listing.pop(name)
        memos = len(core.listings._etags) + len(core.listings._seen)
        assert memos <= 2 * 8, f"{memos} memo entries for 20 checkpoints removed here"

    run_flaky(tmp_path, body)

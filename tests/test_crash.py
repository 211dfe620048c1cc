"""Crash safety: kill -9 the daemon, mount the same cache again, nothing closed is lost.

Tenet 1: when close() returns, the bytes are on the local tier and in the
journal.  These tests write a realistic tree, kill the daemon without warning,
remount, and compare the whole namespace and every closed file's sha256.
Files that were open for writing come back flagged ``incomplete``.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import sqlite3
import stat
import time
from pathlib import Path

import pytest
from conftest import MountedFS, burstfs, force_unmount, wait_for

from burstfs.recovery import ALIVE_PERIOD_S, RELEASE_GRACE_S

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def snapshot(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, tuple[object, ...]]:
    """Every entry under ``root``: type, mode, and size + sha256 or link target."""
    tree: dict[str, tuple[object, ...]] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top) / name
            rel = str(path.relative_to(root))
            if rel in skip:
                continue
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                tree[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                tree[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                tree[rel] = ("file", stat.S_IMODE(st.st_mode), st.st_size, digest)
    return tree


def journal_state(cache: Path, name: str) -> list[str]:
    db = sqlite3.connect(cache / "journal.db")
    try:
        return [s for (s,) in db.execute("SELECT state FROM inodes WHERE name=?", (name.encode(),))]
    finally:
        db.close()


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} survived SIGKILL")


def wait_for_tier_size(cache: Path, ino: int, size: int) -> None:
    """Wait until ``size`` bytes of inode ``ino`` reached the daemon's local tier."""
    data = cache / "data" / f"{ino:016x}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if data.exists() and data.stat().st_size == size:
            return
        time.sleep(0.02)
    raise AssertionError(f"{data} never reached {size} bytes")


def test_kill_9_loses_nothing_closed(burst: MountedFS) -> None:
    root = burst.path
    sizes = {"empty": 0, "one": 1, "page_less": 4095, "page": 4096, "odd": MiB + 3, "big": 20 * MiB}
    (root / "ckpt" / "step_10").mkdir(parents=True)
    (root / "ckpt" / "step_20").mkdir(parents=True)
    (root / "logs" / "deep" / "er").mkdir(parents=True)
    for i, (name, size) in enumerate(sizes.items()):
        data = (hashlib.sha256(name.encode()).digest() * (size // 32 + 1))[:size]
        (root / "ckpt" / "step_10" / f"{name}.bin").write_bytes(data)
        (root / "logs" / "deep" / "er" / f"{i}.txt").write_bytes(data[:1000])
    # Renames: a file, a file over another (atomic replace), a directory.
    os.rename(root / "ckpt" / "step_10" / "one.bin", root / "ckpt" / "step_20" / "one.bin")
    (root / "ckpt" / "latest.tmp").write_bytes(b"step_10")
    (root / "ckpt" / "latest").write_bytes(b"step_0")
    os.replace(root / "ckpt" / "latest.tmp", root / "ckpt" / "latest")
    os.rename(root / "logs" / "deep", root / "logs" / "moved")
    # Deletes: a file, a directory.
    os.unlink(root / "ckpt" / "step_10" / "page.bin")
    (root / "gone").mkdir()
    os.rmdir(root / "gone")
    os.symlink("ckpt/step_10", root / "current")
    os.chmod(root / "ckpt" / "step_10" / "odd.bin", 0o600)
    # A closed file rewritten in place and closed again.
    with open(root / "ckpt" / "step_10" / "page_less.bin", "r+b") as f:
        f.write(b"REWRITTEN")
    # A file being written when the daemon dies (its bytes pushed to the daemon).
    partial = b"P" * (3 * MiB)
    open_fd = os.open(root / "ckpt" / "step_20" / "partial.bin", os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(open_fd, partial)
    open_ino = os.fstat(open_fd).st_ino
    os.posix_fadvise(open_fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start writeback to the daemon
    wait_for_tier_size(burst.cache, open_ino, len(partial))
    assert os.getxattr(root / "ckpt" / "step_20" / "partial.bin", "user.burstfs.state") == b"writing"

    before = snapshot(root, skip=frozenset({"ckpt/step_20/partial.bin"}))
    assert before["ckpt/latest"][3] == hashlib.sha256(b"step_10").hexdigest()
    assert len([k for k, v in before.items() if v[0] == "file"]) == len(sizes) * 2  # +latest -page.bin

    burst.kill()
    try:
        os.close(open_fd)
    except OSError:
        pass  # the connection is gone: close may report it
    assert journal_state(burst.cache, "partial.bin") == ["writing"]

    burst.mount()
    after = snapshot(root, skip=frozenset({"ckpt/step_20/partial.bin"}))
    assert after == before
    # The file that was open: present, flagged incomplete, with the bytes that reached the tier.
    p = root / "ckpt" / "step_20" / "partial.bin"
    assert journal_state(burst.cache, "partial.bin") == ["incomplete"]
    assert os.getxattr(p, "user.burstfs.state") == b"incomplete"
    assert os.getxattr(p, "user.burstfs.error") == b"open for writing when the daemon stopped"
    assert p.read_bytes() == partial
    # Closed files are not incomplete.
    closed = ("staged", "draining", "durable")
    assert journal_state(burst.cache, "big.bin")[0] in closed
    assert journal_state(burst.cache, "empty.bin")[0] in closed
    assert os.getxattr(root / "ckpt" / "step_10" / "big.bin", "user.burstfs.state").decode() in closed
    # Appending does not make it whole; rewriting it from empty does.
    with open(p, "ab") as f:
        f.write(b"+")
    assert os.getxattr(p, "user.burstfs.state") == b"incomplete"
    p.write_bytes(b"complete now")
    assert os.getxattr(p, "user.burstfs.state").decode() in closed
    assert p.read_bytes() == b"complete now"
    burst.unmount()
    burst.mount()
    assert snapshot(root, skip=frozenset({"ckpt/step_20/partial.bin"})) == before
    assert p.read_bytes() == b"complete now"


def _killed_while_written_after_a_close(burst: MountedFS, p: Path, publish: str) -> bytes:
    """Write ``part1-`` to ``p``, journal it (``publish``: a dup closed or an fsync), write on,
    and kill -9 the daemon once those later bytes reached the tier; returns them."""
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, b"part1-")
    if publish == "fsync":
        os.fsync(fd)
    else:
        os.close(os.dup(fd))  # a FLUSH, as a child's exec sends
    later = b"part2-never-closed" * 1000
    os.write(fd, later)
    ino = os.fstat(fd).st_ino
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # through the daemon: start writeback
    wait_for_tier_size(burst.cache, ino, 6 + len(later))
    burst.kill()
    try:
        os.close(fd)
    except OSError:
        pass  # the connection is gone
    return later


@pytest.mark.parametrize("publish", ["a dup closed", "fsync"])
def test_kill_9_of_a_file_still_written_after_a_close_or_fsync_is_incomplete(burst: MountedFS, publish: str) -> None:
    """A close of one descriptor (a forked child's exec, ``cmd > file``) or an fsync journals
    the file while it stays open; bytes written after that are no closed version: after a
    crash the file is incomplete (with every byte that reached the tier), never drained as
    a mix of the journaled size and later bytes (with passthrough the kernel writes them to
    the tier without the daemon)."""
    p = burst.path / "ckpt.pt"
    later = _killed_while_written_after_a_close(burst, p, publish)
    burst.mount()
    assert journal_state(burst.cache, "ckpt.pt") == ["incomplete"]
    assert os.getxattr(p, "user.burstfs.state") == b"incomplete"
    assert p.read_bytes() == b"part1-" + later
    assert os.stat(p).st_size == 6 + len(later)
    time.sleep(0.5)  # the drain had its chance
    published = burst.remote_dir / "ckpt.pt"
    assert not published.exists() or published.read_bytes() == b"part1-"  # at most the fsync'd version


@pytest.mark.parametrize("publish", ["a dup closed", "fsync"])
def test_burstfs_drain_after_a_kill_9_does_not_publish_a_file_still_written(burst: MountedFS, publish: str) -> None:
    """``burstfs drain --cache`` after a crash flags what the next start would flag before it
    drains: a file written after a journaled close or fsync was drained (200000 bytes, a mix of
    the closed version and later writes, published as durable) while the command said it was
    incomplete and would never drain."""
    p = burst.path / "ckpt.pt"
    later = _killed_while_written_after_a_close(burst, p, publish)
    drained = burstfs("drain", "--cache", str(burst.cache), "--now", timeout=60)
    assert "1 file (18006 bytes) is incomplete" in drained.stderr
    assert journal_state(burst.cache, "ckpt.pt") == ["incomplete"]
    published = burst.remote_dir / "ckpt.pt"
    assert not published.exists() or published.read_bytes() == b"part1-"  # at most the fsync'd version
    burst.mount()  # the next start agrees
    assert journal_state(burst.cache, "ckpt.pt") == ["incomplete"]
    assert p.read_bytes() == b"part1-" + later


def test_unmount_of_a_dead_mount_shows_its_open_files_incomplete(burst: MountedFS) -> None:
    """After kill -9 and the documented cleanup (``burstfs unmount MNT``), ``burstfs-admin``
    reading the stopped cache says a file that was open for writing is incomplete, with the
    bytes its data file holds; it said "writing 0 B" until the next mount."""
    p = burst.path / "open.bin"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x" * 100000)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # through the daemon: start writeback
        wait_for_tier_size(burst.cache, os.fstat(fd).st_ino, 100000)
        wait_for(lambda: journal_state(burst.cache, "open.bin") == ["writing"], what="its create journaled")
        pid = burst.daemon_pid()
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass  # the connection is gone
    result = burstfs("unmount", str(burst.path))
    assert "1 file (100000 bytes) is incomplete" in result.stdout
    import json
    import subprocess
    import sys

    admin = Path(sys.executable).with_name("burstfs-admin")
    listed = subprocess.run(
        [str(admin), "ls", "--json", "--cache", str(burst.cache), str(burst.cache)],
        capture_output=True,
        text=True,
        check=True,
    )
    (entry,) = [f for f in json.loads(listed.stdout)["files"] if f["path"] == "open.bin"]
    assert (entry["state"], entry["size"]) == ("incomplete", 100000)


def test_kill_9_while_a_forked_child_closed_the_writers_descriptor_keeps_the_previous_version(
    burst: MountedFS,
) -> None:
    """v1 is durable; a trainer rewrites it, spawns a subprocess halfway (the child's exec
    closes its copy of the descriptor: a FLUSH), writes on, and the daemon dies before the
    trainer's own close.  Through the daemon the later bytes were still in the kernel's
    cache, so the tier held exactly the child's "close": it drained as durable after the
    remount, a torn file over v1.  The file is incomplete; the remote keeps v1.  (A crash
    within RELEASE_GRACE_S of such a close cannot be told from one right after the writer's
    own close(2), which must drain: test_kill_9_after_a_thousand_small_files.)"""
    import subprocess

    p = burst.path / "ckpt.pt"
    v1 = os.urandom(2 << 20)
    p.write_bytes(v1)
    wait_for(lambda: journal_state(burst.cache, "ckpt.pt") == ["durable"], what="v1 durable")
    with open(p, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        subprocess.run(["true"], check=True, close_fds=False)
        f.write(os.urandom(1 << 20))
        f.flush()
        time.sleep(RELEASE_GRACE_S + 2 * ALIVE_PERIOD_S)  # the trainer writes on
        burst.kill()
        try:
            f.close()
        except OSError:
            pass  # the connection is gone
    burst.mount()
    assert journal_state(burst.cache, "ckpt.pt") == ["incomplete"]
    time.sleep(0.5)  # the drain had its chance
    assert (burst.remote_dir / "ckpt.pt").read_bytes() == v1


def test_kill_9_after_a_thousand_small_files(burst: MountedFS) -> None:
    d = burst.path / "shards"
    d.mkdir()
    expected = {f"{i:04d}.pt": f"shard {i} ".encode() * (i % 7 + 1) for i in range(1000)}
    for name, data in expected.items():
        with open(d / name, "wb") as f:
            f.write(data)
    burst.kill()
    burst.mount()
    assert sorted(os.listdir(d)) == sorted(expected)
    for name, data in expected.items():
        assert (d / name).read_bytes() == data, name
    db = sqlite3.connect(burst.cache / "journal.db")
    try:
        states = dict(db.execute("SELECT state, COUNT(*) FROM inodes WHERE kind='file' GROUP BY state"))
    finally:
        db.close()
    assert "incomplete" not in states and "writing" not in states
    assert sum(states.values()) == 1000


def test_kill_9_with_unlinked_open_file_and_replaced_target(burst: MountedFS) -> None:
    root = burst.path
    (root / "keep").write_bytes(b"keep")
    scratch = open(root / "scratch", "w+b")  # noqa: SIM115 (open when the daemon dies)
    scratch.write(b"s" * 100_000)
    scratch.flush()
    os.unlink(root / "scratch")
    (root / "new").write_bytes(b"new")
    reader = open(root / "keep", "rb")  # noqa: SIM115 (open when the daemon dies)
    os.replace(root / "new", root / "keep")  # replaced while a reader holds it open
    pid = burst.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)
    with pytest.raises(OSError) as dead:  # until unmounted, the mount point says so
        os.stat(root / "keep")
    assert dead.value.errno == errno.ENOTCONN
    force_unmount(root)
    for f in (scratch, reader):
        try:
            f.close()
        except OSError:
            pass
    burst.mount()
    assert sorted(os.listdir(root)) == ["keep"]
    assert (root / "keep").read_bytes() == b"new"
    # Only the live file's data remains on the local tier.
    data_files = sorted(p.read_bytes() for p in (burst.cache / "data").iterdir())
    assert data_files == [b"new"]


@pytest.mark.parametrize("damage", ["removed", "emptied"])
def test_a_cache_that_lost_its_journal_is_refused_and_its_data_kept(
    mounted_factory: type[MountedFS], damage: str
) -> None:
    """A journal lost (deleted, or emptied by a full disk) while the tier holds closed files
    not yet durable: a mount would start a fresh journal and remove those data files as a
    crash's leftovers.  It is refused (exit 2, one line), and the data files stay."""
    fs = mounted_factory(extra_args=("--drain-delay", "3600"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "ckpt.pt").write_bytes(b"only copy" * 1000)
    fs.unmount()
    for name in ("journal.db-wal", "journal.db-shm"):
        (fs.cache / name).unlink(missing_ok=True)
    journal = fs.cache / "journal.db"
    if damage == "removed":
        journal.unlink()
    else:
        journal.write_bytes(b"")
    data = sorted(os.listdir(fs.cache / "data"))
    assert data
    result = burstfs(
        "mount", str(fs.path), "--cache", str(fs.cache), "--remote", fs.remote_url, *fs.extra_args, check=False
    )
    assert result.returncode == 2, result.stderr
    assert "no journal" in result.stderr and "Traceback" not in result.stderr
    assert sorted(os.listdir(fs.cache / "data")) == data
    assert [(fs.cache / "data" / name).read_bytes() for name in data] == [b"only copy" * 1000]


def test_a_damaged_journal_is_one_line_saying_what_to_do(mounted_factory: type[MountedFS]) -> None:
    """A journal damaged on disk: `burstfs drain` and `burstfs mount` say so in one line and how
    to go on (they printed a sqlite traceback); nothing is mounted."""
    fs = mounted_factory()  # type: ignore[call-arg]
    fs.expect_log("event=daemon_failed error=journal")
    fs.mount()
    (fs.path / "a.pt").write_bytes(b"a")
    fs.unmount()
    with open(fs.cache / "journal.db", "r+b") as journal:
        journal.seek(100)
        journal.write(b"\xff" * 3000)
    drained = burstfs("drain", "--cache", str(fs.cache), check=False)
    mounted = burstfs("mount", str(fs.path), "--cache", str(fs.cache), "--remote", fs.remote_url, check=False)
    for result in (drained, mounted):
        assert result.returncode == 1, result.stderr
        assert "damaged; move the cache dir aside" in result.stderr and "Traceback" not in result.stderr
    assert not os.path.ismount(fs.path)

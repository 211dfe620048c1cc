"""The POSIX surface of a real mount: what programs see through the kernel.

Each test runs against a fresh ``burstfs mount`` (fixture ``burst``) and checks
values and errnos as a program sees them, including the requests checkpoint
writers rarely make (O_DIRECT, FIFOs, hard links) which must fail cleanly
without taking the daemon down.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import hashlib
import mmap
import multiprocessing
import os
import platform
import stat
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import BIN, MountedFS, file_state, journal_rows, wait_for

pytestmark = pytest.mark.fuse

NOBODY = 65534
LIBC = ctypes.CDLL(None, use_errno=True)
SYS_GETDENTS64 = {"x86_64": 217, "aarch64": 61}.get(platform.machine())
SYSTEM_PYTHON = "/usr/bin/python3"  # readable by nobody, unlike a venv under /root
# States of a file whose last close is journaled (the drain moves it along them).
CLOSED = (b"staged", b"draining", b"durable")


def oserror(code: int) -> pytest.RaisesContext[OSError]:
    return pytest.raises(OSError, match=rf"^\[Errno {code}\]")


# -- create, open flags, read, write ----------------------------------------------------


def test_create_exclusive_trunc_append(burst: MountedFS) -> None:
    p = burst.path / "f"
    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    os.write(fd, b"0123456789")
    os.close(fd)
    with oserror(errno.EEXIST):
        os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    # O_CREAT without O_EXCL opens the existing file and keeps its data.
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    assert os.read(fd, 100) == b"0123456789"
    os.close(fd)
    # O_APPEND: every write goes to the end, whatever the offset.
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, b"ab")
    other = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(other, b"cd")
    os.write(fd, b"ef")
    os.close(other)
    os.close(fd)
    assert p.read_bytes() == b"0123456789abcdef"
    # O_TRUNC empties it.
    fd = os.open(p, os.O_WRONLY | os.O_TRUNC)
    assert os.fstat(fd).st_size == 0
    os.write(fd, b"new")
    os.close(fd)
    assert p.read_bytes() == b"new"
    # Linux truncates on O_RDONLY | O_TRUNC as well; that is a complete change, journaled at once.
    os.close(os.open(p, os.O_RDONLY | os.O_TRUNC))
    assert p.stat().st_size == 0
    assert os.getxattr(p, "user.burstfs.state") in CLOSED
    # The mode asked for, minus the umask.
    old = os.umask(0o027)
    try:
        q = burst.path / "masked"
        os.close(os.open(q, os.O_CREAT | os.O_WRONLY, 0o666))
    finally:
        os.umask(old)
    assert stat.S_IMODE(q.stat().st_mode) == 0o640
    with oserror(errno.ENOENT):
        os.open(burst.path / "missing", os.O_RDONLY)
    with oserror(errno.ENOENT):
        os.open(burst.path / "nodir" / "f", os.O_CREAT | os.O_WRONLY)


def test_read_write_any_offset_and_holes(burst: MountedFS) -> None:
    p = burst.path / "sparse"
    with open(p, "wb") as f:
        f.write(b"head")
        f.seek(10 << 20)
        f.write(b"tail")
    assert p.stat().st_size == (10 << 20) + 4
    with open(p, "rb") as f:
        assert f.read(4) == b"head"
        f.seek(5 << 20)
        assert f.read(1 << 20) == bytes(1 << 20)  # holes read as zeros
        f.seek((10 << 20) - 2)
        assert f.read(100) == b"\0\0tail"
        assert f.read(100) == b""  # at EOF
    # Overwrite in the middle, through pwrite, on a reopened file.
    fd = os.open(p, os.O_RDWR)
    try:
        assert os.pwrite(fd, b"MID", 3 << 20) == 3
        assert os.pread(fd, 5, (3 << 20) - 1) == b"\0MID\0"
        assert os.pread(fd, 10, 1 << 30) == b""
    finally:
        os.close(fd)
    data = p.read_bytes()
    assert len(data) == (10 << 20) + 4
    assert data[:4] == b"head" and data[3 << 20 : (3 << 20) + 3] == b"MID" and data[-4:] == b"tail"
    assert data.count(0) == len(data) - 11


def test_large_file_round_trip(burst: MountedFS) -> None:
    payload = os.urandom(1 << 20) * 24 + os.urandom(12345)  # 24 MiB + odd tail
    p = burst.path / "big.bin"
    with open(p, "wb") as f:
        for i in range(0, len(payload), 3 << 20):
            f.write(payload[i : i + (3 << 20)])
    assert hashlib.sha256(p.read_bytes()).digest() == hashlib.sha256(payload).digest()
    # The local tier holds exactly these bytes (one data file per inode).
    staged = [e for e in (burst.cache / "data").iterdir() if e.stat().st_size == len(payload)]
    assert len(staged) == 1 and staged[0].read_bytes() == payload


def test_truncate_grow_and_shrink(burst: MountedFS) -> None:
    p = burst.path / "t"
    p.write_bytes(b"abcdefgh")
    os.truncate(p, 3)
    assert p.read_bytes() == b"abc"
    os.truncate(p, 6)
    assert p.read_bytes() == b"abc\0\0\0"
    with open(p, "r+b") as f:
        f.truncate(1)
        assert os.fstat(f.fileno()).st_size == 1
        f.seek(0, os.SEEK_END)
        f.write(b"Z")
        f.truncate(4)
    assert p.read_bytes() == b"aZ\0\0"
    os.truncate(p, 0)
    assert p.stat().st_size == 0 and p.read_bytes() == b""
    with oserror(errno.EISDIR):
        os.truncate(burst.path, 0)


def test_fsync_and_fdatasync_journal_before_close(burst: MountedFS) -> None:
    p = burst.path / "synced"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, b"x" * 100_000)
        os.fsync(fd)
        # fsync journaled the file as closed (staged, then drained) while fd is still open.
        assert os.getxattr(p, "user.burstfs.state") in CLOSED
        assert os.getxattr(p, "user.burstfs.generation") == b"1"
        os.write(fd, b"y")
        os.fdatasync(fd)
        assert os.getxattr(p, "user.burstfs.generation") == b"2"
    finally:
        os.close(fd)
    assert p.read_bytes() == b"x" * 100_000 + b"y"
    # An fsync with nothing new, and fsync of a directory, succeed.
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dfd = os.open(burst.path, os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
    os.close(dfd)


def test_stat_during_and_after_writes(burst: MountedFS) -> None:
    p = burst.path / "growing"
    before = time.time_ns()
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o640)
    try:
        st = os.fstat(fd)
        assert st.st_size == 0 and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
        assert st.st_uid == os.getuid() and st.st_nlink == 1
        for n in range(1, 4):
            os.write(fd, b"z" * 1000)
            assert os.fstat(fd).st_size == 1000 * n
            assert p.stat().st_size == 1000 * n  # by path, before close
        assert p.stat().st_mtime_ns >= before - 1_000_000_000
    finally:
        os.close(fd)
    st = p.stat()
    assert st.st_size == 3000 and st.st_blksize >= 4096
    assert before - 1_000_000_000 <= st.st_mtime_ns <= time.time_ns() + 1_000_000_000
    # A directory's mtime moves when an entry is added.
    d = burst.path / "dir"
    d.mkdir()
    os.utime(d, ns=(1, 1))
    (d / "new").write_bytes(b"")
    assert d.stat().st_mtime_ns > 1


def test_chmod_chown_utimens_survive_remount(burst: MountedFS) -> None:
    p = burst.path / "attrs"
    p.write_bytes(b"data")
    os.chmod(p, 0o600)
    os.chown(p, 1234, 5678)
    os.utime(p, ns=(1_600_000_000_123_456_789, 1_500_000_000_987_654_321))
    d = burst.path / "d"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o1777)

    def check() -> None:
        st = p.stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert (st.st_uid, st.st_gid) == (1234, 5678)
        assert st.st_atime_ns == 1_600_000_000_123_456_789
        assert st.st_mtime_ns == 1_500_000_000_987_654_321
        assert stat.S_IMODE(d.stat().st_mode) == 0o1777

    check()
    (burst.path / "plain").write_bytes(b"x")
    mtime_written = (burst.path / "plain").stat().st_mtime_ns
    burst.unmount()
    burst.mount()
    check()
    assert (burst.path / "plain").stat().st_mtime_ns == mtime_written


def test_times_seen_after_close_are_the_ones_journaled(burst: MountedFS) -> None:
    """The mtime and ctime stat shows once a file is closed are what a remount shows.
    Through the daemon the kernel's write-back cache keeps them (it stamps its own clock and
    shows that): a daemon that stamped the WRITEs reaching it after the kernel sent its
    times (copy_file_range, a small pwrite in the kernel's current clock tick) journaled
    other times, and the mtime moved at every remount."""
    m = burst.path
    with open(m / "src", "wb") as f:
        f.write(b"z" * 70000)
    src = os.open(m / "src", os.O_RDONLY)
    dst = os.open(m / "cfr", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert os.copy_file_range(src, dst, 70000, 0, 0) == 70000
    finally:
        os.close(src)
        os.close(dst)
    buf = mmap.mmap(-1, 8192)
    buf.write(b"y" * 8192)
    fd = os.open(m / "odirect", os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        os.write(fd, buf)
    finally:
        os.close(fd)
    fd = os.open(m / "odirect", os.O_RDWR)
    try:
        os.pwrite(fd, b"unaligned", 100)  # within the kernel's clock tick of the close above
    finally:
        os.close(fd)
    (m / "retruncated").write_bytes(b"a" * 5000)
    (m / "retruncated").write_bytes(b"b" * 10)  # O_TRUNC at once
    (m / "truncated").write_bytes(b"c" * 5000)
    os.truncate(m / "truncated", 3000)
    fd = os.open(m / "allocated", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"d" * 100)
        os.posix_fallocate(fd, 0, 1 << 16)
    finally:
        os.close(fd)
    (m / "mapped").write_bytes(b"\0" * 8192)
    with open(m / "mapped", "r+b") as f, mmap.mmap(f.fileno(), 0) as mapped:
        mapped[10:20] = b"0123456789"
        mapped.flush()
    (m / "chmodded").write_bytes(b"e")
    os.chmod(m / "chmodded", 0o600)
    (m / "ftruncated").write_bytes(b"f" * 5000)
    with open(m / "ftruncated", "r+b") as f:  # an acceptance pass: the remount showed an earlier mtime
        f.truncate(10)
    names = ["src", "cfr", "odirect", "retruncated", "truncated", "allocated", "mapped", "chmodded", "ftruncated"]

    def times() -> dict[str, tuple[int, int]]:
        return {name: ((st := os.stat(m / name)).st_mtime_ns, st.st_ctime_ns) for name in names}

    seen = times()
    time.sleep(0.05)  # a few of the kernel's clock ticks
    assert times() == seen
    query = "SELECT ino, mtime_ns, ctime_ns FROM inodes WHERE name=? AND parent!=0"
    rows = {name: journal_rows(burst.cache, query, (name.encode(),))[0] for name in names}
    assert {name: (mtime, ctime) for name, (_, mtime, ctime) in rows.items()} == seen
    # No data file is newer than its journaled close: the drain takes one for a writer it has not seen.
    data = burst.cache / "data"
    assert not [name for name, (ino, mtime, _) in rows.items() if (data / f"{ino:016x}").stat().st_mtime_ns > mtime]
    burst.unmount()
    burst.mount()
    after = times()
    moved = {name: (seen[name], after[name]) for name in names if after[name] != seen[name]}
    assert not moved, f"(mtime, ctime) before and after a remount: {moved}"
    assert (m / "cfr").read_bytes() == b"z" * 70000


# -- names: rename, unlink, directories, symlinks ---------------------------------------


def test_rename_files_and_directories(burst: MountedFS) -> None:
    root = burst.path
    (root / "a").write_bytes(b"A")
    os.rename(root / "a", root / "b")
    assert not (root / "a").exists() and (root / "b").read_bytes() == b"A"
    (root / "d1" / "sub").mkdir(parents=True)
    (root / "d1" / "sub" / "f").write_bytes(b"F")
    os.rename(root / "d1", root / "d2")
    assert (root / "d2" / "sub" / "f").read_bytes() == b"F"
    (root / "other").mkdir()
    os.rename(root / "d2" / "sub", root / "other" / "moved")
    assert (root / "other" / "moved" / "f").read_bytes() == b"F"
    assert os.listdir(root / "d2") == []
    # Directory over an empty directory: fine; over a non-empty one: ENOTEMPTY.
    with oserror(errno.ENOTEMPTY):
        os.rename(root / "d2", root / "other")
    (root / "empty").mkdir()
    os.rename(root / "d2", root / "empty")
    assert not (root / "d2").exists() and (root / "empty").is_dir()
    with oserror(errno.EISDIR):
        os.rename(root / "b", root / "empty")
    with oserror(errno.ENOTDIR):
        os.rename(root / "empty", root / "b")
    with oserror(errno.EINVAL):
        os.rename(root / "other", root / "other" / "moved" / "inside")
    with oserror(errno.ENOENT):
        os.rename(root / "nothing", root / "x")
    assert sorted(os.listdir(root)) == ["b", "empty", "other"]
    assert root.stat().st_nlink == 4  # ., .. and two subdirectories


def test_atomic_replace_keeps_old_data_for_open_readers(burst: MountedFS) -> None:
    target = burst.path / "latest"
    target.write_bytes(b"step-1")
    reader = open(target, "rb")  # noqa: SIM115 (held open across the replace)
    try:
        tmp = burst.path / ".latest.tmp"
        with open(tmp, "wb") as f:
            f.write(b"step-2")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        assert target.read_bytes() == b"step-2"
        assert not tmp.exists()
        assert reader.read() == b"step-1"  # the replaced file lives on for its reader
    finally:
        reader.close()
    assert sorted(os.listdir(burst.path)) == ["latest"]
    assert os.getxattr(target, "user.burstfs.state") in CLOSED


def test_unlink_open_file_and_rmdir(burst: MountedFS) -> None:
    p = burst.path / "scratch"
    with open(p, "w+b") as f:
        f.write(b"still here")
        os.unlink(p)
        assert not p.exists()
        f.seek(0)
        assert f.read() == b"still here"
        f.write(b" and more")
        f.seek(0)
        assert f.read() == b"still here and more"
    assert os.listdir(burst.path) == []
    with oserror(errno.ENOENT):
        os.unlink(p)
    d = burst.path / "d"
    d.mkdir()
    (d / "f").write_bytes(b"")
    with oserror(errno.ENOTEMPTY):
        os.rmdir(d)
    with oserror(errno.EISDIR):
        os.unlink(d)
    with oserror(errno.ENOTDIR):
        os.rmdir(d / "f")
    os.unlink(d / "f")
    os.rmdir(d)
    os.mkdir(burst.path / "x")
    with oserror(errno.EEXIST):
        os.mkdir(burst.path / "x")
    os.rmdir(burst.path / "x")
    # Nothing of the removed files is left on the local tier once closed.
    deadline = time.monotonic() + 10
    while any((burst.cache / "data").iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list((burst.cache / "data").iterdir()) == []


def test_deep_makedirs(burst: MountedFS) -> None:
    parts = [f"level{i:02d}" for i in range(60)]
    deep = burst.path.joinpath(*parts)
    os.makedirs(deep)
    os.makedirs(deep, exist_ok=True)
    (deep / "leaf.bin").write_bytes(b"leaf")
    walked = [(Path(top).relative_to(burst.path), files) for top, _, files in os.walk(burst.path)]
    assert len(walked) == 61
    assert walked[-1] == (Path(*parts), ["leaf.bin"])
    with oserror(errno.EEXIST):
        os.makedirs(deep)
    with oserror(errno.ENOTDIR):
        os.makedirs(deep / "leaf.bin" / "below")


def test_readdir_ten_thousand_entries(burst: MountedFS) -> None:
    """Every name comes back, once.  The entries are directories: they do not drain,
    so the test time is the listing's, not the drain's."""
    d = burst.path / "many"
    d.mkdir()
    names = [f"shard_{i:05d}" for i in range(10_000)]

    def create(chunk: list[str]) -> None:
        for name in chunk:
            os.mkdir(d / name)

    threads = [threading.Thread(target=create, args=(names[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (d / "plain.bin").write_bytes(b"a file among them")
    assert sorted(os.listdir(d)) == sorted(names + ["plain.bin"])
    with os.scandir(d) as it:
        entries = {e.name: e.is_dir(follow_symlinks=False) for e in it}
    assert len(entries) == 10_001 and sum(entries.values()) == 10_000 and not entries["plain.bin"]
    assert d.stat().st_nlink == 10_002
    for name in names[::2]:
        os.rmdir(d / name)
    assert sorted(os.listdir(d)) == sorted(names[1::2] + ["plain.bin"])


def _getdents(fd: int, size: int = 1024) -> list[str]:
    """One getdents64 call with a small buffer: the kernel asks the daemon for the rest of
    the listing in many READDIR requests, each resuming at the offset of the last entry
    it returned."""
    buf = ctypes.create_string_buffer(size)
    n = LIBC.syscall(SYS_GETDENTS64, fd, buf, ctypes.c_size_t(size))
    if n < 0:
        raise OSError(ctypes.get_errno(), "getdents64")
    raw, names, at = buf.raw[:n], [], 0
    while at < n:
        reclen = struct.unpack_from("H", raw, at + 16)[0]
        names.append(raw[at + 19 : at + reclen].split(b"\0", 1)[0].decode())
        at += reclen
    return names


@pytest.mark.skipif(SYS_GETDENTS64 is None, reason="getdents64's number on this machine is not known here")
def test_readdir_skips_entries_removed_during_a_listing_and_repeats_none(burst: MountedFS) -> None:
    """Offsets are positions in the opendir snapshot: a name removed after the listing
    started is skipped and shifts no other entry (each later entry came back a second
    time, and the removed names came back too: the unlink's lookup kept their inodes)."""
    d = burst.path / "d"
    d.mkdir()
    names = [f"e{i:04d}" for i in range(2000)]
    for name in names:
        (d / name).touch()
    removed = {name for i, name in enumerate(names) if i > 1500 and i % 3 == 0}
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seen: list[str] = []
        while len(seen) < 100:
            seen += _getdents(fd)
        for name in sorted(removed):
            os.unlink(d / name)
        while batch := _getdents(fd):
            seen += batch
    finally:
        os.close(fd)
    twice = sorted(name for name, count in collections.Counter(seen).items() if count > 1)
    assert not twice, f"{len(twice)} names returned twice: {twice[:5]}"
    assert not removed & set(seen)
    assert sorted(seen) == sorted(set(names) - removed)
    # Python's scandir: glibc reads entries in batches of up to 1 MiB (st_blksize), here the
    # whole directory at once, and returns what it holds even once unlinked.  Every name once.
    with os.scandir(d) as it:
        first = [next(it).name for _ in range(100)]
        gone = {name for name in names[1000:] if name not in removed and int(name[1:]) % 2}
        for name in gone:
            os.unlink(d / name)
        listed = first + [e.name for e in it]
    assert len(listed) == len(set(listed))
    assert set(listed) - gone == set(names) - removed - gone and not removed & set(listed)


def test_symlinks(burst: MountedFS) -> None:
    (burst.path / "step_100").mkdir()
    (burst.path / "step_100" / "model.pt").write_bytes(b"weights")
    os.symlink("step_100", burst.path / "latest")
    link = burst.path / "latest"
    assert os.readlink(link) == "step_100"
    assert stat.S_ISLNK(os.lstat(link).st_mode)
    assert (link / "model.pt").read_bytes() == b"weights"
    os.symlink("/nowhere/at/all", burst.path / "dangling")
    assert os.readlink(burst.path / "dangling") == "/nowhere/at/all"
    with oserror(errno.ENOENT):
        os.stat(burst.path / "dangling")
    with oserror(errno.EEXIST):
        os.symlink("x", link)
    with oserror(errno.EINVAL):
        os.readlink(burst.path / "step_100")
    os.rename(link, burst.path / "current")
    assert os.readlink(burst.path / "current") == "step_100"
    os.unlink(burst.path / "current")
    assert (burst.path / "step_100" / "model.pt").exists()


def _wait_state(path: Path, states: tuple[bytes, ...], timeout: float = 20) -> bytes:
    deadline = time.monotonic() + timeout
    while (state := os.getxattr(path, "user.burstfs.state")) not in states:
        assert time.monotonic() < deadline, f"{path} still {state!r}"
        time.sleep(0.02)
    return state


def test_fsync_remote_waits_until_durable_or_fails_with_eio(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory(extra_args=("--fsync", "remote"))  # type: ignore[call-arg]
    fs.mount()
    p = fs.path / "model.pt"
    with open(p, "wb") as f:
        f.write(b"w" * 300_000)
        f.flush()
        os.fsync(f.fileno())
        assert os.getxattr(p, "user.burstfs.state") == b"durable"  # no waiting needed
    assert (fs.remote_dir / "model.pt").read_bytes() == b"w" * 300_000
    # A remote that cannot take the file: fsync says so instead of pretending.
    fs.remote_dir.rename(fs.root / "remote.moved")
    fs.remote_dir.write_bytes(b"not a directory any more")
    fs.expect_log("event=request_failed op=fsync")
    q = fs.path / "optim.pt"
    with open(q, "wb") as f:
        f.write(b"o" * 1000)
        f.flush()
        with oserror(errno.EIO):
            os.fsync(f.fileno())
    assert os.getxattr(q, "user.burstfs.state") == b"staged"  # kept, to drain later
    assert q.read_bytes() == b"o" * 1000


def test_tier_full_of_undrained_data_is_enospc_and_the_short_file_never_drains(
    mounted_factory: type[MountedFS],
) -> None:
    fs = mounted_factory(extra_args=("--cache-size", "4M", "--evict", "none", "--full-timeout", "1"))  # type: ignore[call-arg]
    fs.mount()
    fs.expect_log("event=tier_full")
    fs.expect_log("event=request_failed")
    vfs = os.statvfs(fs.path)
    assert vfs.f_blocks * vfs.f_frsize == 4 << 20  # statfs shows the tier burstfs may use
    (fs.path / "first.bin").write_bytes(b"1" * (3 << 20))
    _wait_state(fs.path / "first.bin", (b"durable",))
    second = fs.path / "second.bin"
    f = open(second, "wb")  # noqa: SIM115 (its close is what fails)
    f.write(b"2" * (3 << 20))  # lands in the page cache; the tier refuses it on write-back
    with oserror(errno.ENOSPC):
        f.close()
    # A failed write-back makes close() fail before FLUSH is sent; the file is
    # journaled at RELEASE, which the kernel sends right after.
    _wait_state(second, (b"incomplete",))
    assert b"ENOSPC" in os.getxattr(second, "user.burstfs.error")
    # The first file is untouched; deleting the short one makes room again.
    assert (fs.path / "first.bin").read_bytes() == b"1" * (3 << 20)
    os.unlink(second)
    (fs.path / "third.bin").write_bytes(b"3" * (512 << 10))
    _wait_state(fs.path / "third.bin", (b"durable",))
    assert not (fs.remote_dir / "second.bin").exists()
    assert sorted(p.name for p in fs.remote_dir.iterdir() if p.name != ".burstfs") == ["first.bin", "third.bin"]


def test_sparse_growth_counts_allocated_bytes_not_logical_size(mounted_factory: type[MountedFS]) -> None:
    """Issue 11 #9: truncate growth and copy_file_range far past the end leave holes; the
    capacity limit counts what the tier allocates, so a few such calls cannot fill it
    (they used to count the logical size: the next real write waited, then ENOSPC).
    Sparse files still drain at their logical size.  (A byte limit turns passthrough
    off, so this runs through the daemon.)"""
    fs = mounted_factory(extra_args=("--cache-size", "8M", "--evict", "none", "--full-timeout", "1"))  # type: ignore[call-arg]
    fs.mount()
    sparse = fs.path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.write(b"head")
        f.truncate(64 << 20)  # 8x the limit, all hole
    os.truncate(fs.path / "sparse.bin", 48 << 20)  # by path too; shrinking a hole frees nothing
    src = fs.path / "src.bin"
    src.write_bytes(b"s" * 4096)
    copied = fs.path / "copied.bin"
    with open(src, "rb") as s, open(copied, "wb") as d:
        for i in range(1, 5):  # 4 KiB each, 16 MiB apart
            assert os.copy_file_range(s.fileno(), d.fileno(), 4096, 0, i << 24) == 4096
    with open(fs.path / "seek-ahead.bin", "wb") as f:
        f.seek(40 << 20)
        f.write(b"tail")
    # Real data still fits: 6 MiB under an 8 MiB limit.
    (fs.path / "dense.bin").write_bytes(b"d" * (6 << 20))
    assert copied.stat().st_size == (4 << 24) + 4096
    with open(copied, "rb") as f:
        f.seek(3 << 24)
        assert f.read(4096) == b"s" * 4096
    # Each drains at its logical size.
    expected = {
        "sparse.bin": 48 << 20,
        "copied.bin": (4 << 24) + 4096,
        "seek-ahead.bin": (40 << 20) + 4,
        "dense.bin": 6 << 20,
        "src.bin": 4096,
    }
    for name, size in expected.items():
        _wait_state(fs.path / name, (b"durable",))
        assert (fs.remote_dir / name).stat().st_size == size, name
    assert (fs.remote_dir / "sparse.bin").read_bytes()[:8] == b"head\0\0\0\0"


def _raw_fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) itself: glibc's posix_fallocate writes zeros when the file system
    refuses fallocate, so only the raw call shows that the mount answers it."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if libc.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def test_fallocate_default_mode_and_keep_size(burst: MountedFS) -> None:
    """fallocate(2) reaches the daemon on both data paths (the passthrough shim forwards
    FALLOCATE, which pyfuse3 does not handle); the growth is a change that drains."""
    p = burst.path / "prealloc.bin"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        os.write(fd, b"head")
        if "event=fallocate state=off" in burst.log_text():
            pytest.fail("burstfs/_passthrough*.so was built before fallocate support: rebuild it")
        _raw_fallocate(fd, 0, 0, 3 << 20)  # the default mode extends the file
        assert os.fstat(fd).st_size == p.stat().st_size == 3 << 20
        _raw_fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, 8 << 20)  # allocates, the size stays
        assert os.fstat(fd).st_size == 3 << 20
        with oserror(errno.EOPNOTSUPP):  # punch hole, zero range, collapse: not supported
            _raw_fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096)
        _raw_fallocate(fd, 0, 4 << 20, 1 << 20)  # a refused mode does not turn fallocate off
        os.posix_fallocate(fd, 0, 6 << 20)
        assert os.fstat(fd).st_size == 6 << 20
        assert os.pread(fd, 8, 0) == b"head\0\0\0\0"
    finally:
        os.close(fd)
    _wait_state(p, (b"durable",))
    assert (burst.remote_dir / "prealloc.bin").read_bytes() == b"head" + bytes((6 << 20) - 4)
    with oserror(errno.EPERM):  # the name the shim uses cannot be set by hand
        os.setxattr(p, "burstfs.fallocate", b"x" * 48)


def test_fallocate_claims_tier_space_and_journals_growth_first(mounted_factory: type[MountedFS]) -> None:
    """fallocate counts against --cache-size like a write (ENOSPC past the limit), and
    growing a closed file is journaled `writing` before it lands: a kill -9 leaves it
    `incomplete`, never drained as if finished."""
    fs = mounted_factory(extra_args=("--cache-size", "4M", "--evict", "none", "--full-timeout", "1"))  # type: ignore[call-arg]
    fs.mount()
    fd = os.open(fs.path / "big.bin", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        with oserror(errno.ENOSPC):
            _raw_fallocate(fd, 0, 0, 8 << 20)
        _raw_fallocate(fd, 0, 0, 1 << 20)  # what fits still does
    finally:
        os.close(fd)
    grown = fs.path / "grown.bin"
    grown.write_bytes(b"closed")
    _wait_state(grown, (b"durable",))
    fd = os.open(grown, os.O_RDWR)
    _raw_fallocate(fd, 0, 0, 1 << 20)
    assert os.getxattr(grown, "user.burstfs.state") == b"writing"
    fs.kill()
    with contextlib.suppress(OSError):  # the mount died under it
        os.close(fd)
    fs.mount()
    assert os.getxattr(grown, "user.burstfs.state") == b"incomplete"
    assert (fs.remote_dir / "grown.bin").read_bytes() == b"closed"


# -- extended attributes, statfs, mmap ------------------------------------------------


def test_user_xattrs(burst: MountedFS) -> None:
    p = burst.path / "f"
    p.write_bytes(b"x")
    os.setxattr(p, "user.step", b"1000")
    os.setxattr(p, "user.empty", b"")
    assert os.getxattr(p, "user.step") == b"1000"
    assert os.getxattr(p, "user.empty") == b""
    os.setxattr(p, "user.step", b"2000")
    assert os.getxattr(p, "user.step") == b"2000"
    assert set(os.listxattr(p)) == {"user.step", "user.empty", "user.burstfs.state"}
    with oserror(errno.ENODATA):
        os.getxattr(p, "user.nothing")
    os.removexattr(p, "user.step")
    with oserror(errno.ENODATA):
        os.getxattr(p, "user.step")
    with oserror(errno.ENODATA):
        os.removexattr(p, "user.step")
    with oserror(errno.EOPNOTSUPP):
        os.setxattr(p, "trusted.x", b"1")
    with oserror(errno.EPERM):
        os.setxattr(p, "user.burstfs.state", b"durable")
    with oserror(errno.EPERM):
        os.removexattr(p, "user.burstfs.state")
    # XATTR_CREATE / XATTR_REPLACE are honoured.
    with oserror(errno.EEXIST):
        os.setxattr(p, "user.empty", b"x", os.XATTR_CREATE)
    with oserror(errno.ENODATA):
        os.setxattr(p, "user.absent", b"x", os.XATTR_REPLACE)
    with oserror(errno.EPERM):  # the kernel allows user.* only on files and directories
        os.symlink("f", burst.path / "link")
        os.setxattr(burst.path / "link", "user.x", b"1", follow_symlinks=False)
    big = os.urandom(4000)
    os.setxattr(p, "user.big", big)
    assert os.getxattr(p, "user.big") == big
    # Directories take user xattrs as well, and have no drain state.
    os.setxattr(burst.path, "user.owner", b"team")
    assert os.getxattr(burst.path, "user.owner") == b"team"
    assert os.listxattr(burst.path) == ["user.owner"]
    with oserror(errno.ENODATA):
        os.getxattr(burst.path, "user.burstfs.state")
    # They survive a remount.
    burst.unmount()
    burst.mount()
    assert os.getxattr(p, "user.big") == big
    assert os.getxattr(burst.path, "user.owner") == b"team"


def test_statfs_reports_the_local_tier(burst: MountedFS) -> None:
    mine = os.statvfs(burst.path)
    tier = os.statvfs(burst.cache)
    assert (mine.f_frsize, mine.f_blocks) == (tier.f_frsize, tier.f_blocks)
    assert abs(mine.f_bavail - tier.f_bavail) * tier.f_frsize < 256 << 20
    assert mine.f_namemax == 255
    assert mine.f_files > 0 and mine.f_ffree > 0


def test_mmap_read_and_write(burst: MountedFS) -> None:
    p = burst.path / "mapped"
    data = os.urandom(3 * mmap.PAGESIZE + 17)
    p.write_bytes(data)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[:] == data
        assert m[mmap.PAGESIZE : mmap.PAGESIZE + 5] == data[mmap.PAGESIZE : mmap.PAGESIZE + 5]
    with open(p, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[10:15] = b"HELLO"
        m.flush()
    assert p.read_bytes() == data[:10] + b"HELLO" + data[15:]
    assert os.getxattr(p, "user.burstfs.state") in CLOSED


def _writer(root: str, rank: int) -> None:
    for part in range(2):
        block = hashlib.sha256(f"{rank}-{part}".encode()).digest() * 32768  # 1 MiB
        with open(os.path.join(root, f"rank{rank}_{part}.bin"), "wb") as f:
            for _ in range(3):
                f.write(block)


def test_many_processes_write_different_files(burst: MountedFS) -> None:
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(burst.path), rank)) for rank in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank in range(8):
        for part in range(2):
            block = hashlib.sha256(f"{rank}-{part}".encode()).digest() * 32768
            assert (burst.path / f"rank{rank}_{part}.bin").read_bytes() == block * 3
    assert len(os.listdir(burst.path)) == 16


# -- requests the file system refuses ----------------------------------------------------


def test_hard_links(burst: MountedFS) -> None:
    """link(2): one inode under several names, written through one and read through the
    others; each name drains as its own object with the same bytes; a kill -9 keeps
    every name; an evicted linked file reads back through any name."""
    a, b = burst.path / "a", burst.path / "b"
    a.write_bytes(b"first")
    os.link(a, b)
    assert os.stat(a).st_nlink == os.stat(b).st_nlink == 2 and os.stat(a).st_ino == os.stat(b).st_ino
    with open(a, "r+b") as f:  # a change through one name is seen through the other
        f.write(b"FIRST, then more")
    assert b.read_bytes() == b"FIRST, then more"
    (burst.path / "d").mkdir()
    os.link(b, burst.path / "d" / "c")  # into another directory
    assert os.stat(b).st_nlink == 3
    with oserror(errno.EPERM):
        os.link(burst.path / "d", burst.path / "dlink")  # directories cannot be linked
    with oserror(errno.EEXIST):
        os.link(a, b)
    os.unlink(a)  # the other names keep the file
    assert os.stat(b).st_nlink == 2 and b.read_bytes() == b"FIRST, then more"
    (burst.path / "x").write_bytes(b"other")
    os.rename(burst.path / "x", b)  # replaces one name of the linked file only
    assert b.read_bytes() == b"other" and os.stat(burst.path / "d" / "c").st_nlink == 1
    os.link(burst.path / "d" / "c", a)
    _wait_state(a, (b"durable",))
    assert (burst.remote_dir / "a").read_bytes() == (burst.remote_dir / "d" / "c").read_bytes() == b"FIRST, then more"
    # x drained (or is draining) at its old name and moves to b: wait for the move
    wait_for(lambda: (burst.remote_dir / "b").is_file() and not (burst.remote_dir / "x").exists(), what="x -> b")
    assert (burst.remote_dir / "b").read_bytes() == b"other"
    burst.kill()  # kill -9 and remount: both names, the link count, the bytes
    burst.mount()
    assert os.stat(a).st_nlink == os.stat(burst.path / "d" / "c").st_nlink == 2
    assert os.stat(a).st_ino == os.stat(burst.path / "d" / "c").st_ino
    assert sorted(os.listdir(burst.path)) == ["a", "b", "d"]
    subprocess.run([str(BIN / "burstfs-admin"), "evict", str(a)], check=True, capture_output=True, timeout=60)
    assert os.getxattr(a, "user.burstfs.state") == b"evicted"
    assert (burst.path / "d" / "c").read_bytes() == b"FIRST, then more"  # fetched back
    assert a.read_bytes() == b"FIRST, then more"
    os.unlink(burst.path / "d" / "c")  # one name's object goes, the other's stays
    assert os.stat(a).st_nlink == 1
    wait_for(lambda: not (burst.remote_dir / "d" / "c").exists(), what="delete of d/c")
    assert (burst.remote_dir / "a").read_bytes() == b"FIRST, then more"


def test_fifos_and_sockets_are_local_only_nodes_devices_refused(burst: MountedFS) -> None:
    import socket

    os.mkfifo(burst.path / "fifo", 0o640)
    st = os.stat(burst.path / "fifo")
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_rdev == 0
    assert st.st_nlink == 1 and st.st_size == 0
    # The kernel runs the pipe itself: a writer and a reader meet through the name.
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append((burst.path / "fifo").read_bytes()))
    reader.start()
    (burst.path / "fifo").write_bytes(b"through the pipe")
    reader.join(10)
    assert got == [b"through the pipe"]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(burst.path / "sock"))
        server.listen(1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(burst.path / "sock"))
            conn, _ = server.accept()
            with conn:
                client.sendall(b"hi")
                assert conn.recv(2) == b"hi"
    assert stat.S_ISSOCK(os.stat(burst.path / "sock").st_mode)
    os.mknod(burst.path / "sock2", stat.S_IFSOCK | 0o600)
    # Device nodes stay refused (a checkpoint store needs none; see SEMANTICS).
    with oserror(errno.EPERM):
        os.mknod(burst.path / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    with oserror(errno.EPERM):
        os.mknod(burst.path / "disk", stat.S_IFBLK | 0o600, os.makedev(7, 0))
    os.mknod(burst.path / "plain", stat.S_IFREG | 0o640)
    st = os.stat(burst.path / "plain")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and stat.S_IMODE(st.st_mode) == 0o640
    assert sorted(os.listdir(burst.path)) == ["fifo", "plain", "sock", "sock2"]
    os.rename(burst.path / "sock2", burst.path / "sock3")
    os.chmod(burst.path / "fifo", 0o600)
    # Journaled: they survive a remount; never drained (only the regular file reaches the remote).
    wait_closed = time.monotonic() + 30
    while not (burst.remote_dir / "plain").exists():
        assert time.monotonic() < wait_closed
        time.sleep(0.05)
    burst.unmount()
    burst.mount()
    assert sorted(os.listdir(burst.path)) == ["fifo", "plain", "sock", "sock3"]
    assert stat.S_ISFIFO(os.stat(burst.path / "fifo").st_mode)
    assert stat.S_IMODE(os.stat(burst.path / "fifo").st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(burst.path / "sock3").st_mode)
    assert sorted(p.name for p in burst.remote_dir.iterdir() if p.name != ".burstfs") == ["plain"]
    os.unlink(burst.path / "fifo")
    os.unlink(burst.path / "sock")
    assert sorted(os.listdir(burst.path)) == ["plain", "sock3"]


def test_o_direct_works_aligned_or_not(burst: MountedFS) -> None:
    """SEMANTICS: O_DIRECT reads and writes go to the daemon, so neither buffers nor
    offsets need the alignment the tier's file system asks for (ext4 here: EINVAL)."""
    p = burst.path / "direct"
    buf = mmap.mmap(-1, 1 << 16)  # page aligned
    buf.write(b"D" * (1 << 16))
    fd = os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o644)
    try:
        assert os.write(fd, buf) == 1 << 16
        assert os.write(fd, b"unaligned tail") == 14
        assert os.pwrite(fd, b"x", 3) == 1
    finally:
        os.close(fd)
    expected = b"DDDx" + b"D" * ((1 << 16) - 4) + b"unaligned tail"
    assert p.read_bytes() == expected
    fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
    try:
        got = mmap.mmap(-1, 1 << 16)
        assert os.readv(fd, [got]) == 1 << 16
        assert got[:] == expected[: 1 << 16]
        assert os.pread(fd, 10, 1) == expected[1:11]
    finally:
        os.close(fd)
    wait_for(lambda: file_state(burst.cache, "direct") == "durable", timeout=30, what="the file drained")
    assert (burst.remote_dir / "direct").read_bytes() == expected


def test_long_names(burst: MountedFS) -> None:
    long = "n" * 256
    with oserror(errno.ENAMETOOLONG):
        os.open(burst.path / long, os.O_CREAT | os.O_WRONLY, 0o644)
    with oserror(errno.ENAMETOOLONG):
        os.mkdir(burst.path / long)
    with oserror(errno.ENAMETOOLONG):
        os.stat(burst.path / long)
    with oserror(errno.ENAMETOOLONG):
        os.symlink("t", burst.path / long)
    ok = burst.path / ("m" * 255)
    ok.write_bytes(b"fits")
    with oserror(errno.ENAMETOOLONG):
        os.rename(ok, burst.path / long)
    assert ok.read_bytes() == b"fits"
    (burst.path / "ünïcode ✓ name").write_bytes(b"u")
    assert sorted(os.listdir(burst.path)) == sorted(["m" * 255, "ünïcode ✓ name"])


def test_names_that_are_not_utf8_are_refused(burst: MountedFS) -> None:
    """Remote keys are UTF-8: such a name is refused with EILSEQ (it once stopped every drain)."""
    root = os.fsencode(burst.path)
    bad = b"caf\xe9.pt"
    with oserror(errno.EILSEQ):
        os.open(root + b"/" + bad, os.O_CREAT | os.O_WRONLY, 0o644)
    with oserror(errno.EILSEQ):
        os.mkdir(root + b"/" + bad)
    with oserror(errno.EILSEQ):
        os.symlink(b"t", root + b"/" + bad)
    (burst.path / "ok.pt").write_bytes(b"fine")
    with oserror(errno.EILSEQ):
        os.rename(root + b"/ok.pt", root + b"/" + bad)
    with oserror(errno.EILSEQ):
        os.link(root + b"/ok.pt", root + b"/" + bad)
    assert os.listdir(root) == [b"ok.pt"]
    wait_for(lambda: file_state(burst.cache, "ok.pt") == "durable", timeout=30, what="the file drained")
    assert (burst.remote_dir / "ok.pt").read_bytes() == b"fine"


# -- permissions: other users ------------------------------------------------------------


def _as_nobody(cwd: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` as uid/gid 65534 with ``cwd`` as its working directory.

    The working directory is entered as root before dropping privileges, so the
    test does not depend on the (private) directories above the mount point.
    """

    def drop() -> None:
        os.chdir(cwd)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    return subprocess.run(
        [SYSTEM_PYTHON, "-c", code], check=False, preexec_fn=drop, capture_output=True, text=True, timeout=30
    )


def _errno_of(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


TRY = """
import errno, os, sys
def attempt(fn, *args):
    try:
        fn(*args)
        print("ok")
    except OSError as e:
        print(errno.errorcode[e.errno])
"""


def test_other_users_are_shut_out_without_allow_other(burst: MountedFS) -> None:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs {SYSTEM_PYTHON} to run code as another user")
    os.chmod(burst.path, 0o777)
    (burst.path / "f").write_bytes(b"x")
    os.chmod(burst.path / "f", 0o666)
    result = _as_nobody(Path("/"), TRY + f"attempt(os.stat, {str(burst.path / 'f')!r})")
    assert _errno_of(result) == "EACCES"


def test_allow_other_permissions(mounted_factory: type[MountedFS]) -> None:
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"needs {SYSTEM_PYTHON} to run code as another user")
    fs = mounted_factory(extra_args=("--allow-other",))  # type: ignore[call-arg]
    fs.mount()
    shared = fs.path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    secret = shared / "secret"
    secret.write_bytes(b"root only")
    os.chmod(secret, 0o600)
    public = shared / "public"
    public.write_bytes(b"everyone")
    os.chmod(public, 0o644)

    result = _as_nobody(
        shared,
        TRY
        + """
with open("mine", "wb") as f:
    f.write(b"by nobody")
st = os.stat("mine")
print(st.st_uid, st.st_gid)
attempt(open, "secret", "rb")
print(open("public", "rb").read().decode())
attempt(open, "public", "ab")
attempt(os.chown, "public", 65534, 65534)
attempt(os.chmod, "public", 0o777)
attempt(os.unlink, "public")
attempt(os.setxattr, "mine", "user.who", b"nobody")
""",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == [
        "65534 65534",
        "EACCES",  # 0600 root file
        "everyone",
        "EACCES",  # not writable for others
        "EPERM",  # chown by a non-owner
        "EPERM",  # chmod by a non-owner
        "EPERM",  # sticky directory: only the owner may remove
        "ok",
    ]
    mine = shared / "mine"
    assert mine.read_bytes() == b"by nobody"
    assert (mine.stat().st_uid, mine.stat().st_gid) == (NOBODY, NOBODY)
    assert os.getxattr(mine, "user.who") == b"nobody"
    # root may chown; stat shows it, to nobody too.
    os.chown(secret, NOBODY, NOBODY)
    assert (secret.stat().st_uid, secret.stat().st_gid) == (NOBODY, NOBODY)
    result = _as_nobody(shared, "print(open('secret', 'rb').read().decode())")
    assert result.returncode == 0 and result.stdout.strip() == "root only", result.stderr
    # A directory of root's without write permission for others.
    result = _as_nobody(fs.path, TRY + "attempt(os.mkdir, 'nope')\nattempt(os.listdir, '.')")
    assert _errno_of(result).split("\n") == ["EACCES", "ok"]


# -- a second node on the same remote ----------------------------------------------------


def test_what_a_second_node_sees(mounted_factory: type[MountedFS], tmp_path: Path) -> None:
    remote = tmp_path / "shared-remote"
    remote.mkdir()
    writer = mounted_factory("writer", f"file://{remote}")  # type: ignore[call-arg]
    writer.mount()
    (writer.path / "run" / "step_1").mkdir(parents=True)
    model = writer.path / "run" / "step_1" / "model.pt"
    model.write_bytes(b"m" * 100_000)
    os.chmod(model, 0o600)
    os.setxattr(model, "user.step", b"1")
    os.symlink("step_1", writer.path / "run" / "latest")
    (writer.path / "empty").mkdir()
    _wait_state(model, (b"durable",))
    reader = mounted_factory("reader", f"file://{remote}", ("--list-ttl", "1"))  # type: ignore[call-arg]
    reader.mount()
    seen = reader.path / "run" / "step_1" / "model.pt"
    assert sorted(os.listdir(reader.path)) == ["run"]  # no empty directories on the remote
    assert os.listdir(reader.path / "run") == ["step_1"]  # no symlinks either
    st = seen.stat()
    assert (st.st_size, stat.S_IMODE(st.st_mode)) == (100_000, 0o644)  # modes stay on the writer
    assert os.listxattr(seen) == ["user.burstfs.state"]
    assert os.getxattr(seen, "user.burstfs.state") == b"remote"
    assert seen.read_bytes() == b"m" * 100_000  # fetched and verified
    # Opening it read-write and closing without a change publishes nothing.
    open(seen, "r+b").close()
    assert os.getxattr(seen, "user.burstfs.state") == b"durable"
    assert os.getxattr(seen, "user.burstfs.generation") == b"0"
    # New files of the writer appear after the listing's TTL.
    (writer.path / "run" / "step_1" / "optim.pt").write_bytes(b"o")
    _wait_state(writer.path / "run" / "step_1" / "optim.pt", (b"durable",))
    deadline = time.monotonic() + 10
    while "optim.pt" not in os.listdir(reader.path / "run" / "step_1"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (reader.path / "run" / "step_1" / "optim.pt").read_bytes() == b"o"


def test_overlapping_out_of_order_writes_through_the_daemon(mounted_factory: type[MountedFS]) -> None:
    """Issue 10 #20: queued writes released together, one an overwrite, were EIO
    (KeyError in the streaming digests); the bytes and the drain must be right."""
    fs = mounted_factory(extra_args=("--no-passthrough", "--no-writeback-cache"))  # type: ignore[call-arg]
    fs.mount()
    p = fs.path / "shuffled"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        assert os.pwrite(fd, b"a" * 8, 0) == 8
        assert os.pwrite(fd, b"c" * 4, 12) == 4  # ahead of what is hashed: queued
        assert os.pwrite(fd, b"X" * 4, 10) == 4  # queued too
        assert os.pwrite(fd, b"b" * 6, 8) == 6  # releases both, and overwrites the one at 10
        os.fsync(fd)
    finally:
        os.close(fd)
    expected = b"a" * 8 + b"b" * 6 + b"cc"
    assert p.read_bytes() == expected
    _wait_state(p, (b"durable",))
    assert (fs.remote_dir / "shuffled").read_bytes() == expected

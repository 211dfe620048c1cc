"""A tier on a file system of its own that fills up (docs/OPERATIONS.md "A full tier").

The layout OPERATIONS recommends: the cache dir alone on a small tmpfs, no byte
limit, FUSE passthrough on (the kernel writes the tier, unseen by the daemon).
Durable copies must be evicted ahead of the writers, and a tier full of data not
yet durable must still let files be removed (the journal lives on the same file
system: it keeps a reserve for that).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from conftest import BIN, DATA_PATHS, FUSE_OK, MountedFS, burstfs, is_mounted, wait_for

from burstfs.core import BurstCore
from burstfs.headroom import headroom_bytes
from burstfs.journal import ROOT_INO, Journal

pytestmark = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")

MiB = 1 << 20
TIER_MIB = 24


@pytest.fixture
def small_tier(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs for the cache dir (and the mount point)."""
    tier = tmp_path / "tier"
    tier.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TIER_MIB}m", "tmpfs", str(tier)], check=True)
    try:
        yield tier
    finally:
        subprocess.run(["umount", "-l", str(tier)], check=False)


def _on_tier(factory: type[MountedFS], tier: Path, tmp_path: Path, *args: str) -> MountedFS:
    """A mount whose root (mount point, cache dir) is the small tier; its remote is not on it."""
    (tmp_path / "remote").mkdir(exist_ok=True)
    return factory(tier.name, f"file://{tmp_path / 'remote'}", args)  # type: ignore[call-arg]


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _wait_durable(fs: MountedFS) -> None:
    result = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", str(fs.path), "--timeout", "60"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("data_path", sorted(DATA_PATHS))
def test_durable_copies_are_evicted_ahead_of_the_writers(
    small_tier: Path, mounted_factory: type[MountedFS], tmp_path: Path, data_path: str
) -> None:
    """Twice the tier's size in 4 MiB files, each waited durable: every write succeeds (the
    old copies are evicted to keep the headroom free), and every file reads back."""
    fs = _on_tier(mounted_factory, small_tier, tmp_path, *DATA_PATHS[data_path])
    fs.mount()
    headroom = headroom_bytes(os.statvfs(small_tier).f_blocks * os.statvfs(small_tier).f_frsize)
    contents = {}
    for i in range(2 * TIER_MIB // 4):
        data = os.urandom(4 * MiB)
        (fs.path / f"step{i}.pt").write_bytes(data)
        contents[f"step{i}.pt"] = data
        _wait_durable(fs)
        wait_for(lambda: _free(small_tier) >= headroom, timeout=30, what="the headroom freed")
    assert (fs.cache / "reserve").exists()
    for name, data in contents.items():  # each fetch back makes its room by evicting others
        assert (fs.path / name).read_bytes() == data, name


@pytest.mark.parametrize("data_path", sorted(DATA_PATHS))
def test_a_tier_full_of_undrained_data_still_removes_files(
    small_tier: Path, mounted_factory: type[MountedFS], tmp_path: Path, data_path: str
) -> None:
    """Nothing can drain (the delay), the writes fill the file system: the next write fails
    with ENOSPC, and then rm still works (the journal's reserve), frees the room, and the
    write goes through again."""
    fs = _on_tier(mounted_factory, small_tier, tmp_path, *DATA_PATHS[data_path], "--drain-delay", "3600")
    fs.expect_log("event=tier_full")
    fs.expect_log("event=commit_failed")
    fs.mount()
    wait_for(lambda: (fs.cache / "reserve").exists(), timeout=30, what="the journal's reserve")
    written = []
    with pytest.raises(OSError) as full:
        for i in range(TIER_MIB):
            (fs.path / f"f{i}").write_bytes(os.urandom(4 * MiB))
            written.append(f"f{i}")
    assert full.value.errno == errno.ENOSPC
    assert written
    for name in written:
        os.unlink(fs.path / name)
    # The last one: what its writes left of it, unless its close found no room for the
    # journal either (its name, never journaled, is gone then: SEMANTICS "create / open").
    with contextlib.suppress(FileNotFoundError):
        os.unlink(fs.path / f"f{len(written)}")
    data = os.urandom(4 * MiB)
    (fs.path / "after.pt").write_bytes(data)
    assert (fs.path / "after.pt").read_bytes() == data
    fs.unmount()
    fs.mount()  # the journal is intact
    assert sorted(p.name for p in fs.path.iterdir() if not p.name.startswith(".")) == ["after.pt"]
    assert (fs.path / "after.pt").read_bytes() == data


def _durable_then_evicted(fs: MountedFS, count: int, size: int) -> dict[str, bytes]:
    """``count`` files of ``size`` bytes, each durable before the next, then all evicted and the
    mount restarted (no page cache to answer from): every read fetches."""
    data = {f"f{i}": os.urandom(size) for i in range(count)}
    for name, content in data.items():
        (fs.path / name).write_bytes(content)
        subprocess.run(
            [str(BIN / "burstfs-admin"), "wait", str(fs.path / name), "--timeout", "120"],
            check=True,
            capture_output=True,
        )
    subprocess.run([str(BIN / "burstfs-admin"), "evict", str(fs.path)], check=True, capture_output=True)
    fs.unmount()
    fs.mount()
    return data


def _read_a_mib_of_each(fs: MountedFS, data: dict[str, bytes], offset: int) -> None:
    for name, content in data.items():
        with open(fs.path / name, "rb") as f:
            f.seek(offset)
            assert f.read(1 << 20) == content[offset : offset + (1 << 20)], name


def test_reads_of_a_few_chunks_of_evicted_files_leave_room_for_the_next_checkpoint(
    mounted_factory: type[MountedFS],
) -> None:
    """A restore that touches 1 MiB of each of four 20 MiB files on a 64 MiB tier: a fetch claims
    room for its whole file, and kept that claim once its reader was gone, so the fourth read
    and the next checkpoint's write failed with ENOSPC (nothing undrained, burstfs holding 0 B)."""
    fs = mounted_factory("partial", None, ("--cache-size", "64M", "--full-timeout", "3"))  # type: ignore[call-arg]
    fs.mount()
    data = _durable_then_evicted(fs, 4, 20 << 20)  # each durable before the next: 80 MiB go through 64 MiB
    _read_a_mib_of_each(fs, data, 5 << 20)
    fresh = os.urandom(10 << 20)
    (fs.path / "next.pt").write_bytes(fresh)
    assert (fs.path / "next.pt").read_bytes() == fresh


def test_a_writer_opened_below_the_headroom_finds_it_made_before_its_first_write(small_tier: Path) -> None:
    """In-process, the headroom task not running: a create on a tier below its headroom evicts
    durable copies before it returns.  Through passthrough the kernel's first write comes next,
    unseen by the daemon: left to the task's next look, a save right after ``burstfs-admin wait``
    failed with ENOSPC (CI, once)."""
    cache = small_tier / "cache"
    cache.mkdir()
    headroom = headroom_bytes(os.statvfs(small_tier).f_blocks * os.statvfs(small_tier).f_frsize)

    async def body(core: BurstCore) -> None:
        for i in range(TIER_MIB // 4 - 1):
            fh, inode = await core.create(ROOT_INO, f"step{i}.pt".encode(), 0o644, os.O_WRONLY, 0, 0)
            await core.write(fh, 0, os.urandom(4 * MiB))
            await core.flush(fh)
            await core.release(fh)
            claimed = await trio.to_thread.run_sync(core.journal.drain.claim, inode.ino, inode.generation)
            assert isinstance(claimed, tuple), claimed
            key, intent = claimed
            assert await trio.to_thread.run_sync(
                core.journal.drain.finish_upload, inode.ino, inode.generation, key, intent, "test"
            )
        assert _free(small_tier) < headroom
        fh, _ = await core.create(ROOT_INO, b"next.pt", 0o644, os.O_WRONLY, 0, 0)
        assert _free(small_tier) >= headroom
        await core.release(fh)

    async def main() -> None:
        journal = Journal(cache)
        core = BurstCore(cache, journal)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(core.committer.run)
                await body(core)
                nursery.cancel_scope.cancel()
        finally:
            core.close()
            journal.close()

    trio.run(main)


def test_writers_that_go_on_after_enospc_leave_the_journal_its_room(
    small_tier: Path, mounted_factory: type[MountedFS], tmp_path: Path
) -> None:
    """An outage (the drain held back) while a job keeps saving through passthrough: writers go on
    after their first ENOSPC.  They took the journal's whole reserve the moment it was given back,
    and then no rm, no drain record and no restart could commit (a wedge for good).  Now the
    failed files can be removed, the rest drains once the remote is back, the tier frees up, and
    the cache mounts again."""
    fs = _on_tier(mounted_factory, small_tier, tmp_path, "--drain-delay", "3600")
    fs.expect_log("event=tier_full")
    fs.expect_log("event=commit_failed")
    fs.expect_log("event=mover_pass_failed")
    fs.mount()
    wait_for(lambda: (fs.cache / "reserve").exists(), timeout=30, what="the journal's reserve")
    contents, failed = {}, []
    for i in range(TIER_MIB // 4 + 3):  # past full: the job's next saves fail too
        data = os.urandom(4 * MiB)
        try:
            (fs.path / f"f{i}").write_bytes(data)
            contents[f"f{i}"] = data
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            failed.append(f"f{i}")
    assert contents and len(failed) >= 2
    for name in failed:  # a save refused at its create left no file
        (fs.path / name).unlink(missing_ok=True)
    subprocess.run([str(BIN / "burstfs-admin"), "drain", str(fs.path), "--now"], check=True, capture_output=True)
    _wait_durable(fs)
    data = os.urandom(4 * MiB)  # room again: durable copies are evicted for it
    (fs.path / "after.pt").write_bytes(data)
    contents["after.pt"] = data
    fs.unmount()
    fs.mount()
    for name, content in contents.items():
        assert (fs.path / name).read_bytes() == content, name


def test_a_file_whose_writes_failed_at_close_shows_what_the_tier_holds(
    mounted_factory: type[MountedFS], tmp_path: Path
) -> None:
    """Through the daemon (write-back cache) a full --cache-size fails the writes at close:
    the file is incomplete without those bytes on the tier, yet stat said 12 MiB where the
    daemon said 8 and a read returned all of them from the kernel's cache, until that cache
    was dropped and the file shrank.  Now the size agrees everywhere and the lost bytes
    read as zeros."""
    fs = mounted_factory(
        "cs", None, ("--no-passthrough", "--cache-size", "24M", "--drain-delay", "3600", "--full-timeout", "1")
    )  # type: ignore[call-arg]
    fs.expect_log("event=tier_full")
    fs.expect_log("event=request_failed")
    fs.mount()
    for i in range(2):
        (fs.path / f"f{i}").write_bytes(os.urandom(8 * MiB))
    late = fs.path / "late"
    sent = os.urandom(12 * MiB)
    with pytest.raises(OSError) as err:
        late.write_bytes(sent)
    assert err.value.errno == errno.ENOSPC
    state = subprocess.run(
        [str(BIN / "burstfs-admin"), "ls", str(fs.path), "--json"], capture_output=True, text=True, check=True
    ).stdout
    import json

    (row,) = [f for f in json.loads(state)["files"] if f["path"].endswith("late")]
    assert row["state"] == "incomplete" and row["size"] == os.stat(late).st_size == 12 * MiB, row
    on_tier = (fs.cache / "data" / f"{os.stat(late).st_ino:016x}").read_bytes()
    landed = len(on_tier.rstrip(b"\0"))
    assert landed < len(sent) and on_tier[:landed] == sent[:landed]
    wait_for(lambda: late.read_bytes() == on_tier, what="the kernel's cached pages of the lost bytes dropped")
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    assert os.stat(late).st_size == 12 * MiB and late.read_bytes() == on_tier


def test_a_new_cache_dir_on_a_full_file_system_is_one_line(small_tier: Path, tmp_path: Path) -> None:
    """A cache dir made on a full file system: `burstfs mount` printed a Python traceback (the
    lock's pid could not be written).  Now one line that names the cache and the cause."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    with open(small_tier / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
        while True:
            filler.write(b"\0" * MiB)
    (tmp_path / "remote").mkdir()
    (tmp_path / "mnt").mkdir()
    cache = small_tier / "cache"
    result = burstfs(
        "mount", str(tmp_path / "mnt"), "--cache", str(cache), "--remote", f"file://{tmp_path / 'remote'}", check=False
    )  # fmt: skip
    assert result.returncode == 1 and not is_mounted(tmp_path / "mnt"), result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"cannot set up cache dir {cache}: No space left on device" in result.stderr


def test_drain_of_a_cache_on_a_read_only_file_system_is_one_line(
    small_tier: Path, tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """A cache whose file system went read-only (I/O errors): `burstfs drain --cache` ended in a
    traceback (its log could not be opened).  Now one line, exit 2, the cache untouched."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = _on_tier(mounted_factory, small_tier, tmp_path, "--drain-delay", "600")
    fs.mount()
    (fs.path / "model.pt").write_bytes(b"m" * 1000)
    fs.unmount()
    subprocess.run(["mount", "-o", "remount,ro", str(small_tier)], check=True)
    result = burstfs("drain", "--cache", str(fs.cache), "--now", check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"burstfs: cache dir {fs.cache} is not writable: copy it elsewhere to drain it"
    assert not (tmp_path / "remote" / "model.pt").exists()


def test_a_remote_file_larger_than_the_tier_can_hold_fails_at_once(
    small_tier: Path, tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """A restore node's read of a remote file smaller than the tier's file system but larger
    than what files may take there (the journal, its reserve and the log take the rest) waited
    --full-timeout for a drain with nothing undrained, then blamed data not yet durable."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    data = os.urandom(TIER_MIB * MiB - (128 << 10))  # less than the file system, more than files may take
    (tmp_path / "remote").mkdir()
    writer = mounted_factory("writer", f"file://{tmp_path / 'remote'}", ())  # type: ignore[call-arg]
    writer.mount()
    (writer.path / "big.bin").write_bytes(data)
    writer.unmount("--wait", "--wait-timeout", "60")
    reader = _on_tier(mounted_factory, small_tier, tmp_path, "--full-timeout", "30")
    reader.mount()
    reader.expect_log("tier_too_small")
    reader.expect_log("request_failed")
    started = time.monotonic()
    with pytest.raises(OSError) as failed, open(reader.path / "big.bin", "rb") as f:
        f.read(4096)
    assert failed.value.errno == errno.ENOSPC and time.monotonic() - started < 20
    assert "event=tier_too_small" in reader.log_text() and "give the tier a larger file system" in reader.log_text()
    small = b"s" * 1000  # the tier still works
    (reader.path / "small.bin").write_bytes(small)
    assert (reader.path / "small.bin").read_bytes() == small


def _remote_files(tmp_path: Path, mounted_factory: type[MountedFS], sizes: dict[str, int]) -> dict[str, bytes]:
    """Files written durable to the remote through a mount off the small tier (a writer node)."""
    (tmp_path / "remote").mkdir(exist_ok=True)
    writer = mounted_factory("writer", f"file://{tmp_path / 'remote'}", ())  # type: ignore[call-arg]
    writer.mount()
    data = {name: os.urandom(size) for name, size in sizes.items()}
    for name, content in data.items():
        (writer.path / name).write_bytes(content)
    writer.unmount("--wait", "--wait-timeout", "60")
    return data


def test_concurrent_restore_reads_do_not_overfill_the_tier(
    small_tier: Path, tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """Three 9 MiB files read at once on a 24 MiB tier with no byte limit: each fetch saw the
    file system's free room, not the room the fetches in flight had claimed, so all three
    fetched at once, filled the tier and failed; the partial copies they left were never
    evicted (not local), so every later read waited --full-timeout for a drain with nothing
    to drain, then failed, until a remount."""
    data = _remote_files(tmp_path, mounted_factory, {f"rank{i}.pt": 9 * MiB for i in range(3)})
    reader = _on_tier(mounted_factory, small_tier, tmp_path, "--full-timeout", "30")
    reader.mount()
    errors: list[BaseException] = []

    def read(name: str) -> None:
        try:
            assert (reader.path / name).read_bytes() == data[name], name
        except BaseException as exc:  # the thread's failure is the test's
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(name,)) for name in data]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    fresh = os.urandom(4 * MiB)  # the next checkpoint still finds room (durable copies are evicted)
    (reader.path / "next.pt").write_bytes(fresh)
    assert (reader.path / "next.pt").read_bytes() == fresh


def test_a_read_whose_room_open_files_hold_fails_after_one_wait_and_says_so(
    small_tier: Path, tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """Found in an acceptance pass: a reader holding two restored files open read a third
    that did not fit beside them. The fetch waited --full-timeout for a drain with nothing to
    drain, failed with "full of data not yet durable", and the kernel's retry of the read
    waited the whole timeout again (one read(2): twice the timeout; an mmap reader: SIGBUS)."""
    data = _remote_files(tmp_path, mounted_factory, {f"rank{i}.pt": 9 * MiB for i in range(3)})
    reader = _on_tier(mounted_factory, small_tier, tmp_path, "--full-timeout", "2")
    reader.mount()
    held = [open(reader.path / name, "rb") for name in ("rank0.pt", "rank1.pt")]  # noqa: SIM115
    try:
        for f, name in zip(held, ("rank0.pt", "rank1.pt"), strict=True):
            assert f.read() == data[name]
        with pytest.raises(OSError) as failed:
            (reader.path / "rank2.pt").read_bytes()
        assert failed.value.errno == errno.ENOSPC
        log = (reader.cache / "burstfs.log").read_text()
        assert log.count("action=wait_for_drain") == 1, log  # the kernel's retry failed at once
        assert log.count("reason=held_by_open_files") == 1 and "full of data not yet durable" not in log, log
    finally:
        for f in held:
            f.close()
    assert (reader.path / "rank2.pt").read_bytes() == data["rank2.pt"]  # their room is free once closed


def test_a_prefetch_larger_than_the_tier_leaves_it_working(
    small_tier: Path, tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """`burstfs-admin prefetch` of four 8 MiB files onto a 24 MiB tier: its fetches filled the
    tier at once, all failed, and the partial copies they left wedged every later read.  And
    (an acceptance pass) it said "fetched 32.0 MiB in 4 files" with files it had evicted again
    to fetch the others: it warns, and the JSON lists them."""
    data = _remote_files(tmp_path, mounted_factory, {f"shard{i}.bin": 8 * MiB for i in range(4)})
    reader = _on_tier(mounted_factory, small_tier, tmp_path, "--full-timeout", "30")
    reader.mount()
    prefetch = subprocess.run(
        [str(BIN / "burstfs-admin"), "prefetch", str(reader.path)], capture_output=True, text=True, timeout=120
    )
    assert prefetch.returncode == 0, prefetch.stdout + prefetch.stderr
    listing = subprocess.run(
        [str(BIN / "burstfs-admin"), "ls", str(reader.path), "--json"], capture_output=True, text=True, check=True
    )
    not_local = [f for f in json.loads(listing.stdout)["files"] if f["state"] != "durable"]
    assert not_local and "evicted again" in prefetch.stderr, (listing.stdout, prefetch.stderr)
    again = subprocess.run(
        [str(BIN / "burstfs-admin"), "prefetch", str(reader.path), "--json"], capture_output=True, text=True
    )
    assert json.loads(again.stdout)["evicted_again"], again.stdout
    assert "evicted again" in again.stderr, again.stderr  # --json warns on stderr too (ADMIN.md)
    for name, content in data.items():
        assert (reader.path / name).read_bytes() == content, name
    fresh = os.urandom(4 * MiB)  # within the headroom kept ahead of the writers (passthrough)
    (reader.path / "next.pt").write_bytes(fresh)
    assert (reader.path / "next.pt").read_bytes() == fresh


def test_what_partial_reads_left_on_the_tier_is_evicted_for_a_writer(mounted_factory: type[MountedFS]) -> None:
    """Reads of a few chunks of remote files leave those chunks on the tier (a cache for the
    next read).  They were never evicted (the files are not local), so a tier filled by such
    restores failed the next checkpoint's writes with ENOSPC while burstfs held nothing
    undrained; `burstfs-admin evict` freed nothing either."""
    fs = mounted_factory("partial", None, ("--cache-size", "40M", "--full-timeout", "3"))  # type: ignore[call-arg]
    fs.mount()
    data = _durable_then_evicted(fs, 4, 16 << 20)
    _read_a_mib_of_each(fs, data, 9 << 20)
    status = subprocess.run([str(BIN / "burstfs-admin"), "status", str(fs.path), "--json"], capture_output=True)
    assert json.loads(status.stdout)["local_tier"]["used_bytes"] >= 4 << 20  # what the reads left is shown
    fresh = os.urandom(38 << 20)  # room for it only once the partial copies (4 MiB) are gone
    (fs.path / "next.pt").write_bytes(fresh)
    assert (fs.path / "next.pt").read_bytes() == fresh
    for name, content in data.items():  # and the files read back whole, fetched anew
        assert (fs.path / name).read_bytes() == content, name
    subprocess.run([str(BIN / "burstfs-admin"), "evict", str(fs.path)], check=True, capture_output=True)
    fs.unmount()  # no page cache to answer from
    fs.mount()
    with open(fs.path / "f0", "rb") as f:  # burstfs-admin evict drops what a partial read left
        f.seek(9 << 20)
        f.read(1 << 20)
    evicted = subprocess.run(
        [str(BIN / "burstfs-admin"), "evict", str(fs.path / "f0"), "--json"], capture_output=True, check=True
    )
    assert json.loads(evicted.stdout)["bytes_freed"] > 0, evicted.stdout


def test_what_a_fetch_left_when_the_daemon_died_is_removed_at_the_next_start(
    mounted_factory: type[MountedFS],
) -> None:
    """A partial read of a remote file, then kill -9: its partly fetched data file stayed on the
    tier after the restart, counted nowhere (not local) and never evicted: room lost for good."""
    fs = mounted_factory("partial", None, ("--cache-size", "64M"))  # type: ignore[call-arg]
    fs.mount()
    data = _durable_then_evicted(fs, 1, 16 << 20)
    _read_a_mib_of_each(fs, data, 9 << 20)
    assert any((fs.cache / "data").iterdir())  # the chunks the read fetched
    fs.kill()
    fs.mount()
    assert not any((fs.cache / "data").iterdir())
    assert (fs.path / "f0").read_bytes() == data["f0"]


def test_sigterm_fails_a_write_waiting_for_room_and_the_daemon_stops_at_once(
    mounted_factory: type[MountedFS],
) -> None:
    """A writer waiting on a tier full of undrained data (the drain held back, as by a remote
    that is down): SIGTERM left the daemon running until the write's --full-timeout ran out
    (58 s of 60), since the FUSE loop ends only once every request is answered.  Now the
    write fails with ENOSPC at once, the daemon stops in seconds, and closed files stay."""
    fs = mounted_factory("stop", None, ("--cache-size", "8M", "--drain-delay", "600", "--full-timeout", "60"))  # type: ignore[call-arg]
    fs.mount()
    closed = os.urandom(6 * MiB)
    (fs.path / "closed.bin").write_bytes(closed)
    pid = fs.daemon_pid()
    outcome: dict[str, object] = {}

    def blocked_writer() -> None:
        try:
            with open(fs.path / "big.bin", "wb") as f:
                f.write(os.urandom(4 * MiB))
            outcome["result"] = "written"
        except OSError as exc:
            outcome["result"] = errno.errorcode.get(exc.errno or 0, str(exc))

    writer = threading.Thread(target=blocked_writer)
    writer.start()
    wait_for(lambda: "action=wait_for_drain" in fs.log_text(), timeout=30, what="the write to wait for room")
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGTERM)

    def daemon_gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(daemon_gone, timeout=90, interval=0.1, what="the daemon to exit")
    took = time.monotonic() - stopped_at
    writer.join(30)
    assert took < 15, f"the daemon took {took:.1f}s to stop after SIGTERM"
    assert outcome.get("result") == "ENOSPC", outcome
    assert "action=ENOSPC reason=stopping" in fs.log_text()
    subprocess.run(["fusermount3", "-u", str(fs.path)], capture_output=True, check=False)
    fs.mount()
    assert (fs.path / "closed.bin").read_bytes() == closed


def _drain_state(fs: MountedFS) -> dict[str, object]:
    result = subprocess.run(
        [str(BIN / "burstfs-admin"), "status", str(fs.path), "--json"], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)["drain"]  # type: ignore[no-any-return]


def test_a_full_file_remote_is_an_outage_the_drain_outlasts_not_a_halt(
    mounted_factory: type[MountedFS], tmp_path: Path
) -> None:
    """A remote file system with room for small files but not for a large one: the large one
    backs off and the others drain; once room is made, it drains too.  The drain halted on
    ENOSPC, resumed at every probe (the probe made an empty file) and halted again at the next
    upload, so `burstfs-admin wait` exited 4 ("waiting will not help") or waited in silence,
    depending on when it looked."""
    remote = tmp_path / "remote"
    remote.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(remote)], check=True)
    try:
        fs = mounted_factory("full", f"file://{remote}")  # type: ignore[call-arg]
        fs.mount()
        big, small = os.urandom(12 * MiB), os.urandom(4096)
        (fs.path / "big.pt").write_bytes(big)
        wait_for(lambda: "no_space" in _drain_state(fs)["errors_by_kind"], what="the upload of big.pt failing")
        (fs.path / "small.json").write_bytes(small)
        result = subprocess.run(
            [str(BIN / "burstfs-admin"), "wait", str(fs.path / "small.json"), "--timeout", "30"],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert _drain_state(fs)["halted"] is None  # the large file backs off meanwhile
        assert "event=drain_halted" not in fs.log_text()
        wait_for(lambda: _drain_state(fs)["outage"], what="status to show the outage")  # big.pt tried again
        result = subprocess.run(
            [str(BIN / "burstfs-admin"), "wait", str(fs.path), "--timeout", "2"], capture_output=True, text=True
        )
        assert result.returncode == 3 and "big.pt" in result.stderr, result.stdout + result.stderr
        told = [line for line in result.stderr.splitlines() if line.startswith("burstfs-admin wait: REMOTE FAILING")]
        assert len(told) == 1 and "remote file system full" in told[0], result.stderr
        subprocess.run(["mount", "-o", "remount,size=64m", str(remote)], check=True)
        subprocess.run([str(BIN / "burstfs-admin"), "drain", str(fs.path), "--now"], check=True, capture_output=True)
        _wait_durable(fs)
        assert (remote / "big.pt").read_bytes() == big and (remote / "small.json").read_bytes() == small
        fs.unmount()
        with contextlib.suppress(OSError), open(remote / "filler", "wb") as filler:  # the remote full to the brim
            while True:
                filler.write(bytes(MiB))
        fs.mount()  # this cache drained there: it mounts, as after a restart during any outage
        assert (fs.path / "small.json").read_bytes() == small
        fs.unmount()
        fresh = mounted_factory("fresh", f"file://{remote}")  # type: ignore[call-arg]
        refused = burstfs(
            "mount", str(fresh.path), "--cache", str(fresh.cache), "--remote", fresh.remote_url, check=False
        )
        assert refused.returncode != 0 and "remote file system full" in refused.stderr, refused.stderr
    finally:
        subprocess.run(["umount", "-l", str(remote)], check=False)

"""``burstfs-admin`` against real mounts: every command, its JSON, its exit codes.

The remote is a file:// directory, so drains finish in milliseconds; tests wait
with ``burstfs-admin wait`` (itself under test) and never assert on timing.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, FUSE_OK, MountedFS, RemoteTarget, burstfs, wait_for
from s3server import free_port

from burstfs.committer import DEFER_S

pytestmark = pytest.mark.fuse

ADMIN = str(BIN / "burstfs-admin")


def admin(*args: str | Path, expect: int | None = 0, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([ADMIN, *map(str, args)], capture_output=True, text=True, timeout=timeout, check=False)
    if expect is not None and result.returncode != expect:
        raise AssertionError(
            f"burstfs-admin {' '.join(map(str, args))}: exit {result.returncode}, "
            f"expected {expect}\nstdout: {result.stdout}\nstderr: {result.stderr}"
        )
    return result


def admin_json(*args: str | Path, expect: int = 0) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(admin(*args, "--json", expect=expect).stdout)
    assert doc["schema"] == 1
    return doc


def checkpoint(fs: MountedFS, files: dict[str, bytes]) -> None:
    """Write ``files`` under the mount and wait until all are durable."""
    for name, data in files.items():
        (fs.path / name).parent.mkdir(parents=True, exist_ok=True)
        (fs.path / name).write_bytes(data)
    admin("wait", *(fs.path / name for name in files), "--timeout", "60")


WRITER = (
    "import sys; f = open(sys.argv[1], 'wb'); f.write(b'partial'); f.flush(); print('ready', flush=True); "
    "sys.stdin.readline(); f.close()"
)


@contextlib.contextmanager
def held_open(path: Path) -> Iterator[subprocess.Popen[str]]:
    """``path`` open for writing in another process (a descriptor of ours would be inherited
    by every subprocess we start and closed at its exec, and each close publishes the file)."""
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline().strip() == "ready"  # type: ignore[union-attr]
        time.sleep(3 * DEFER_S)  # a new file's name is journaled at most DEFER_S after its create
        yield writer
    finally:
        if writer.poll() is None:
            writer.communicate("close\n", timeout=30)


def flip_byte(path: Path, offset: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- status, ls, xattrs ------------------------------------------------------------------------


def test_status_human_json_and_watch(burst: MountedFS) -> None:
    checkpoint(burst, {"ck/a": os.urandom(300_000), "ck/b": b"hello"})
    doc = admin_json("status", burst.path / "ck")
    assert doc["live"] and doc["mountpoint"] == str(burst.path) and doc["cache_dir"] == str(burst.cache)
    assert doc["remote"] == burst.remote_url and doc["pid"] == burst.daemon_pid()
    assert doc["states"]["durable"] == {"files": 2, "bytes": 300_005}
    assert set(doc["states"]) == {
        "writing",
        "staged",
        "draining",
        "durable",
        "evicted",
        "remote",
        "failed",
        "incomplete",
    }
    assert doc["undrained"] == {"files": 0, "bytes": 0, "oldest_closed_at": None, "oldest_age_s": None}
    # The mover counts a file just after journaling it durable, which is what `wait` sees.
    doc = wait_for(
        lambda: (d := admin_json("status", burst.path))["drain"]["files_drained"] >= 2 and d, what="drain counters"
    )
    assert doc["drain"]["bytes_drained"] >= 300_005
    assert doc["drain"]["eta_s"] == 0 and doc["drain"]["halted"] is None
    tier = doc["local_tier"]
    assert tier["used_bytes"] == 300_005 and 0 < tier["fs_free_bytes"] <= tier["fs_total_bytes"]
    assert tier["mount_total_bytes"] > 0

    human = admin("status", burst.path).stdout
    assert f"burstfs at {burst.path} (running" in human
    assert any(line.split()[:2] == ["durable", "2"] for line in human.splitlines())
    assert burst.remote_url in human and "undrained: 0 files" in human

    watch = subprocess.Popen([ADMIN, "status", str(burst.path), "--watch"], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        seen = ""
        while seen.count("STATE") < 2 and time.monotonic() < deadline:
            seen += watch.stdout.readline()  # type: ignore[union-attr]
    finally:
        watch.send_signal(signal.SIGINT)
        watch.communicate(timeout=10)
    assert seen.count("STATE") >= 2
    assert watch.returncode == 0


def test_ls_and_state_xattrs(burst: MountedFS) -> None:
    data = os.urandom(100_000)
    checkpoint(burst, {"ck/model.pt": data, "ck/sub/opt.pt": b"x" * 10, "other": b"y"})
    files = {f["path"]: f for f in admin_json("ls", burst.path / "ck")["files"]}
    assert set(files) == {"ck/model.pt", "ck/sub/opt.pt"}
    model = files["ck/model.pt"]
    assert model["state"] == "durable" and model["size"] == len(data) and model["remote_key"] == "ck/model.pt"
    assert model["generation"] >= 1 and model["durable_generation"] == model["generation"]
    assert len(model["digest"]) == 32 and model["error"] is None
    assert [f["path"] for f in admin_json("ls", burst.path / "ck" / "sub" / "opt.pt")["files"]] == ["ck/sub/opt.pt"]

    table = admin("ls", burst.path).stdout.splitlines()
    assert table[0].split() == ["STATE", "SIZE", "GEN", "DIGEST", "PATH", "REMOTE", "KEY"]
    assert any("ck/sub/opt.pt" in line and line.startswith("durable") for line in table)
    result = admin("ls", burst.path / "missing", expect=1)
    assert "missing" in result.stderr and "No such file" in result.stderr

    path = burst.path / "ck" / "model.pt"
    assert os.getxattr(path, "user.burstfs.state") == b"durable"
    assert os.getxattr(path, "user.burstfs.generation") == str(model["generation"]).encode()
    assert os.getxattr(path, "user.burstfs.digest") == model["digest"].encode()
    assert os.getxattr(path, "user.burstfs.remote_key") == b"ck/model.pt"
    assert "user.burstfs.state" in os.listxattr(path)
    with pytest.raises(OSError) as exc:
        os.getxattr(path, "user.burstfs.error")  # no error recorded
    assert exc.value.errno == errno.ENODATA


# -- wait ----------------------------------------------------------------------------------------


def test_wait_times_out_on_a_file_open_for_writing(burst: MountedFS) -> None:
    path = burst.path / "ck" / "open.bin"
    path.parent.mkdir()
    with held_open(path):
        result = admin("wait", burst.path / "ck", "--timeout", "0.5", expect=3)
        assert "timeout" in result.stderr and "ck/open.bin (writing)" in result.stderr
        doc = admin_json("wait", path, "--timeout", "0.2", expect=3)
        assert doc["result"] == "timeout" and doc["pending"] == [
            {"path": "ck/open.bin", "state": "writing", "error": None}
        ]
    admin("wait", path, "--timeout", "60")
    assert admin_json("wait", burst.path)["result"] == "durable"
    assert "No such file" in admin("wait", burst.path / "nope", expect=1).stderr


def test_wait_right_after_a_create_waits_for_the_file_being_written(mounted_factory: Any) -> None:
    """A new file's row is deferred to its close (at most DEFER_S): `wait` asks the daemon to
    commit it first, so a file created a moment ago is being written, not absent."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs: MountedFS = mounted_factory()
    fs.mount()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(fs.path / "shard.bin")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        result = admin("wait", fs.path, "--timeout", "0.5", expect=3)  # no sleep: at once
        assert "shard.bin" in result.stderr + result.stdout
    finally:
        writer.communicate("close\n", timeout=30)
    admin("wait", fs.path, "--timeout", "30")


def test_wait_fails_on_an_incomplete_file(mounted_factory: Any) -> None:
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs: MountedFS = mounted_factory()
    fs.mount()
    path = fs.path / "shard.bin"
    with held_open(path) as writer:
        fs.kill()  # the daemon dies while the file is open for writing
        writer.kill()
        writer.wait()
    fs.mount()
    assert admin_json("status", fs.path)["states"]["incomplete"]["files"] == 1
    result = admin("wait", path, "--timeout", "30", expect=4)
    assert "shard.bin: incomplete" in result.stderr
    assert admin_json("wait", fs.path, expect=4)["result"] == "failed"


def test_unmount_wait_is_admin_wait_without_incomplete_files(mounted_factory: Any) -> None:
    """`burstfs unmount --wait` waits as `burstfs-admin wait MNT` does (one wait_durable):
    a failed file refuses the unmount, an incomplete one (it never drains) is left out."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs: MountedFS = mounted_factory()
    fs.mount()
    with held_open(fs.path / "torn.bin") as writer:
        fs.kill()
        writer.kill()
        writer.wait()
    fs.mount()
    checkpoint(fs, {"a": b"abc"})
    with sqlite3.connect(
        fs.cache / "journal.db", timeout=30
    ) as db:  # a permanent drain failure, as the mover records it
        db.execute("UPDATE inodes SET state='failed', error='injected' WHERE name=?", (b"a",))
    refused = burstfs("unmount", "--wait", str(fs.path), check=False)
    assert refused.returncode == 1 and "1 file failed to drain; not unmounting" in refused.stderr
    assert admin_json("status", fs.path)["live"]
    admin("retry", fs.path)
    fs.unmount("--wait", "--wait-timeout", "60")  # torn.bin stays incomplete: not waited for
    assert admin_json("status", fs.cache)["states"]["incomplete"]["files"] == 1


# -- drain, retry --------------------------------------------------------------------------------


def test_drain_now_and_retry_failed(burst: MountedFS) -> None:
    checkpoint(burst, {"a": b"abc"})
    admin("drain", burst.path, "--now")
    assert admin_json("drain", burst.path, "--now") == {"schema": 1}
    assert "--now" in admin("drain", burst.path, expect=2).stderr
    assert admin_json("retry", burst.path)["requeued"] == 0
    # A permanent drain failure, injected in the journal as the mover would record it.
    with sqlite3.connect(burst.cache / "journal.db", timeout=30) as db:
        db.execute("UPDATE inodes SET state='failed', error='injected' WHERE name=?", (b"a",))
    result = admin("wait", burst.path / "a", expect=4)
    assert "a: failed (injected)" in result.stderr
    assert "requeued 1 failed files" in admin("retry", burst.path / "a").stdout
    admin("wait", burst.path / "a", "--timeout", "60")


# -- verify ----------------------------------------------------------------------------------------


def test_verify_local_and_remote(burst: MountedFS) -> None:
    checkpoint(burst, {"ck/w.pt": os.urandom(200_000), "ck/x.pt": b"tiny"})
    doc = admin_json("verify", burst.path / "ck", "--remote")
    assert doc["mismatches"] == 0
    assert [(f["path"], f["result"], f["local"]["result"], f["remote"]["result"]) for f in doc["files"]] == [
        ("ck/w.pt", "OK", "ok", "ok"),
        ("ck/x.pt", "OK", "ok", "ok"),
    ]
    assert "OK" in admin("verify", burst.path / "ck" / "w.pt").stdout

    ino = {f["path"]: f["ino"] for f in admin_json("ls", burst.path)["files"]}["ck/w.pt"]
    staged = burst.cache / "data" / f"{ino:016x}"
    flip_byte(staged, 123_456)
    result = admin("verify", burst.path / "ck", expect=4)
    assert "MISMATCH  ck/w.pt" in result.stdout and "bytes 0-200000 differ" in result.stdout
    assert "OK        ck/x.pt" in result.stdout
    flip_byte(staged, 123_456)

    flip_byte(burst.remote_dir / "ck" / "w.pt", 7)
    doc = admin_json("verify", burst.path / "ck" / "w.pt", "--remote", expect=4)
    (entry,) = doc["files"]
    assert entry["result"] == "MISMATCH" and entry["local"]["result"] == "ok"
    assert entry["remote"]["result"] == "mismatch" and "do not match their checksum" in entry["remote"]["detail"]


def test_verify_remote_of_a_file_not_drained_yet_is_skipped_not_ok(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory("held", extra_args=("--drain-delay", "3600", "--no-passthrough"))  # type: ignore[call-arg]
    # (through the daemon the close journals digests: the local check passes)
    fs.mount()
    (fs.path / "w.pt").write_bytes(os.urandom(100_000))
    doc = admin_json("verify", fs.path / "w.pt", "--remote", expect=1)
    (entry,) = doc["files"]
    assert (entry["result"], entry["local"]["result"], entry["remote"]["result"]) == ("SKIPPED", "ok", "skipped")
    assert entry["remote"]["detail"] == "not on the remote yet" and doc["skipped"] == 1
    assert admin_json("verify", fs.path / "w.pt")["files"][0]["result"] == "OK"  # the local check alone


@pytest.mark.parametrize("compress", ["none", "lz4"])
def test_verify_remote_finds_bytes_appended_to_an_object(
    mounted_factory: type[MountedFS], remote: RemoteTarget, compress: str
) -> None:
    """An object with bytes beyond what its manifest stores is not the file (a read through a
    fresh mount is EIO): `verify --remote` said OK, on the writing node and on a fresh one,
    since every chunk the manifest lists still checked out."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    writer = mounted_factory("writer", remote.url, (*remote.extra_args, "--compress", compress))  # type: ignore[call-arg]
    writer.mount()
    data = os.urandom(1_500_000) + bytes(1_500_000)  # 3,000,000 bytes, half of them compressible
    checkpoint(writer, {"ck/x.bin": data})
    assert admin_json("verify", writer.path / "ck", "--remote")["mismatches"] == 0
    stored = remote.read("ck/x.bin")
    assert stored is not None and (len(stored) < len(data)) == (compress == "lz4")
    remote.write("ck/x.bin", stored + b"X")

    (entry,) = admin_json("verify", writer.path / "ck" / "x.bin", "--remote", expect=4)["files"]
    assert (entry["result"], entry["local"]["result"], entry["remote"]["result"]) == ("MISMATCH", "ok", "mismatch")
    assert f"is {len(stored) + 1} bytes" in entry["remote"]["detail"], entry

    reader = mounted_factory("reader", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    result = admin("verify", reader.path / "ck" / "x.bin", "--remote", expect=4)
    assert "MISMATCH  ck/x.bin" in result.stdout and "do not match their checksums" in result.stderr


def test_verify_remote_on_a_fresh_node_lists_the_directories_it_walks(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """On a restore node, `verify --remote` of a directory nobody listed yet (or of the mount
    root) checked nothing and exited 0 over a corrupt object: it lists the whole subtree first."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    writer = mounted_factory("writer", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    checkpoint(writer, {"ck/w.pt": os.urandom(300_000), "ck/deep/z.pt": os.urandom(100_000), "top.pt": b"top"})
    writer.unmount()
    stored = bytearray(remote.read("ck/deep/z.pt") or b"")
    stored[4321] ^= 0xFF
    remote.write("ck/deep/z.pt", bytes(stored))

    fresh = mounted_factory("fresh", remote.url, remote.extra_args)  # type: ignore[call-arg]
    fresh.mount()
    doc = admin_json("verify", fresh.path / "ck", "--remote", expect=4)
    assert {f["path"]: f["result"] for f in doc["files"]} == {"ck/deep/z.pt": "MISMATCH", "ck/w.pt": "OK"}, doc

    root = mounted_factory("root", remote.url, remote.extra_args)  # type: ignore[call-arg]
    root.mount()
    result = admin("verify", root.path, "--remote", expect=4)
    assert "MISMATCH  ck/deep/z.pt" in result.stdout, result.stdout
    assert "OK        ck/w.pt" in result.stdout and "OK        top.pt" in result.stdout


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_verify_remote_fails_when_a_directory_cannot_be_listed(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """What a directory holds on the remote is not known when its listing fails: that is no
    "every file checked and matching" (exit 0), however few files the node knew of."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    assert remote.proxy is not None
    writer = mounted_factory("writer", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    checkpoint(writer, {"ck/a.pt": os.urandom(10_000)})
    writer.unmount()

    fresh = mounted_factory("fresh", remote.url, remote.extra_args)  # type: ignore[call-arg]
    fresh.mount()
    remote.proxy.fail_next(1000, status=503, match="list-type=2")
    result = admin("verify", fresh.path, "--remote", expect=1)
    assert "could not list" in result.stderr and "OK" not in result.stdout, result
    remote.proxy.clear()
    doc = admin_json("verify", fresh.path, "--remote")
    assert [(f["path"], f["result"]) for f in doc["files"]] == [("ck/a.pt", "OK")]


# -- journal ----------------------------------------------------------------------------------------


def test_journal_events(burst: MountedFS) -> None:
    checkpoint(burst, {"ck/a": b"1", "b": b"2"})
    events = admin_json("journal", burst.path, "--since", "10m")["events"]
    assert ("closed", "ck/a") in {(e["event"], e["path"]) for e in events}
    assert ("durable", "b") in {(e["event"], e["path"]) for e in events}
    assert {e["path"] for e in admin_json("journal", burst.path / "ck")["events"]} == {"ck/a"}
    future = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 3600))
    assert admin_json("journal", burst.path, "--since", future)["events"] == []
    assert "durable" in admin("journal", burst.path, "--since", "1h").stdout
    assert "--since" in admin("journal", burst.path, "--since", "yesterday", expect=2).stderr


# -- evict, prefetch -----------------------------------------------------------------------------------


def test_evict_and_prefetch(burst: MountedFS) -> None:
    data = os.urandom(500_000)
    checkpoint(burst, {"ck/a": data, "ck/b": b"small"})
    doc = admin_json("evict", burst.path / "ck")
    assert doc["bytes_freed"] == 500_005 and all(f["ok"] for f in doc["files"])
    assert {f["state"] for f in admin_json("ls", burst.path)["files"]} == {"evicted"}

    result = admin("prefetch", burst.path / "ck")
    assert "[2/2 files" in result.stdout and "fetched ck/a" in result.stdout
    assert {f["state"] for f in admin_json("ls", burst.path)["files"]} == {"durable"}
    assert (burst.path / "ck" / "a").read_bytes() == data

    with open(burst.path / "ck" / "a", "rb"):
        doc = admin_json("evict", burst.path / "ck" / "a", expect=1)
    assert doc["files"][0]["errno"] == errno.EBUSY
    admin_json("evict", burst.path / "ck" / "a")
    with open(burst.path / "ck" / "a", "rb") as partly:  # open, its first bytes fetched
        assert partly.read(1000) == data[:1000]
        doc = admin_json("evict", burst.path / "ck" / "a", expect=1)  # it said "evicted (0 B)"
        assert doc["files"][0]["errno"] == errno.EBUSY
        assert partly.read() == data[1000:]
    assert "nope: No such file or directory" in admin("evict", burst.path / "nope", expect=1).stderr


# -- a stopped mount, nothing mounted ------------------------------------------------------------------


def test_stopped_mount_reads_the_journal(burst: MountedFS) -> None:
    checkpoint(burst, {"ck/a": b"abc"})
    burst.unmount()
    doc = admin_json("status", burst.cache)
    assert not doc["live"] and doc["mountpoint"] == str(burst.path) and doc["pid"] is None
    assert doc["states"]["durable"]["files"] == 1 and doc["remote"] == burst.remote_url
    assert "not mounted (last at" in admin("status", burst.cache).stdout
    files = admin_json("ls", burst.path / "ck", "--cache", burst.cache)["files"]
    assert [(f["path"], f["state"]) for f in files] == [("ck/a", "durable")]
    doc = admin_json("verify", burst.path / "ck", "--cache", burst.cache, "--remote")
    assert [f["result"] for f in doc["files"]] == ["OK"]
    assert admin_json("wait", burst.cache)["result"] == "durable"
    assert any(e["event"] == "durable" for e in admin_json("journal", burst.cache)["events"])

    result = admin("status", burst.path, expect=2)
    assert "burstfs mount MOUNTPOINT --cache DIR --remote URL" in result.stderr
    assert "--cache DIR" in result.stderr
    result = admin("drain", burst.path, "--cache", burst.cache, "--now", expect=1)
    assert f"burstfs drain --cache {burst.cache}" in result.stderr
    assert "burstfs mount" in admin("retry", burst.cache, expect=1).stderr


def test_a_stopped_cache_shows_an_upload_whose_drain_was_killed_as_staged(mounted_factory: Any) -> None:
    """An upload journaled as in flight when its process died (``burstfs drain --cache``
    killed) is not in flight: status and ls of the stopped cache said ``draining``."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs: MountedFS = mounted_factory("killed", extra_args=("--drain-delay", "3600"))
    fs.mount()
    (fs.path / "ck").mkdir()
    (fs.path / "ck" / "a").write_bytes(b"abc")
    (fs.path / "ck" / "b").write_bytes(b"defg")
    time.sleep(DEFER_S + 2.5)  # the closes' records land (a crash within 2 s of a close cannot tell it)
    fs.kill()
    with sqlite3.connect(fs.cache / "journal.db") as db:  # what a drain killed mid-upload leaves
        db.execute("UPDATE inodes SET state='draining' WHERE name=?", (b"a",))
    files = admin_json("ls", fs.path / "ck", "--cache", fs.cache)["files"]
    assert sorted((f["path"], f["state"]) for f in files) == [("ck/a", "staged"), ("ck/b", "staged")]
    states = admin_json("status", fs.cache)["states"]
    assert states["staged"] == {"files": 2, "bytes": 7} and states["draining"]["files"] == 0
    fs.mount()  # and it drains at the next start
    admin("drain", fs.path, "--now")
    assert admin_json("wait", fs.path / "ck", "--timeout", "60")["result"] == "durable"


def test_a_path_that_does_not_exist_is_exit_1(burst: MountedFS) -> None:
    """docs/ADMIN.md: exit 1 when a path does not exist, live or stopped: no command reports
    on nothing (status) or claims to have steered it (abandon)."""
    checkpoint(burst, {"ck/a": b"abc"})
    missing = burst.path / "nonexist"
    for args in (("status", missing), ("ls", missing), ("wait", missing), ("abandon", missing, "--yes")):
        result = admin(*args, expect=1)
        assert f"{missing}: No such file or directory (in the burstfs mount {burst.path})" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and not result.stdout
    admin("status", burst.path / "ck")
    burst.unmount()
    result = admin("status", missing, "--cache", burst.cache, expect=1)
    assert f"No such file or directory (in the journal of cache {burst.cache})" in result.stderr
    admin("status", burst.path / "ck", "--cache", burst.cache)


def test_journal_limit_must_be_at_least_1(burst: MountedFS) -> None:
    assert "--limit" in admin("journal", burst.path, "--limit", "-1", expect=2).stderr
    assert "--limit" in admin("journal", burst.path, "--limit", "0", expect=2).stderr
    assert admin_json("journal", burst.path, "--limit", "1")["events"] is not None


# -- the control socket ----------------------------------------------------------------------------------

# Connects to the socket as uid 65534, started as root so that it can run this venv's python.
_CONNECT_AS_NOBODY = """
import ctypes, os, socket, sys
os.setegid(65534)
os.seteuid(65534)  # SO_PEERCRED reports the effective uid
if sys.argv[2] == "past-file-permissions":
    ctypes.CDLL(None).setfsuid(0)  # file access stays root's: only the daemon's own check is left
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(b'{"op": "status"}\\n')
print(s.makefile().readline())
"""


def test_control_socket_is_owner_only(burst: MountedFS) -> None:
    sock = burst.cache / "control.sock"
    st = os.stat(sock)
    assert oct(st.st_mode & 0o777) == oct(0o600) and st.st_uid == os.getuid()
    # As uid 65534 the kernel refuses: the directories and the socket are owner-only.
    denied = subprocess.run(
        [sys.executable, "-c", _CONNECT_AS_NOBODY, str(sock), "plain"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert denied.returncode != 0 and "PermissionError" in denied.stderr
    # Past the file permissions, the daemon itself refuses a peer that is not its uid or root.
    answer = subprocess.run(
        [sys.executable, "-c", _CONNECT_AS_NOBODY, str(sock), "past-file-permissions"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    reply = json.loads(answer.stdout)
    assert reply["ok"] is False and reply["errno"] == errno.EACCES and "uid 65534" in reply["error"]
    # The protocol itself: unknown ops and malformed lines are answered, not fatal.
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.sendall(b'{"op": "nope"}\nnot json\n{"op": "ls", "path": ""}\n')
        replies = s.makefile()
        unknown, garbled, listing = (json.loads(replies.readline()) for _ in range(3))
    assert unknown["ok"] is False and unknown["errno"] == errno.EINVAL and "unknown op" in unknown["error"]
    assert garbled["ok"] is False and garbled["errno"] == errno.EINVAL
    assert listing["ok"] is True and listing["files"] == []


# -- metrics -------------------------------------------------------------------------------------------


def _samples(text: str) -> dict[str, float]:
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_metrics_endpoint(mounted_factory: Any) -> None:
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    port = free_port()
    fs: MountedFS = mounted_factory(extra_args=("--metrics-addr", f"127.0.0.1:{port}"))
    fs.mount()
    checkpoint(fs, {"ck/a": os.urandom(64_000), "ck/b": b"bb"})

    def scrape() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return _samples(response.read().decode())

    # The mover counts a file just after journaling it durable, which is what `wait` sees.
    samples = wait_for(lambda: (s := scrape())["burstfs_drain_latency_seconds_count"] >= 2 and s, what="metrics")
    assert samples['burstfs_files{state="durable"}'] == 2
    assert samples["burstfs_drained_bytes_total"] >= 64_002
    assert samples["burstfs_drained_files_total"] >= 2
    assert samples['burstfs_drain_latency_seconds_bucket{le="+Inf"}'] >= 2
    assert samples["burstfs_staged_bytes"] == 0 and samples["burstfs_queue_depth"] == 0
    assert samples["burstfs_fetched_bytes_total"] == 0 and samples["burstfs_drain_halted"] == 0
    assert samples["burstfs_remote_outage_seconds"] == 0
    assert 0 < samples["burstfs_local_tier_free_bytes"] <= samples["burstfs_local_tier_capacity_bytes"]
    # A getxattr outside user.* is ENODATA; the shim answers it without the daemon (where built).
    answered = samples["burstfs_fuse_xattr_answered_in_shim_total"]
    for _ in range(3):
        with pytest.raises(OSError) as exc:
            os.getxattr(fs.path / "ck" / "a", "security.selinux")
        assert exc.value.errno == errno.ENODATA
    assert os.getxattr(fs.path / "ck" / "a", "user.burstfs.state") == b"durable"  # user.* reaches the daemon
    if importlib.util.find_spec("burstfs._passthrough") is not None:
        assert scrape()["burstfs_fuse_xattr_answered_in_shim_total"] == answered + 3
    # A read refused on a corrupt object is a read error, not the drain's (its alert stays quiet).
    admin_json("evict", fs.path / "ck" / "a")
    corrupt = bytearray((fs.remote_dir / "ck" / "a").read_bytes())
    corrupt[100] ^= 1
    (fs.remote_dir / "ck" / "a").write_bytes(bytes(corrupt))
    with pytest.raises(OSError) as exc:
        (fs.path / "ck" / "a").read_bytes()
    assert exc.value.errno == errno.EIO
    after = scrape()
    assert after['burstfs_read_errors_total{kind="corrupt_read"}'] == 1
    assert not [name for name in after if name.startswith("burstfs_drain_errors_total")]
    # Bound to the address given, not to every interface.
    with open("/proc/net/tcp") as tcp:
        listening = [line.split()[1] for line in tcp if line.split()[3] == "0A"]
    assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening

    full_port = free_port()  # port + 1 was taken once in CI (another test's server)
    full = mounted_factory(
        "full", extra_args=("--metrics-addr", f"127.0.0.1:{full_port}", "--cache-size", "16M", "--drain-delay", "3600")
    )
    full.mount()
    (full.path / "staged.bin").write_bytes(os.urandom(12 << 20))
    with urllib.request.urlopen(f"http://127.0.0.1:{full_port}/metrics", timeout=10) as response:
        tier = _samples(response.read().decode())
    # What the mount reports (df), within --cache-size: it read the host's file system (the
    # runbook's "tier will fill" alert never fired).
    df = os.statvfs(full.path)
    assert tier["burstfs_local_tier_capacity_bytes"] == df.f_blocks * df.f_frsize <= 16 << 20
    assert tier["burstfs_local_tier_free_bytes"] == df.f_bavail * df.f_frsize <= 4 << 20

    bad = mounted_factory("bad", extra_args=("--metrics-addr", "9100"))
    result = burstfs(
        "mount", str(bad.path), "--cache", str(bad.cache), "--remote", bad.remote_url, *bad.extra_args, check=False
    )
    assert result.returncode == 2 and "HOST:PORT" in result.stderr


def test_verify_remote_on_a_restore_node_checks_remote_only_files(mounted_factory: type[MountedFS]) -> None:
    """Issue 11 #5: on a node that only lists the files, `verify --remote` fetches and
    checks each object against its manifest (finding a corrupt one), and a file that
    could not be checked (SKIPPED) is never a success exit."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    writer = mounted_factory("writer")  # type: ignore[call-arg]
    writer.mount()
    checkpoint(writer, {"ck/good.pt": os.urandom(100_000), "ck/bad.pt": os.urandom(100_000)})
    writer.unmount()
    flip_byte(writer.remote_dir / "ck" / "bad.pt", 4321)

    reader = mounted_factory("reader", writer.remote_url)  # type: ignore[call-arg]
    reader.mount()
    reader.expect_log("event=verify_mismatch")
    assert sorted(os.listdir(reader.path / "ck")) == ["bad.pt", "good.pt"]
    doc = admin_json("verify", reader.path / "ck", "--remote", expect=4)
    results = {f["path"]: (f["result"], f["remote"]["result"]) for f in doc["files"]}
    assert results == {"ck/bad.pt": ("MISMATCH", "mismatch"), "ck/good.pt": ("OK", "ok")}, doc

    # Without --remote nothing can be checked on this node: SKIPPED, exit 1, says so.
    result = admin("verify", reader.path / "ck" / "good.pt", expect=1)
    assert "SKIPPED" in result.stdout and "could not be checked" in result.stderr

    # prefetch says one failed (and exits 1), not "fetched 2 files"
    reader.expect_log("corrupt")
    reader.expect_log("mismatch")
    result = admin("prefetch", reader.path / "ck", expect=1)
    assert "in 1 file; 1 failed" in result.stdout, result.stdout
    # ls shows the whole xxh3-128 digest (32 hex digits), as documented
    digest = admin_json("ls", reader.path / "ck" / "good.pt")["files"][0]["digest"]
    row = [line for line in admin("ls", reader.path / "ck").stdout.splitlines() if "good.pt" in line]
    assert digest is None or digest in row[0]
    assert any(len(word) == 32 for word in admin("ls", writer.cache).stdout.split()), "no 32-digit digest"


def test_verify_of_a_file_left_incomplete_by_a_crash_is_skipped_not_a_mismatch(
    mounted_factory: type[MountedFS],
) -> None:
    """A durable file rewritten in place when the daemon died: its bytes are no closed version,
    so there is nothing to compare them with (it said MISMATCH: corruption of the tier)."""
    # Every write reaches the daemon at once (on any kernel): the rewrite lands before the kill.
    fs = mounted_factory("crashed", extra_args=("--no-passthrough", "--no-writeback-cache"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "a.pt").write_bytes(os.urandom(1 << 20))
    admin("wait", fs.path / "a.pt")
    f = open(fs.path / "a.pt", "r+b", buffering=0)  # noqa: SIM115 (open when the daemon dies)
    f.write(b"rewritten")
    fs.kill()
    with contextlib.suppress(OSError):  # the daemon is gone
        f.close()
    fs.mount()
    (entry,) = admin_json("verify", fs.path / "a.pt", expect=1)["files"]
    assert (entry["result"], entry["local"]["result"]) == ("SKIPPED", "skipped"), entry
    assert "incomplete" in entry["local"]["detail"]


# -- what file names can hold --------------------------------------------------------------------------


def test_a_file_name_with_a_newline_makes_no_line_of_its_own(mounted_factory: type[MountedFS]) -> None:
    """A writer of the mount could forge a whole line in burstfs.log with a file name holding a
    newline (burstfs.log promises one line per event), and the text of `ls` and `journal`
    printed the name raw.  Escaped (\\n) in all three; the JSON keeps the name as it is."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory("names")  # type: ignore[call-arg]
    fs.mount()
    forged = "1999-01-01 00:00:00,000 ERROR burstfs.mover event=drain_halted remote=FORGED"
    name = f"ok\n{forged}"
    checkpoint(fs, {name: b"x"})
    assert [f["path"] for f in admin_json("ls", fs.path)["files"]] == [name]
    listing = admin("ls", fs.path).stdout.splitlines()
    assert len(listing) == 2 and "ok\\n1999-01-01" in listing[1], listing
    events = admin("journal", fs.path).stdout.splitlines()
    assert events and all(not line.startswith("1999") for line in events), events
    assert any("ok\\n1999-01-01" in line for line in events), events
    fs.unmount()
    log_lines = fs.log_text().splitlines()
    assert not [line for line in log_lines if line.startswith("1999")], "a forged log line"
    assert all(line[:4].isdigit() or line.startswith("    ") for line in log_lines), log_lines
    assert any("key=ok\\n1999-01-01" in line for line in log_lines)


def test_latest_and_abandon_take_cache_as_every_command_does(mounted_factory: type[MountedFS]) -> None:
    """docs/ADMIN.md: "Every command takes --cache"; latest and abandon refused it (exit 2, no
    such option).  latest of a stopped mount named by its cache reads the remote it recorded;
    abandon says it needs the running mount."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory("ck")  # type: ignore[call-arg]
    fs.mount()
    checkpoint(fs, {"run/step_1/shard.bin": b"w" * 1000, "run/step_1/.metadata": b"meta"})
    fs.unmount()
    found = admin_json("latest", fs.path / "run", "--cache", fs.cache)
    assert found["dir"] == "run/step_1", found
    result = admin("abandon", fs.path / "run" / "step_1", "--cache", fs.cache, "--yes", expect=1)
    assert "abandon needs a running mount" in result.stderr, result.stderr
    result = admin("latest", "--remote", fs.remote_url, "--cache", fs.cache, expect=2)
    assert "give --remote or --cache, not both" in result.stderr, result.stderr

"""FUSE passthrough: the kernel does file I/O on the local tier, the daemon keeps the books.

The POSIX suite (test_posix.py) runs on both data paths through the ``burst``
fixture; these tests cover what is particular to passthrough: that it is really
on, that bytes bypass the daemon, when it is off, how it meets files still being
fetched, and writes the daemon learns of only at close.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, FUSE_OK, MountedFS, file_state, wait_for

pytestmark = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")


def _kernel_has_passthrough() -> bool:
    major, minor = (int(x) for x in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 9)


needs_passthrough = pytest.mark.skipif(not _kernel_has_passthrough(), reason="FUSE passthrough needs Linux 6.9+")


def status(path: Path) -> dict[str, Any]:
    out = subprocess.run(
        [str(BIN / "burstfs-admin"), "status", "--json", str(path)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)


@needs_passthrough
def test_bytes_bypass_the_daemon(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory()  # type: ignore[call-arg]
    fs.mount()
    assert "event=passthrough state=on" in fs.log_text()
    data = os.urandom(1 << 20) * 24
    (fs.path / "ckpt.pt").write_bytes(data)
    doc = status(fs.path)
    assert doc["data_path"] == "passthrough"
    assert doc["daemon_written_bytes"] == 0
    assert (fs.path / "ckpt.pt").stat().st_size == len(data)
    assert (fs.path / "ckpt.pt").read_bytes() == data
    wait_for(lambda: file_state(fs.cache, "ckpt.pt") == "durable", what="drained")
    # The drain hashed the file itself (the daemon never saw the bytes) and stored a manifest.
    assert (fs.remote_dir / "ckpt.pt").read_bytes() == data
    assert os.getxattr(fs.path / "ckpt.pt", "user.burstfs.digest")


def test_daemon_path_when_asked_or_limited(mounted_factory: type[MountedFS]) -> None:
    for name, args in (("off", ("--no-passthrough",)), ("limited", ("--cache-size", "1G"))):
        fs = mounted_factory(name, extra_args=args)  # type: ignore[call-arg]
        fs.mount()
        (fs.path / "f").write_bytes(b"x" * 100_000)
        doc = status(fs.path)
        assert doc["data_path"] == "daemon"
        assert doc["daemon_written_bytes"] == 100_000
        assert "event=passthrough state=off reason=" in fs.log_text()


def test_writes_through_a_dup_after_the_first_close_are_published(burst: MountedFS) -> None:
    p = burst.path / "dup.bin"
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    second = os.dup(fd)
    os.write(fd, b"a" * 300_000)
    os.close(fd)  # close(2) publishes what is there now
    os.write(second, b"b" * 200_000)
    os.close(second)  # the last close publishes the rest
    want = b"a" * 300_000 + b"b" * 200_000
    assert p.read_bytes() == want
    wait_for(lambda: file_state(burst.cache, "dup.bin") == "durable", what="drained")
    assert (burst.remote_dir / "dup.bin").read_bytes() == want


def test_stat_follows_writes_of_an_open_file(burst: MountedFS) -> None:
    p = burst.path / "growing"
    with open(p, "wb", buffering=0) as f:
        for i in range(1, 4):
            f.write(b"z" * 65536)
            assert os.stat(p).st_size == i * 65536
            assert os.fstat(f.fileno()).st_size == i * 65536
        before = os.stat(p).st_mtime_ns
        os.utime(p, ns=(1_000_000_000, 2_000_000_000))  # an explicit mtime wins over the write's
        assert os.stat(p).st_mtime_ns == 2_000_000_000
    assert before > 2_000_000_000
    assert os.stat(p).st_mtime_ns == 2_000_000_000


def test_a_file_being_fetched_opens_cached_then_direct(mounted_factory: type[MountedFS], tmp_path: Path) -> None:
    """The kernel refuses to mix passthrough and page-cache opens of one file: opens
    of a file still being fetched all go through the daemon until they close."""
    remote = tmp_path / "shared"
    remote.mkdir()
    writer = mounted_factory("writer", f"file://{remote}")  # type: ignore[call-arg]
    writer.mount()
    data = os.urandom(1 << 20) * 40
    (writer.path / "model.pt").write_bytes(data)
    wait_for(lambda: file_state(writer.cache, "model.pt") == "durable", what="drained")
    reader = mounted_factory("reader", f"file://{remote}")  # type: ignore[call-arg]
    reader.mount()
    p = reader.path / "model.pt"
    with open(p, "rb") as first:
        assert first.read(1 << 20) == data[: 1 << 20]  # fetching has begun
        with open(p, "r+b") as second:  # opened while the first is still cached
            second.seek(5)
            second.write(b"EDIT")
        assert first.read() == (data[:5] + b"EDIT" + data[9:])[1 << 20 :]
    edited = data[:5] + b"EDIT" + data[9:]
    with open(p, "rb") as again:  # all closed: this one passes through
        assert hashlib.sha256(again.read()).digest() == hashlib.sha256(edited).digest()
    wait_for(lambda: (remote / "model.pt").read_bytes() == edited, what="edit drained")

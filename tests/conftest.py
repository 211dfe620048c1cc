"""Shared fixtures: real burstfs mounts (through the CLI, as a user runs it).

A mount fixture starts the daemon with ``burstfs mount``, waits until it is live,
and at teardown unmounts (lazily if stuck) and fails the test if the daemon
logged an unexpected error or a bug (pyfuse3 test/util.py and s3ql's
pytest_checklogs are the models).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
FUSE_OK = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None and os.geteuid() == 0
needs_fuse = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")


def burstfs(*args: str, check: bool = True, timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run the ``burstfs`` CLI of this environment."""
    result = subprocess.run([str(BIN / "burstfs"), *args], capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise AssertionError(f"burstfs {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == real for line in f)


def force_unmount(path: Path) -> None:
    if is_mounted(path):
        if subprocess.run(["fusermount3", "-u", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


class MountedFS:
    """A burstfs mount started by a test: its paths and lifecycle."""

    # Log lines a test may legitimately cause are declared with expect_log().
    BAD_LOG_MARKERS = ("event=request_bug", "Traceback", "event=daemon_failed")

    def __init__(self, root: Path, remote_url: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.root = root
        self.path = root / "mnt"
        self.cache = root / "cache"
        self.remote_dir = root / "remote"
        self.remote_url = remote_url or f"file://{self.remote_dir}"
        self.extra_args = extra_args
        self.expected_log: list[str] = []
        self.path.mkdir(parents=True, exist_ok=True)
        self.remote_dir.mkdir(parents=True, exist_ok=True)

    def mount(self, *args: str) -> None:
        burstfs("mount", str(self.path), "--cache", str(self.cache), "--remote", self.remote_url,
                *self.extra_args, *args)  # fmt: skip
        assert is_mounted(self.path)

    def unmount(self, *args: str) -> None:
        burstfs("unmount", str(self.path), *args)

    def daemon_pid(self) -> int:
        return int((self.cache / "lock").read_text().strip())

    def kill(self) -> None:
        """kill -9 the daemon and clean up the dead mount, as an operator would."""
        pid = self.daemon_pid()
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        force_unmount(self.path)

    def expect_log(self, marker: str) -> None:
        self.expected_log.append(marker)

    def log_text(self) -> str:
        log = self.cache / "burstfs.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def unexpected_log_lines(self) -> list[str]:
        bad = []
        for line in self.log_text().splitlines():
            if any(m in line for m in self.BAD_LOG_MARKERS) and not any(e in line for e in self.expected_log):
                bad.append(line)
        return bad

    def cleanup(self) -> None:
        if is_mounted(self.path):
            try:
                self.unmount()
            except (AssertionError, subprocess.TimeoutExpired):
                force_unmount(self.path)
        try:
            pid = self.daemon_pid()
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass


@pytest.fixture
def mounted_factory(tmp_path: Path) -> Iterator[type[MountedFS]]:
    """Build extra mounts (other caches, other options) that are cleaned up after the test."""
    created: list[MountedFS] = []

    def factory(name: str = "fs", remote_url: str | None = None, extra_args: tuple[str, ...] = ()) -> MountedFS:
        fs = MountedFS(tmp_path / name, remote_url, extra_args)
        created.append(fs)
        return fs

    yield factory  # type: ignore[misc]
    problems = []
    for fs in created:
        fs.cleanup()
        problems += fs.unexpected_log_lines()
    assert not problems, "daemon logged unexpected errors:\n" + "\n".join(problems)


@pytest.fixture
def burst(mounted_factory: type[MountedFS]) -> MountedFS:
    """A live mount over a file:// remote in a temp dir."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory()  # type: ignore[call-arg]
    fs.mount()
    return fs


@pytest.fixture
def burst_mount(burst: MountedFS) -> Path:
    """The mount point of a live mount (for tests that only need a directory)."""
    return burst.path

"""``burstfs-admin wait`` and ``prefetch`` progress: plain lines without a terminal,
a bar (bytes, rate, ETA) on one (a pty)."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios

import pytest
from conftest import BIN, FUSE_OK, MountedFS

pytestmark = [pytest.mark.fuse, pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")]

ADMIN = str(BIN / "burstfs-admin")


@pytest.fixture
def delayed(mounted_factory: type[MountedFS]) -> MountedFS:
    """A mount whose files wait an hour before they drain (until `drain --now`)."""
    fs = mounted_factory(extra_args=("--drain-delay", "3600"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "ck").mkdir()
    (fs.path / "ck" / "a").write_bytes(os.urandom(300_000))
    (fs.path / "ck" / "b").write_bytes(os.urandom(100_000))
    return fs


def test_wait_prints_plain_progress_lines_without_a_terminal(delayed: MountedFS) -> None:
    wait = subprocess.Popen(
        [ADMIN, "wait", str(delayed.path / "ck"), "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert wait.stderr is not None
    first = wait.stderr.readline()  # before anything drains
    assert first.startswith("durable: 0/2 files, 0 B of 390.6 KiB"), first
    subprocess.run([ADMIN, "drain", str(delayed.path), "--now"], check=True, capture_output=True, timeout=60)
    _out, err = wait.communicate(timeout=120)
    assert wait.returncode == 0, err
    lines = [first.strip(), *err.splitlines()]
    assert lines[-1].startswith("durable: 2/2 files, 390.6 KiB of 390.6 KiB, ") and lines[-1].endswith("ETA 0s"), lines
    assert "B/s" in lines[-1] and "\r" not in err  # plain lines, no bar
    assert len(lines) == len(set(lines))  # one line per change, not per poll


def run_in_pty(argv: list[str], timeout: float = 120) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdin, stdout and stderr; its exit code and output."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    process = subprocess.Popen(argv, stdin=terminal, stdout=terminal, stderr=terminal, close_fds=True)
    os.close(terminal)
    chunks = []
    try:
        while True:
            ready, _, _ = select.select([controller], [], [], timeout)
            if not ready:
                raise AssertionError(f"{argv} printed nothing for {timeout}s")
            try:
                data = os.read(controller, 65536)
            except OSError:  # EIO: the other side closed
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(controller)
    return process.wait(timeout=timeout), b"".join(chunks).decode(errors="replace")


def test_wait_and_prefetch_show_a_bar_on_a_terminal(delayed: MountedFS) -> None:
    subprocess.run([ADMIN, "drain", str(delayed.path), "--now"], check=True, capture_output=True, timeout=60)
    code, out = run_in_pty([ADMIN, "wait", str(delayed.path / "ck"), "--timeout", "120"])
    assert code == 0, out
    assert "durable: 100%" in out and "391k/391k" in out and "2/2 files" in out, out
    subprocess.run([ADMIN, "evict", str(delayed.path / "ck")], check=True, capture_output=True, timeout=60)
    code, out = run_in_pty([ADMIN, "prefetch", str(delayed.path / "ck")])
    assert code == 0, out
    assert "fetched: 100%" in out and "2/2 files" in out and "B/s" in out, out
    assert "fetched ck/a" in out and "fetched 390.6 KiB in 2 files" in out


def test_prefetch_plain_lines_have_rate_and_eta(delayed: MountedFS) -> None:
    subprocess.run([ADMIN, "drain", str(delayed.path), "--now"], check=True, capture_output=True, timeout=60)
    subprocess.run([ADMIN, "wait", str(delayed.path / "ck")], check=True, capture_output=True, timeout=120)
    subprocess.run([ADMIN, "evict", str(delayed.path / "ck")], check=True, capture_output=True, timeout=60)
    result = subprocess.run([ADMIN, "prefetch", str(delayed.path / "ck")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[1].startswith("[2/2 files, 390.6 KiB of 390.6 KiB, ") and "ETA 0s]" in lines[1], (
        lines
    )
    assert {line.rsplit("] ", 1)[1] for line in lines[:2]} == {"fetched ck/a", "fetched ck/b"}
    assert all("B/s" in line for line in lines[:2])


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.25, "250ms"), (59.4, "59s"), (59.6, "1m00s"), (119.5, "2m00s"), (659.7, "11m00s"), (3599.6, "1h00m")],
)
def test_durations_round_once_and_never_show_60(seconds: float, shown: str) -> None:
    from burstfs.progress import fmt_duration

    assert fmt_duration(seconds) == shown

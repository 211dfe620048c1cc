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


class FakeClock:
    """``time`` for burstfs.progress: ``monotonic`` reads ``now``, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def eta_of(line: str) -> str:
    return line.rsplit("ETA ", 1)[1].strip()


def seconds_of(shown: str) -> float:
    """'87h49m', '9s', '1m05s', '250ms' -> seconds."""
    import re

    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|h|m|s)", shown))


def test_wait_eta_with_many_small_files_follows_the_files_made_durable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported line was 'durable: 1432/1531 files, 4.1 MiB of 7.5 MiB, 11 B/s, ETA 87h49m'
    for a wait that ended 4.7 s later: small files became durable ten a second, but the ETA
    divided the bytes left (mostly in a few larger files, counted only once durable) by the
    few bytes those small files moved."""
    import io

    from burstfs import progress

    clock = FakeClock()
    monkeypatch.setattr(progress, "time", clock)
    out = io.StringIO()
    bar = progress.Progress("durable", stream=out, terminal=False)
    total_files, total_bytes = 1531, int(7.5 * 2**20)
    files, done = 1400, int(4.1 * 2**20) - 320
    bar.update(files, total_files, done, total_bytes)  # the first poll
    lines = []
    for _ in range(32):  # a small file durable every 0.1 s
        clock.now += 0.1
        files, done = files + 1, done + 10
        bar.update(files, total_files, done, total_bytes)
        lines.append(out.getvalue().splitlines()[-1])
    assert eta_of(lines[0]) == "-" and "- B/s" in lines[0], lines[0]  # 0.1 s is no rate yet
    assert lines[-1].startswith("durable: 1432/1531 files, 4.1 MiB of 7.5 MiB, "), lines[-1]
    assert 5 <= seconds_of(eta_of(lines[-1])) <= 20, lines[-1]  # 99 files at 10 a second
    # A drain that stops: once the window holds no progress there is no rate and no ETA.
    clock.now += 30
    assert bar.counts(files, total_files, done, total_bytes).endswith("- B/s, ETA -")
    # The window's rate, not the average since the start: bytes fast now, after the stall.
    for _ in range(20):
        clock.now += 0.5
        files, done = files + 1, done + 2**20 // 10
        bar.update(files, total_files, done, total_bytes)
    line = out.getvalue().splitlines()[-1]
    assert "204.8 KiB/s" in line and seconds_of(eta_of(line)) <= 15, line
    bar.update(total_files, total_files, total_bytes, total_bytes)
    assert out.getvalue().splitlines()[-1].endswith("ETA 0s")


def test_prefetch_eta_with_bytes_in_flight_follows_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch of 40 small files and one 1 GiB file: the small ones are done within a
    second, so the files' rate said 'ETA 0s'-ish while the large file had 8 s to go.  Its
    bytes count as they land (``bytes_in_flight``): the ETA follows them."""
    import io

    from burstfs import progress

    clock = FakeClock()
    monkeypatch.setattr(progress, "time", clock)
    out = io.StringIO()
    bar = progress.Progress("fetched", stream=out, terminal=False, baseline=0, bytes_in_flight=True)
    total_files, total_bytes = 41, 40 * 4096 + 2**30
    bar.update(0, total_files, 0, total_bytes)
    for tick in range(1, 21):  # 100 MiB/s: the small files all done in the first half second
        clock.now += 0.1
        bar.update(min(40, tick * 8), total_files, min(total_bytes, tick * 10 * 2**20), total_bytes)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("fetched: 40/41 files, ") and "100.0 MiB/s" in line, line
    assert 7 <= seconds_of(eta_of(line)) <= 10, line  # ~824 MiB left at 100 MiB/s

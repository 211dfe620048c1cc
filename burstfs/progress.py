"""Progress of ``burstfs-admin wait`` and ``prefetch`` in bytes, with rate and ETA:
a tqdm bar on a terminal, plain lines otherwise (a log, a pipe, CI), one per change."""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import TextIO

from tqdm import tqdm


def count(n: int, noun: str) -> str:
    """``1 file``, ``2 files``: a count and its noun for a message."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def they(n: int, singular: str, plural: str) -> str:
    """What is said of a count of ``n``: ``they(1, "it stays", "they stay")`` is ``it stays``."""
    return singular if n == 1 else plural


def be(n: int) -> str:
    """The verb for a count of ``n``: ``1 file is``, ``2 files are``."""
    return "is" if n == 1 else "are"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 0.9995:
        return f"{seconds * 1000:.0f}ms"
    whole = round(seconds)  # rounded once, so 59.6 s is 1m00s, never 60s (nor 10m60s)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


#: The rate is what became done over about the last RATE_WINDOW seconds: after a stall the
#: rate is 0 (no ETA) once the window holds no progress, and a burst shows as one.
RATE_WINDOW = 10.0
#: No rate nor ETA until the counts span this long: one file done 0.1 s after the first
#: poll is no rate (it showed any number, and an ETA from it).
MIN_SPAN = 1.0


class Progress:
    """Bytes done of a total.  ``update`` with the latest counts; ``close`` at the end."""

    def __init__(
        self,
        what: str,
        stream: TextIO | None = None,
        terminal: bool | None = None,
        baseline: int | None = None,
        bytes_in_flight: bool = False,
    ) -> None:
        """``bytes_in_flight``: the byte count includes files still under way (prefetch's), so the
        ETA goes by bytes alone (see :meth:`speed_and_eta`)."""
        self.what = what
        self.bytes_in_flight = bytes_in_flight
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.started = time.monotonic()
        # (time, files done, bytes done) where the counts changed: the rate's window.  The
        # first is ``baseline`` bytes (no files) done at the start, else the first update's.
        self.samples: deque[tuple[float, int, int]] = deque()
        if baseline is not None:
            self.samples.append((self.started, 0, baseline))
        self.last: tuple[int, int, int, int] | None = None
        self.bar: tqdm[None] | None = None
        if self.terminal:
            self.bar = tqdm(
                desc=what,
                total=0,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                dynamic_ncols=True,
                leave=True,
                # tqdm's own rate and ETA count bytes only, smoothed: the postfix has ours.
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]",
            )

    def update(
        self, done_files: int, total_files: int, done_bytes: int, total_bytes: int, message: str | None = None
    ) -> None:
        """The latest counts; ``message`` (e.g. the file just fetched) goes to stdout above the
        bar, or ends the plain line."""
        counts = (done_files, total_files, done_bytes, total_bytes)
        if not self.samples or self.samples[-1][1:] != (done_files, done_bytes):
            self.samples.append((time.monotonic(), done_files, done_bytes))
        if self.bar is not None:
            if message:
                self.bar.write(message, file=sys.stdout)
            self.bar.total = total_bytes
            self.bar.n = done_bytes
            speed, eta = self.speed_and_eta(*counts)
            self.bar.set_postfix_str(f"{done_files}/{total_files} files, {speed}, ETA {eta}", refresh=False)
            self.bar.refresh()
        elif message:
            sys.stdout.write(f"[{self.counts(*counts)}] {message}\n")
            sys.stdout.flush()
        elif counts != self.last:
            self.stream.write(f"{self.what}: {self.counts(*counts)}\n")
            self.stream.flush()
        self.last = counts

    def note(self, text: str) -> None:
        """A line about the work, not its counts (an outage): above the bar, or a line of its own."""
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(f"{text}\n")
            self.stream.flush()

    def counts(self, done_files: int, total_files: int, done_bytes: int, total_bytes: int) -> str:
        """'3/10 files, 1.2 GiB of 4.0 GiB, 250.0 MiB/s, ETA 11s' (:meth:`speed_and_eta`)."""
        speed, eta = self.speed_and_eta(done_files, total_files, done_bytes, total_bytes)
        return (
            f"{done_files}/{total_files} files, {fmt_bytes(done_bytes)} of {fmt_bytes(total_bytes)}, {speed}, ETA {eta}"
        )

    def rates(self, done_files: int, done_bytes: int) -> tuple[float | None, float | None]:
        """Files and bytes done per second over the last RATE_WINDOW seconds (since the first
        sample while it is younger); None for a count that did not move, or before MIN_SPAN."""
        now = time.monotonic()
        window_start = now - RATE_WINDOW
        while len(self.samples) >= 2 and self.samples[1][0] <= window_start:
            self.samples.popleft()  # the first sample is now the counts at the window's start
        if not self.samples:
            return None, None
        since, files, nbytes = self.samples[0]
        span = now - max(since, window_start)  # the counts held still between samples
        if span < MIN_SPAN:
            return None, None
        file_rate = (done_files - files) / span if done_files > files else None
        byte_rate = (done_bytes - nbytes) / span if done_bytes > nbytes else None
        return file_rate, byte_rate

    def speed_and_eta(self, done_files: int, total_files: int, done_bytes: int, total_bytes: int) -> tuple[str, str]:
        """The byte rate and the ETA, as shown.  A file counts (files and bytes) only once it
        is done, so each count alone misleads: with many small files and a few large ones the
        bytes hardly move while files go by (an ETA of 87 hours for a wait of 4.7 s), and the
        other way round with a few large files.  The ETA is the sooner of the two estimates,
        files left at the files' rate and bytes left at the bytes' rate, each from the window;
        "-" until one of them moved.  Where the bytes count files under way (``bytes_in_flight``)
        they alone say how far it is."""
        file_rate, byte_rate = self.rates(done_files, done_bytes)
        speed = f"{fmt_bytes(byte_rate)}/s" if byte_rate else "- B/s"
        files_left, bytes_left = total_files - done_files, total_bytes - done_bytes
        if files_left <= 0 and bytes_left <= 0:
            return speed, "0s"
        estimates = []
        if files_left > 0 and file_rate and not self.bytes_in_flight:
            estimates.append(files_left / file_rate)
        if bytes_left > 0 and byte_rate:
            estimates.append(bytes_left / byte_rate)
        return speed, fmt_duration(min(estimates)) if estimates else "-"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

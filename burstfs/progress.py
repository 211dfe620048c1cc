"""Progress of ``burstfs-admin wait`` and ``prefetch`` in bytes, with rate and ETA:
a tqdm bar on a terminal, plain lines otherwise (a log, a pipe, CI), one per change."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


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


class Progress:
    """Bytes done of a total.  ``update`` with the latest counts; ``close`` at the end."""

    def __init__(
        self, what: str, stream: TextIO | None = None, terminal: bool | None = None, baseline: int | None = None
    ) -> None:
        self.what = what
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.started = time.monotonic()
        self.first_bytes = baseline  # done at the start (default: the first update's): the rate counts what moved since
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
            )

    def update(
        self, done_files: int, total_files: int, done_bytes: int, total_bytes: int, message: str | None = None
    ) -> None:
        """The latest counts; ``message`` (e.g. the file just fetched) goes to stdout above the
        bar, or ends the plain line."""
        counts = (done_files, total_files, done_bytes, total_bytes)
        if self.first_bytes is None:
            self.first_bytes = done_bytes
        if self.bar is not None:
            if message:
                self.bar.write(message, file=sys.stdout)
            self.bar.total = total_bytes
            self.bar.n = done_bytes
            self.bar.set_postfix_str(f"{done_files}/{total_files} files", refresh=False)
            self.bar.refresh()
        elif message:
            sys.stdout.write(f"[{self.counts(*counts)}] {message}\n")
            sys.stdout.flush()
        elif counts != self.last:
            self.stream.write(f"{self.what}: {self.counts(*counts)}\n")
            self.stream.flush()
        self.last = counts

    def counts(self, done_files: int, total_files: int, done_bytes: int, total_bytes: int) -> str:
        """'3/10 files, 1.2 GiB of 4.0 GiB, 250.0 MiB/s, ETA 11s' (the rate counts bytes moved since the start)."""
        elapsed = time.monotonic() - self.started
        moved = done_bytes - (self.first_bytes or 0)
        rate = moved / elapsed if elapsed > 0 and moved > 0 else None
        left = total_bytes - done_bytes
        eta = "0s" if left <= 0 else fmt_duration(left / rate) if rate else "-"
        speed = f"{fmt_bytes(rate)}/s" if rate else "- B/s"
        return (
            f"{done_files}/{total_files} files, {fmt_bytes(done_bytes)} of {fmt_bytes(total_bytes)}, {speed}, ETA {eta}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

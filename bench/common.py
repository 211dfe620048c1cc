"""Helpers shared by the benchmarks: a burstfs mount on tmpfs, timing, reporting."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

BIN = Path(sys.executable).parent


class BenchMount:
    """A burstfs daemon whose cache lives on tmpfs next to a plain tmpfs directory."""

    def __init__(self, base: Path, remote_url: str | None = None, args: tuple[str, ...] = ()) -> None:
        self.base = base
        self.mnt = base / "mnt"
        self.cache = base / "cache"
        self.plain = base / "plain"
        self.remote_dir = base / "remote"
        for d in (self.mnt, self.plain, self.remote_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.remote_url = remote_url or f"file://{self.remote_dir}"
        self.args = args

    def mount(self) -> None:
        subprocess.run([str(BIN / "burstfs"), "mount", str(self.mnt), "--cache", str(self.cache),
                        "--remote", self.remote_url, "--log-level", "WARNING", *self.args], check=True)  # fmt: skip

    def unmount(self) -> None:
        subprocess.run([str(BIN / "burstfs"), "unmount", str(self.mnt)], check=False, capture_output=True)

    def daemon_pid(self) -> int:
        return int((self.cache / "lock").read_text().strip())

    def daemon_peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.daemon_pid()}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")


@contextlib.contextmanager
def bench_mount(remote_url: str | None = None, args: tuple[str, ...] = ()) -> Iterator[BenchMount]:
    base = Path(tempfile.mkdtemp(prefix="burstfs-bench-", dir="/dev/shm"))
    mount = BenchMount(base, remote_url, args)
    mount.mount()
    try:
        yield mount
    finally:
        mount.unmount()
        shutil.rmtree(base, ignore_errors=True)


def drop_page_cache() -> None:
    """Best effort: the kernel's clean page cache (needs root)."""
    os.sync()
    with contextlib.suppress(OSError):
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: list[float]) -> float:
    return statistics.median(values)


def report(title: str, rows: list[tuple[str, float, float, float | None]], as_json: bool) -> None:
    """rows: (case, burstfs seconds, baseline seconds, target ratio)."""
    if as_json:
        print(json.dumps({"title": title, "rows": [
            {"case": c, "burstfs_s": b, "baseline_s": p, "ratio": b / p, "target": t} for c, b, p, t in rows
        ]}))  # fmt: skip
        return
    print(f"\n{title}")
    print(f"{'case':<44} {'burstfs s':>10} {'baseline s':>11} {'ratio':>7} {'target':>7}")
    for case, b, p, target in rows:
        mark = "" if target is None else ("ok" if b / p <= target else "MISS")
        print(f"{case:<44} {b:>10.3f} {p:>11.3f} {b / p:>6.2f}x {'' if target is None else f'{target:.2f}x':>7} {mark}")

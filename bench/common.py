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
from typing import Any

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
        subprocess.run(
            [
                str(BIN / "burstfs"),
                "mount",
                str(self.mnt),
                "--cache",
                str(self.cache),
                "--remote",
                self.remote_url,
                "--log-level",
                "WARNING",
                *self.args,
            ],
            check=True,
        )

    def unmount(self) -> None:
        subprocess.run([str(BIN / "burstfs"), "unmount", str(self.mnt)], check=False, capture_output=True)

    def daemon_pid(self) -> int:
        return int((self.cache / "lock").read_text().strip())

    def wait_drained(self, timeout: float = 600.0) -> None:
        """Until no live file waits to drain (so one case's drain does not slow the next)."""
        import sqlite3

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            db = sqlite3.connect(f"file:{self.cache / 'journal.db'}?mode=ro", uri=True)
            try:
                (busy,) = db.execute(
                    "SELECT count(*) FROM inodes WHERE kind='file' AND parent!=0 "
                    "AND state IN ('writing', 'staged', 'draining')"
                ).fetchone()
            finally:
                db.close()
            if not busy:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{self.mnt}: drain still busy after {timeout:.0f}s")

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
        print(
            json.dumps(
                {
                    "title": title,
                    "rows": [
                        {"case": c, "burstfs_s": b, "baseline_s": p, "ratio": b / p, "target": t} for c, b, p, t in rows
                    ],
                }
            )
        )
        return
    print(f"\n{title}")
    print(f"{'case':<44} {'burstfs s':>10} {'baseline s':>11} {'ratio':>7} {'target':>7}")
    for case, b, p, target in rows:
        mark = "" if target is None else ("ok" if b / p <= target else "MISS")
        print(f"{case:<44} {b:>10.3f} {p:>11.3f} {b / p:>6.2f}x {'' if target is None else f'{target:.2f}x':>7} {mark}")


# -- helpers for drain.py and restore.py (added; nothing above changed) ---------------------

TESTS = Path(__file__).resolve().parent.parent / "tests"


def file_state(cache: Path, name: str) -> str | None:
    """The journal state of the live file called ``name`` (basename) in ``cache``, or None."""
    import sqlite3

    db = sqlite3.connect(f"file:{cache / 'journal.db'}?mode=ro", uri=True)
    try:
        row = db.execute("SELECT state FROM inodes WHERE name=? AND parent!=0", (name.encode(),)).fetchone()
        return row[0] if row else None
    finally:
        db.close()


def wait_durable(cache: Path, names: list[str], timeout: float = 600.0, interval: float = 0.005) -> float:
    """Poll the journal until every file in ``names`` is durable; returns perf_counter() then."""
    deadline = time.monotonic() + timeout
    while True:
        if all(file_state(cache, n) == "durable" for n in names):
            return time.perf_counter()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{names} not durable after {timeout:.0f}s: {[file_state(cache, n) for n in names]}")
        time.sleep(interval)


@contextlib.contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (tests/s3server.py), with this process's AWS env pointing at it.

    The environment is what the daemon (a child of this process) inherits.
    """
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from s3server import _USER_AWS_VARS, MotoServer, client_env

    saved = dict(os.environ)
    for name in _USER_AWS_VARS:
        os.environ.pop(name, None)
    os.environ.update(client_env())
    server = MotoServer()
    server.start()
    try:
        yield server.endpoint
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(saved)


def make_bucket(endpoint: str, name: str) -> None:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from s3server import make_bucket as make

    make(endpoint, name)


def rss_peak_mib(pid: int) -> float:
    """VmHWM of a live process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def state_dict(size_mib: int) -> dict[str, object]:
    """A model-like state dict of ``size_mib`` MiB: 16 float32 tensors."""
    import torch

    n_tensors = 16
    per = size_mib * (1 << 20) // n_tensors // 4
    return {f"layer{i}.weight": torch.randn(per) for i in range(n_tensors)}


class _Timed:
    """A barrier that notes when each rank passed it (``wait`` is all ``target`` calls)."""

    def __init__(self, barrier: Any, started: Any, index: int) -> None:
        self.barrier, self.started, self.index = barrier, started, index

    def wait(self) -> None:
        self.barrier.wait()
        self.started[self.index] = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process


def _rank(target: Callable[..., None], args: tuple[object, ...], start: _Timed, finished: Any) -> None:
    target(*args, start)
    finished[start.index] = time.perf_counter()


def run_ranks(target: Callable[..., None], args_per_rank: list[tuple[object, ...]]) -> float:
    """Seconds from the start, a barrier all ranks wait on (the first rank past it), until the
    last of one process per rank has run ``target(*args, barrier)``.  Neither start-up nor exit is timed: a child
    forked from this (big) process takes a while to tear down its copy of the parent's
    memory map (it put seconds on 8 readers after a raw read had grown the heap to GiBs,
    none of it I/O)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(args_per_rank) + 1)
    started = ctx.Array("d", len(args_per_rank), lock=False)
    finished = ctx.Array("d", len(args_per_rank), lock=False)
    procs = [
        ctx.Process(target=_rank, args=(target, args, _Timed(barrier, started, index), finished))
        for index, args in enumerate(args_per_rank)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError("a rank failed")
    return max(finished) - min(started)


# -- restoring: what bench/restore.py and bench/peers.py both run ------------------------------

READ_BUF = 8 << 20  # what each shard reader asks read() for


def retain_freed_memory() -> None:
    """No mmap'd malloc chunks and no heap trimming: freed tensors' pages get reused, not re-faulted."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, 2**31 - 1)


def read_shard(path: str, start: Any) -> None:
    buf = bytearray(READ_BUF)
    start.wait()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def read_shards_parallel(paths: list[Path]) -> float:
    """Seconds until ``len(paths)`` processes have each read one file (start on a barrier)."""
    return run_ranks(read_shard, [(str(p),) for p in paths])


def torch_load(path: Path) -> None:
    import torch

    torch.load(path, weights_only=True)

"""How much of the cores does the drain take from the next burst of writers?

8 ranks write 128 MiB each (checkpoint A), then at once 8 more (checkpoint B) while A
drains; the same into a plain tmpfs directory.  Reported per contender (medians):
B's wall time, its slowest create, and the daemon's CPU seconds while B's ranks
write (all threads, from /proc: the creates and closes, and the part of the drain
that did not yield).

    python bench/drain_yield.py [--repeat 6] [--mount-arg=...] [--json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_mount, median, report  # noqa: E402


def write_rank(path: str, size: int, start: multiprocessing.Barrier, done: multiprocessing.Queue) -> None:  # type: ignore[valid-type]
    block = os.urandom(1 << 20)
    start.wait()
    began = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    opened = time.perf_counter()
    for _ in range(size >> 20):
        os.write(fd, block)
    os.close(fd)
    done.put((opened - began, time.perf_counter()))


def cpu_seconds(pid: int) -> float:
    """User + system CPU of every thread of ``pid`` (the process total includes them)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def checkpoint(directory: Path, ranks: int, size: int, pid: int | None = None) -> tuple[float, float, float]:
    """(wall seconds, slowest create, daemon CPU seconds meanwhile) of one checkpoint of ``ranks`` files."""
    directory.mkdir()
    start = multiprocessing.Barrier(ranks + 1)
    done: multiprocessing.Queue = multiprocessing.Queue()  # type: ignore[type-arg]
    procs = [
        multiprocessing.Process(target=write_rank, args=(str(directory / f"shard{r}.distcp"), size, start, done))
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    cpu = cpu_seconds(pid) if pid else 0.0
    start.wait()
    began = time.perf_counter()
    results = [done.get() for _ in procs]
    cpu = (cpu_seconds(pid) - cpu) if pid else 0.0
    for p in procs:
        p.join()
    return max(end for _, end in results) - began, max(opened for opened, _ in results), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--shard-mib", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=6)
    parser.add_argument("--mount-arg", action="append", default=[], help="extra burstfs mount argument")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    size = args.shard_mib << 20
    runs: dict[str, list[tuple[float, float, float]]] = {"mount": [], "plain": []}
    with bench_mount(args=tuple(args.mount_arg)) as m:
        pid = m.daemon_pid()
        for i in range(args.repeat):
            for where, base in (("plain", m.plain), ("mount", m.mnt))[:: 1 if i % 2 == 0 else -1]:
                checkpoint(base / f"a{i}", args.ranks, size)  # A: drains while B is written
                runs[where].append(checkpoint(base / f"b{i}", args.ranks, size, pid if where == "mount" else None))
                if where == "mount":
                    m.wait_drained()
                for d in (base / f"a{i}", base / f"b{i}"):
                    for f in d.iterdir():
                        f.unlink()
            m.wait_drained()

    def col(where: str, index: int) -> float:
        return median([r[index] for r in runs[where]])

    rows = [(f"{args.ranks} ranks while {args.ranks} ranks drain", col("mount", 0), col("plain", 0), 1.15)]
    report("the next burst while the last drains: burstfs mount vs plain tmpfs (medians)", rows, args.json)
    if not args.json:
        print(f"slowest create: {col('mount', 1) * 1e3:.0f} ms (plain {col('plain', 1) * 1e3:.1f} ms)")
        print(f"daemon CPU while the ranks write: {col('mount', 2):.2f} s")


if __name__ == "__main__":
    main()

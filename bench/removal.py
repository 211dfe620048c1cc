"""Does removing an old checkpoint stall the mount?  Plain tmpfs vs a burstfs mount.

Training scripts delete old checkpoints (keep the last N) while the job goes on.
Freeing a large file's pages takes long (~170 ms per GiB on tmpfs): here, while
``--files`` files of ``--file-mib`` are removed, another thread stats a file and
creates a small one in a loop; reported are the time of the removal and the
longest wait of one probe, in a plain directory on tmpfs and through the mount
(the drain is held back, so only the removal runs).  Target: the probe's worst
wait stays near its plain-tmpfs figure.

    python bench/removal.py [--files 4] [--file-mib 1024] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_mount, median, report  # noqa: E402


def remove_while_probing(directory: Path, files: int, file_mib: int) -> tuple[float, float]:
    """(seconds to remove the files, longest stat + small create meanwhile)."""
    names = [directory / f"old{i}.pt" for i in range(files)]
    block = os.urandom(1 << 20)
    for name in names:
        with open(name, "wb") as f:
            for _ in range(file_mib):
                f.write(block)
    probe = directory / "probe"
    probe.write_bytes(b"p")
    stop = threading.Event()
    waits: list[float] = []

    def probing() -> None:
        count = 0
        while not stop.is_set():
            start = time.perf_counter()
            os.stat(probe)
            (directory / f"small{count}").write_bytes(b"s")
            waits.append(time.perf_counter() - start)
            count += 1

    thread = threading.Thread(target=probing)
    thread.start()
    time.sleep(0.2)
    start = time.perf_counter()
    for name in names:
        os.unlink(name)
    removal = time.perf_counter() - start
    time.sleep(0.3)
    stop.set()
    thread.join()
    for entry in directory.iterdir():
        entry.unlink()
    return removal, max(waits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"mount": [], "plain": []}
    with bench_mount(args=("--drain-delay", "3600")) as m:
        for i in range(args.repeat):
            for where, base in (("mount", m.mnt), ("plain", m.plain))[:: 1 if i % 2 == 0 else -1]:
                directory = base / f"rep{i}"
                directory.mkdir()
                results[where].append(remove_while_probing(directory, args.files, args.file_mib))

    def col(where: str, index: int) -> float:
        return median([r[index] for r in results[where]])

    size = f"{args.files} x {args.file_mib} MiB"
    rows = [
        (f"rm {size}", col("mount", 0), col("plain", 0), None),
        (f"worst stat + create while rm {size}", col("mount", 1), col("plain", 1), None),
    ]
    report("removing an old checkpoint: burstfs mount vs plain tmpfs (medians)", rows, args.json)


if __name__ == "__main__":
    main()

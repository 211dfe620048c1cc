"""The mover's loop while it drains many small files: drain time and how long the loop stalls.

Issue 14 part 3 moved the mover's SQLite calls off its asyncio loop (the journal
thread).  This drains ``--files`` small files in-process (a file remote on
/dev/shm, the journal written as the front writes it, ``tests/journaltree.py``)
and, on the same loop, runs a 1 ms ticker: its overshoot is what an upload,
fetch or listing sharing the loop would wait.  With ``--baseline DIR`` (another
checkout with ``tests/journaltree.py``) both trees run side by side, alternating,
``--repeat`` times; medians and the ratios this/baseline are reported.

    .venv/bin/python bench/moverloop.py [--files 2000] [--size 4096] [--repeat 3] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def measure(files: int, size: int) -> dict[str, float]:
    """One drain in this process (the tree on ``sys.path`` is the contender)."""
    sys.path.insert(0, str(Path(os.environ.get("MOVERLOOP_TREE", REPO)) / "tests"))
    from journaltree import JournalTree

    from burstfs.config import DrainOptions, S3Options, parse_remote_url
    from burstfs.journal import Journal
    from burstfs.mover import Mover

    base = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        cache, remote = base / "cache", base / "remote"
        cache.mkdir()
        remote.mkdir()
        journal = Journal(cache)
        tree = JournalTree(journal, cache)
        dirs = [tree.mkdir(f"d{i}") for i in range(max(1, files // 100))]
        for i in range(files):
            tree.write(f"f{i}", b"x" * size, dirs[i % len(dirs)])
        mover = Mover(cache, parse_remote_url(f"file://{remote}"), S3Options(), DrainOptions())
        lags: list[float] = []

        async def main() -> float:
            done = False

            async def ticker() -> None:
                while not done:
                    started = time.perf_counter()
                    await asyncio.sleep(0.001)
                    lags.append(time.perf_counter() - started - 0.001)

            tick = asyncio.create_task(ticker())
            started = time.perf_counter()
            await mover.run(until_idle=True)
            elapsed = time.perf_counter() - started
            done = True
            await tick
            return elapsed

        elapsed = asyncio.run(main())
        assert journal.state_counts().get("durable", (0, 0))[0] == files, journal.state_counts()
        journal.close()
        lags.sort()
        return {
            "seconds": elapsed,
            "lag_p99_ms": 1000 * lags[int(len(lags) * 0.99)],
            "lag_max_ms": 1000 * lags[-1],
        }
    finally:
        shutil.rmtree(base)


def run_child(tree: Path, files: int, size: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "MOVERLOOP_TREE": str(tree)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--files", str(files), "--size", str(size)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=1800).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--size", type=int, default=4096, help="bytes per file")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout to run side by side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.files, args.size)))
        return
    trees = {"this": REPO} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for _ in range(args.repeat):
        for name, tree in trees.items():
            runs[name].append(run_child(tree, args.files, args.size))
    medians = {
        name: {k: statistics.median(r[k] for r in results) for k in results[0]} for name, results in runs.items()
    }
    doc: dict[str, object] = {"files": args.files, "size": args.size, "repeat": args.repeat, "medians": medians}
    if args.baseline:
        doc["ratio_this_over_baseline"] = {k: medians["this"][k] / medians["baseline"][k] for k in medians["this"]}
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()

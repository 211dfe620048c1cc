"""How long a checkpoint write blocks the writer: burstfs mount vs plain tmpfs.

Cases, each run into a plain directory on tmpfs and into two mounts whose caches
are on the same tmpfs: one with FUSE passthrough (the default where available)
and one with the data path through the daemon (--no-passthrough); interleaved,
several repeats, medians compared:
  - torch.save of a 1 GiB state dict (close included: that is when close returns);
  - 8 processes each writing a 128 MiB shard at once (DCP-style ranks);
  - the same 8 ranks again right after a first checkpoint of 8 shards, while that one
    drains (the baseline writes both into tmpfs);
  - 1000 files of 4 KiB, each created, written and closed, while the shards drain.
Also reports the daemon's peak RSS.  Targets: ratio <= 1.15x, RSS <= 300 MiB.

    python bench/blocking.py [--size-mib 1024] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bench_mount, median, report, run_ranks, state_dict, timed  # noqa: E402


def write_shard(path: str, size: int, start: multiprocessing.Barrier) -> None:  # type: ignore[valid-type]
    block = os.urandom(1 << 20)
    start.wait()
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(block)


def write_small_files(directory: Path, count: int) -> None:
    """Many small files, each closed before the next (tokenizer files, per-rank metadata)."""
    block = os.urandom(4096)
    for i in range(count):
        with open(directory / f"f{i}", "wb") as f:
            f.write(block)


def shards_once(directory: Path, ranks: int, size: int) -> float:
    return run_ranks(write_shard, [(str(directory / f"shard{r}.bin"), size) for r in range(ranks)])


def second_while_first_drains(directory: Path, args: argparse.Namespace) -> float:
    """Seconds of checkpoint B's ranks, written right after checkpoint A's (A drains meanwhile)."""
    first, second = directory / "a", directory / "b"
    first.mkdir(parents=True)
    second.mkdir()
    shards_once(first, args.ranks, args.shard_mib << 20)
    seconds = shards_once(second, args.ranks, args.shard_mib << 20)
    for d in (first, second):
        for f in d.iterdir():
            f.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--shard-mib", type=int, default=128)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--small-files", type=int, default=1000, help="files of 4 KiB in the small-file case")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mount-arg", action="append", default=[], help="extra burstfs mount argument")
    args = parser.parse_args()

    import torch

    sd = state_dict(args.size_mib)
    extra = tuple(args.mount_arg)
    cases = ("save", "shards", "draining", "small")
    results: dict[str, dict[str, list[float]]] = {case: {} for case in cases}
    with bench_mount(args=extra) as direct, bench_mount(args=("--no-passthrough", *extra)) as daemon:
        targets = {"passthrough": direct.mnt, "daemon": daemon.mnt, "plain": direct.plain}
        for case in cases:
            for where in targets:
                results[case][where] = []

        def settle() -> None:  # each write starts with both drains idle (drain.py measures overlap)
            direct.wait_drained()
            daemon.wait_drained()

        for i in range(args.repeat):
            # Interleaved, and each repeat starts with another contender: the VM makes
            # touching recently freed memory slow, which hits whoever runs first.
            names = list(targets)
            order = [(where, targets[where]) for where in names[i % len(names) :] + names[: i % len(names)]]
            for where, directory in order:
                target = directory / f"ckpt{i}.pt"
                settle()
                results["save"][where].append(timed(lambda: torch.save(sd, target)))
                target.unlink()
            for where, directory in order:
                d = directory / f"step{i}"
                d.mkdir()
                settle()
                results["shards"][where].append(shards_once(d, args.ranks, args.shard_mib << 20))
                for f in d.iterdir():
                    f.unlink()
            for where, directory in order:
                settle()
                results["draining"][where].append(second_while_first_drains(directory / f"busy{i}", args))
            for where, directory in order:
                d = directory / f"small{i}"
                d.mkdir()
                results["small"][where].append(timed(lambda: write_small_files(d, args.small_files)))
        rss = {"passthrough": direct.daemon_peak_rss_mib(), "daemon": daemon.daemon_peak_rss_mib()}
    names = {
        "save": (f"torch.save {args.size_mib} MiB", 1.15),
        "shards": (f"{args.ranks} ranks x {args.shard_mib} MiB shards", 1.15),
        "draining": ("8 ranks while 8 ranks drain", 1.15),
        "small": (f"{args.small_files} x 4 KiB files (draining)", None),
    }
    rows = [
        (f"{names[case][0]} [{path}]", median(results[case][path]), median(results[case]["plain"]), names[case][1])
        for case in cases
        for path in ("passthrough", "daemon")
    ]
    report("blocking time: burstfs mount vs plain tmpfs (medians)", rows, args.json)
    if not args.json:
        for path, mib in rss.items():
            print(f"daemon peak RSS [{path}]: {mib:.0f} MiB (target <= 300 MiB)")


if __name__ == "__main__":
    main()

"""How long a checkpoint write blocks the writer: burstfs mount vs plain tmpfs.

Cases, each run into the mount and into a plain directory on the same tmpfs,
alternating, several repeats, medians compared:
  - torch.save of a 1 GiB state dict (close included: that is when close returns);
  - 8 processes each writing a 128 MiB shard at once (DCP-style ranks).
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
    results: dict[str, dict[str, list[float]]] = {
        case: {"fs": [], "plain": []} for case in ("save", "shards", "small")
    }
    with bench_mount(args=tuple(args.mount_arg)) as m:
        for i in range(args.repeat):
            for where, directory in (("fs", m.mnt), ("plain", m.plain)):
                target = directory / f"ckpt{i}.pt"
                results["save"][where].append(timed(lambda: torch.save(sd, target)))
                target.unlink()
            for where, directory in (("fs", m.mnt), ("plain", m.plain)):
                d = directory / f"step{i}"
                d.mkdir()
                results["shards"][where].append(shards_once(d, args.ranks, args.shard_mib << 20))
                for f in d.iterdir():
                    f.unlink()
            for where, directory in (("fs", m.mnt), ("plain", m.plain)):
                d = directory / f"small{i}"
                d.mkdir()
                results["small"][where].append(timed(lambda: write_small_files(d, args.small_files)))
        rss = m.daemon_peak_rss_mib()
    rows = [
        (f"torch.save {args.size_mib} MiB", median(results["save"]["fs"]), median(results["save"]["plain"]), 1.15),
        (f"{args.ranks} ranks x {args.shard_mib} MiB shards", median(results["shards"]["fs"]),
         median(results["shards"]["plain"]), 1.15),
        (f"{args.small_files} x 4 KiB files (draining)", median(results["small"]["fs"]),
         median(results["small"]["plain"]), None),
    ]  # fmt: skip
    report("blocking time: burstfs mount vs plain tmpfs (medians)", rows, args.json)
    if not args.json:
        print(f"daemon peak RSS: {rss:.0f} MiB (target <= 300 MiB)")


if __name__ == "__main__":
    main()

"""How long does a checkpoint block training: burstfs.pinned.async_save vs plain torch.save.

One run measures, on the same state and directory:
  - blocking time of torch.save (the whole write) and of async_save (the snapshot only),
  - the time until the async file is complete (SaveHandle.wait),
  - on a GPU, the device-to-host bandwidth of the snapshot vs a plain pinned copy_ of the
    same bytes (the best the link can do).
Each is repeated ``--repeat`` times after one warm-up save (which allocates the pool's
buffer; its blocking time is reported separately as the cold first save) and reported as
a median. Results are ratios within one run, so they compare across machines.

Both writers get a fresh file whose predecessor was deleted just before: on a VM the
pages of a file freed seconds earlier may have gone back to the host and fault in
slowly again, which would penalise whichever writer happened to reuse them later.

    .venv/bin/python bench/async_save.py --size-mib 1024 --repeat 3 --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from burstfs.pinned import PinnedPool, async_save

LAYERS = 8  # tensors per state entry: enough that per-tensor overhead shows, like a real model


def build_state(size_mib: int, device: torch.device) -> dict[str, Any]:
    """A model + AdamW-like state of about ``size_mib``: fp32 params, exp_avg, exp_avg_sq."""
    per_tensor = (size_mib << 20) // (3 * LAYERS * 4)  # fp32 elements per tensor

    # uniform_ is cheap to fill; the values do not matter to torch.save or a copy
    def tensor() -> torch.Tensor:
        return torch.empty(per_tensor, device=device).uniform_()

    params = {f"layers.{i}.weight": tensor() for i in range(LAYERS)}
    return {
        "model": params,
        "optim": {
            "state": {
                i: {"step": torch.tensor(100.0), "exp_avg": tensor(), "exp_avg_sq": tensor()} for i in range(LAYERS)
            },
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": list(range(LAYERS))}],
        },
        "step": 100,
    }


def state_bytes(state: dict[str, Any]) -> int:
    tensors = list(state["model"].values())
    for s in state["optim"]["state"].values():
        tensors += [v for v in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_torch_save(state: dict[str, Any], path: Path, device: torch.device) -> float:
    path.unlink(missing_ok=True)  # same starting point as time_async_save
    sync(device)
    start = time.perf_counter()
    torch.save(state, path)
    return time.perf_counter() - start


def time_async_save(state: dict[str, Any], path: Path, pool: PinnedPool, device: torch.device) -> tuple[float, float]:
    """(blocking_s, total_s) of one async_save."""
    path.unlink(missing_ok=True)  # both writes start from the same free memory, see the module doc
    sync(device)
    start = time.perf_counter()
    handle = async_save(state, path, pool=pool)
    blocking = time.perf_counter() - start
    handle.wait()
    return blocking, time.perf_counter() - start


def time_plain_pinned_copy(nbytes: int, device: torch.device, repeat: int) -> float:
    """Median seconds of one pinned non-blocking copy_ of ``nbytes`` from the GPU: the link's best."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(repeat + 1):  # first one warms up the copy engine
        sync(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    state = build_state(args.size_mib, device)
    nbytes = state_bytes(state)
    pool = PinnedPool()
    cold_blocking, cold_total = time_async_save(state, directory / "async.pt", pool, device)
    runs = []
    for _ in range(args.repeat):
        save_s = time_torch_save(state, directory / "plain.pt", device)
        blocking_s, total_s = time_async_save(state, directory / "async.pt", pool, device)
        runs.append({"torch_save_s": save_s, "async_blocking_s": blocking_s, "async_total_s": total_s})
    med = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    result: dict[str, Any] = {
        "config": {
            "dir": str(directory),
            "size_mib": args.size_mib,
            "bytes": nbytes,
            "repeat": args.repeat,
            "device": str(device),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "pool_pinned": pool.pinned,
        },
        "runs": runs,
        "cold_async_blocking_s": cold_blocking,
        "cold_async_total_s": cold_total,
        "median": med,
        "ratios": {
            "async_blocking_vs_torch_save": med["async_blocking_s"] / med["torch_save_s"],
            "async_total_vs_torch_save": med["async_total_s"] / med["torch_save_s"],
        },
    }
    if device.type == "cuda":
        copy_s = time_plain_pinned_copy(nbytes, device, args.repeat)
        result["median"]["plain_pinned_copy_s"] = copy_s
        result["gbps"] = {
            "snapshot_d2h": nbytes / med["async_blocking_s"] / 1e9,
            "plain_pinned_copy_d2h": nbytes / copy_s / 1e9,
        }
        result["ratios"]["snapshot_vs_plain_copy_bandwidth"] = copy_s / med["async_blocking_s"]
    return result


def print_table(result: dict[str, Any]) -> None:
    cfg, med = result["config"], result["median"]
    print(
        f"state {cfg['bytes'] / 2**20:.0f} MiB on {cfg['device']}, dir {cfg['dir']}, "
        f"{cfg['repeat']} repeats (median), torch {cfg['torch']}, {cfg['cpus']} CPUs, pinned pool: {cfg['pool_pinned']}"
    )
    rows = [
        ("torch.save (blocking = whole write)", med["torch_save_s"]),
        ("async_save blocking (snapshot)", med["async_blocking_s"]),
        ("async_save until file complete", med["async_total_s"]),
        ("async_save blocking, cold pool (1st save)", result["cold_async_blocking_s"]),
    ]
    if "plain_pinned_copy_s" in med:
        rows.append(("plain pinned copy_ of the same bytes", med["plain_pinned_copy_s"]))
    for name, seconds in rows:
        print(f"  {name:<44} {seconds:8.3f} s")
    for name, value in result.get("gbps", {}).items():
        print(f"  {name + ' GB/s':<44} {value:8.2f}")
    for name, value in result["ratios"].items():
        print(f"  ratio {name:<38} {value:8.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dir", type=Path, help="checkpoint directory (default: a temp dir under /dev/shm, removed after)"
    )
    parser.add_argument("--size-mib", type=int, default=1024, help="state size in MiB (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="measured repetitions (default 3)")
    parser.add_argument("--cpu", action="store_true", help="keep the state on the CPU even if CUDA is available")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file ('-' for stdout)")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.size_mib < 1:
        parser.error("--repeat and --size-mib must be >= 1")
    temp = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="burstfs-bench-", dir="/dev/shm")) if temp else args.dir
    directory.mkdir(parents=True, exist_ok=True)
    try:
        result = run(args, directory)
    finally:
        if temp:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for name in ("plain.pt", "async.pt"):
                (directory / name).unlink(missing_ok=True)
    print_table(result)
    if args.json is not None:
        text = json.dumps(result, indent=2)
        if str(args.json) == "-":
            print(text)
        else:
            args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

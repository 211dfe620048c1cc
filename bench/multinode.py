"""Cross-node commits on moto: what the intent costs, how soon the marker follows, how fast `latest` is.

Cases (all on a moto server on 127.0.0.1, mounts with caches on tmpfs):
  - intent: torch.save of a --size-mib checkpoint into a directory this node has not
    written in yet (its round starts at the open; the close waits for the intent
    record, at most --remote-wait) vs into a directory whose round is already open
    (a file held open there: the intent is out, nothing to wait for).  Target <= 2%.
  - marker: two mounts; node 1's drain is held (--drain-delay) while node 0 writes its
    shards and the marker; node 1 is released, and the remote is polled every few
    ms: seconds from node 1's done record appearing to the marker appearing.
    Target <= 1 s.
  - latest: --checkpoints directories, each one shard plus `.metadata`, written
    through a mount and committed; then `burstfs-admin latest --remote` (the whole
    command, a fresh process, as a restart script runs it).  Printed, no target.

    python bench/multinode.py [--size-mib 1024] [--repeat 3] [--checkpoints 1000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BIN, bench_mount, make_bucket, median, moto_endpoint, state_dict, timed  # noqa: E402


def s3_keys(endpoint: str, bucket: str, prefix: str) -> set[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys: set[str] = set()
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.update(obj["Key"] for obj in page.get("Contents", []))
    return keys


def intent_case(endpoint: str, size_mib: int, repeat: int) -> tuple[float, float]:
    """(median seconds into fresh directories, median seconds into directories whose round is open)."""
    import torch

    make_bucket(endpoint, "intent")
    sd = state_dict(size_mib)
    fresh, open_round = [], []
    with bench_mount("s3://intent/run", ("--endpoint-url", endpoint)) as mount:
        for i in range(repeat):
            for case in ("fresh", "open") if i % 2 == 0 else ("open", "fresh"):
                directory = mount.mnt / f"{case}{i}"
                directory.mkdir()
                mount.wait_drained()
                if case == "open":
                    with open(directory / "held", "wb"):  # the round starts; its intent goes out
                        time.sleep(0.5)
                        open_round.append(timed(lambda: torch.save(sd, directory / "model.pt")))
                else:
                    fresh.append(timed(lambda: torch.save(sd, directory / "model.pt")))
                mount.wait_drained()
    return median(fresh), median(open_round)


def marker_case(endpoint: str, repeat: int) -> list[float]:
    """Seconds from the last done record to the marker, per repeat (remote polled every ~5 ms)."""
    make_bucket(endpoint, "marker")
    admin = str(BIN / "burstfs-admin")
    gaps = []
    with (
        bench_mount("s3://marker/run", ("--endpoint-url", endpoint, "--node-id", "n0")) as n0,
        bench_mount("s3://marker/run", ("--endpoint-url", endpoint, "--node-id", "n1", "--drain-delay", "3600")) as n1,
    ):
        for i in range(repeat):
            step = f"ckpt/step_{i}"
            for rank, mount in enumerate((n0, n0, n1, n1)):
                (mount.mnt / step).mkdir(parents=True, exist_ok=True)
                (mount.mnt / step / f"__{rank}_0.distcp").write_bytes(os.urandom(4 << 20))
            subprocess.run([admin, "wait", str(n0.mnt / step)], check=True, capture_output=True)
            (n0.mnt / step / ".metadata").write_bytes(b"metadata")
            time.sleep(1.0)  # n0's gate is polling, waiting for n1
            done_prefix = f"run/.burstfs/groups/{step}/n1@"
            marker = f"run/{step}/.metadata"
            subprocess.run([admin, "drain", str(n1.mnt), "--now"], check=True, capture_output=True)
            done_at = marker_at = None
            deadline = time.monotonic() + 120
            while marker_at is None and time.monotonic() < deadline:
                keys = s3_keys(endpoint, "marker", "run/")
                now = time.perf_counter()
                if done_at is None and any(k.startswith(done_prefix) and k.endswith(".done") for k in keys):
                    done_at = now
                if marker in keys:
                    marker_at = now
                time.sleep(0.005)
            if done_at is None or marker_at is None:
                raise TimeoutError(f"{step}: done seen {done_at}, marker seen {marker_at}")
            gaps.append(marker_at - done_at)
    return gaps


def latest_case(endpoint: str, count: int) -> tuple[float, float, str]:
    """(seconds to write and commit ``count`` checkpoints, seconds of `latest --remote`, its answer)."""
    make_bucket(endpoint, "latest")
    started = time.perf_counter()
    with bench_mount("s3://latest/run", ("--endpoint-url", endpoint)) as mount:
        for i in range(count):
            step = mount.mnt / "ckpt" / f"step_{i:05d}"
            step.mkdir(parents=True)
            (step / "__0_0.distcp").write_bytes(os.urandom(1024))
            (step / ".metadata").write_bytes(b"m")
        deadline = time.monotonic() + 1800
        while len([k for k in s3_keys(endpoint, "latest", "run/.burstfs/commits/") if k.endswith(".commit")]) < count:
            if time.monotonic() > deadline:
                raise TimeoutError("commits did not all land")
            time.sleep(1.0)
    written = time.perf_counter() - started
    command = [
        str(BIN / "burstfs-admin"),
        "latest",
        "--remote",
        "s3://latest/run",
        "--endpoint-url",
        endpoint,
        "--json",
        "ckpt",
    ]
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True)
    took = time.perf_counter() - start
    answer = json.loads(result.stdout)["dir"] if result.returncode == 0 else f"exit {result.returncode}"
    return written, took, answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--checkpoints", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with moto_endpoint() as endpoint:
        fresh, open_round = intent_case(endpoint, args.size_mib, args.repeat)
        gaps = marker_case(endpoint, args.repeat)
        written, took, answer = latest_case(endpoint, args.checkpoints)
    doc = {
        "intent": {"fresh_dir_s": fresh, "open_round_s": open_round, "added": fresh / open_round - 1, "target": 0.02},
        "done_to_marker_s": {"each": gaps, "max": max(gaps), "target": 1.0},
        "latest": {"checkpoints": args.checkpoints, "write_and_commit_s": written, "latest_s": took, "answer": answer},
    }
    if args.json:
        print(json.dumps(doc))
        return
    print(
        f"torch.save {args.size_mib} MiB (medians of {args.repeat}): fresh directory {fresh:.3f} s, "
        f"round already open {open_round:.3f} s: intent adds {100 * (fresh / open_round - 1):+.1f}% (target <= 2%)"
    )
    print(
        f"last done -> marker on the remote: {', '.join(f'{g:.3f}' for g in gaps)} s (max {max(gaps):.3f}, "
        "target <= 1 s)"
    )
    print(
        f"latest --remote over {args.checkpoints} checkpoints: {took:.2f} s (whole command) -> {answer}; "
        f"writing and committing them took {written:.0f} s"
    )


if __name__ == "__main__":
    main()

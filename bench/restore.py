"""Restore through the mount vs reading the same bytes without burstfs.

Setup: a writer mount drains a ``torch.save`` checkpoint (``--size-mib``) and
``--ranks`` shard files (``--shard-mib`` each) to the remote, then unmounts.  One
run, contenders alternating, ``--repeat`` times, medians:

cold (empty local tier: a reader mount with a fresh cache over the same remote
prefix, kernel page cache dropped through /proc/sys/vm/drop_caches before each read)
  - ``torch.load`` of the checkpoint through the mount, vs raw parallel ranged reads
    of the object (8 MiB ranges, 16 in flight = burstfs' fetch concurrency, xxh3 of
    each range for parity with verification) written to a local tmpfs file, then
    ``torch.load`` of that file (download-then-load; ``torch.load`` of an in-memory
    BytesIO is 3-5x slower than of a file, so it would flatter burstfs);
  - ``--ranks`` processes each reading its shard through the mount at once, vs the
    same raw ranged reads of all the shard objects into memory, 16 in flight.
  File remote: a directory on /dev/shm read with ``os.pread`` (tmpfs: dropping caches
  does not evict it, so the "remote" is as fast as RAM).  S3: moto on 127.0.0.1 read
  with aiobotocore ranged GETs; moto reads the whole object for every ranged GET, so
  that case uses ``--s3-size-mib`` (64) and ``--s3-shard-mib`` (8).  Target <= 1.3x.
warm (file remote only; the files are on the local tier after the cold read)
  - unmount + remount the same cache (the mount's page cache is gone), drop caches,
    read again through the mount, vs the same read of a plain copy on tmpfs.  Target <= 1.1x.
  - the same read again without remount: the kernel page cache of the mount is hot
    (labelled as such; no target).
one by one (moto, through the fault proxy adding ``--rtt-ms`` to every request, as a far
store answers): ``--small-files`` files of ``--small-kib`` read one after another by one
process through a fresh mount, vs boto3 listing the directory then GETting each (no target:
round trips per file decide it).
Also the reader daemons' peak RSS (target <= 300 MiB).

This process keeps the memory it frees (glibc mallopt) and warms up once, so that
neither contender's ``torch.load`` pays this VM's slow, noisy page faults for fresh
memory (~0.5 s per GiB, sometimes seconds): the ratios compare I/O paths.
``--read-ahead-kb`` sets the reader mounts' readahead (an experiment, see bench/RESULTS.md).

    .venv/bin/python bench/restore.py [--size-mib 1024] [--shard-mib 128] [--repeat 3] [--skip-s3]
                                      [--read-ahead-kb N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    TESTS,
    BenchMount,
    drop_page_cache,
    make_bucket,
    median,
    moto_endpoint,
    read_shards_parallel,
    report,
    retain_freed_memory,
    state_dict,
    timed,
    torch_load,
    wait_durable,
)

MiB = 1 << 20
RANGE = 8 * MiB  # burstfs' default part size = its fetch chunk
FETCH_CONCURRENCY = 16  # burstfs.restore.FETCH_CONCURRENCY


def set_read_ahead(mnt: Path, kib: int | None) -> None:
    """Set the FUSE mount's readahead (the kernel default, 128 KiB, makes 128 KiB read requests)."""
    if kib is None:
        return
    dev = os.stat(mnt).st_dev
    Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb").write_text(f"{kib}\n")


def fresh_base() -> Path:
    return Path(tempfile.mkdtemp(prefix="burstfs-bench-restore-", dir="/dev/shm"))


class Sink:
    """Where raw ranged reads land: bytearrays in memory, or (``dest``) local files written with pwrite."""

    def __init__(self, sizes: list[int], dest: list[Path] | None) -> None:
        self.bufs = [bytearray(n) for n in sizes] if dest is None else []
        self.fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for p in dest or ()]

    def put(self, i: int, offset: int, data: bytes) -> None:  # blocking: called in a thread
        if self.fds:
            os.pwrite(self.fds[i], data, offset)
        else:
            self.bufs[i][offset : offset + len(data)] = data

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def raw_file_ranges(paths: list[Path], dest: list[Path] | None = None, threads: int = FETCH_CONCURRENCY) -> None:
    """Parallel 8 MiB preads of every file, xxh3 of each range, into memory or into ``dest`` files."""
    import xxhash

    sizes = [p.stat().st_size for p in paths]
    sink = Sink(sizes, dest)
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:

        def one(job: tuple[int, int]) -> None:
            i, offset = job
            data = os.pread(fds[i], RANGE, offset)
            xxhash.xxh3_64_hexdigest(data)
            sink.put(i, offset, data)

        jobs = [(i, off) for i, n in enumerate(sizes) for off in range(0, n, RANGE)]
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))
    finally:
        for fd in fds:
            os.close(fd)
        sink.close()


class RawS3Reader:
    """aiobotocore ranged GETs (16 in flight, xxh3 of each) on one loop and client made before timing."""

    def __init__(self, endpoint: str) -> None:
        from aiobotocore.config import AioConfig
        from aiobotocore.session import get_session

        config = AioConfig(
            max_pool_connections=FETCH_CONCURRENCY + 4,
            s3={"addressing_style": "path"},
            retries={"mode": "standard", "total_max_attempts": 1},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self.runner = asyncio.Runner()
        self.stack = contextlib.AsyncExitStack()
        self.client = self.runner.run(
            self.stack.enter_async_context(
                get_session().create_client("s3", region_name="us-east-1", endpoint_url=endpoint, config=config)
            )
        )

    def close(self) -> None:
        self.runner.run(self.stack.aclose())
        self.runner.close()

    def read(self, bucket: str, keys: list[tuple[str, int]], dest: list[Path] | None = None) -> None:
        sink = Sink([size for _, size in keys], dest)
        try:
            # The buffers are not the coroutine's result: asyncio.Runner reprs a finished
            # task, and the repr of a large bytearray takes seconds.
            self.runner.run(self._read(bucket, keys, sink))
        finally:
            sink.close()

    async def _read(self, bucket: str, keys: list[tuple[str, int]], sink: Sink) -> None:
        import xxhash

        slots = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def one(i: int, offset: int) -> None:
            key, size = keys[i]
            end = min(offset + RANGE, size)
            async with slots:
                response = await self.client.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{end - 1}")
                async with response["Body"] as stream:
                    data = await stream.read()
            await asyncio.to_thread(xxhash.xxh3_64_hexdigest, data)
            await asyncio.to_thread(sink.put, i, offset, data)

        await asyncio.gather(*(one(i, off) for i, (_, size) in enumerate(keys) for off in range(0, size, RANGE)))


def one_by_one(endpoint: str, bucket: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """Cold reads of many small files one after another (a tokenizer, configs, a DCP rank's
    small files), each request ``--rtt-ms`` late (the fault proxy, as a far object store
    answers): round trips per file decide it.  burstfs through a fresh mount vs boto3: a
    listing, then one GET per file."""
    import boto3

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from faultproxy import FaultProxy

    root = fresh_base()
    names = [f"f{i:04d}.bin" for i in range(args.small_files)]
    times: dict[str, list[float]] = {"fs": [], "raw": []}
    try:
        writer = BenchMount(root / "writer", f"s3://{bucket}/small", ("--endpoint-url", endpoint))
        writer.mount()
        try:
            (writer.mnt / "d").mkdir()
            for name in names:
                (writer.mnt / "d" / name).write_bytes(os.urandom(args.small_kib * 1024))
            wait_durable(writer.cache, names)
        finally:
            writer.unmount()
        with FaultProxy(endpoint) as proxy:
            proxy.delay_next(10**9, seconds=args.rtt_ms / 1000)
            client = boto3.client("s3", endpoint_url=proxy.endpoint, region_name="us-east-1")
            for i in range(args.repeat):
                for who in ("fs", "raw") if i % 2 == 0 else ("raw", "fs"):
                    drop_page_cache()
                    if who == "raw":
                        start = time.perf_counter()
                        client.list_objects_v2(Bucket=bucket, Prefix="small/d/", Delimiter="/")
                        for name in names:
                            client.get_object(Bucket=bucket, Key=f"small/d/{name}")["Body"].read()
                        times["raw"].append(time.perf_counter() - start)
                        continue
                    reader = BenchMount(root / f"reader{i}", f"s3://{bucket}/small", ("--endpoint-url", proxy.endpoint))
                    reader.mount()
                    try:
                        os.listdir(reader.mnt)  # the mount's own first listing, as in the raw case's
                        start = time.perf_counter()
                        for name in names:
                            (reader.mnt / "d" / name).read_bytes()
                        times["fs"].append(time.perf_counter() - start)
                    finally:
                        reader.unmount()
                        shutil.rmtree(root / f"reader{i}", ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return times


# -- the benchmark ---------------------------------------------------------------------------


class Remote:
    """Where the writer drained to, and how the raw contender reads it."""

    def __init__(self, url: str, extra: tuple[str, ...], raw: Any, prepare: Any = None) -> None:
        self.url, self.extra, self.raw = url, extra, raw  # raw(keys, dest=None): ranged reads of those objects
        self.prepare = prepare  # prepare(keys): anything raw needs to know first (untimed)


def write_checkpoint(m: BenchMount, sd: dict[str, Any], ranks: int, shard_mib: int) -> list[str]:
    """The checkpoint and shards, written into the writer mount and drained; returns their paths."""
    import torch

    torch.save(sd, m.mnt / "ckpt.pt")
    (m.mnt / "shards").mkdir()
    for r in range(ranks):
        block = torch.randint(0, 256, (shard_mib * MiB,), dtype=torch.uint8).numpy().tobytes()
        (m.mnt / f"shards/rank{r}.bin").write_bytes(block)
    names = ["ckpt.pt", *[f"rank{r}.bin" for r in range(ranks)]]
    wait_durable(m.cache, names)
    return ["ckpt.pt", *[f"shards/rank{r}.bin" for r in range(ranks)]]


def run_remote(
    label: str, remote: Remote, sd: dict[str, Any], args: argparse.Namespace, ranks: int, shard_mib: int, warm: bool
) -> dict[str, Any]:
    root = fresh_base()
    res: dict[str, list[float]] = {
        k: []
        for k in (
            "cold_load_fs",
            "cold_load_raw",
            "cold_raw_read_only",
            "cold_shards_fs",
            "cold_shards_raw",
            "warm_load_fs",
            "warm_load_plain",
            "warm_shards_fs",
            "warm_shards_plain",
            "hot_load_fs",
            "hot_shards_fs",
        )
    }
    rss: list[float] = []
    try:
        writer = BenchMount(root / "writer", remote.url, remote.extra)
        writer.mount()
        try:
            keys = write_checkpoint(writer, sd, ranks, shard_mib)
        finally:
            writer.unmount()
        shutil.rmtree(root / "writer", ignore_errors=True)
        shard_keys = keys[1:]
        if remote.prepare is not None:
            remote.prepare(keys)
        remote.raw(keys[:1], [root / "warmup.pt"])  # untimed: grows the heap, opens connections
        torch_load(root / "warmup.pt")
        (root / "warmup.pt").unlink()
        remote.raw(shard_keys)
        plain = root / "plain"
        if warm:  # plain tmpfs copies of the same files, for the warm baseline
            src = Path(remote.url.removeprefix("file://"))
            for key in keys:
                (plain / key).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / key, plain / key)
        for i in range(args.repeat):
            reader = BenchMount(root / f"reader{i}", remote.url, (*remote.extra, *args.mount_arg))
            reader.mount()
            set_read_ahead(reader.mnt, args.read_ahead_kb)
            try:
                mnt = reader.mnt
                order = ("fs", "raw") if i % 2 == 0 else ("raw", "fs")
                for who in order:
                    drop_page_cache()
                    if who == "fs":
                        res["cold_load_fs"].append(timed(functools.partial(torch_load, mnt / "ckpt.pt")))
                    else:
                        local = root / "download.pt"
                        start = time.perf_counter()
                        remote.raw(keys[:1], [local])
                        res["cold_raw_read_only"].append(time.perf_counter() - start)
                        torch_load(local)
                        res["cold_load_raw"].append(time.perf_counter() - start)
                        local.unlink()
                for who in order:
                    drop_page_cache()
                    if who == "fs":
                        res["cold_shards_fs"].append(read_shards_parallel([mnt / k for k in shard_keys]))
                    else:
                        res["cold_shards_raw"].append(timed(lambda: remote.raw(shard_keys)))
                if warm:
                    rss.append(reader.daemon_peak_rss_mib())  # the daemon that did the cold reads
                    reader.unmount()  # same cache, fresh mount: files local, mount page cache cold
                    reader.mount()
                    set_read_ahead(reader.mnt, args.read_ahead_kb)
                    for who in order:
                        drop_page_cache()
                        if who == "fs":
                            res["warm_load_fs"].append(timed(functools.partial(torch_load, mnt / "ckpt.pt")))
                            res["warm_shards_fs"].append(read_shards_parallel([mnt / k for k in shard_keys]))
                        else:
                            res["warm_load_plain"].append(timed(functools.partial(torch_load, plain / "ckpt.pt")))
                            res["warm_shards_plain"].append(read_shards_parallel([plain / k for k in shard_keys]))
                    # again, page cache of the mount now hot
                    res["hot_load_fs"].append(timed(functools.partial(torch_load, mnt / "ckpt.pt")))
                    res["hot_shards_fs"].append(read_shards_parallel([mnt / k for k in shard_keys]))
                rss.append(reader.daemon_peak_rss_mib())
            finally:
                reader.unmount()
                shutil.rmtree(root / f"reader{i}", ignore_errors=True)
            print(
                f"  [{label}] repeat {i + 1}: " + " ".join(f"{k}={v[-1]:.2f}" for k, v in res.items() if v),
                file=sys.stderr,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"times": res, "rss": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="torch.save checkpoint, file remote")
    parser.add_argument("--shard-mib", type=int, default=128, help="each shard, file remote")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--s3-size-mib", type=int, default=64, help="checkpoint on moto (ranged GETs read it all)")
    parser.add_argument("--s3-shard-mib", type=int, default=8, help="each shard on moto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--small-files", type=int, default=100, help="files read one by one on moto (0: skip)")
    parser.add_argument("--small-kib", type=int, default=256)
    parser.add_argument("--rtt-ms", type=float, default=20.0, help="added to every request of the one-by-one case")
    parser.add_argument("--skip-s3", action="store_true")
    parser.add_argument(
        "--read-ahead-kb",
        type=int,
        default=None,
        help="set the reader mounts' bdi read_ahead_kb (an experiment; default: the kernel's 128)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mount-arg", action="append", default=[], help="extra mount argument for the reader")
    args = parser.parse_args()
    retain_freed_memory()
    load_start = os.getloadavg()

    results: dict[str, Any] = {}
    remote_dir = fresh_base()
    try:

        def raw_file(keys: list[str], dest: list[Path] | None = None) -> None:
            raw_file_ranges([remote_dir / k for k in keys], dest)

        sd = state_dict(args.size_mib)
        remote = Remote(f"file://{remote_dir}", (), raw_file)
        results["file"] = run_remote("file", remote, sd, args, args.ranks, args.shard_mib, warm=True)
        del sd
    finally:
        shutil.rmtree(remote_dir, ignore_errors=True)

    if not args.skip_s3:
        sd = state_dict(args.s3_size_mib)
        with moto_endpoint() as endpoint:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            make_bucket(endpoint, bucket)
            reader = RawS3Reader(endpoint)
            try:
                sizes: dict[str, int] = {}

                def sizes_of(keys: list[str]) -> None:  # like a restore that knows its manifest
                    import boto3

                    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
                    sizes.update({k: client.head_object(Bucket=bucket, Key=f"ckpt/{k}")["ContentLength"] for k in keys})

                def raw_s3(keys: list[str], dest: list[Path] | None = None) -> None:
                    reader.read(bucket, [(f"ckpt/{k}", sizes[k]) for k in keys], dest)

                remote = Remote(f"s3://{bucket}/ckpt", ("--endpoint-url", endpoint), raw_s3, sizes_of)
                results["s3"] = run_remote("s3", remote, sd, args, args.ranks, args.s3_shard_mib, warm=False)
                if args.small_files:
                    results["s3"]["times"].update(
                        {f"small_{k}": v for k, v in one_by_one(endpoint, bucket, args).items()}
                    )
            finally:
                reader.close()

    t = results["file"]["times"]
    shards = f"{args.ranks} x {args.shard_mib} MiB shards"
    rows: list[tuple[str, float, float, float | None]] = [
        (f"cold torch.load {args.size_mib} MiB (file)", median(t["cold_load_fs"]), median(t["cold_load_raw"]), 1.3),
        (f"cold {shards} (file)", median(t["cold_shards_fs"]), median(t["cold_shards_raw"]), 1.3),
    ]
    if "s3" in results:
        s = results["s3"]["times"]
        s3_shards = f"{args.ranks} x {args.s3_shard_mib} MiB shards"
        rows += [
            (
                f"cold torch.load {args.s3_size_mib} MiB (moto)",
                median(s["cold_load_fs"]),
                median(s["cold_load_raw"]),
                1.3,
            ),
            (f"cold {s3_shards} (moto)", median(s["cold_shards_fs"]), median(s["cold_shards_raw"]), 1.3),
        ]
        if args.small_files:
            rows.append(
                (
                    f"{args.small_files} x {args.small_kib} KiB one by one +{args.rtt_ms:g}ms (moto)",
                    median(s["small_fs"]),
                    median(s["small_raw"]),
                    None,
                )
            )
    rows += [
        (
            f"warm torch.load {args.size_mib} MiB (remount)",
            median(t["warm_load_fs"]),
            median(t["warm_load_plain"]),
            1.1,
        ),
        (f"warm {shards} (remount)", median(t["warm_shards_fs"]), median(t["warm_shards_plain"]), 1.1),
        (
            f"page cache hot: torch.load {args.size_mib} MiB",
            median(t["hot_load_fs"]),
            median(t["warm_load_plain"]),
            None,
        ),
        (f"page cache hot: {shards}", median(t["hot_shards_fs"]), median(t["warm_shards_plain"]), None),
    ]
    title = (
        f"restore through the mount vs raw ranged reads (cold) / plain tmpfs (warm), medians of {args.repeat}; "
        f"raw = {RANGE >> 20} MiB ranges x {FETCH_CONCURRENCY} in flight + xxh3"
    )
    report(title, rows, args.json)
    rss = max(r for v in results.values() for r in v["rss"])
    raw_only = {k: median(v["times"]["cold_raw_read_only"]) for k, v in results.items()}
    if args.json:
        print(
            json.dumps(
                {
                    "title": "details",
                    "reader_daemon_peak_rss_mib": rss,
                    "raw_read_only_s": raw_only,
                    "loadavg": [load_start[0], os.getloadavg()[0]],
                    "read_ahead_kb": args.read_ahead_kb,
                    "raw": results,
                }
            )
        )
        return
    print(f"reader daemon peak RSS: {rss:.0f} MiB (target <= 300 MiB)")
    load_end = os.getloadavg()[0]
    print(f"load average at start {load_start[0]:.2f}, at end {load_end:.2f} (2 cores; others' jobs add noise)")
    if args.read_ahead_kb is not None:
        print(f"reader mounts' read_ahead_kb set to {args.read_ahead_kb} (kernel default 128)")
    for k, v in raw_only.items():
        print(f"raw ranged reads of the checkpoint alone ({k}) into a local file, before its torch.load: {v:.3f} s")
    print("cold = fresh cache + drop_caches; the file remote lives on tmpfs, so its bytes stay in RAM")
    if "s3" in results:
        print(
            f"moto sizes: checkpoint {args.s3_size_mib} MiB, shards {args.s3_shard_mib} MiB (moto reads the "
            "whole object for every ranged GET, both contenders alike); no warm rows on moto (same local tier)"
        )


if __name__ == "__main__":
    main()

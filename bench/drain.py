"""How long until a checkpoint is durable, and what a drain costs the next checkpoint.

One run, contenders side by side (alternating order), ``--repeat`` times, medians:

(a) time to durable: from the start of ``torch.save`` of a state dict into a fresh
    mount until the journal says the file is ``durable``, vs the raw pipeline that a
    user would script without burstfs: ``torch.save`` into a plain tmpfs directory,
    then
      - S3 (moto on 127.0.0.1): a multipart upload of the same bytes with aiobotocore,
        same part size and parts in flight (no checksums: the cheapest raw upload);
        moto takes only ~60-80 MiB/s here, so this case uses ``--s3-size-mib`` (256);
      - file remote (a directory on /dev/shm): a chunked copy with the same chunk size
        and threads in flight that also xxh3-hashes each chunk, published by rename.
    Target <= 1.25x (the project's design targets).
(b) blocking time of checkpoint B written into the mount right after checkpoint A,
    while A drains (file remote: the drain is pure local CPU and memory bandwidth,
    the worst case for contention on this box), vs the same A-then-B into a plain
    tmpfs directory.  Target <= 1.15x (issue 13, "also while the previous
    checkpoint is draining").
(c) daemon memory when ``--ranks`` shards (``--shard-mib``) are written at once and
    drain together (the mover drains max-files=4 at a time, each holding up to
    concurrency x part size of chunks).
Also the daemon's peak RSS over every mount (target <= 300 MiB), and, for (a), where
the burstfs time goes (close returned / draining / durable, polled from the
journal every 5 ms).

    .venv/bin/python bench/drain.py [--size-mib 1024] [--s3-size-mib 256] [--repeat 3]
                                    [--ranks 8] [--shard-mib 512] [--skip-s3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    BenchMount,
    make_bucket,
    median,
    moto_endpoint,
    report,
    state_dict,
    timed,
    wait_durable,
)

MiB = 1 << 20


def fresh_base() -> Path:
    return Path(tempfile.mkdtemp(prefix="burstfs-bench-drain-", dir="/dev/shm"))


def mount_args(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    return ("--part-size", f"{args.part_mib}M", "--concurrency", str(args.concurrency), *extra, *args.mount_arg)


# -- raw contenders ------------------------------------------------------------------


def raw_copy_hash(src: Path, dst: Path, part: int, threads: int) -> None:
    """Chunked parallel copy with an xxh3-64 of each chunk, published by rename (the file remote's job)."""
    import xxhash

    size = src.stat().st_size
    tmp = dst.with_name(f".{dst.name}.{uuid.uuid4().hex}")
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:

        def one(offset: int) -> str:
            data = os.pread(fin, min(part, size - offset), offset)
            digest = xxhash.xxh3_64_hexdigest(data)
            os.pwrite(fout, data, offset)
            return digest

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(0, size, part)))
        os.fsync(fout)
    finally:
        os.close(fin)
        os.close(fout)
    os.replace(tmp, dst)


def s3_client(endpoint: str, connections: int) -> Any:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    config = AioConfig(
        max_pool_connections=connections,
        retries={"mode": "standard", "total_max_attempts": 1},
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return get_session().create_client("s3", region_name="us-east-1", endpoint_url=endpoint, config=config)


class RawUploader:
    """aiobotocore multipart uploads on one loop and one client, both made before any timing.

    burstfs' daemon has a warm client when a checkpoint closes; so does this.
    """

    def __init__(self, endpoint: str, inflight: int) -> None:
        import contextlib

        self.runner = asyncio.Runner()
        self.stack = contextlib.AsyncExitStack()
        self.client = self.runner.run(self.stack.enter_async_context(s3_client(endpoint, inflight + 4)))
        self.inflight = inflight

    def close(self) -> None:
        self.runner.run(self.stack.aclose())
        self.runner.close()

    def upload(self, bucket: str, key: str, src: Path, part: int) -> None:
        self.runner.run(self._upload(bucket, key, src, part))

    async def _upload(self, bucket: str, key: str, src: Path, part: int) -> None:
        """``inflight`` parts at once, each read from ``src`` when its slot frees."""
        client, size = self.client, src.stat().st_size
        upload_id = (await client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
        slots = asyncio.Semaphore(self.inflight)
        fd = os.open(src, os.O_RDONLY)
        try:

            async def send(number: int, offset: int) -> dict[str, Any]:
                async with slots:
                    data = await asyncio.to_thread(os.pread, fd, min(part, size - offset), offset)
                    response = await client.upload_part(
                        Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
                    )
                    return {"PartNumber": number, "ETag": response["ETag"]}

            parts = await asyncio.gather(*(send(n + 1, off) for n, off in enumerate(range(0, size, part))))
        finally:
            os.close(fd)
        await client.complete_multipart_upload(
            Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": list(parts)}
        )


def empty_bucket(endpoint: str, bucket: str) -> None:
    """Free moto's memory between repeats."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", ()):
            client.delete_object(Bucket=bucket, Key=obj["Key"])


# -- (a) time to durable ----------------------------------------------------------------


class Timeline:
    """When the journal first showed each step of one file's drain (polled)."""

    def __init__(self, cache: Path, name: str) -> None:
        self.cache, self.name = cache, name

    def follow(self, timeout: float = 900.0, interval: float = 0.005) -> dict[str, float]:
        seen: dict[str, float] = {}
        db = sqlite3.connect(f"file:{self.cache / 'journal.db'}?mode=ro", uri=True)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                row = db.execute(
                    "SELECT state FROM inodes WHERE name=? AND parent!=0", (self.name.encode(),)
                ).fetchone()
                now = time.perf_counter()
                if row is not None:
                    (state,) = row
                    if state in ("draining", "durable"):
                        seen.setdefault("draining", now)
                    if state == "durable":
                        seen["durable"] = now
                        return seen
                    if state == "failed":
                        raise RuntimeError(f"{self.name} failed to drain (see {self.cache}/burstfs.log)")
                time.sleep(interval)
        finally:
            db.close()
        raise TimeoutError(f"{self.name} not durable after {timeout:.0f}s")


def burstfs_to_durable(
    sd: dict[str, Any], args: argparse.Namespace, remote_url: str | None, extra: tuple[str, ...]
) -> tuple[float, dict[str, float], float]:
    """(seconds to durable, breakdown, daemon peak RSS MiB) of one torch.save into a fresh mount."""
    import torch

    base = fresh_base()
    m = BenchMount(base, remote_url, mount_args(args, extra))
    m.mount()
    try:
        start = time.perf_counter()
        torch.save(sd, m.mnt / "ckpt.pt")
        closed = time.perf_counter()
        seen = Timeline(m.cache, "ckpt.pt").follow()
        rss = m.daemon_peak_rss_mib()
    finally:
        m.unmount()
        shutil.rmtree(base, ignore_errors=True)
    parts = {
        "save (close returned)": closed - start,
        "close -> draining": seen["draining"] - closed,
        "draining -> durable (hash + upload)": seen["durable"] - seen["draining"],
    }
    return seen["durable"] - start, parts, rss


def raw_to_durable(sd: dict[str, Any], plain: Path, ship: Any) -> tuple[float, float]:
    """(total, save part) of torch.save into tmpfs followed by ``ship(path)``."""
    import torch

    target = plain / "ckpt.pt"
    start = time.perf_counter()
    torch.save(sd, target)
    saved = time.perf_counter()
    ship(target)
    total = time.perf_counter() - start
    target.unlink()
    return total, saved - start


def durable_case(
    label: str, sd: dict[str, Any], args: argparse.Namespace, remote_for: Any, ship_for: Any, cleanup: Any = None
) -> dict[str, Any]:
    """Alternate burstfs and raw ``args.repeat`` times; ``remote_for(i)`` -> (url, mount args)."""
    fs, raw, raw_save, rss = [], [], [], []
    parts: dict[str, list[float]] = {}
    plain = fresh_base()
    try:
        for i in range(args.repeat):
            order = ("fs", "raw") if i % 2 == 0 else ("raw", "fs")
            for who in order:
                if who == "fs":
                    url, extra = remote_for(i)
                    seconds, breakdown, peak = burstfs_to_durable(sd, args, url, extra)
                    fs.append(seconds)
                    rss.append(peak)
                    for k, v in breakdown.items():
                        parts.setdefault(k, []).append(v)
                else:
                    total, save = raw_to_durable(sd, plain, ship_for(i))
                    raw.append(total)
                    raw_save.append(save)
                if cleanup is not None:
                    cleanup()
            print(f"  [{label}] repeat {i + 1}: burstfs {fs[-1]:.2f}s raw {raw[-1]:.2f}s", file=sys.stderr)
    finally:
        shutil.rmtree(plain, ignore_errors=True)
    return {"fs": fs, "raw": raw, "raw_save": raw_save, "parts": parts, "rss": rss}


# -- (b) blocking while the previous checkpoint drains ------------------------------------


def watch_durable(cache: Path, name: str, out: list[float]) -> None:
    out.append(wait_durable(cache, [name], interval=0.02))  # light polling: it shares the GIL with torch.save


def blocking_while_draining(sd: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    import torch

    fs, plain_times, rss, drain_busy = [], [], [], []
    for i in range(args.repeat):
        order = ("fs", "plain") if i % 2 == 0 else ("plain", "fs")
        for who in order:
            base = fresh_base()
            try:
                if who == "fs":
                    m = BenchMount(base, None, mount_args(args))
                    m.mount()
                    try:
                        torch.save(sd, m.mnt / "a.pt")
                        a_done: list[float] = []  # when A became durable, watched while B is written
                        watcher = threading.Thread(target=watch_durable, args=(m.cache, "a.pt", a_done))
                        watcher.start()
                        b_start = time.perf_counter()
                        fs.append(timed(functools.partial(torch.save, sd, m.mnt / "b.pt")))
                        watcher.join()
                        drain_busy.append(a_done[0] - b_start)  # > B's time: B overlapped all of A's drain
                        wait_durable(m.cache, ["b.pt"])
                        rss.append(m.daemon_peak_rss_mib())
                    finally:
                        m.unmount()
                else:
                    d = base / "plain"
                    d.mkdir()
                    torch.save(sd, d / "a.pt")
                    plain_times.append(timed(functools.partial(torch.save, sd, d / "b.pt")))
            finally:
                shutil.rmtree(base, ignore_errors=True)
        print(f"  [blocking] repeat {i + 1}: burstfs {fs[-1]:.2f}s plain {plain_times[-1]:.2f}s", file=sys.stderr)
    return {"fs": fs, "plain": plain_times, "rss": rss, "a_drain_after_b_start": drain_busy}


# -- (c) memory with many files draining at once ---------------------------------------------


def write_rank(path: str, size: int, start: Any) -> None:
    block = os.urandom(1 << 20)
    start.wait()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(size >> 20))


def ranks_rss(args: argparse.Namespace) -> dict[str, Any]:
    """Peak daemon RSS when ``--ranks`` shards are written at once and drain together (max-files of them)."""
    import multiprocessing

    base = fresh_base()
    m = BenchMount(base, None, mount_args(args))
    m.mount()
    try:
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(args.ranks + 1)
        procs = [
            ctx.Process(target=write_rank, args=(str(m.mnt / f"rank{r}.bin"), args.shard_mib * MiB, barrier))
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        barrier.wait()
        start = time.perf_counter()
        for p in procs:
            p.join()
        written = time.perf_counter()
        rss_written = m.daemon_peak_rss_mib()
        durable = wait_durable(m.cache, [f"rank{r}.bin" for r in range(args.ranks)])
        return {
            "rss": [m.daemon_peak_rss_mib()],
            "rss_after_writes": rss_written,
            "write_s": written - start,
            "durable_s": durable - start,
        }
    finally:
        m.unmount()
        shutil.rmtree(base, ignore_errors=True)


# -- (d) issue 13's write targets on moto, against boto3's upload_file ----------------------


def boto3_reference(endpoint: str, part: int, threads: int) -> Any:
    """``upload_file`` with ``threads`` threads and ``part``-byte parts (what a user would script)."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    config = TransferConfig(multipart_threshold=part, multipart_chunksize=part, max_concurrency=threads)
    return lambda bucket, key, path: client.upload_file(str(path), bucket, key, Config=config)


def daemon_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def moto_ckpt_case(args: argparse.Namespace, endpoint: str, bucket: str, upload: Any) -> dict[str, Any]:
    """1 GiB torch.save and 8 ranks x 128 MiB: written, then durable; burstfs vs tmpfs + upload_file."""
    import torch

    sd = state_dict(args.moto_ckpt_mib)
    out: dict[str, Any] = {"save": {"fs": [], "ref": []}, "ranks": {"fs": [], "ref": []}, "cpu_per_gib": [], "rss": []}
    rank_bytes = args.moto_rank_mib * MiB

    def fs_run(i: int, case: str) -> float:
        base = fresh_base()
        m = BenchMount(base, f"s3://{bucket}/fs{case}{i}", mount_args(args, ("--endpoint-url", endpoint)))
        m.mount()
        try:
            pid, cpu0 = m.daemon_pid(), daemon_cpu_s(m.daemon_pid())
            start = time.perf_counter()
            if case == "save":
                torch.save(sd, m.mnt / "ckpt.pt")
                names, size = ["ckpt.pt"], args.moto_ckpt_mib * MiB
            else:
                run_ranks_into(m.mnt, args.moto_ranks, rank_bytes)
                names, size = [f"rank{r}.bin" for r in range(args.moto_ranks)], args.moto_ranks * rank_bytes
            done = wait_durable(m.cache, names, interval=0.02) - start
            out["cpu_per_gib"].append((daemon_cpu_s(pid) - cpu0) / (size / 1024**3))
            out["rss"].append(m.daemon_peak_rss_mib())
            return done
        finally:
            m.unmount()
            shutil.rmtree(base, ignore_errors=True)

    def ref_run(i: int, case: str) -> float:
        plain = fresh_base()
        try:
            start = time.perf_counter()
            if case == "save":
                torch.save(sd, plain / "ckpt.pt")
                paths = [plain / "ckpt.pt"]
            else:
                run_ranks_into(plain, args.moto_ranks, rank_bytes)
                paths = [plain / f"rank{r}.bin" for r in range(args.moto_ranks)]
            with ThreadPoolExecutor(len(paths)) as pool:  # ranks upload their own shard at once
                list(pool.map(lambda p: upload(bucket, f"ref{case}{i}/{p.name}", p), paths))
            return time.perf_counter() - start
        finally:
            shutil.rmtree(plain, ignore_errors=True)

    for i in range(args.repeat):
        for case in ("save", "ranks"):
            order = ("fs", "ref") if i % 2 == 0 else ("ref", "fs")
            for who in order:
                out[case][who].append((fs_run if who == "fs" else ref_run)(i, case))
                empty_bucket(endpoint, bucket)
            print(
                f"  [moto {case}] repeat {i + 1}: burstfs {out[case]['fs'][-1]:.2f}s ref {out[case]['ref'][-1]:.2f}s",
                file=sys.stderr,
            )
    return out


def run_ranks_into(directory: Path, ranks: int, size: int) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(ranks + 1)
    procs = [
        ctx.Process(target=write_rank, args=(str(directory / f"rank{r}.bin"), size, barrier)) for r in range(ranks)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    for p in procs:
        p.join()


def small_files_case(args: argparse.Namespace, endpoint: str, bucket: str) -> dict[str, float]:
    """A directory of ``--small-files`` 4 KiB files written while nothing drains
    (``--drain-delay``), then drained at once: files per second to durable, and the
    same PUTs from a 32-thread boto3 client (the store's own ceiling here)."""
    import subprocess

    import boto3

    count = args.small_files
    base = fresh_base()
    m = BenchMount(
        base, f"s3://{bucket}/small", mount_args(args, ("--endpoint-url", endpoint, "--drain-delay", "3600"))
    )
    m.mount()
    try:
        d = m.mnt / "many"
        d.mkdir()
        block = os.urandom(4096)
        for i in range(count):
            (d / f"f{i}").write_bytes(block)
        pid, cpu0 = m.daemon_pid(), daemon_cpu_s(m.daemon_pid())
        start = time.perf_counter()
        subprocess.run(
            [str(Path(sys.executable).parent / "burstfs-admin"), "drain", "--now", str(m.mnt)],
            check=True,
            capture_output=True,
        )
        m.wait_drained()
        fs_s = time.perf_counter() - start
        cpu = daemon_cpu_s(pid) - cpu0
    finally:
        m.unmount()
        shutil.rmtree(base, ignore_errors=True)
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    start = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=f"ref/f{i}", Body=block), range(count)))
    ref_s = time.perf_counter() - start
    empty_bucket(endpoint, bucket)
    return {"fs_files_per_s": count / fs_s, "ref_files_per_s": count / ref_s, "cpu_ms_per_file": cpu / count * 1e3}


def issue13_moto(args: argparse.Namespace) -> None:
    with moto_endpoint() as endpoint:
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        make_bucket(endpoint, bucket)
        upload = boto3_reference(endpoint, args.part_mib * MiB, args.concurrency)
        small = small_files_case(args, endpoint, bucket) if args.small_files else None
        if args.small_files_only:
            if small is not None:
                print_small_files(args, small)
            return
        ckpt = moto_ckpt_case(args, endpoint, bucket, upload)
    rows: list[tuple[str, float, float, float | None]] = [
        (
            f"moto: torch.save {args.moto_ckpt_mib} MiB -> durable",
            median(ckpt["save"]["fs"]),
            median(ckpt["save"]["ref"]),
            1.1,
        ),
        (
            f"moto: {args.moto_ranks} ranks x {args.moto_rank_mib} MiB -> durable",
            median(ckpt["ranks"]["fs"]),
            median(ckpt["ranks"]["ref"]),
            1.1,
        ),
    ]
    report(
        f"issue 13 on moto: burstfs vs tmpfs + boto3 upload_file ({args.concurrency} threads, "
        f"{args.part_mib} MiB parts), medians of {args.repeat}",
        rows,
        args.json,
    )
    print(
        f"daemon CPU per GiB drained: {median(ckpt['cpu_per_gib']):.2f} s (median), "
        f"peak RSS {max(ckpt['rss']):.0f} MiB (target <= 300 MiB)"
    )
    if small is not None:
        print_small_files(args, small)


def print_small_files(args: argparse.Namespace, small: dict[str, float]) -> None:
    print(
        f"{args.small_files} x 4 KiB files -> durable: {small['fs_files_per_s']:.0f} files/s "
        f"(target >= 500), daemon CPU {small['cpu_ms_per_file']:.2f} ms/file; "
        f"boto3 put_object x 32 threads: {small['ref_files_per_s']:.0f} files/s"
    )


# -- main --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024, help="checkpoint size, file remote and case (b)")
    parser.add_argument("--s3-size-mib", type=int, default=256, help="checkpoint size on moto (slow: ~70 MiB/s)")
    parser.add_argument("--part-mib", type=int, default=8, help="part / chunk size (burstfs --part-size)")
    parser.add_argument("--concurrency", type=int, default=8, help="parts in flight (burstfs --concurrency)")
    parser.add_argument("--ranks", type=int, default=8, help="(c): shards written at once")
    parser.add_argument("--shard-mib", type=int, default=512, help="(c): size of each shard")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-s3", action="store_true", help="only the file remote")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mount-arg", action="append", default=[], help="extra burstfs mount argument")
    parser.add_argument("--issue13", action="store_true", help="only issue 13's write targets on moto (vs boto3)")
    parser.add_argument("--moto-ckpt-mib", type=int, default=1024, help="--issue13: torch.save size")
    parser.add_argument("--moto-ranks", type=int, default=8, help="--issue13: ranks")
    parser.add_argument("--moto-rank-mib", type=int, default=128, help="--issue13: size of each rank's file")
    parser.add_argument("--small-files", type=int, default=10000, help="--issue13: 4 KiB files to durable (0: skip)")
    parser.add_argument("--small-files-only", action="store_true", help="--issue13: only the small files case")
    args = parser.parse_args()
    if args.issue13:
        issue13_moto(args)
        return
    import torch

    load_start = os.getloadavg()
    sd = state_dict(args.size_mib)
    warm = fresh_base()  # first touch of fresh memory is slow on a VM: not in any timing
    torch.save(sd, warm / "warm.pt")
    shutil.rmtree(warm)
    part, inflight = args.part_mib * MiB, args.concurrency
    results: dict[str, Any] = {}

    def file_remote(i: int) -> tuple[str | None, tuple[str, ...]]:
        return None, ()  # BenchMount's own remote dir, under its /dev/shm base

    def file_ship(i: int) -> Any:
        def ship(src: Path) -> None:
            remote = src.parent / f"remote{i}"
            remote.mkdir()
            raw_copy_hash(src, remote / src.name, part, inflight)
            shutil.rmtree(remote)

        return ship

    results["file"] = durable_case("file", sd, args, file_remote, file_ship)

    if not args.skip_s3:
        sd_s3 = state_dict(args.s3_size_mib)
        with moto_endpoint() as endpoint:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            make_bucket(endpoint, bucket)

            def s3_remote(i: int) -> tuple[str | None, tuple[str, ...]]:
                return f"s3://{bucket}/fs{i}", ("--endpoint-url", endpoint)

            uploader = RawUploader(endpoint, inflight)

            def s3_ship(i: int) -> Any:
                return lambda src: uploader.upload(bucket, f"raw{i}/ckpt.pt", src, part)

            try:
                results["s3"] = durable_case(
                    "s3", sd_s3, args, s3_remote, s3_ship, cleanup=lambda: empty_bucket(endpoint, bucket)
                )
            finally:
                uploader.close()
        del sd_s3

    results["blocking"] = blocking_while_draining(sd, args)
    del sd
    results["ranks"] = ranks_rss(args)

    rows: list[tuple[str, float, float, float | None]] = []
    rows.append(
        (
            f"file remote: torch.save {args.size_mib} MiB -> durable",
            median(results["file"]["fs"]),
            median(results["file"]["raw"]),
            1.25,
        )
    )
    if "s3" in results:
        rows.append(
            (
                f"moto S3: torch.save {args.s3_size_mib} MiB -> durable",
                median(results["s3"]["fs"]),
                median(results["s3"]["raw"]),
                1.25,
            )
        )
    rows.append(
        (
            f"B {args.size_mib} MiB while A drains (blocking)",
            median(results["blocking"]["fs"]),
            median(results["blocking"]["plain"]),
            1.15,
        )
    )
    all_rss = [r for key in ("file", "s3", "blocking", "ranks") if key in results for r in results[key]["rss"]]
    peak_rss = max(all_rss)
    title = (
        f"time to durable vs raw pipeline; blocking while draining (medians of {args.repeat}; "
        f"part {args.part_mib} MiB x {inflight} in flight)"
    )
    report(title, rows, args.json)
    remotes = [where for where in ("file", "s3") if where in results]
    breakdown = {where: {k: median(v) for k, v in results[where]["parts"].items()} for where in remotes}
    raw_save = {where: median(results[where]["raw_save"]) for where in remotes}
    if args.json:
        print(
            json.dumps(
                {
                    "title": "details",
                    "daemon_peak_rss_mib": peak_rss,
                    "burstfs_breakdown_s": breakdown,
                    "loadavg": [load_start[0], os.getloadavg()[0]],
                    "raw_save_s": raw_save,
                    "raw": results,
                }
            )
        )
        return
    print(f"daemon peak RSS: {peak_rss:.0f} MiB over {len(all_rss)} mounts (target <= 300 MiB)")
    per_case = {k: max(results[k]["rss"]) for k in ("file", "s3", "blocking", "ranks") if k in results}
    print("  peak RSS per case (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in per_case.items()))
    rk = results["ranks"]
    print(
        f"  (c) {args.ranks} ranks x {args.shard_mib} MiB written at once: RSS {rk['rss_after_writes']:.0f} MiB "
        f"after the writes ({rk['write_s']:.2f}s), {rk['rss'][0]:.0f} MiB once all durable ({rk['durable_s']:.2f}s)"
    )
    load_end = os.getloadavg()[0]
    print(f"load average at start {load_start[0]:.2f}, at end {load_end:.2f} (2 cores; others' jobs add noise)")
    if "s3" in results:
        print(
            f"note: the moto case uses {args.s3_size_mib} MiB (moto uploads at ~60-80 MiB/s), "
            f"the file remote case {args.size_mib} MiB"
        )
    for where, parts in breakdown.items():
        ship = median(results[where]["raw"]) - raw_save[where]
        print(
            f"where the burstfs time goes, {where} remote (medians; raw: torch.save into tmpfs "
            f"{raw_save[where]:.3f}s, then ship {ship:.3f}s):"
        )
        for k, v in parts.items():
            print(f"  {k:<34} {v:8.3f} s")
    busy = results["blocking"]["a_drain_after_b_start"]
    b_med = median(results["blocking"]["fs"])
    print(
        f"(b) A became durable a median {median(busy):.2f}s after B started (B took {b_med:.2f}s): "
        + ("B overlapped all of A's drain" if median(busy) >= b_med else "A's drain ended while B was written")
    )


if __name__ == "__main__":
    main()

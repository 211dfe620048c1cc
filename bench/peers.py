"""burstfs beside the peers a user would pick otherwise, on ONE moto server in ONE run.

Contenders (each in its own prefix of one bucket):
  - ``reference``: boto3 ``upload_file`` / ``download_file`` with 8 threads and 8 MiB parts
    (``torch.save`` / ``torch.load`` through a plain tmpfs directory);
  - ``one GET per object``: the same uploads, read back with one plain GET per object streamed
    into tmpfs (moto reads the whole object for every ranged GET, so this is its real speed);
  - ``burstfs``: the default mount (FUSE passthrough where the kernel has it) and ``--no-passthrough``;
  - ``rclone writes`` / ``rclone full``: ``rclone mount --vfs-cache-mode writes|full`` (Debian's
    ``rclone``), 8 MiB chunks x 8 uploads in flight like the reference, ``--vfs-write-back 0s``
    (rclone's default waits 5 s after close before uploading; this measures its transfer, not that delay).
    Skipped, with the reason printed, where the ``rclone`` binary is missing.

Cases, per contender, in this order (the durable cases write what the cold cases read back):
  1. ``torch.save`` of a ``--size-mib`` state dict -> durable on S3 (burstfs: the journal says
     ``durable``; rclone: the object has its full size on S3; reference: upload_file returned);
  2. ``--ranks`` processes each writing a ``--shard-mib`` file at once -> all durable;
  3. cold ``torch.load`` of the checkpoint (fresh mount with an empty cache, page cache dropped;
     reference: download_file into tmpfs, then torch.load);
  4. cold read of the ``--ranks`` files by as many processes at once (reference: 8 downloads at once);
  5. ``burstfs-admin prefetch`` of the checkpoint into a fresh mount (reference: ``download_file``);
  6. cold ``torch.load(mmap=True)`` of the checkpoint, then one tensor summed, and
  7. cold safetensors ``safe_open`` of ``model.safetensors`` (written with the checkpoint, not
     timed there), one tensor read: burstfs only; reported with the bytes the daemon fetched
     (allocated bytes of the reader's tier) over the bytes the reader touched (target <= 2x);
  8. a sharded checkpoint of the state dict in ``--ranks`` files, saved by one process -> durable
     (reference: save to tmpfs, upload the files at once): PyTorch DCP (``dcp.save``,
     ``FileSystemWriter(thread_count=ranks)``) and Hugging Face style safetensors shards with a
     ``model.safetensors.index.json``; and
  9. cold load of each in one process, which reads the index and then walks the files one by
     one (``dcp.load``; ``safetensors.torch.load_file`` of each shard in the index's order, as
     ``from_pretrained`` does) (reference: download the files at once, then load from tmpfs).
     Not run through rclone (its cells show "-"); when a cold sharded case is chosen with ``--case``, also
     ``burstfs --no-read-plans`` (no prefetch planned from the index).
Also per burstfs mount: daemon CPU seconds per GiB restored in each read case, and peak RSS.
Ratios are to the reference.  ``--size`` preset ``issue`` = the issue's 1 GiB / 8 x 128 MiB.
``--py-spy DIR`` records the default burstfs mount's daemon (py-spy, raw collapsed stacks,
thread ids) during its cold cases into DIR and prints where its samples went (PROFILE_GROUPS).

    .venv/bin/python bench/peers.py [--size small|issue] [--repeat 1] [--py-spy DIR] [--no-rclone] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    BenchMount,
    drop_page_cache,
    make_bucket,
    median,
    moto_endpoint,
    read_shards_parallel,
    retain_freed_memory,
    rss_peak_mib,
    run_ranks,
    state_dict,
    timed,
    torch_load,
    wait_durable,
)
from drain import write_rank

MiB = 1 << 20
PART = 8 * MiB
THREADS = 8
SIZES = {"small": (256, 32), "issue": (1024, 128)}  # checkpoint MiB, each rank file MiB


def fresh_base(tag: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"burstfs-bench-peers-{tag}-", dir="/dev/shm"))


def rank_names(ranks: int) -> list[str]:
    return [f"rank{r}.bin" for r in range(ranks)]


def s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        max_pool_connections=THREADS * 8 + 4,
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=config)


class Contender:
    """One way to get a checkpoint to S3 and back; every method returns seconds."""

    name = ""

    def save_durable(self, sd: dict[str, Any]) -> float:
        raise NotImplementedError

    def ranks_durable(self, ranks: int, shard: int) -> float:
        raise NotImplementedError

    def cold_load(self) -> float:
        raise NotImplementedError

    def cold_ranks(self, ranks: int) -> float:
        raise NotImplementedError

    def prefetch(self) -> float:
        return float("nan")

    def cold_mmap_tensor(self) -> float:
        return float("nan")

    def cold_safetensors(self) -> float:
        return float("nan")

    def sharded_durable(self, fmt: str, sd: dict[str, Any], files: int) -> float:
        return float("nan")

    def cold_sharded_load(self, fmt: str, sd: dict[str, Any]) -> float:
        return float("nan")

    def close(self) -> None:
        pass


SHARDED = ("dcp", "safetensors")  # the sharded formats of cases 8 and 9


def sharded_save(fmt: str, sd: dict[str, Any], path: Path, files: int) -> list[str]:
    """One process saves ``sd`` into directory ``path`` as ``files`` shards and their index; the names."""
    import warnings

    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(path), thread_count=files))
    else:
        from safetensors.torch import save_file

        path.mkdir(parents=True, exist_ok=True)
        names = list(sd)
        weight_map: dict[str, str] = {}
        for i in range(files):
            shard = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
            tensors = {name: sd[name] for name in names[i::files]}
            save_file(tensors, path / shard)
            weight_map.update(dict.fromkeys(tensors, shard))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return sorted(p.name for p in path.iterdir())


def sharded_load(fmt: str, sd: dict[str, Any], path: Path) -> None:
    """One process loads ``path``: the index, then the shards one by one (DCP: into ``sd`` in place)."""
    import warnings

    if fmt == "dcp":
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
        return
    from safetensors.torch import load_file

    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(weight_map.values())):  # from_pretrained's order
        for tensor in load_file(path / shard).values():
            tensor.sum()  # mmap-backed until touched: a model copies every tensor in


class Reference(Contender):
    """boto3's managed transfers, 8 threads x 8 MiB parts, through a tmpfs directory."""

    name = "boto3 reference"

    def __init__(self, endpoint: str, bucket: str) -> None:
        from boto3.s3.transfer import TransferConfig

        self.client, self.bucket, self.prefix = s3_client(endpoint), bucket, "reference"
        self.config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS)
        self.dir = fresh_base("ref")
        self.sharded_files: dict[str, list[str]] = {}  # format -> what sharded_durable uploaded

    def _upload(self, names: list[str]) -> None:
        def one(name: str) -> None:
            self.client.upload_file(str(self.dir / name), self.bucket, f"{self.prefix}/{name}", Config=self.config)

        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(one, names))
        for name in names:
            (self.dir / name).unlink()

    def _download(self, names: list[str]) -> None:
        def one(name: str) -> None:
            self.client.download_file(self.bucket, f"{self.prefix}/{name}", str(self.dir / name), Config=self.config)

        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(one, names))

    def save_durable(self, sd: dict[str, Any]) -> float:
        import torch

        start = time.perf_counter()
        torch.save(sd, self.dir / "ckpt.pt")
        self._upload(["ckpt.pt"])
        return time.perf_counter() - start

    def ranks_durable(self, ranks: int, shard: int) -> float:
        names = rank_names(ranks)
        start = time.perf_counter()
        run_ranks(write_rank, [(str(self.dir / n), shard) for n in names])
        self._upload(names)
        return time.perf_counter() - start

    def cold_load(self) -> float:
        start = time.perf_counter()
        self._download(["ckpt.pt"])
        torch_load(self.dir / "ckpt.pt")
        seconds = time.perf_counter() - start
        (self.dir / "ckpt.pt").unlink()
        return seconds

    def cold_ranks(self, ranks: int) -> float:
        names = rank_names(ranks)
        seconds = timed(functools.partial(self._download, names))
        for name in names:
            (self.dir / name).unlink()
        return seconds

    def prefetch(self) -> float:
        seconds = timed(functools.partial(self._download, ["ckpt.pt"]))
        (self.dir / "ckpt.pt").unlink()
        return seconds

    def sharded_durable(self, fmt: str, sd: dict[str, Any], files: int) -> float:
        start = time.perf_counter()
        self.sharded_files[fmt] = [f"{fmt}/{name}" for name in sharded_save(fmt, sd, self.dir / fmt, files)]
        self._upload(self.sharded_files[fmt])
        return time.perf_counter() - start

    def cold_sharded_load(self, fmt: str, sd: dict[str, Any]) -> float:
        start = time.perf_counter()
        self._download(self.sharded_files[fmt])
        sharded_load(fmt, sd, self.dir / fmt)
        seconds = time.perf_counter() - start
        shutil.rmtree(self.dir / fmt)
        return seconds

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class OneGet(Reference):
    """The object store's own speed on this server: one plain GET per object, its body
    streamed into a tmpfs file (moto reads the whole object for every ranged GET, so the
    reference's 8 MiB ranges cost it per range; real S3 does not)."""

    name = "one GET per object"

    def __init__(self, endpoint: str, bucket: str) -> None:
        super().__init__(endpoint, bucket)
        self.prefix = "onegetref"

    def _download(self, names: list[str]) -> None:
        def one(name: str) -> None:
            body = self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}")["Body"]
            with open(self.dir / name, "wb") as out:
                shutil.copyfileobj(body, out, PART)

        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(one, names))


class MountContender(Contender):
    """A FUSE mount over ``s3://bucket/prefix``: writes go through a fresh mount, cold reads
    through another fresh mount with an empty cache."""

    def __init__(self, name: str, tag: str) -> None:
        self.name, self.tag = name, tag
        self.base = fresh_base(tag)
        self.generation = 0
        self.mnt: Path | None = None

    def mount(self) -> Path:  # a fresh mount, empty local cache
        raise NotImplementedError

    def unmount(self) -> None:
        raise NotImplementedError

    def wait_durable(self, names: list[str]) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def mounted(self) -> Iterator[Path]:
        mnt = self.mount()
        try:
            yield mnt
        finally:
            self.unmount()

    def save_durable(self, sd: dict[str, Any]) -> float:
        import torch

        with self.mounted() as mnt:
            start = time.perf_counter()
            torch.save(sd, mnt / "ckpt.pt")
            self.wait_durable(["ckpt.pt"])
            return time.perf_counter() - start

    def ranks_durable(self, ranks: int, shard: int) -> float:
        names = rank_names(ranks)
        with self.mounted() as mnt:
            start = time.perf_counter()
            run_ranks(write_rank, [(str(mnt / n), shard) for n in names])
            self.wait_durable(names)
            return time.perf_counter() - start

    def cold_load(self) -> float:
        with self.mounted() as mnt:
            drop_page_cache()
            return timed(functools.partial(torch_load, mnt / "ckpt.pt"))

    def cold_ranks(self, ranks: int) -> float:
        with self.mounted() as mnt:
            drop_page_cache()
            return read_shards_parallel([mnt / n for n in rank_names(ranks)])

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


class Burstfs(MountContender):
    def __init__(
        self, name: str, tag: str, endpoint: str, bucket: str, args: tuple[str, ...], profile_dir: Path | None = None
    ) -> None:
        super().__init__(name, tag)
        self.url, self.args = f"s3://{bucket}/{tag}", ("--endpoint-url", endpoint, *args)
        self.profile_dir = profile_dir
        self.current: BenchMount | None = None
        self.profiler: subprocess.Popen[bytes] | None = None
        #: per read case: daemon CPU seconds, bytes the reader asked for, bytes the tier holds after it
        self.costs: dict[str, list[tuple[float, int, int]]] = {}
        self.peak_rss_mib = 0.0

    def mount(self) -> Path:
        self.generation += 1
        self.current = BenchMount(self.base / f"m{self.generation}", self.url, self.args)
        self.current.mount()
        return self.current.mnt

    def unmount(self) -> None:
        assert self.current is not None
        self.current.unmount()
        shutil.rmtree(self.current.base, ignore_errors=True)

    def wait_durable(self, names: list[str]) -> None:
        assert self.current is not None
        wait_durable(self.current.cache, names)

    @contextlib.contextmanager
    def profiled(self, case: str) -> Iterator[None]:
        """py-spy on the daemon of the current mount while ``case`` runs (when asked for)."""
        if self.profile_dir is None or self.current is None:
            yield
            return
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        out = self.profile_dir / f"{self.tag}-{case}.txt"
        self.profiler = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "py-spy"),
                "record",
                "--pid",
                str(self.current.daemon_pid()),
                "--rate",
                "250",
                "--threads",
                "--format",
                "raw",
                "--output",
                str(out),
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # py-spy attaches
        try:
            yield
        finally:
            self.profiler.send_signal(signal.SIGINT)
            self.profiler.wait(timeout=60)

    def save_durable(self, sd: dict[str, Any]) -> float:
        from safetensors.torch import save_file

        seconds = super().save_durable(sd)
        with self.mounted() as mnt:  # what the safetensors case reads; not timed
            save_file(sd, mnt / "model.safetensors")
            self.wait_durable(["model.safetensors"])
        return seconds

    @contextlib.contextmanager
    def measured(self, case: str) -> Iterator[list[int]]:
        """Daemon CPU, peak RSS and the bytes on the tier after ``case`` (the mount is fresh);
        the case appends the bytes its reader touched to the list it is given."""
        assert self.current is not None
        pid = self.current.daemon_pid()
        before = daemon_cpu_s(pid)
        touched: list[int] = []
        yield touched
        cpu = daemon_cpu_s(pid) - before
        self.peak_rss_mib = max(self.peak_rss_mib, rss_peak_mib(pid))
        held = sum(f.stat().st_blocks * 512 for f in (self.current.cache / "data").iterdir())
        self.costs.setdefault(case, []).append((cpu, sum(touched), held))

    def cold_load(self) -> float:
        with self.mounted() as mnt:
            drop_page_cache()
            with self.profiled("cold_load"), self.measured("cold torch.load") as touched:
                touched.append((mnt / "ckpt.pt").stat().st_size)
                return timed(functools.partial(torch_load, mnt / "ckpt.pt"))

    def cold_ranks(self, ranks: int) -> float:
        with self.mounted() as mnt:
            paths = [mnt / n for n in rank_names(ranks)]
            drop_page_cache()
            with self.profiled("cold_ranks"), self.measured("cold read of rank files") as touched:
                touched.extend(p.stat().st_size for p in paths)
                return read_shards_parallel(paths)

    def prefetch(self) -> float:
        with self.mounted() as mnt:
            path = mnt / "ckpt.pt"
            drop_page_cache()
            with self.measured("prefetch") as touched:
                touched.append(path.stat().st_size)
                command = [str(Path(sys.executable).parent / "burstfs-admin"), "prefetch", str(path)]
                return timed(functools.partial(subprocess.run, command, check=True, capture_output=True))

    def cold_mmap_tensor(self) -> float:
        with self.mounted() as mnt:
            drop_page_cache()
            with self.measured("cold mmap: one tensor") as touched:
                return timed(functools.partial(touch_one_tensor_mmap, mnt / "ckpt.pt", touched))

    def cold_safetensors(self) -> float:
        with self.mounted() as mnt:
            drop_page_cache()
            with self.measured("cold safetensors: one tensor") as touched:
                return timed(functools.partial(touch_one_tensor_safetensors, mnt / "model.safetensors", touched))

    def sharded_durable(self, fmt: str, sd: dict[str, Any], files: int) -> float:
        with self.mounted() as mnt:
            start = time.perf_counter()
            names = sharded_save(fmt, sd, mnt / fmt, files)
            self.wait_durable(names)
            return time.perf_counter() - start

    def cold_sharded_load(self, fmt: str, sd: dict[str, Any]) -> float:
        with self.mounted() as mnt:
            drop_page_cache()
            with self.profiled(f"cold_{fmt}_load"), self.measured(f"cold {fmt} shards, one process") as touched:
                touched.extend(p.stat().st_size for p in (mnt / fmt).iterdir())
                return timed(functools.partial(sharded_load, fmt, sd, mnt / fmt))


ONE_TENSOR = "layer7.weight"  # in the middle of the file: neither the header nor the zip directory's chunk


def touch_one_tensor_mmap(path: Path, touched: list[int]) -> None:
    import torch

    tensor = torch.load(path, mmap=True, weights_only=True)[ONE_TENSOR]
    float(tensor.sum())
    touched.append(tensor.numel() * tensor.element_size())


def touch_one_tensor_safetensors(path: Path, touched: list[int]) -> None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        tensor = f.get_tensor(ONE_TENSOR)
    float(tensor.sum())
    touched.append(tensor.numel() * tensor.element_size())


def daemon_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Rclone(MountContender):
    """``rclone mount`` of the same bucket, configured through RCLONE_CONFIG_* variables."""

    def __init__(self, mode: str, endpoint: str, bucket: str) -> None:
        super().__init__(f"rclone {mode}", f"rclone-{mode}")
        self.mode, self.endpoint, self.bucket = mode, endpoint, bucket
        self.client = s3_client(endpoint)
        self.proc: subprocess.Popen[bytes] | None = None
        self.sizes: dict[str, int] = {}

    def env(self) -> dict[str, str]:
        conf = {
            "TYPE": "s3",
            "PROVIDER": "Other",
            "ENV_AUTH": "false",
            "ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
            "SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            "REGION": "us-east-1",
            "ENDPOINT": self.endpoint,
            "FORCE_PATH_STYLE": "true",
        }
        return {**os.environ, **{f"RCLONE_CONFIG_MOTO_{k}": v for k, v in conf.items()}}

    def mount(self) -> Path:
        self.generation += 1
        gen = self.base / f"m{self.generation}"
        self.mnt = gen / "mnt"
        self.mnt.mkdir(parents=True)
        log = open(gen / "rclone.log", "wb")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [
                "rclone",
                "mount",
                f"moto:{self.bucket}/{self.tag}",
                str(self.mnt),
                "--vfs-cache-mode",
                self.mode,
                "--cache-dir",
                str(gen / "cache"),
                "--vfs-write-back",
                "0s",
                "--s3-chunk-size",
                "8M",
                "--s3-upload-concurrency",
                str(THREADS),
                "--s3-upload-cutoff",
                "8M",
                "--dir-cache-time",
                "1s",
            ],
            env=self.env(),
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 30
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rclone mount failed: {(gen / 'rclone.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return self.mnt

    def unmount(self) -> None:
        assert self.proc is not None and self.mnt is not None
        subprocess.run(["fusermount3", "-u", str(self.mnt)], check=False, capture_output=True)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            subprocess.run(["umount", "-l", str(self.mnt)], check=False, capture_output=True)

    def wait_durable(self, names: list[str], timeout: float = 600.0) -> None:
        """Until each object is on S3 with the size written (a multipart upload appears whole)."""
        assert self.mnt is not None
        want = {n: (self.mnt / n).stat().st_size for n in names}
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending:
            listed = self.client.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.tag}/").get("Contents", ())
            sizes = {o["Key"].rsplit("/", 1)[1]: o["Size"] for o in listed}
            pending = {n for n in pending if sizes.get(n) != want[n]}
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"rclone: {sorted(pending)} not on S3 after {timeout:.0f}s")
            time.sleep(0.01)


CASES: list[tuple[str, Callable[[Contender, dict[str, Any], argparse.Namespace], float]]] = [
    ("torch.save -> durable", lambda c, sd, a: c.save_durable(sd)),
    ("ranks -> durable", lambda c, sd, a: c.ranks_durable(a.ranks, a.shard_mib * MiB)),
    ("cold torch.load", lambda c, sd, a: c.cold_load()),
    ("cold read of rank files", lambda c, sd, a: c.cold_ranks(a.ranks)),
    ("prefetch", lambda c, sd, a: c.prefetch()),
    ("cold mmap: one tensor", lambda c, sd, a: c.cold_mmap_tensor()),
    ("cold safetensors: one tensor", lambda c, sd, a: c.cold_safetensors()),
    ("dcp shards -> durable", lambda c, sd, a: c.sharded_durable("dcp", sd, a.ranks)),
    ("cold dcp shards", lambda c, sd, a: c.cold_sharded_load("dcp", sd)),
    ("safetensors shards -> durable", lambda c, sd, a: c.sharded_durable("safetensors", sd, a.ranks)),
    ("cold safetensors shards", lambda c, sd, a: c.cold_sharded_load("safetensors", sd)),
]


#: Where the daemon's py-spy samples go: the first rule whose words appear in a sample's stack
#: (thread name first) wins; bench/RESULTS.md's breakdown uses these groups.
PROFILE_GROUPS: list[tuple[str, tuple[str, ...]]] = [
    ("S3 client creation (first GET)", ("_PrefixTrie", "ClientCreatorContext")),
    ("SSL context of the client session", ("_build_verify_context",)),
    ("GET body read (aiohttp)", ("S3Session.read_body", "stream_range", "data_received", "StreamReader")),
    ("GET request/response (botocore)", ("S3Session.call",)),
    ("chunk verification (decode_chunk)", ("decode_chunk",)),
    ("tier write (+ xxh3 of streamed pieces)", ("pwrite_full", "_write_hashed")),
    ("trio <-> mover hop", ("on_mover_loop", "WakeupSocketpair", "call_soon_threadsafe")),
    ("thread-pool workers (handoff)", ("asyncio_",)),
    ("FUSE request loop (trio, pyfuse3)", ("MainThread",)),
    ("mover loop otherwise", ("",)),
]


def profile_breakdown(path: Path, rate: int = 250) -> dict[str, float]:
    """Active thread-seconds per PROFILE_GROUPS group in a py-spy raw (collapsed) file."""
    seconds = {group: 0.0 for group, _ in PROFILE_GROUPS}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        group = next(g for g, words in PROFILE_GROUPS if any(w in stack for w in words))
        seconds[group] += int(count) / rate
    return seconds


def contenders(endpoint: str, bucket: str, args: argparse.Namespace) -> tuple[list[Contender], list[str]]:
    found: list[Contender] = [
        Reference(endpoint, bucket),
        OneGet(endpoint, bucket),
        Burstfs("burstfs", "burstfs", endpoint, bucket, (), args.py_spy),
        Burstfs("burstfs --no-passthrough", "burstfs-nopt", endpoint, bucket, ("--no-passthrough",)),
    ]
    if args.case and any(f"cold {fmt} shards" in args.case for fmt in SHARDED):
        found.append(Burstfs("burstfs --no-read-plans", "burstfs-noplans", endpoint, bucket, ("--no-read-plans",)))
    skipped: list[str] = []
    if args.py_spy is not None and shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None:
        skipped.append(f"py-spy profile: no py-spy next to {sys.executable} (pip install py-spy)")
        found = [Burstfs("burstfs", "burstfs", endpoint, bucket, ()) if c.name == "burstfs" else c for c in found]
    if args.no_rclone:
        skipped.append("rclone writes, rclone full: --no-rclone")
    elif shutil.which("rclone") is None:
        skipped.append("rclone writes, rclone full: no rclone binary on PATH (Debian: apt-get install rclone)")
    else:
        found += [Rclone("writes", endpoint, bucket), Rclone("full", endpoint, bucket)]
    return found, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="small",
        help="small: 256 MiB / 8 x 32 MiB (a few minutes on 2 cores); issue: 1 GiB / 8 x 128 MiB",
    )
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="rounds (contender order rotates); medians")
    parser.add_argument("--py-spy", type=Path, default=None, help="record the default mount's daemon into DIR")
    parser.add_argument("--no-rclone", action="store_true", help="burstfs and the reference only (faster)")
    parser.add_argument(
        "--case",
        action="append",
        choices=[name for name, _ in CASES],
        help="run only these cases (repeatable; a cold case reads what its '-> durable' case wrote: include it)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = [(name, run) for name, run in CASES if not args.case or name in args.case]
    args.size_mib, args.shard_mib = SIZES[args.size]
    retain_freed_memory()
    load_start = os.getloadavg()[0]
    sd = state_dict(args.size_mib)
    warm = fresh_base("warm")  # first touch of fresh memory is slow on a VM: not in any timing
    torch_path = warm / "warm.pt"
    import torch

    torch.save(sd, torch_path)
    torch_load(torch_path)
    shutil.rmtree(warm)

    times: dict[str, dict[str, list[float]]] = {}
    with moto_endpoint() as endpoint:
        bucket = f"peers-{uuid.uuid4().hex[:8]}"
        make_bucket(endpoint, bucket)
        found, skipped = contenders(endpoint, bucket, args)
        for line in skipped:
            print(f"skipped: {line}", file=sys.stderr)
        try:
            for i in range(args.repeat):
                order = found[i % len(found) :] + found[: i % len(found)]
                for c in order:
                    for case, run in cases:
                        seconds = run(c, sd, args)
                        times.setdefault(c.name, {}).setdefault(case, []).append(seconds)
                        print(f"  [{i + 1}] {c.name:<26} {case:<26} {seconds:7.2f} s", file=sys.stderr)
        finally:
            for c in found:
                c.close()

    ref = Reference.name
    names = [c.name for c in found]
    labels = {
        "torch.save -> durable": f"torch.save {args.size_mib} MiB -> durable",
        "ranks -> durable": f"{args.ranks} x {args.shard_mib} MiB ranks -> durable",
        "cold torch.load": f"cold torch.load {args.size_mib} MiB",
        "cold read of rank files": f"cold read of {args.ranks} x {args.shard_mib} MiB",
        "prefetch": f"`burstfs-admin prefetch` {args.size_mib} MiB (reference: download_file)",
        "cold mmap: one tensor": f"cold `torch.load(mmap=True)` {args.size_mib} MiB, one tensor",
        "cold safetensors: one tensor": f"cold safetensors `safe_open` {args.size_mib} MiB, one tensor",
        "dcp shards -> durable": f"DCP save {args.size_mib} MiB as {args.ranks} files -> durable",
        "cold dcp shards": f"cold `dcp.load` {args.size_mib} MiB, {args.ranks} files, one process",
        "safetensors shards -> durable": f"safetensors {args.size_mib} MiB as {args.ranks} shards + index -> durable",
        "cold safetensors shards": f"cold safetensors {args.ranks} shards + index, one process",
    }
    med = {n: {case: median(v) for case, v in t.items()} for n, t in times.items()}
    if args.json:
        print(
            json.dumps(
                {
                    "size": args.size,
                    "repeat": args.repeat,
                    "medians_s": med,
                    "raw_s": times,
                    "skipped": skipped,
                    "loadavg": [load_start, os.getloadavg()[0]],
                }
            )
        )
        return
    print(f"\npeers on one moto server, medians of {args.repeat} (s; ratio to the {ref})")
    print(f"| case | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(names)}")
    for case, _ in cases:
        cells = [
            "-"
            if med[n][case] != med[n][case]  # NaN: the contender has no such case
            else f"{med[n][case]:.2f}"
            + ("" if n == ref or med[ref][case] != med[ref][case] else f" ({med[n][case] / med[ref][case]:.2f}x)")
            for n in names
        ]
        print(f"| {labels[case]} | {' | '.join(cells)} |")
    print(f"load average at start {load_start:.2f}, at end {os.getloadavg()[0]:.2f} (2 cores; others' jobs add noise)")
    for line in skipped:
        print(f"skipped: {line}")
    print("\nburstfs read cases: bytes the reader touched, bytes fetched onto the tier, daemon CPU per GiB")
    for c in found:
        if isinstance(c, Burstfs):
            for case, runs in c.costs.items():
                cpu, touched, held = (median([r[i] for r in runs]) for i in range(3))
                print(
                    f"  {c.name:<26} {case:<30} touched {touched / MiB:7.1f} MiB  fetched {held / MiB:7.1f} MiB "
                    f"({held / max(touched, 1):.2f}x)  CPU {cpu:5.2f} s ({cpu / max(held / 2**30, 1e-9):.2f} s/GiB)"
                )
            print(f"  {c.name:<26} daemon peak RSS {c.peak_rss_mib:.0f} MiB (target <= 300)")
    for path in sorted(args.py_spy.glob("*.txt")) if args.py_spy is not None else ():
        shares = profile_breakdown(path)
        total = sum(shares.values())
        print(f"\npy-spy {path.name}: {total:.2f} active thread-seconds (shares, not CPU, on a busy box)")
        for group, secs in shares.items():
            print(f"  {group:<36} {secs:6.2f} s {100 * secs / max(total, 1e-9):4.0f} %")


if __name__ == "__main__":
    main()

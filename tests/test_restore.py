"""Restore through a real mount: a second node's view, verified fetches, eviction, backpressure.

Plus RestoreService on its own (no FUSE): descriptors, forget, verification without a manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pytest
import xxhash
from conftest import BIN, DATA_PATHS, MountedFS, RemoteTarget, file_state, wait_for
from faultproxy import FaultProxy
from s3server import fresh_bucket

from burstfs.config import S3Options, parse_remote_url
from burstfs.errors import CorruptDataError, FsError, RemoteError
from burstfs.localtier import LocalTier
from burstfs.objects import ChunkInfo, Manifest, ObjectStore, manifest_key
from burstfs.remote import FileRemote, RetryPolicy
from burstfs.remote.s3 import S3Remote
from burstfs.restore import MAX_OPEN_FDS, RestoreService
from burstfs.restore import service as restore_service

T = TypeVar("T")

fuse = pytest.mark.fuse  # the mount tests; the RestoreService unit tests below need no FUSE

MiB = 1 << 20


def drained(fs: MountedFS, *names: str) -> bool:
    return all(file_state(fs.cache, name) == "durable" for name in names)


def drained_then_reader(
    factory: type[MountedFS],
    url: str,
    files: dict[str, bytes],
    writer_args: Sequence[str] = (),
    reader_args: Sequence[str] = (),
    meanwhile: Callable[[], object] = lambda: None,
) -> MountedFS:
    """A writer mount drains ``files`` (top-level names) to ``url``; then (after ``meanwhile``)
    a reader mount of it with a cache of its own, as a restore node has."""
    writer = factory("w", url, tuple(writer_args))  # type: ignore[call-arg]
    writer.mount()
    for name, content in files.items():
        (writer.path / name).write_bytes(content)
    wait_for(lambda: drained(writer, *files), what="drain")
    meanwhile()
    reader = factory("r", url, tuple(reader_args))  # type: ignore[call-arg]
    reader.mount()
    return reader


def reader_of_a_drained_dir(
    factory: type[MountedFS], remote: RemoteTarget, directory: str, files: dict[str, bytes]
) -> MountedFS:
    """``files`` drained into ``directory`` by a writer mount that then unmounts; a reader
    mount (a cache of its own) that listed the root only: ``directory`` known, never listed."""
    writer = factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    (writer.path / directory).mkdir()
    for name, content in files.items():
        (writer.path / directory / name).write_bytes(content)
    wait_for(lambda: drained(writer, *files), what="drain")
    writer.unmount()
    reader = factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    assert os.listdir(reader.path) == [directory]
    return reader


def write_checkpoint(fs: MountedFS) -> dict[str, bytes]:
    files = {
        "run/step10/model.pt": os.urandom(13 * MiB),
        "run/step10/optim.pt": os.urandom(3 * MiB + 17),
        "run/step10/empty.json": b"",
        "run/latest": b"step10",
    }
    for path, content in files.items():
        (fs.path / path).parent.mkdir(parents=True, exist_ok=True)
        (fs.path / path).write_bytes(content)
    wait_for(lambda: drained(fs, "model.pt", "optim.pt", "empty.json", "latest"), what="drain")
    return files


def read_shard(path: str, queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with open(path, "rb") as f:
        queue.put((path, len(f.read())))


@fuse
def test_second_node_with_fresh_cache_sees_and_reads_everything(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    writer = mounted_factory("writer", remote.url, (*remote.extra_args, "--part-size", "5M"))  # type: ignore[call-arg]
    writer.mount()
    files = write_checkpoint(writer)
    reader = mounted_factory("reader", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    assert sorted(os.listdir(reader.path / "run")) == ["latest", "step10"]
    assert ".burstfs" not in os.listdir(reader.path)
    assert os.stat(reader.path / "run/step10/model.pt").st_size == 13 * MiB
    assert os.getxattr(reader.path / "run/step10/model.pt", "user.burstfs.state") == b"remote"
    for path, content in files.items():
        assert (reader.path / path).read_bytes() == content
    assert file_state(reader.cache, "model.pt") == "durable"  # fetched: now local
    # A file the first node drains later shows up on the second once the listing's TTL passed.
    (writer.path / "run/step10/late.bin").write_bytes(b"late")
    wait_for(lambda: drained(writer, "late.bin"), what="late drain")
    reader.unmount()
    reader.mount("--list-ttl", "0")
    assert (reader.path / "run/step10/late.bin").read_bytes() == b"late"


@fuse
@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_restore_rides_out_a_few_throttled_listings(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    """A fresh node's first listing of a checkpoint directory answered 503 (SlowDown, as S3
    does when many nodes list at once): the lookup failed EIO at once and the whole restore
    with it.  A listing that fails fast is tried again within the request's wait."""
    assert remote.proxy is not None
    writer = mounted_factory("writer", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    content = os.urandom(300_000)
    (writer.path / "ck").mkdir()
    (writer.path / "ck/a.pt").write_bytes(content)
    wait_for(lambda: drained(writer, "a.pt"), what="drain")
    writer.unmount()
    reader = mounted_factory("reader", remote.url, remote.extra_args)  # type: ignore[call-arg]
    remote.proxy.fail_next(3, status=503, match=lambda line: "list-type=2" in line and "ck%2F" in line)
    reader.mount()
    assert (reader.path / "ck/a.pt").read_bytes() == content
    assert remote.proxy.injected == 3


@fuse
def test_random_reads_fetch_only_what_they_touch(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    writer = mounted_factory("w", remote.url, (*remote.extra_args, "--part-size", "5M"))  # type: ignore[call-arg]
    writer.mount()
    content = os.urandom(20 * MiB)
    (writer.path / "big.safetensors").write_bytes(content)
    wait_for(lambda: drained(writer, "big.safetensors"), what="drain")
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    with open(reader.path / "big.safetensors", "rb") as f:
        f.seek(17 * MiB + 5)
        assert f.read(1000) == content[17 * MiB + 5 : 17 * MiB + 1005]
    data_file = next((reader.cache / "data").iterdir())
    # Sparse: only the touched 1 MiB blocks (each verified by its own digest) are local, the
    # kernel's readahead included (3 MiB measured), not whole 5 MiB parts.
    assert os.stat(data_file).st_blocks * 512 <= 4 * MiB
    assert (reader.path / "big.safetensors").read_bytes() == content


@fuse
def test_flipped_byte_in_the_remote_gives_eio_never_wrong_data(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    writer = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    content = os.urandom(2 * MiB)
    (writer.path / "ckpt.pt").write_bytes(content)
    wait_for(lambda: drained(writer, "ckpt.pt"), what="drain")
    corrupt = bytearray(content)
    corrupt[MiB + 3] ^= 0xFF
    remote.write("ckpt.pt", bytes(corrupt))
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    reader.expect_log("checksum")
    reader.expect_log("request_failed")
    with pytest.raises(OSError) as err:
        (reader.path / "ckpt.pt").read_bytes()
    assert err.value.errno == errno.EIO
    assert "ckpt.pt" in reader.log_text()


@fuse
def test_an_object_cut_short_at_a_chunk_boundary_gives_eio_never_a_shorter_file(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """Every chunk left checks out, and the listing says the short size: only the manifest's
    size tells (it was served as a clean, shorter file)."""
    content = os.urandom(12 * MiB)
    args = remote.extra_args
    reader = drained_then_reader(
        mounted_factory,
        remote.url,
        {"ckpt.pt": content},
        (*args, "--part-size", "5M"),
        args,
        meanwhile=lambda: remote.write("ckpt.pt", content[: 5 * MiB]),
    )
    reader.expect_log("event=corrupt_data")
    with pytest.raises(OSError) as err:
        (reader.path / "ckpt.pt").read_bytes()
    assert err.value.errno == errno.EIO
    assert "its manifest says 12582912" in reader.log_text()


@fuse
@pytest.mark.parametrize("change", ["appended", "cut short"])
def test_a_compressed_object_of_another_length_than_its_manifest_says_gives_eio(
    mounted_factory: type[MountedFS], remote: RemoteTarget, change: str
) -> None:
    """A compressed prefix lists a file at its manifest's size: bytes appended to the object
    were served without a word (while ``verify --remote`` said MISMATCH)."""
    content = b"compressible checkpoint " * 300_000
    lz4 = (*remote.extra_args, "--compress", "lz4")

    def change_object() -> None:
        stored = remote.read("c.pt")
        assert stored is not None and len(stored) < len(content)
        remote.write("c.pt", stored + b"x" if change == "appended" else stored[:-1])

    reader = drained_then_reader(mounted_factory, remote.url, {"c.pt": content}, lz4, lz4, meanwhile=change_object)
    reader.expect_log("event=corrupt_data")
    with pytest.raises(OSError) as err:
        (reader.path / "c.pt").read_bytes()
    assert err.value.errno == errno.EIO
    assert f"its manifest says {len(content)}" in reader.log_text()


@fuse
def test_a_file_its_owner_rewrote_since_it_was_listed_is_not_called_corrupt(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """Listed at 300,000 bytes, rewritten by its owner at 400,000 since: the read fails (the
    listing is stale until --list-ttl), but it was logged as corrupt data (an ERROR)."""
    owner = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    owner.mount()
    (owner.path / "a.pt").write_bytes(os.urandom(300_000))
    wait_for(lambda: drained(owner, "a.pt"), what="drain")
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    assert os.stat(reader.path / "a.pt").st_size == 300_000
    (owner.path / "a.pt").write_bytes(os.urandom(400_000))
    wait_for(lambda: len(remote.read("a.pt") or b"") == 400_000 and drained(owner, "a.pt"), what="the rewrite")
    reader.expect_log("event=listed_size_stale")
    with pytest.raises(OSError) as err:
        (reader.path / "a.pt").read_bytes()
    assert err.value.errno == errno.EIO
    log = reader.log_text()
    assert "rewritten on the remote since it was listed (300000 bytes, now 400000)" in log
    assert "event=corrupt_data" not in log


@fuse
def test_an_object_deleted_after_it_was_listed_gives_eio_and_a_log_line(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """stat still shows the file (listed), so ENOENT from read() was a contradiction."""
    files = {"ckpt.pt": os.urandom(3 * MiB)}
    reader = drained_then_reader(mounted_factory, remote.url, files, remote.extra_args, remote.extra_args)
    reader.expect_log("event=remote_object_gone")
    assert os.stat(reader.path / "ckpt.pt").st_size == 3 * MiB
    remote.delete("ckpt.pt")
    with pytest.raises(OSError) as err:
        (reader.path / "ckpt.pt").read_bytes()
    assert err.value.errno == errno.EIO
    assert "event=remote_object_gone" in reader.log_text()


@fuse
def test_a_node_that_listed_a_prefix_before_it_held_compressed_objects_reads_them_right(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """A node mounted before any node drained with ``--compress`` listed the compressed files
    of the first one that did at their stored sizes, and every read of them failed EIO
    ("remote object is 35375 bytes, its manifest says 9000000") until it remounted."""
    reader = mounted_factory("early", remote.url, (*remote.extra_args, "--list-ttl", "0.5"))  # type: ignore[call-arg]
    reader.mount()
    assert os.listdir(reader.path) == []  # the prefix looked at: no compressed objects there
    writer = mounted_factory("lz4", remote.url, (*remote.extra_args, "--compress", "lz4"))  # type: ignore[call-arg]
    writer.mount()
    content = b"compressible checkpoint " * 400_000  # 9.6 MB, stored in far fewer bytes
    (writer.path / "ck").mkdir()
    (writer.path / "ck/f.bin").write_bytes(content)
    wait_for(lambda: drained(writer, "f.bin"), what="compressed drain")

    def listed_size() -> int | None:  # as `ls -l ck` shows it (a listing once --list-ttl passed)
        with contextlib.suppress(FileNotFoundError):
            os.listdir(reader.path / "ck")
            return os.stat(reader.path / "ck/f.bin").st_size
        return None

    wait_for(lambda: listed_size() == len(content), timeout=30, what=f"the file size (listed {listed_size()})")
    assert (reader.path / "ck/f.bin").read_bytes() == content


@fuse
def test_objects_from_other_tools_are_served_unverified(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    remote.write("foreign/weights.bin", b"written by aws s3 cp" * 1000)
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    assert (reader.path / "foreign/weights.bin").read_bytes() == b"written by aws s3 cp" * 1000
    assert "event=unverified_object key=foreign/weights.bin" in reader.log_text()


@fuse
def test_eight_ranks_restore_shards_in_parallel(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    writer = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    (writer.path / "shards").mkdir()
    for rank in range(8):
        (writer.path / f"shards/rank{rank}.bin").write_bytes(os.urandom(MiB + rank))
    wait_for(lambda: drained(writer, *[f"rank{r}.bin" for r in range(8)]), what="drain")
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=read_shard, args=(str(reader.path / f"shards/rank{r}.bin"), queue)) for r in range(8)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert {os.path.basename(k): v for k, v in results.items()} == {f"rank{r}.bin": MiB + r for r in range(8)}
    for rank in range(8):
        assert (reader.path / f"shards/rank{rank}.bin").read_bytes() == (
            writer.path / f"shards/rank{rank}.bin"
        ).read_bytes()


@fuse
def test_full_tier_evicts_durable_files_lru_and_refetches_them(tmp_path, mounted_factory: type[MountedFS]) -> None:  # type: ignore[no-untyped-def]
    fs = mounted_factory("small", extra_args=("--cache-size", "24M"))  # type: ignore[call-arg]
    fs.mount()
    contents = {}
    for i in range(4):  # 4 x 8 MiB through a 24 MiB tier: the oldest durable file must leave
        contents[i] = os.urandom(8 * MiB)
        (fs.path / f"ckpt{i}.pt").write_bytes(contents[i])
        wait_for(lambda i=i: drained(fs, f"ckpt{i}.pt"), what=f"drain of ckpt{i}")
    assert file_state(fs.cache, "ckpt0.pt") == "evicted"
    assert file_state(fs.cache, "ckpt3.pt") == "durable"  # the newest stays hot
    vfs = os.statvfs(fs.path)
    assert vfs.f_blocks * vfs.f_frsize <= 24 * MiB
    assert (fs.path / "ckpt0.pt").read_bytes() == contents[0]  # read back from the remote


@fuse
def test_tier_full_of_undrained_data_waits_then_enospc(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    if remote.proxy is None:
        pytest.skip("needs the fault proxy to stall the drain")
    fs = mounted_factory("full", remote.url, (*remote.extra_args, "--cache-size", "12M", "--full-timeout", "2"))  # type: ignore[call-arg]
    fs.mount()
    remote.proxy.delay_next(1000, 20.0, match="PUT")
    fs.expect_log("tier_full")
    fs.expect_log("request_failed")
    first = os.urandom(8 * MiB)
    (fs.path / "first.bin").write_bytes(first)
    with pytest.raises(OSError) as err, open(fs.path / "second.bin", "wb") as f:
        f.write(os.urandom(8 * MiB))
    assert err.value.errno == errno.ENOSPC
    assert (fs.path / "first.bin").read_bytes() == first  # undrained data is never evicted
    remote.proxy.clear()


@fuse
def test_admin_prefetch_warms_a_checkpoint(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    writer = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    write_checkpoint(writer)
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    result = subprocess.run(
        [str(BIN / "burstfs-admin"), "prefetch", str(reader.path / "run")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert file_state(reader.cache, "model.pt") == "durable"
    assert file_state(reader.cache, "optim.pt") == "durable"


@fuse
def test_a_file_opened_while_prefetch_lists_its_directory_waits_for_that_listing(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """A lookup beside ``burstfs-admin prefetch DIR`` found DIR neither due for a listing
    (prefetch's was under way) nor being listed (prefetch's was not one requests wait for):
    the open failed EIO at once ("the remote could not be listed here yet")."""
    if remote.proxy is None:
        pytest.skip("needs the fault proxy to hold the listing")
    files = {f"f{i}.bin": os.urandom(300_000) for i in range(4)}
    reader = reader_of_a_drained_dir(mounted_factory, remote, "big", files)
    remote.proxy.delay_next(1, seconds=1.5, match=lambda line: "list-type=2" in line and "big%2F" in line)
    prefetch = subprocess.Popen(
        [str(BIN / "burstfs-admin"), "prefetch", str(reader.path / "big")], stdout=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: any("big%2F" in line for line in remote.proxy.requests), what="prefetch's listing")
        assert (reader.path / "big/f0.bin").read_bytes() == files["f0.bin"]
    finally:
        assert prefetch.wait(timeout=60) == 0
    remote.proxy.clear()


@fuse
def test_prefetch_of_a_directory_it_cannot_list_fails(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    """It said "fetched 0 B in 0 files" and exited 0 for a checkpoint directory the remote
    would not list: a restart script was told the checkpoint was warm."""
    if remote.proxy is None:
        pytest.skip("needs the fault proxy to refuse the listing")
    reader = reader_of_a_drained_dir(mounted_factory, remote, "ck", {"a.bin": os.urandom(100_000)})
    remote.proxy.fail_next(100, status=403, match=lambda line: "list-type=2" in line and "ck%2F" in line)
    result = subprocess.run(
        [str(BIN / "burstfs-admin"), "prefetch", str(reader.path / "ck")], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "could not list this directory" in result.stderr, result.stdout + result.stderr
    remote.proxy.clear()


@fuse
def test_large_prefix_lists_lazily_and_completely(mounted_factory: type[MountedFS], tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A directory of 20,000 objects written by another node (or tool) lists in full."""
    fs = mounted_factory("big")  # type: ignore[call-arg]
    many = fs.remote_dir / "many"
    many.mkdir(parents=True)
    for i in range(20_000):
        (many / f"f{i:05d}").write_bytes(b"")
    fs.mount()
    names = os.listdir(fs.path / "many")
    assert len(names) == 20_000 and "f19999" in names
    assert os.stat(fs.path / "many/f12345").st_size == 0


@fuse
def test_evicted_file_without_manifest_is_verified_against_the_journal(mounted_factory: type[MountedFS]) -> None:
    """An evicted file whose object was swapped and whose manifest was deleted: the journal
    still has its digests, so the swapped bytes are refused (EIO), never served."""
    fs = mounted_factory("n")  # type: ignore[call-arg]
    fs.mount()
    content = os.urandom(3 * MiB + 5)
    (fs.path / "ckpt.pt").write_bytes(content)
    wait_for(lambda: drained(fs, "ckpt.pt"), what="drain")
    subprocess.run(
        [str(BIN / "burstfs-admin"), "evict", str(fs.path / "ckpt.pt")], check=True, capture_output=True, timeout=60
    )
    assert file_state(fs.cache, "ckpt.pt") == "evicted"
    swapped = bytearray(content)
    swapped[2 * MiB + 7] ^= 0x01
    (fs.remote_dir / "ckpt.pt").write_bytes(bytes(swapped))
    (fs.remote_dir / ".burstfs/manifests/ckpt.pt.json").unlink()
    fs.expect_log("request_failed")
    with pytest.raises(OSError) as err:
        (fs.path / "ckpt.pt").read_bytes()
    assert err.value.errno == errno.EIO
    assert "event=corrupt_data key=ckpt.pt" in fs.log_text()
    assert "range=" in fs.log_text()
    (fs.remote_dir / "ckpt.pt").write_bytes(content)  # repaired: now it reads, verified
    assert (fs.path / "ckpt.pt").read_bytes() == content
    assert file_state(fs.cache, "ckpt.pt") == "durable"


# -- RestoreService without a mount --------------------------------------------------------------

CHUNK = 4096
FAST_RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02)


class FakeJournal:
    """The journal calls RestoreService makes."""

    def __init__(self) -> None:
        self.rows: dict[int, types.SimpleNamespace] = {}
        self.updates: list[tuple[str, tuple[Any, ...]]] = []

    def add(
        self,
        ino: int,
        key: str,
        size: int,
        digest: str | None = None,
        chunk_size: int | None = None,
        chunks: list[str] | None = None,
    ) -> None:
        import json

        self.rows[ino] = types.SimpleNamespace(
            ino=ino,
            remote_key=key,
            size=size,
            digest=digest,
            chunk_size=chunk_size,
            chunks=json.dumps(chunks) if chunks is not None else None,
        )

    def fetch_row(self, ino: int) -> types.SimpleNamespace | None:
        return self.rows.get(ino)

    def finish_fetch(self, ino: int, size: int, **digests: Any) -> None:
        self.updates.append(("durable", (ino, size, digests)))


def chunk_digests(data: bytes, chunk: int = CHUNK) -> list[str]:
    return [xxhash.xxh3_64_hexdigest(data[i : i + chunk]) for i in range(0, len(data), chunk)]


async def put_with_manifest(store: ObjectStore, key: str, data: bytes, chunk: int = CHUNK) -> Manifest:
    manifest = Manifest(
        key=key,
        size=len(data),
        chunk_size=chunk,
        digest=xxhash.xxh3_128_hexdigest(data),
        generation=1,
        mtime_ns=0,
        mode=0o100600,
        chunks=tuple(
            ChunkInfo(d, "raw", min(chunk, len(data) - i * chunk)) for i, d in enumerate(chunk_digests(data, chunk))
        ),
    )
    await store.remote.put_object(key, data)
    await store.remote.put_object(manifest_key(key), manifest.to_json())
    return manifest


def service(tmp_path: Path, journal: FakeJournal, **kw: Any) -> RestoreService:
    (tmp_path / "remote").mkdir(exist_ok=True)
    store = ObjectStore(FileRemote(parse_remote_url(f"file://{tmp_path / 'remote'}")), FAST_RETRY)
    return RestoreService(store, journal, LocalTier(tmp_path / "cache"), **kw)  # type: ignore[arg-type]


def run_async(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def settle(svc: RestoreService) -> None:
    """Wait for prefetches to land."""
    for _ in range(1000):
        if not any(f.in_flight for f in svc._files.values()):
            return
        await asyncio.sleep(0.01)


def test_one_ranged_get_serves_consecutive_chunks_and_a_bad_one_fails_only_itself(tmp_path: Path) -> None:
    """A read of 6 chunks from the middle of a file (the file remote: no stream) is one ranged GET;
    a flipped byte in one of them fails that chunk alone: the others land, verified."""
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    content = os.urandom(12 * CHUNK)
    gets: list[tuple[int, int]] = []
    remote = svc.store.remote
    get_range = remote.get_range

    async def counted(key: str, start: int, end: int) -> bytes:
        if key == "run.pt":  # not its manifest
            gets.append((start, end))
        return await get_range(key, start, end)

    remote.get_range = counted  # type: ignore[method-assign]

    async def body() -> None:
        await put_with_manifest(svc.store, "run.pt", content)
        journal.add(4, "run.pt", len(content))
        stored = tmp_path / "remote" / "run.pt"
        damaged = bytearray(stored.read_bytes())
        damaged[5 * CHUNK + 7] ^= 0xFF
        stored.write_bytes(bytes(damaged))
        gets.clear()
        with pytest.raises(CorruptDataError, match=f"bytes {5 * CHUNK}-{6 * CHUNK}"):
            await svc.ensure_local(4, 3 * CHUNK, 6 * CHUNK)  # chunks 3..8
        assert gets == [(3 * CHUNK, 9 * CHUNK), (5 * CHUNK, 6 * CHUNK)]  # the bad one once more, alone
        assert svc._files[4].present == {3, 4, 6, 7, 8}
        assert await svc.ensure_local(4, 6 * CHUNK, 2 * CHUNK) == 0  # the good ones are local: no GET
        assert gets == [(3 * CHUNK, 9 * CHUNK), (5 * CHUNK, 6 * CHUNK)]
        await svc.aclose()

    run_async(body)
    local = svc.tier.path(4).read_bytes()
    assert local[3 * CHUNK : 5 * CHUNK] == content[3 * CHUNK : 5 * CHUNK]
    assert local[6 * CHUNK : 9 * CHUNK] == content[6 * CHUNK : 9 * CHUNK]


def test_partial_fetches_of_many_files_hold_a_bounded_number_of_fds(tmp_path: Path) -> None:
    """Reading 4 KiB from each of 300 cold files once took one descriptor per file for good
    (19 -> 319 fds; EMFILE under a 256 limit).  Now at most MAX_OPEN_FDS stay open."""
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    files = {ino: os.urandom(40 * CHUNK) for ino in range(1, 301)}

    async def body() -> None:
        for ino, data in files.items():
            await put_with_manifest(svc.store, f"f{ino}", data)
            journal.add(ino, f"f{ino}", len(data))
        before = open_fd_count()
        for ino in files:
            assert await svc.ensure_local(ino, 0, 4096) >= 4096
        await settle(svc)
        assert len(svc._files) == 300  # all still partly fetched
        assert svc.open_fds <= MAX_OPEN_FDS
        assert open_fd_count() - before <= MAX_OPEN_FDS
        # A file whose descriptor was closed gets it back when it needs it again.
        for ino in (1, 300):
            assert await svc.ensure_local(ino, 0, 40 * CHUNK) == 40 * CHUNK
            assert svc.tier.path(ino).read_bytes() == files[ino]
        await svc.aclose()

    run_async(body)


def test_forget_keeps_the_fd_until_the_pwrite_using_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """forget() (unlink or eviction) during a chunk's pwrite must not close the descriptor under
    the writing thread: the number could be reused by another file and get its bytes."""
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    data = os.urandom(4 * CHUNK)
    journal.add(7, "k", len(data))
    tier_file = str(svc.tier.path(7))
    started, release = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    real_pwrite = os.pwrite

    def slow_pwrite(fd: int, buf: Any, offset: int) -> int:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == tier_file and "fd" not in seen:
                seen["fd"] = fd
                started.set()
                release.wait(10)
                seen["still_ours"] = os.readlink(f"/proc/self/fd/{fd}") == tier_file
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)

    async def body() -> None:
        await put_with_manifest(svc.store, "k", data)
        reader = asyncio.create_task(svc.ensure_local(7, 0, 100))
        assert await asyncio.to_thread(started.wait, 10)
        svc.forget(7)
        await asyncio.sleep(0.05)  # let the cancellations run
        release.set()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
        for _ in range(500):
            if svc.open_fds == 0:
                break
            await asyncio.sleep(0.01)

    run_async(body)
    assert seen.get("still_ours") is True, "the descriptor was closed while a pwrite used it"
    assert svc.open_fds == 0
    with contextlib.suppress(OSError):  # closed afterwards (or reused by something else)
        assert os.readlink(f"/proc/self/fd/{seen['fd']}") != tier_file


@pytest.mark.parametrize("journal_has", ["chunk digests", "whole digest only"])
def test_object_without_manifest_is_verified_against_journal_digests(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, journal_has: str
) -> None:
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    content = os.urandom(5 * CHUNK + 17)
    chunks = chunk_digests(content) if journal_has == "chunk digests" else None
    journal.add(3, "ckpt.pt", len(content), digest=xxhash.xxh3_128_hexdigest(content), chunk_size=CHUNK, chunks=chunks)
    swapped = bytearray(content)
    swapped[3 * CHUNK + 9] ^= 0x01

    async def body() -> None:
        await svc.store.remote.put_object("ckpt.pt", bytes(swapped))  # no manifest
        with caplog.at_level(logging.WARNING, logger="burstfs"):
            for offset in (3 * CHUNK, 0):  # the bad chunk, and (whole-digest case) any read at all
                with pytest.raises(CorruptDataError) as info:
                    await svc.ensure_local(3, offset, len(content))
                assert "ckpt.pt" in str(info.value)
                if chunks is not None:
                    break
        lines = [r.getMessage() for r in caplog.records if "event=corrupt_data" in r.getMessage()]
        assert lines and all("key=ckpt.pt" in line and "range=" in line for line in lines)
        expected_range = f"range={3 * CHUNK}-{4 * CHUNK}" if chunks is not None else f"range=0-{len(content)}"
        assert expected_range in lines[0]
        assert journal.updates == []  # never recorded as local
        await svc.store.remote.put_object("ckpt.pt", content)  # repaired
        assert await svc.ensure_local(3, 0, len(content)) == len(content)
        assert svc.tier.path(3).read_bytes() == content
        assert journal.updates and journal.updates[0][0] == "durable" and journal.updates[0][1][0] == 3

    run_async(body)


def test_object_nobody_recorded_digests_for_is_served_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    content = b"written by another tool" * 100
    journal.add(4, "foreign.bin", len(content))

    async def body() -> None:
        await svc.store.remote.put_object("foreign.bin", content)
        with caplog.at_level(logging.WARNING, logger="burstfs"):
            assert await svc.ensure_local(4, 0, len(content)) == len(content)
        assert "event=unverified_object key=foreign.bin" in caplog.text

    run_async(body)
    assert svc.tier.path(4).read_bytes() == content


def test_sequential_reads_grow_the_prefetch_window_and_a_seek_resets_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranged window is half as many bytes as the sequential run has read (up to MAX_WINDOW_BYTES),
    none after a seek: a reader that stops has fetched at most about 1.5 times what it read."""
    monkeypatch.setattr(restore_service, "MAX_WINDOW_BYTES", 16 * CHUNK)
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    content = os.urandom(64 * CHUNK)

    async def read_chunk(index: int) -> int:
        """Chunks fetched so far, prefetches landed, after a read of chunk ``index``."""
        await svc.ensure_local(7, index * CHUNK, CHUNK)
        await settle(svc)
        return svc.fetched_bytes // CHUNK

    async def body() -> None:
        await put_with_manifest(svc.store, "seq", content)
        journal.add(7, "seq", len(content))
        # Windows 0, 1, 1, 2, 2: each read fetches its chunk and half as many ahead as the run has read.
        assert [await read_chunk(i) for i in range(5)] == [1, 3, 4, 6, 7]
        assert await read_chunk(40) == 8  # a seek: no window (chunk 40 only)
        assert await read_chunk(41) == 10  # sequential again: window 1 (42)
        for i in range(5, 40):  # the window stops growing at MAX_WINDOW_BYTES
            await read_chunk(i)
        assert svc._files[7].window == 16
        await svc.aclose()

    run_async(body)
    data = svc.tier.path(7).read_bytes()
    assert (
        data[: 40 * CHUNK] == content[: 40 * CHUNK]
        and data[40 * CHUNK : 44 * CHUNK] == content[40 * CHUNK : 44 * CHUNK]
    )


def test_a_chunk_that_does_not_match_its_manifest_is_never_written_or_served(tmp_path: Path) -> None:
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    content = os.urandom(8 * CHUNK)
    damaged = bytearray(content)
    damaged[5 * CHUNK + 100] ^= 0x40

    async def body() -> None:
        await put_with_manifest(svc.store, "m.pt", content)
        await svc.store.remote.put_object("m.pt", bytes(damaged))  # the object rots; its manifest does not
        journal.add(9, "m.pt", len(content))
        for _ in range(2):  # a failed chunk is not remembered as present: the next read checks again
            with pytest.raises(CorruptDataError, match=f"m.pt: bytes {5 * CHUNK}-{6 * CHUNK}"):
                await svc.ensure_local(9, 5 * CHUNK, CHUNK)
        assert await svc.ensure_local(9, 0, 2 * CHUNK) >= 2 * CHUNK  # the other chunks are fine
        await settle(svc)
        assert bytes(damaged[5 * CHUNK : 6 * CHUNK]) not in svc.tier.path(9).read_bytes()
        assert journal.updates == []
        await svc.store.remote.put_object("m.pt", content)  # repaired
        assert await svc.ensure_local(9, 0, len(content)) == len(content)
        await svc.aclose()

    run_async(body)
    assert svc.tier.path(9).read_bytes() == content


class GatedRemote(FileRemote):
    """A file remote whose ranged reads for which ``holds(key, start)`` wait for ``release``."""

    def __init__(self, directory: Path, holds: Callable[[str, int], bool]) -> None:
        super().__init__(parse_remote_url(f"file://{directory}"))
        self.holds = holds
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        if self.holds(key, start):
            self.entered.set()
            await self.release.wait()
        return await super().get_range(key, start, end)


def gated_service(tmp_path: Path, holds: Callable[[str, int], bool]) -> tuple[RestoreService, GatedRemote, FakeJournal]:
    """A restore service over a file remote whose reads for which ``holds(key, start)`` wait."""
    (tmp_path / "remote").mkdir()
    remote = GatedRemote(tmp_path / "remote", holds)
    journal = FakeJournal()
    svc = RestoreService(ObjectStore(remote, FAST_RETRY), journal, LocalTier(tmp_path / "cache"))  # type: ignore[arg-type]
    return svc, remote, journal


def test_a_read_whose_file_is_forgotten_during_its_fetch_says_so(tmp_path: Path) -> None:
    """A file removed (or evicted) while a read waited for its chunks: the read failed "the
    mover stopped" (its chunk fetches were cancelled), which it had not (a prefetch beside rm -r)."""
    svc, remote, journal = gated_service(tmp_path, lambda key, start: not key.startswith(".burstfs/"))
    content = os.urandom(4 * CHUNK)

    async def body() -> None:
        await put_with_manifest(svc.store, "rm.pt", content)
        journal.add(6, "rm.pt", len(content))
        reader = asyncio.ensure_future(svc.ensure_local(6, 0, len(content)))
        await remote.entered.wait()
        svc.forget(6)
        with pytest.raises(FsError) as info:
            await reader
        assert info.value.errno == errno.ESTALE and "went away" in str(info.value)
        await svc.aclose()

    run_async(body)


def test_aclose_ends_the_prefetches_and_closes_the_descriptors(tmp_path: Path) -> None:
    """The mover's stop (or crash) ends every chunk fetch the restore service started, prefetches
    included, and closes its descriptors; nothing is left running on a loop that is going away."""
    svc, remote, journal = gated_service(  # chunks from 2 on never come
        tmp_path, lambda key, start: start >= 2 * CHUNK and not key.startswith(".burstfs/")
    )
    content = os.urandom(8 * CHUNK)

    async def body() -> None:
        await put_with_manifest(svc.store, "p.pt", content)
        journal.add(5, "p.pt", len(content))
        before = open_fd_count()
        assert await svc.ensure_local(5, 0, CHUNK) == CHUNK  # chunk 0
        assert await svc.ensure_local(5, CHUNK, CHUNK) == 2 * CHUNK  # sequential: chunk 2 prefetches and hangs
        await remote.entered.wait()
        assert open_fd_count() == before + 1  # the data file, kept open for the prefetches
        tasks = [t for f in svc._files.values() for t in f.in_flight.values()]
        assert tasks
        await svc.aclose()
        assert all(t.done() for t in tasks) and open_fd_count() == before
        assert svc.fetched_bytes == 2 * CHUNK and journal.updates == []
        with pytest.raises(FsError) as info:  # asked for while the mover stops: EIO, nothing started
            await svc.ensure_local(5, 6 * CHUNK, CHUNK)
        assert info.value.errno == errno.EIO

    run_async(body)


def test_let_go_revokes_an_open_waiting_on_the_remote_and_never_touches_the_new_bytes(tmp_path: Path) -> None:
    """A remote file emptied by O_TRUNC while its fetch waits for its manifest: let_go returns at
    once (it waits on no remote), and the late fetch neither resizes the new data file nor
    registers, but fails its waiters with ESTALE (the core then reads what is local)."""
    svc, remote, journal = gated_service(tmp_path, lambda key, start: key.startswith(".burstfs/"))  # manifests wait
    content = os.urandom(3 * CHUNK)

    async def body() -> None:
        await put_with_manifest(svc.store, "e.pt", content)
        journal.add(4, "e.pt", len(content))
        reader = asyncio.ensure_future(svc.ensure_local(4, 0, CHUNK))
        await remote.entered.wait()
        await asyncio.wait_for(svc.let_go(4), 5)
        svc.tier.create(4)  # the core's new, empty data file, then the writer's bytes
        svc.tier.path(4).write_bytes(b"new bytes")
        remote.release.set()
        with pytest.raises(FsError) as info:
            await reader
        assert info.value.errno == errno.ESTALE
        assert svc.tier.path(4).read_bytes() == b"new bytes" and 4 not in svc._files
        await svc.aclose()

    run_async(body)


# -- streams: a file read from its start comes as one GET (S3 on moto, behind the fault proxy) ----------

S3_CHUNK = 64 * 1024


@contextlib.asynccontextmanager
async def s3_service(
    endpoint: str, proxy: FaultProxy, journal: FakeJournal, tmp_path: Path
) -> AsyncIterator[RestoreService]:
    """A RestoreService over a fresh moto bucket reached through ``proxy``; pieces of 16 KiB."""
    bucket = fresh_bucket(endpoint)
    remote = S3Remote(parse_remote_url(f"s3://{bucket}/ckpts"), S3Options(endpoint_url=proxy.endpoint))
    svc = RestoreService(ObjectStore(remote, FAST_RETRY), journal, LocalTier(tmp_path / "cache"))  # type: ignore[arg-type]
    svc.streams.piece = 16 * 1024
    try:
        await svc.list_dir("")  # as a mount does first: the prefix holds no compressed objects
        yield svc
    finally:
        await svc.aclose()
        await remote.close()


def gets_of(proxy: FaultProxy, key: str) -> int:
    """GET requests for the object ``key`` (not its manifest) the proxy has seen."""
    return sum(1 for line in proxy.requests if line.startswith("GET ") and f"/ckpts/{key} " in line)


@pytest.fixture
def proxy(s3_env: str) -> Iterator[FaultProxy]:
    with FaultProxy(s3_env) as fault_proxy:
        yield fault_proxy


def test_a_read_from_the_start_streams_the_rest_in_one_get_within_twice_what_was_read(
    tmp_path: Path, s3_env: str, proxy: FaultProxy
) -> None:
    """A sequential run from offset 0 is ONE GET whose lead grows with what was read (so a
    reader that stops has fetched at most about twice what it read); a seek elsewhere gets ranged
    chunks and no prefetch; the stream, allowed on, lands the rest of the file."""
    journal = FakeJournal()
    content = os.urandom(64 * S3_CHUNK)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "seq.pt", content, S3_CHUNK)
            journal.add(1, "seq.pt", len(content))
            for i in range(4):  # 4 chunks read in 16 KiB reads
                for offset in range(i * S3_CHUNK, (i + 1) * S3_CHUNK, 16 * 1024):
                    await svc.ensure_local(1, offset, 16 * 1024)
            await asyncio.sleep(0.3)  # the stream lands what its lead allows, then waits
            fetch = svc._files[1]
            assert fetch.stream is not None  # waiting for the reader, its GET open
            assert 4 * S3_CHUNK < svc.fetched_bytes <= 2 * 4 * S3_CHUNK + S3_CHUNK
            gets = gets_of(proxy, "seq.pt")
            assert gets == 1  # the first read at offset 0 started the stream
            assert await svc.ensure_local(1, 40 * S3_CHUNK + 5, 100) < 40 * S3_CHUNK  # a seek: one ranged chunk
            assert 40 in fetch.present and 41 not in fetch.present and gets_of(proxy, "seq.pt") == gets + 1
            assert await svc.ensure_local(1, 4 * S3_CHUNK, 60 * S3_CHUNK) == len(content)  # the rest: the same stream
            assert gets_of(proxy, "seq.pt") == gets + 1
            assert svc.fetched_bytes == len(content)  # no chunk landed twice (40 was read past)
        assert svc.tier.path(1).read_bytes() == content
        assert journal.updates and journal.updates[0][1][:2] == (1, len(content))

    run_async(body)


def test_a_prefetch_is_one_get(tmp_path: Path, s3_env: str, proxy: FaultProxy) -> None:
    journal = FakeJournal()
    content = os.urandom(20 * S3_CHUNK + 123)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "all.pt", content, S3_CHUNK)
            journal.add(2, "all.pt", len(content))
            assert await svc.ensure_local(2, 0, len(content)) == len(content)
            assert gets_of(proxy, "all.pt") == 1
        assert svc.tier.path(2).read_bytes() == content

    run_async(body)


def test_a_cold_read_from_the_start_sends_its_get_beside_the_manifest_get(
    tmp_path: Path, s3_env: str, proxy: FaultProxy
) -> None:
    """The stream's GET goes out with the manifest's (a restore reading small files one after
    another waited two round trips per file) and is the stream's only GET; a read elsewhere in
    a file sends none ahead; a manifest that does not match drops it."""
    journal = FakeJournal()
    content = os.urandom(20 * S3_CHUNK + 5)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            for key in ("a.pt", "b.pt", "c.pt"):
                await put_with_manifest(svc.store, key, content, S3_CHUNK)
            journal.add(1, "a.pt", len(content))
            journal.add(2, "b.pt", len(content))
            journal.add(3, "c.pt", len(content), digest="0123456789abcdef")  # drained as other bytes
            proxy.delay_next(1, seconds=1.0, match="manifests/a.pt")
            reader = asyncio.ensure_future(svc.ensure_local(1, 0, len(content)))
            for _ in range(100):
                if gets_of(proxy, "a.pt"):
                    break
                await asyncio.sleep(0.01)
            assert gets_of(proxy, "a.pt") == 1 and not reader.done()  # sent while the manifest's waits
            assert await reader == len(content)
            assert gets_of(proxy, "a.pt") == 1
            assert await svc.ensure_local(2, 7 * S3_CHUNK + 1, 100) < len(content)  # a seek: one ranged GET
            assert gets_of(proxy, "b.pt") == 1
            with pytest.raises(CorruptDataError, match="changed since it was drained"):
                await svc.ensure_local(3, 0, 100)
            assert svc.streams.active == 0 and svc.streams.early == 0 and 3 not in svc._files
            # Sent ahead only while stream slots are free: each holds a connection until its
            # manifest arrives, and the manifests need connections too.
            for ino in range(10, 22):
                await put_with_manifest(svc.store, f"m{ino}.pt", content, S3_CHUNK)
                journal.add(ino, f"m{ino}.pt", len(content))
            proxy.delay_next(12, seconds=0.5, match="manifests/m")
            readers = [asyncio.ensure_future(svc.ensure_local(ino, 0, len(content))) for ino in range(10, 22)]
            await asyncio.sleep(0.3)
            assert svc.streams.early == svc.streams.max_streams
            assert await asyncio.gather(*readers) == [len(content)] * 12
            assert svc.streams.early == 0
        assert svc.tier.path(1).read_bytes() == content

    run_async(body)


def test_a_get_sent_ahead_for_a_reader_that_went_away_gives_its_slot_back(
    tmp_path: Path, s3_env: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader cancelled while its file's manifest was on its way (the open goes on without
    it): the GET sent ahead holds a stream slot and a connection until the stall bound, then
    is closed; the next read of the file opens a GET of its own."""
    from burstfs.restore import stream as restore_stream

    monkeypatch.setattr(restore_stream, "READ_STALL_S", 0.6)
    journal = FakeJournal()
    content = os.urandom(8 * S3_CHUNK)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "gone.pt", content, S3_CHUNK)
            journal.add(1, "gone.pt", len(content))
            proxy.delay_next(1, seconds=0.3, match="manifests/gone.pt")
            reader = asyncio.ensure_future(svc.ensure_local(1, 0, len(content)))
            await asyncio.sleep(0.1)
            reader.cancel()
            await asyncio.sleep(0.3)
            assert 1 in svc._files and svc.streams.early == 1  # opened, its GET sent, no reader planned
            await asyncio.sleep(0.5)
            assert svc.streams.early == 0
            assert await svc.ensure_local(1, 0, len(content)) == len(content)
            assert gets_of(proxy, "gone.pt") == 2
        assert svc.tier.path(1).read_bytes() == content

    run_async(body)


def test_a_streamed_chunk_that_does_not_match_is_a_clear_error_and_never_served(
    tmp_path: Path, s3_env: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    journal = FakeJournal()
    content = os.urandom(12 * S3_CHUNK)
    damaged = bytearray(content)
    damaged[7 * S3_CHUNK + 100] ^= 0x40

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "rot.pt", content, S3_CHUNK)
            await svc.store.remote.put_object("rot.pt", bytes(damaged))  # the object rots; its manifest does not
            journal.add(3, "rot.pt", len(content))
            with caplog.at_level(logging.ERROR, logger="burstfs"), pytest.raises(CorruptDataError) as info:
                await svc.ensure_local(3, 0, len(content))  # a prefetch: one stream
            assert f"rot.pt: bytes {7 * S3_CHUNK}-{8 * S3_CHUNK} do not match" in str(info.value)
            assert f"range={7 * S3_CHUNK}-{8 * S3_CHUNK}" in caplog.text
            fetch = svc._files[3]
            assert 7 not in fetch.present and set(range(7)) <= fetch.present
            assert await svc.ensure_local(3, 0, 7 * S3_CHUNK) == 7 * S3_CHUNK  # what checked out is served
            assert journal.updates == []
            await svc.store.remote.put_object("rot.pt", content)  # repaired: the next read streams again
            assert await svc.ensure_local(3, 0, len(content)) == len(content)
        assert svc.tier.path(3).read_bytes() == content

    run_async(body)


@pytest.mark.parametrize("how", ["stream", "ranged"])
def test_a_chunk_damaged_in_transit_is_fetched_once_more_and_served_right(
    tmp_path: Path, s3_env: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    """A bit flipped between the store and this node (the object is intact): the read failed
    EIO although a second GET of the chunk would have matched.  A chunk that does not match is
    fetched once more; only one that fails again is corrupt (the object itself: the test above)."""
    journal = FakeJournal()
    content = os.urandom(12 * S3_CHUNK)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "flip.pt", content, S3_CHUNK)
            journal.add(5, "flip.pt", len(content))
            at = 5 * S3_CHUNK + 777
            proxy.flip_next(1, match="/ckpts/flip.pt ", at=at if how == "stream" else 777)
            with caplog.at_level(logging.WARNING, logger="burstfs"):
                if how == "stream":
                    assert await svc.ensure_local(5, 0, len(content)) == len(content)
                else:  # a seek: ranged chunks
                    await svc.ensure_local(5, 5 * S3_CHUNK + 10, 100)
                    assert 5 in svc._files[5].present
            assert proxy.injected == 1 and gets_of(proxy, "flip.pt") == 2
            assert "event=chunk_refetched key=flip.pt" in caplog.text
            if how == "ranged":
                assert await svc.ensure_local(5, 0, len(content)) == len(content)
        assert svc.tier.path(5).read_bytes() == content

    run_async(body)


def test_a_stream_cut_mid_body_resumes_from_the_bytes_already_landed(
    tmp_path: Path, s3_env: str, proxy: FaultProxy, caplog: pytest.LogCaptureFixture
) -> None:
    journal = FakeJournal()
    content = os.urandom(48 * S3_CHUNK + 999)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "cut.pt", content, S3_CHUNK)
            journal.add(4, "cut.pt", len(content))
            proxy.reset_next(2, when="body", after=20 * S3_CHUNK + 5000, match="/ckpts/cut.pt ")
            with caplog.at_level(logging.WARNING, logger="burstfs"):
                assert await svc.ensure_local(4, 0, len(content)) == len(content)
            assert proxy.injected == 2 and gets_of(proxy, "cut.pt") == 3
            assert svc.fetched_bytes == len(content)  # resumed where the bytes stopped landing, never from 0
            resumed = [line for line in caplog.text.splitlines() if "event=stream_resumed key=cut.pt" in line]
            # Resumed from where its bytes stopped landing (the first cut may come before any did).
            assert len(resumed) == 2 and "offset=0 " not in resumed[1]
        assert svc.tier.path(4).read_bytes() == content

    run_async(body)


def test_a_stream_that_goes_silent_after_a_cut_fails_its_read_and_frees_its_slot_within_the_stall_bound(
    tmp_path: Path, s3_env: str, proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall bound runs from the last byte that landed, across resumes: a stream cut
    mid-body whose resumed GET hangs gives up after READ_STALL_S of silence, not after a
    read timeout per attempt (a black-holed prefetch failed 41 s after its last byte, its
    message saying 30 s)."""
    from burstfs.restore import state as restore_state
    from burstfs.restore import stream as restore_stream

    stall = 1.5
    for module in (restore_service, restore_state, restore_stream):
        monkeypatch.setattr(module, "READ_STALL_S", stall, raising=False)
    journal = FakeJournal()
    content = os.urandom(40 << 20)  # the cut comes after more than socket buffers hold: after the black hole

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            await put_with_manifest(svc.store, "hang.pt", content, S3_CHUNK)
            journal.add(9, "hang.pt", len(content))
            proxy.reset_next(1, when="body", after=24 << 20, match="/ckpts/hang.pt ")
            assert await svc.ensure_local(9, 0, 100) == S3_CHUNK  # the stream is open, waiting for its reader
            proxy.blackhole()  # the resumed GET (and any ranged one) is never answered
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RemoteError, match="sent nothing for"):
                await svc.ensure_local(9, 0, len(content))
            assert loop.time() - started < stall + 3.0  # S3's read timeout here is 20 s
            for _ in range(60):
                if svc.streams.active == 0:
                    break
                await asyncio.sleep(0.05)
            assert svc.streams.active == 0  # the stream gave up too: its slot is free, its GET closed
            assert S3_CHUNK < svc.fetched_bytes < len(content)  # it landed bytes before it went silent
            proxy.resume()

    run_async(body)


def test_a_stream_left_by_its_reader_ends_and_a_later_read_starts_another(
    tmp_path: Path, s3_env: str, proxy: FaultProxy
) -> None:
    journal = FakeJournal()
    content = os.urandom(16 * S3_CHUNK)

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            svc.streams.idle_s, svc.streams.max_streams = 60.0, 1  # no idle end before the ranged read below
            await put_with_manifest(svc.store, "idle.pt", content, S3_CHUNK)
            await put_with_manifest(svc.store, "other.pt", content, S3_CHUNK)
            journal.add(5, "idle.pt", len(content))
            journal.add(6, "other.pt", len(content))
            assert await svc.ensure_local(5, 0, 100) == S3_CHUNK  # a header read: the stream lands one chunk, waits
            assert svc.streams.active == 1
            assert await svc.ensure_local(6, 0, 2 * S3_CHUNK) == 2 * S3_CHUNK  # no stream slot left: ranged
            assert gets_of(proxy, "other.pt") == 1  # both chunks in one ranged GET, each verified
            svc.streams.idle_s = 0.2
            waiting = svc._files[5].stream
            assert waiting is not None
            waiting.moved.set()  # the stream waits again, now with the short idle bound
            for _ in range(100):
                if svc.streams.active == 0:
                    break
                await asyncio.sleep(0.05)
            assert svc.streams.active == 0 and svc._files[5].stream is None  # idle: ended, its slot given back
            assert await svc.ensure_local(5, S3_CHUNK, len(content)) == len(content)  # the reader is back
            assert gets_of(proxy, "idle.pt") == 2
        assert svc.tier.path(5).read_bytes() == content

    run_async(body)


@pytest.mark.parametrize("journal_has", ["chunk digests", "whole digest only"])
def test_a_streamed_object_without_manifest_is_verified_against_journal_digests(
    tmp_path: Path, s3_env: str, proxy: FaultProxy, journal_has: str
) -> None:
    journal = FakeJournal()
    content = os.urandom(10 * S3_CHUNK + 17)
    chunks = chunk_digests(content, S3_CHUNK) if journal_has == "chunk digests" else None
    swapped = bytearray(content)
    swapped[6 * S3_CHUNK + 9] ^= 0x01

    async def body() -> None:
        async with s3_service(s3_env, proxy, journal, tmp_path) as svc:
            journal.add(8, "bare.pt", len(content), xxhash.xxh3_128_hexdigest(content), S3_CHUNK, chunks)  # no manifest
            await svc.store.remote.put_object("bare.pt", bytes(swapped))
            bad = f"{6 * S3_CHUNK}-{7 * S3_CHUNK}" if chunks is not None else f"0-{len(content)}"
            with pytest.raises(CorruptDataError, match=f"bare.pt: bytes {bad} do not match"):
                await svc.ensure_local(8, 0, len(content))
            # A chunk that does not match its journaled digest is streamed once more first.
            assert gets_of(proxy, "bare.pt") == (2 if chunks is not None else 1) and journal.updates == []
            if chunks is not None:
                assert 6 not in svc._files[8].present and set(range(6)) <= svc._files[8].present
            await svc.store.remote.put_object("bare.pt", content)  # repaired
            assert await svc.ensure_local(8, 0, len(content)) == len(content)
        assert svc.tier.path(8).read_bytes() == content

    run_async(body)


@fuse
@pytest.mark.parametrize("data_path", sorted(DATA_PATHS))
def test_a_file_restored_by_reading_then_evicted_is_fetched_again_in_full(
    tmp_path: Path, mounted_factory: type[MountedFS], data_path: str
) -> None:
    """Files restored by reading them (the kernel's readahead still asking as the last chunk
    landed), evicted, read again: the same bytes, and a write into one drains the whole file.
    A fetch left over from the first restore claimed the new copy's chunks were here: reads
    gave nothing (passthrough: 0 bytes, SIGBUS under mmap) or zeros, and a 4-byte patch
    drained as a 4-byte object over the checkpoint."""
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    writer = mounted_factory("writer", url)  # type: ignore[call-arg]
    writer.mount()
    files = {f"step/f{i}.bin": os.urandom(i * 16 * MiB + 123) for i in range(1, 5)}
    for path, content in files.items():
        (writer.path / path).parent.mkdir(exist_ok=True)
        (writer.path / path).write_bytes(content)
    subprocess.run([str(BIN / "burstfs-admin"), "wait", str(writer.path)], check=True, capture_output=True, timeout=120)
    writer.unmount()
    reader = mounted_factory("reader", url, DATA_PATHS[data_path])  # type: ignore[call-arg]
    reader.mount()
    for path, content in files.items():
        assert (reader.path / path).read_bytes() == content
    subprocess.run([str(BIN / "burstfs-admin"), "evict", str(reader.path)], check=True, capture_output=True, timeout=60)
    assert {file_state(reader.cache, f"f{i}.bin") for i in range(1, 5)} == {"evicted"}
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    for path, content in files.items():
        assert (reader.path / path).read_bytes() == content, path
    subprocess.run([str(BIN / "burstfs-admin"), "evict", str(reader.path)], check=True, capture_output=True, timeout=60)
    for path in files:
        fd = os.open(reader.path / path, os.O_RDWR)
        try:
            os.pwrite(fd, b"PTCH", 0)
        finally:
            os.close(fd)
    subprocess.run([str(BIN / "burstfs-admin"), "wait", str(reader.path)], check=True, capture_output=True, timeout=120)
    for path, content in files.items():
        assert (tmp_path / "remote" / path).read_bytes() == b"PTCH" + content[4:], path


@fuse
def test_a_file_larger_than_the_cache_size_is_refused_at_once_with_a_clear_error(
    tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """A restore node with --cache-size smaller than a file: the read fails at once with ENOSPC
    that names --cache-size (it waited twice --full-timeout for a drain that had nothing to do,
    then blamed "data not yet durable")."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    reader = drained_then_reader(mounted_factory, url, {"big.bin": os.urandom(24 * MiB)}, (), ("--cache-size", "8M"))
    reader.expect_log("event=request_failed")
    reading = f"open({str(reader.path / 'big.bin')!r}, 'rb').read(4096)"
    try:
        result = subprocess.run([sys.executable, "-c", reading], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the read waited for a drain that has nothing to free") from None
    assert "No space left on device" in result.stderr, result.stderr
    assert "event=tier_too_small" in reader.log_text() and "raise --cache-size" in reader.log_text()


def test_a_read_arriving_just_after_the_fetch_completed_fetches_nothing_again(tmp_path: Path) -> None:
    """A kernel readahead asked before the first read's answer marked the file local: it
    arrived once the fetch had completed and opened a second fetch of the whole file, which
    got the chunks it asked for again (and kept a descriptor until the file was evicted)."""
    journal = FakeJournal()
    svc = service(tmp_path, journal)
    content = os.urandom(8 * CHUNK)

    async def body() -> None:
        await put_with_manifest(svc.store, "done", content)
        journal.add(7, "done", len(content))
        assert await svc.ensure_local(7, 0, len(content)) == len(content)
        fetched = svc.fetched_bytes
        assert await svc.ensure_local(7, 6 * CHUNK, 2 * CHUNK) == len(content)  # the late readahead
        await settle(svc)
        assert svc.fetched_bytes == fetched and not svc._files and svc.open_fds == 0
        svc.forget(7)  # evicted: the next read fetches again
        assert await svc.ensure_local(7, 6 * CHUNK, 2 * CHUNK) < len(content)
        await settle(svc)
        assert svc.fetched_bytes > fetched
        await svc.aclose()

    run_async(body)
    assert svc.tier.path(7).read_bytes()[: 8 * CHUNK] == content


@fuse
def test_a_directory_no_listing_reached_yet_is_listed_before_a_rename_or_rmdir(
    tmp_path: Path, mounted_factory: type[MountedFS]
) -> None:
    """A fresh cache over a filled remote; d and d/sub were never opened here.  `mv d d2`
    returned 0 but moved nothing (d2 empty, d back at the next listing, the objects never
    moved), and `rmdir d` passed a directory the remote fills."""
    (tmp_path / "remote").mkdir()
    url = f"file://{tmp_path / 'remote'}"
    writer = mounted_factory("w", url)  # type: ignore[call-arg]
    writer.mount()
    (writer.path / "d/sub").mkdir(parents=True)
    (writer.path / "d/x").write_bytes(b"x" * 5000)
    (writer.path / "d/sub/y").write_bytes(b"y" * 7000)
    (writer.path / "e/sub").mkdir(parents=True)
    (writer.path / "e/sub/z").write_bytes(b"z" * 3000)
    wait_for(lambda: drained(writer, "x", "y", "z"), what="drain")
    writer.unmount()
    reader = mounted_factory("r", url)  # type: ignore[call-arg]
    reader.mount()
    assert sorted(os.listdir(reader.path)) == ["d", "e"]  # d, e known only from the root's listing
    with pytest.raises(OSError) as err:
        os.rmdir(reader.path / "e")
    assert err.value.errno == errno.ENOTEMPTY
    (reader.path / "empty").mkdir()
    os.rename(reader.path / "d", reader.path / "d2")
    assert (reader.path / "d2/x").read_bytes() == b"x" * 5000
    assert (reader.path / "d2/sub/y").read_bytes() == b"y" * 7000
    subprocess.run([str(BIN / "burstfs-admin"), "wait", str(reader.path)], check=True, capture_output=True, timeout=60)
    assert (tmp_path / "remote/d2/sub/y").read_bytes() == b"y" * 7000
    gone = (tmp_path / "remote/d/x", tmp_path / "remote/d/sub/y")
    wait_for(lambda: not any(p.exists() for p in gone), what="the old objects deleted")
    assert sorted(os.listdir(reader.path)) == ["d2", "e", "empty"]


@fuse
def test_a_reader_keeps_reading_a_remote_file_unlinked_or_replaced_under_it(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """A file read from the remote stays readable through an open descriptor after its name is
    unlinked or replaced (os.replace), as on a local file system: its object stays until the
    copy is whole here or the reader closes, and what replaced it still drains meanwhile.
    Before, the unlink queued the object's delete and cleared its key: the next read was EIO."""
    files = {"gone.bin": os.urandom(3 * MiB + 7), "swapped.bin": os.urandom(2 * MiB + 3)}
    reader = drained_then_reader(mounted_factory, remote.url, files, remote.extra_args, remote.extra_args)
    gone = open(reader.path / "gone.bin", "rb")  # noqa: SIM115 (held across the unlink)
    swapped = open(reader.path / "swapped.bin", "rb")  # noqa: SIM115
    try:
        assert gone.read(4096) == files["gone.bin"][:4096]  # fetched in part only
        os.unlink(reader.path / "gone.bin")
        (reader.path / "tmp").write_bytes(b"the new version")
        os.replace(reader.path / "tmp", reader.path / "swapped.bin")
        # The replacement drains while the old file is still open (fetched whole meanwhile).
        subprocess.run(
            [str(BIN / "burstfs-admin"), "wait", "--timeout", "60", str(reader.path)],
            check=True,
            capture_output=True,
            timeout=90,
        )
        assert remote.read("swapped.bin") == b"the new version"
        assert gone.read() == files["gone.bin"][4096:]
        assert swapped.read() == files["swapped.bin"]
    finally:
        gone.close()
        swapped.close()
    wait_for(lambda: remote.read("gone.bin") is None, what="the unlinked file's object deleted after its close")
    assert not (reader.path / "gone.bin").exists()
    assert (reader.path / "swapped.bin").read_bytes() == b"the new version"
    assert "event=request_failed" not in reader.log_text()

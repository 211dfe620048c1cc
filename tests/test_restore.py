"""Restore through a real mount: a second node's view, verified fetches, eviction, backpressure."""

from __future__ import annotations

import errno
import multiprocessing
import os
import subprocess

import pytest
from conftest import BIN, MountedFS, RemoteTarget, file_state, wait_for

pytestmark = pytest.mark.fuse

MiB = 1 << 20


def drained(fs: MountedFS, *names: str) -> bool:
    return all(file_state(fs.cache, name) == "durable" for name in names)


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
    assert os.stat(data_file).st_blocks * 512 < 20 * MiB  # sparse: only touched chunks are local
    assert (reader.path / "big.safetensors").read_bytes() == content


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


def test_objects_from_other_tools_are_served_unverified(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    remote.write("foreign/weights.bin", b"written by aws s3 cp" * 1000)
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    assert (reader.path / "foreign/weights.bin").read_bytes() == b"written by aws s3 cp" * 1000
    assert "event=unverified_object key=foreign/weights.bin" in reader.log_text()


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
        assert (reader.path / f"shards/rank{rank}.bin").read_bytes() == (writer.path / f"shards/rank{rank}.bin").read_bytes()


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
    with pytest.raises(OSError) as err:
        with open(fs.path / "second.bin", "wb") as f:
            f.write(os.urandom(8 * MiB))
    assert err.value.errno == errno.ENOSPC
    assert (fs.path / "first.bin").read_bytes() == first  # undrained data is never evicted
    remote.proxy.clear()


def test_admin_prefetch_warms_a_checkpoint(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    writer = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    write_checkpoint(writer)
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    result = subprocess.run([str(BIN / "burstfs-admin"), "prefetch", str(reader.path / "run")],
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert file_state(reader.cache, "model.pt") == "durable"
    assert file_state(reader.cache, "optim.pt") == "durable"


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

"""Prefetch planned from a checkpoint's index (burstfs/readplans.py).

What an index names (pure), and through real mounts on a second node: a reader
walking the shards an index names finds the next ones fetched, while ranks that
open their own shards side by side trigger nothing.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, MountedFS, RemoteTarget, wait_for

from burstfs.checkpointindex import index_kind, weight_map_files
from burstfs.nodes import Inode
from burstfs.readplans import AHEAD_FILES, Plan, dcp_files

MiB = 1 << 20
SHARDS = [f"__{rank}_0.distcp".encode() for rank in range(8)]


def test_index_kinds() -> None:
    assert index_kind(b".metadata") == "dcp"
    assert index_kind(b"model.safetensors.index.json") == "weight_map"
    assert index_kind(b"pytorch_model.bin.index.json") == "weight_map"
    assert index_kind(b"model.safetensors") is None
    assert index_kind(b"metadata") is None


def test_a_dcp_checkpoint_is_its_directorys_distcp_files_in_rank_order() -> None:
    names = [b"__10_0.distcp", b".metadata", b"__2_1.distcp", b"notes.txt", b"__2_0.distcp", b"__0_0.distcp"]
    assert dcp_files(names) == [b"__0_0.distcp", b"__2_0.distcp", b"__2_1.distcp", b"__10_0.distcp"]
    assert dcp_files([b".metadata"]) == []


def test_a_walk_step_is_an_open_of_a_planned_file_after_another_was_closed() -> None:
    index = Inode(ino=9, kind="file", mode=0o100644, uid=0, gid=0, parent=1, name=b".metadata")
    plan = Plan(index, "dcp", SHARDS[:3])
    assert not plan.walked_to(SHARDS[0])  # nothing closed yet: ranks opening side by side
    plan.closed.add(SHARDS[0])
    assert not plan.walked_to(SHARDS[0])  # the same file again (a reopen) is no step
    assert plan.walked_to(SHARDS[1]) and plan.walked_to(SHARDS[2])
    assert not plan.walked_to(b"notes.txt")  # not planned
    plan.closed.add(SHARDS[1])
    assert plan.walked_to(SHARDS[0])


def test_a_weight_map_names_its_shards_and_nothing_outside_the_directory() -> None:
    doc = {
        "metadata": {"total_size": 3},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00001-of-00002.safetensors",
            "d": "../elsewhere.safetensors",
            "e": 7,
        },
    }
    assert weight_map_files(json.dumps(doc).encode()) == [
        b"model-00001-of-00002.safetensors",
        b"model-00002-of-00002.safetensors",
    ]


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"[1, 2]", b"{", b'{"weight_map": [1]}', b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000]
)
def test_a_damaged_index_is_no_plan_and_no_error(data: bytes) -> None:
    assert weight_map_files(data) == []


#: Two sharded layouts a restore walks: (index name, shard names).
LAYOUTS = {
    "dcp": (".metadata", SHARDS),
    "weight_map": (
        "model.safetensors.index.json",
        [f"model-{r + 1:05d}-of-00008.safetensors".encode() for r in range(8)],
    ),
}


def index_bytes(kind: str) -> bytes:
    if kind == "dcp":
        return b"(a DCP .metadata: the plan takes the directory's .distcp files, not this)"
    weight_map = {f"layer{r}.weight": os.fsdecode(name) for r, name in enumerate(LAYOUTS[kind][1])}
    return json.dumps({"metadata": {"total_size": 8 * 4 * MiB}, "weight_map": weight_map}).encode()


def write_checkpoint(fs: MountedFS, kind: str = "dcp") -> dict[bytes, bytes]:
    index, names = LAYOUTS[kind]
    directory = fs.path / "ckpt" / "step5"
    directory.mkdir(parents=True)
    shards = {name: os.urandom(4 * MiB) for name in names}
    for name, content in shards.items():
        (directory / os.fsdecode(name)).write_bytes(content)
    (directory / index).write_bytes(index_bytes(kind))
    wait_for(
        lambda: all(os.getxattr(p, "user.burstfs.state") == b"durable" for p in directory.iterdir()),
        what="drain",
    )
    return shards


def states(directory: Path, names: list[bytes] = SHARDS) -> dict[bytes, str]:
    return {name: os.getxattr(directory / os.fsdecode(name), "user.burstfs.state").decode() for name in names}


@pytest.mark.fuse
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_a_reader_walking_the_shards_finds_the_next_ones_fetched(
    mounted_factory: type[MountedFS], remote: RemoteTarget, kind: str
) -> None:
    index, names = LAYOUTS[kind]
    writer = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    shards = write_checkpoint(writer, kind)
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    directory = reader.path / "ckpt" / "step5"
    assert (directory / index).read_bytes() == index_bytes(kind)
    assert set(states(directory, names).values()) == {"remote"}
    assert (directory / os.fsdecode(names[0])).read_bytes() == shards[names[0]]
    time.sleep(0.5)  # one shard read to its end and closed is not a walk yet
    assert list(states(directory, names).values()) == ["durable"] + ["remote"] * 7
    with open(directory / os.fsdecode(names[1]), "rb") as second:  # a named file opened after another closed
        ahead = names[2 : 2 + AHEAD_FILES]
        wait_for(lambda: all(states(directory, names)[n] == "durable" for n in ahead), what="the next shards")
        assert second.read() == shards[names[1]]
    assert all(states(directory, names)[n] == "remote" for n in names[2 + AHEAD_FILES :])  # no further than ahead
    for name, content in shards.items():  # every shard still reads back exactly (fetched ahead or not)
        assert (directory / os.fsdecode(name)).read_bytes() == content


@pytest.mark.fuse
def test_ranks_opening_their_own_shards_side_by_side_fetch_them_whole_and_nothing_ahead(
    mounted_factory: type[MountedFS],
) -> None:
    writer = mounted_factory("w")
    writer.mount()
    write_checkpoint(writer)
    reader = mounted_factory("r", writer.remote_url)  # type: ignore[call-arg]
    reader.mount()
    directory = reader.path / "ckpt" / "step5"
    (directory / ".metadata").read_bytes()
    with contextlib.ExitStack() as stack:  # ranks 0-3 of this node, each on its own shard
        files = [stack.enter_context(open(directory / os.fsdecode(name), "rb")) for name in SHARDS[:4]]
        for f in files:
            f.read(MiB)
        # A DCP rank reads all of its own file: each opened one comes whole (one GET from its start).
        wait_for(lambda: all(states(directory)[n] == "durable" for n in SHARDS[:4]), what="the opened shards")
    time.sleep(1.0)
    assert all(states(directory)[n] == "remote" for n in SHARDS[4:])


@pytest.mark.fuse
def test_an_open_of_a_planned_dcp_file_returns_with_it_whole_and_reads_it_through_passthrough(
    mounted_factory: type[MountedFS],
) -> None:
    """A rank reads all of its own DCP data file: its open waits for the whole file, so that
    the kernel reads it from the local tier (passthrough) instead of asking the daemon for
    every MiB.  A file no plan names is opened at once and fetched as it is read."""
    writer = mounted_factory("w")
    writer.mount()
    shards = write_checkpoint(writer)
    notes = os.urandom(2 * MiB)
    (writer.path / "ckpt" / "step5" / "notes.bin").write_bytes(notes)
    wait_for(lambda: os.getxattr(writer.path / "ckpt" / "step5" / "notes.bin", "user.burstfs.state") == b"durable")
    reader = mounted_factory("r", writer.remote_url)  # type: ignore[call-arg]
    reader.mount()
    directory = reader.path / "ckpt" / "step5"
    (directory / ".metadata").read_bytes()
    wait_for(lambda: "event=read_plan " in reader.log_text(), what="the plan")
    with open(directory / os.fsdecode(SHARDS[5]), "rb") as shard:
        assert states(directory, [SHARDS[5]]) == {SHARDS[5]: "durable"}  # whole before its first read
        assert shard.read() == shards[SHARDS[5]]
    assert "event=open_whole_fetched" in reader.log_text()
    with open(directory / "notes.bin", "rb") as other:
        assert os.getxattr(directory / "notes.bin", "user.burstfs.state") == b"remote"
        assert other.read() == notes


@pytest.mark.fuse
def test_a_corrupt_shard_fetched_ahead_fails_only_its_own_read(mounted_factory: type[MountedFS]) -> None:
    writer = mounted_factory("w")
    writer.mount()
    shards = write_checkpoint(writer)
    bad = SHARDS[3]
    object_path = writer.remote_dir / "ckpt" / "step5" / os.fsdecode(bad)
    flipped = bytearray(object_path.read_bytes())
    flipped[MiB + 5] ^= 0xFF
    object_path.write_bytes(bytes(flipped))
    reader = mounted_factory("r", writer.remote_url)  # type: ignore[call-arg]
    reader.mount()
    reader.expect_log("checksum")
    reader.expect_log("read_plan_fetch_failed")
    reader.expect_log("request_failed")
    directory = reader.path / "ckpt" / "step5"
    (directory / ".metadata").read_bytes()
    assert (directory / os.fsdecode(SHARDS[0])).read_bytes() == shards[SHARDS[0]]
    assert (directory / os.fsdecode(SHARDS[1])).read_bytes() == shards[SHARDS[1]]  # the walk: 2-5 fetched ahead
    wait_for(lambda: "event=read_plan_fetch_failed" in reader.log_text(), what="the planned fetch of the bad shard")
    # fetched ahead beside the bad one (which may fail first: they run at once)
    wait_for(lambda: states(directory)[SHARDS[2]] == "durable", what="shard 2 fetched ahead")
    with pytest.raises(OSError) as err:  # its reader gets the error, never the flipped byte
        (directory / os.fsdecode(bad)).read_bytes()
    assert err.value.errno == errno.EIO
    for name in SHARDS[4:]:  # the mount and the walk go on
        assert (directory / os.fsdecode(name)).read_bytes() == shards[name]

    # status lists the failed read (it was only in the log), and calls it no outage of the remote
    def listed() -> dict[str, Any] | None:
        result = subprocess.run([str(BIN / "burstfs-admin"), "status", str(reader.path), "--json"], capture_output=True)
        drain = dict(json.loads(result.stdout)["drain"])
        return drain if any(e["kind"] == "corrupt_read" for e in drain["recent_errors"]) else None

    drain = wait_for(listed, timeout=10, what="the failed read in status")
    assert any(os.fsdecode(bad) in e["message"] for e in drain["recent_errors"]), drain
    assert drain["outage"] is None, drain


@pytest.mark.fuse
def test_dcp_load_in_one_process_restores_through_a_planned_walk(mounted_factory: type[MountedFS]) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    state = {f"layer{i}.weight": torch.randn(256 * 1024) for i in range(8)}
    writer = mounted_factory("w")
    writer.mount()
    directory = writer.path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory), thread_count=4))
    names = sorted(p.name for p in directory.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp", "__0_3.distcp"]
    wait_for(lambda: all(os.getxattr(directory / n, "user.burstfs.state") == b"durable" for n in names), what="drain")
    reader = mounted_factory("r", writer.remote_url)  # type: ignore[call-arg]
    reader.mount()
    loaded = {name: torch.zeros_like(t) for name, t in state.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(str(reader.path / "dcp")))
    assert all(torch.equal(loaded[name], state[name]) for name in state)
    assert "event=read_plan " in reader.log_text() and "kind=dcp files=4" in reader.log_text()


@pytest.mark.fuse
def test_files_rewritten_or_unlinked_while_fetched_ahead_keep_their_new_state(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    if remote.proxy is None:
        pytest.skip("needs the fault proxy to hold the planned fetches")
    writer = mounted_factory("w", remote.url, remote.extra_args)  # type: ignore[call-arg]
    writer.mount()
    shards = write_checkpoint(writer)
    reader = mounted_factory("r", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    directory = reader.path / "ckpt" / "step5"
    (directory / ".metadata").read_bytes()
    assert (directory / os.fsdecode(SHARDS[0])).read_bytes() == shards[SHARDS[0]]
    rewritten, removed = SHARDS[3], SHARDS[4]
    for name in (rewritten, removed):  # their fetches ahead wait at the proxy
        remote.proxy.delay_next(2, 1.5, match=os.fsdecode(name))
    with open(directory / os.fsdecode(SHARDS[1]), "rb") as walker:  # the walk step: 1-5 fetched ahead
        time.sleep(0.3)
        (directory / os.fsdecode(rewritten)).write_bytes(b"new bytes")  # O_TRUNC: emptied, not fetched
        os.unlink(directory / os.fsdecode(removed))
        assert walker.read() == shards[SHARDS[1]]
    time.sleep(2.0)  # the held fetches come back
    assert (directory / os.fsdecode(rewritten)).read_bytes() == b"new bytes"
    assert not (directory / os.fsdecode(removed)).exists()
    for name in (SHARDS[2], SHARDS[5], SHARDS[6], SHARDS[7]):
        assert (directory / os.fsdecode(name)).read_bytes() == shards[name]
    wait_for(lambda: states(directory, [rewritten]) == {rewritten: "durable"}, what="the rewrite drained")
    remote.proxy.clear()

"""Many nodes, one checkpoint: real mounts with separate caches over one moto prefix.

Node 1's drain is held back with ``--drain-delay`` (released with ``burstfs-admin
drain --now``), so the test decides when its shards become durable; the remote is
read with boto3 behind burstfs' back.  Nothing is asserted on timing: the checks
are on what the remote holds while a node's shards are known to be staged.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import BIN, FUSE_OK, MountedFS, burstfs, journal_rows, wait_for
from s3server import fresh_bucket

from burstfs.remote.base import manifest_key

pytestmark = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")

ADMIN = str(BIN / "burstfs-admin")
HELD = ("--drain-delay", "3600")


def admin(*args: str | Path, expect: int | None = 0, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([ADMIN, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if expect is not None and result.returncode != expect:
        raise AssertionError(
            f"burstfs-admin {' '.join(map(str, args))}: exit {result.returncode}, {result.stdout} {result.stderr}"
        )
    return result


class Bucket:
    def __init__(self, endpoint: str) -> None:
        import boto3

        self.endpoint = endpoint
        self.name = fresh_bucket(endpoint)
        self.url = f"s3://{self.name}/job"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")

    def keys(self) -> set[str]:
        found = set()
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix="job/"):
            found.update(obj["Key"][len("job/") :] for obj in page.get("Contents", []))
        return found

    def latest(self, subdir: str = "", expect: int | None = 0) -> dict[str, object]:
        result = admin("latest", "--remote", self.url, "--endpoint-url", self.endpoint, "--json", subdir, expect=expect)
        doc: dict[str, object] = json.loads(result.stdout)
        return doc


@pytest.fixture
def bucket(s3_env: str) -> Bucket:
    return Bucket(s3_env)


def node(factory: type[MountedFS], bucket: Bucket, name: str, *args: str) -> MountedFS:
    fs = factory(name, bucket.url, ("--endpoint-url", bucket.endpoint, "--node-id", name, *args))  # type: ignore[call-arg]
    fs.mount()
    return fs


def write(fs: MountedFS, path: str, data: bytes) -> None:
    target = fs.path / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def state(fs: MountedFS, path: str) -> str | None:
    """The journal state of ``path`` on ``fs`` (by its parent directory and name)."""
    dir_key, _, name = path.rpartition("/")
    rows = journal_rows(fs.cache, "SELECT ino, parent, state FROM inodes WHERE name=? AND parent!=0", (name.encode(),))
    for _ino, parent, row_state in rows:
        parents = journal_rows(fs.cache, "SELECT name FROM inodes WHERE ino=?", (parent,))
        if parents and parents[0][0].decode() == dir_key.rpartition("/")[2]:
            return str(row_state)
    return None


def shard(step: int, rank: int) -> bytes:
    return os.urandom(64) + f"step {step} rank {rank}".encode() * 5000


def test_marker_appears_only_after_every_node_shards_are_durable(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", *HELD)
    step = "ckpt/step_100"
    shards = {f"{step}/__{rank}_0.distcp": shard(100, rank) for rank in range(4)}
    for rank, (path, data) in enumerate(shards.items()):
        write(n0 if rank < 2 else n1, path, data)
    admin("wait", n0.path / step / "__0_0.distcp", n0.path / step / "__1_0.distcp")
    write(n0, f"{step}/.metadata", b"metadata of step 100")
    # n0's gate has looked at the remote and found n1's intent without a done:
    status = wait_for(
        lambda: json.loads(admin("status", n0.path, "--json").stdout).get("checkpoints_waiting"),
        what="n0's marker to wait for n1",
    )
    assert [w["node"] for w in status[0]["waiting"]] == ["n1"] and status[0]["dir"] == step
    assert "waiting for node n1" in admin("status", n0.path).stdout
    # The held marker drains when n1 is done, not at a rate: no ETA ("ETA 0ms" before).
    assert json.loads(admin("status", n0.path, "--json").stdout)["drain"]["eta_s"] is None
    assert {state(n1, p) for p in list(shards)[2:]} == {"staged"}
    keys = bucket.keys()
    assert f"{step}/.metadata" not in keys and set(list(shards)[:2]) <= keys
    assert bucket.latest("ckpt", expect=1)["dir"] is None

    admin("drain", n1.path, "--now")

    def check_and_find_marker() -> bool:
        keys = bucket.keys()
        if f"{step}/.metadata" in keys:  # never before all four shards are there
            assert set(shards) <= keys, sorted(keys)
            return True
        return False

    wait_for(check_and_find_marker, interval=0.01, what="the marker on the remote")
    found = wait_for(lambda: bucket.latest("ckpt", expect=None).get("dir"), what="latest")
    assert found == step
    for path, data in shards.items():
        assert bucket.client.get_object(Bucket=bucket.name, Key=f"job/{path}")["Body"].read() == data
    assert admin("latest", n0.path / "ckpt").stdout.strip() == str(n0.path / step)
    from burstfs import client

    assert client.latest(n1.path / "ckpt") == n1.path / step
    assert client.latest("ckpt", remote=bucket.url, endpoint_url=bucket.endpoint) == Path(step)
    assert client.latest("other", remote=bucket.url, endpoint_url=bucket.endpoint) is None


def _n0_marker_waits_for_n1(bucket: Bucket, n0: MountedFS, step: str, number: int) -> None:
    """n0 writes its shard and the step's marker: the marker waits for n1 (status says so)."""
    write(n0, f"{step}/__0_0.distcp", shard(number, 0))
    admin("wait", n0.path / step / "__0_0.distcp")
    write(n0, f"{step}/.metadata", f"metadata of step {number}".encode())
    status = wait_for(
        lambda: json.loads(admin("status", n0.path, "--json").stdout).get("checkpoints_waiting"),
        what="n0's marker to wait for n1",
    )
    assert [w["node"] for w in status[0]["waiting"]] == ["n1"]
    assert f"{step}/.metadata" not in bucket.keys()
    assert bucket.latest("ckpt", expect=1)["dir"] is None


def _release_n1_and_find_its_shard_under_the_marker(bucket: Bucket, n1: MountedFS, step: str, mine: bytes) -> None:
    """Drain n1's held shard: the marker reaches the remote only with it there, then latest names the step."""
    admin("drain", n1.path, "--now")

    def check_and_find_marker() -> bool:
        keys = bucket.keys()
        if f"{step}/.metadata" in keys:
            assert f"{step}/__1_0.distcp" in keys, sorted(keys)
            return True
        return False

    wait_for(check_and_find_marker, interval=0.01, what="the marker on the remote")
    assert wait_for(lambda: bucket.latest("ckpt", expect=None).get("dir"), what="latest") == step
    assert bucket.client.get_object(Bucket=bucket.name, Key=f"job/{step}/__1_0.distcp")["Body"].read() == mine


@pytest.mark.parametrize("moved", ["file", "directory"])
def test_shards_renamed_into_the_checkpoint_hold_its_marker_back(
    mounted_factory: type[MountedFS], bucket: Bucket, moved: str
) -> None:
    """The atomic-write pattern: n1 writes its shard elsewhere and renames it into the step
    (a file from a staging directory, or its temp directory renamed to the step's name).
    The moved shard joins n1's round in the step: n0's marker waits for it."""
    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", *HELD)
    step = "ckpt/step_200"
    mine = shard(200, 1)
    if moved == "file":
        write(n1, "staging/__1_0.distcp", mine)
        (n1.path / step).mkdir(parents=True)
        os.rename(n1.path / "staging/__1_0.distcp", n1.path / step / "__1_0.distcp")
    else:
        write(n1, "ckpt/tmp_step_200/__1_0.distcp", mine)
        os.rename(n1.path / "ckpt/tmp_step_200", n1.path / step)
    _n0_marker_waits_for_n1(bucket, n0, step, 200)

    _release_n1_and_find_its_shard_under_the_marker(bucket, n1, step, mine)


def test_a_shard_synced_before_its_close_holds_the_marker_its_round_was_done_without(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """DCP's writer fsyncs each shard before closing it.  n1's round in the step, opened with
    the shard, is done (with no file) while the shard is still being written; the fsync
    journals the shard, so its close had nothing left to publish and, before, joined no round:
    n0's marker went out over a shard n1 had not drained (a fresh node's load failed)."""
    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", *HELD)
    step = "ckpt/step_300"
    mine = shard(300, 1)
    (n1.path / step).mkdir(parents=True)
    fd = os.open(n1.path / step / "__1_0.distcp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, mine[: len(mine) // 2])
        wait_for(
            lambda: any(k.startswith(f".burstfs/groups/{step}/n1@") and k.endswith(".done") for k in bucket.keys()),
            what="n1's round done while its shard is open",
        )
        os.write(fd, mine[len(mine) // 2 :])
        os.fsync(fd)
    finally:
        os.close(fd)
    _n0_marker_waits_for_n1(bucket, n0, step, 300)

    _release_n1_and_find_its_shard_under_the_marker(bucket, n1, step, mine)


def test_pruning_a_checkpoint_deletes_the_shards_other_nodes_drained_since_it_was_listed(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Rank 0 prunes step 1 seconds after writing it: n1's shard landed after n0 last listed
    step 1 (well within --list-ttl). It goes too: left on the remote, it would bring the
    deleted step back on every node."""
    from burstfs.retention import checkpoints_in, prune_checkpoints

    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", *HELD)
    for step in (1, 2, 3):
        write(n1, f"run/step_{step}/__1_0.distcp", shard(step, 1))
        write(n0, f"run/step_{step}/__0_0.distcp", shard(step, 0))
        admin("wait", n0.path / f"run/step_{step}/__0_0.distcp")
        write(n0, f"run/step_{step}/.metadata", b"metadata")
        admin("drain", n1.path, "--now")
        wait_for(lambda step=step: bucket.latest("run", expect=None).get("dir") == f"run/step_{step}", what="commit")
    assert "run/step_1/__1_0.distcp" in bucket.keys()
    deleted = prune_checkpoints(checkpoints_in(n0.path / "run", "step_*"), keep_last=2)
    assert deleted == [n0.path / "run/step_1"]
    wait_for(lambda: not any(k.startswith("run/step_1/") for k in bucket.keys()), what="step 1 gone from the remote")
    assert {k for k in bucket.keys() if k.startswith("run/step_3/")} >= {"run/step_3/__1_0.distcp"}


def test_removing_a_committed_checkpoint_deletes_its_marker_on_the_remote_first(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """``rm -r`` of a step (readdir order: the shards, then the marker written last) and
    keep-last-N both delete the step's marker on the remote before any of its shards: a daemon
    killed part-way through leaves no marker over a torn step for ``latest`` and other nodes."""
    from burstfs.retention import checkpoints_in, prune_checkpoints

    n0 = node(mounted_factory, bucket, "n0")
    for step in (1, 2, 3):
        for rank in range(3):
            write(n0, f"run/step_{step}/__{rank}_0.distcp", shard(step, rank))
        write(n0, f"run/step_{step}/.metadata", b"metadata")
        admin("wait", n0.path / f"run/step_{step}")
    wait_for(lambda: bucket.latest("run", expect=None).get("dir") == "run/step_3", what="step 3's commit")
    subprocess.run(["rm", "-r", str(n0.path / "run/step_3")], check=True)
    assert prune_checkpoints(checkpoints_in(n0.path / "run", "step_*"), keep_last=1) == [n0.path / "run/step_1"]
    admin("wait", n0.path, "--timeout", "60")
    deletes = re.findall(r"event=remote_delete key=run/(step_\d)/(\S+)", n0.log_text())
    for step in ("step_1", "step_3"):
        names = [name for deleted, name in deletes if deleted == step]
        assert names[0] == ".metadata" and sorted(names[1:]) == [f"__{r}_0.distcp" for r in range(3)], deletes
    assert bucket.latest("run")["dir"] == "run/step_2"


def test_keep_last_n_on_a_second_node_never_deletes_the_newest_complete_checkpoint(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """n0 pruned step 1; then rank 0 came back on n1 and pruned with keep-last-1.  n1 ordered
    the steps by mtime: step 1, emptied here by the merge that dropped its files, looked the
    newest and counted as durable, so n1 deleted steps 3 and 2 and kept the empty one.  A step
    without its marker (abandoned) did not hold a newer place either."""
    from burstfs.retention import checkpoints_in, prune_checkpoints

    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "0")
    for step in (1, 2, 3):
        write(n1, f"run/step_{step}/__1_0.distcp", shard(step, 1))
        write(n0, f"run/step_{step}/__0_0.distcp", shard(step, 0))
        admin("wait", n1.path / f"run/step_{step}")
        write(n0, f"run/step_{step}/.metadata", b"metadata")
        admin("wait", n0.path / f"run/step_{step}", "--timeout", "60")
    write(n1, "run/step_4/__1_0.distcp", shard(4, 1))  # no marker: abandoned
    admin("wait", n1.path / "run/step_4")
    assert sorted(os.listdir(n1.path / "run")) == ["step_1", "step_2", "step_3", "step_4"]
    assert prune_checkpoints(checkpoints_in(n0.path / "run", "step_*"), keep_last=2) == [n0.path / "run/step_1"]
    wait_for(lambda: not any(k.startswith("run/step_1/") for k in bucket.keys()), what="step 1 gone from the remote")
    # The merge drops n0's shard and n1's own: an empty directory here, which the next listing
    # of run/ drops too (it may have by the time n1 prunes).
    with contextlib.suppress(FileNotFoundError):
        os.listdir(n1.path / "run/step_1")
    deleted = prune_checkpoints(checkpoints_in(n1.path / "run", "step_*"), keep_last=1)
    assert set(deleted) - {n1.path / "run/step_1"} == {n1.path / "run/step_2"}
    assert not (n1.path / "run/step_1").exists()
    assert bucket.latest("run")["dir"] == "run/step_3"
    assert {"run/step_3/.metadata", "run/step_3/__0_0.distcp", "run/step_3/__1_0.distcp"} <= bucket.keys()


def test_the_step_latest_names_opens_at_once_through_the_same_mount(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """A restart on n1 asks for the step n0 published after n1 last listed ``run`` (well within
    ``--list-ttl``): the step ``latest`` names opens at once through n1's mount, whether it asked
    ``burstfs-admin latest`` or the ``user.burstfs.latest`` attribute (a DCP resume got ENOENT)."""
    n0 = node(mounted_factory, bucket, "n0")
    written: dict[int, bytes] = {}

    def publish(step: int) -> None:
        written[step] = shard(step, 0)
        write(n0, f"run/step_{step}/__0_0.distcp", written[step])
        write(n0, f"run/step_{step}/.metadata", f"metadata {step}".encode())
        admin("wait", n0.path / f"run/step_{step}")
        wait_for(lambda: bucket.latest("run", expect=None).get("dir") == f"run/step_{step}", what=f"step {step}")

    publish(1)
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "3600")
    assert os.listdir(n1.path / "run") == ["step_1"]
    publish(2)
    found = Path(admin("latest", n1.path / "run").stdout.strip())
    assert found == n1.path / "run/step_2"
    assert (found / ".metadata").read_bytes() == b"metadata 2"
    assert (found / "__0_0.distcp").read_bytes() == written[2]
    publish(3)
    doc = json.loads(os.getxattr(n1.path / "run", "user.burstfs.latest"))
    assert doc["dir"] == "run/step_3"
    assert (n1.path / doc["dir"] / "__0_0.distcp").read_bytes() == written[3]
    assert sorted(os.listdir(n1.path / "run")) == ["step_1", "step_2", "step_3"]
    # A directory n0 made after n1 listed the root: latest looks on the remote (it said ENOENT,
    # exit 1: "no checkpoint", until the root's next listing), and the step opens at once.
    write(n0, "other/step_1/__0_0.distcp", written[1])
    write(n0, "other/step_1/.metadata", b"metadata of other")
    admin("wait", n0.path / "other/step_1")
    wait_for(lambda: bucket.latest("other", expect=None).get("dir") == "other/step_1", what="other's step")
    result = admin("latest", n1.path / "other")
    assert Path(result.stdout.strip()) == n1.path / "other/step_1" and not result.stderr, result.stderr
    assert (n1.path / "other/step_1/__0_0.distcp").read_bytes() == written[1]


def test_latest_of_a_megatron_run_names_the_iteration_its_tracker_names(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Megatron's layout (``iter_NNNNNNN/`` without markers, the tracker beside them): ``latest``
    is the run directory and ``step`` the iteration the tracker names, which opens at once
    through a mount that listed the run before it was written."""
    n0 = node(mounted_factory, bucket, "n0")
    written: dict[int, bytes] = {}

    def publish(iteration: int) -> None:
        written[iteration] = shard(iteration, 0)
        write(n0, f"run/iter_{iteration:07d}/mp_rank_00/model_optim_rng.pt", written[iteration])
        write(n0, "run/latest_checkpointed_iteration.txt", str(iteration).encode())
        admin("wait", n0.path / "run")

    publish(100)
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "3600")
    assert sorted(os.listdir(n1.path / "run")) == ["iter_0000100", "latest_checkpointed_iteration.txt"]
    publish(200)
    found = json.loads(admin("latest", n1.path / "run", "--json").stdout)
    assert (found["dir"], found["step"]) == ("run", "run/iter_0000200"), found
    assert (n1.path / found["step"] / "mp_rank_00/model_optim_rng.pt").read_bytes() == written[200]
    publish(300)
    doc = json.loads(os.getxattr(n1.path / "run", "user.burstfs.latest"))
    assert doc["step"] == "run/iter_0000300"
    assert (n1.path / doc["step"] / "mp_rank_00/model_optim_rng.pt").read_bytes() == written[300]


def test_a_killed_node_holds_its_checkpoint_back_and_latest_returns_the_previous(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Node 1 dies (kill -9, cache gone) before its step-200 shards drain: step 200's marker is
    never published, latest says step 100, a fresh node restores step 100 bit-exact, and an
    operator can abandon step 200."""
    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", *HELD)
    written: dict[str, bytes] = {}
    for step in (100, 200):
        for rank in range(4):
            path = f"ckpt/step_{step}/__{rank}_0.distcp"
            written[path] = shard(step, rank)
            write(n0 if rank < 2 else n1, path, written[path])
        if step == 100:
            admin("drain", n1.path, "--now")
        admin("wait", *(n0.path / f"ckpt/step_{step}/__{rank}_0.distcp" for rank in range(2)))
        write(n0, f"ckpt/step_{step}/.metadata", f"metadata {step}".encode())
        if step == 100:
            wait_for(lambda: bucket.latest("ckpt", expect=None).get("dir") == "ckpt/step_100", what="step 100")

    n1.kill()
    shutil.rmtree(n1.cache)
    wait_for(
        lambda: json.loads(admin("status", n0.path, "--json").stdout).get("checkpoints_waiting"),
        what="n0's step-200 marker to wait for the lost node",
    )
    assert "ckpt/step_200/.metadata" not in bucket.keys()
    assert bucket.latest("ckpt")["dir"] == "ckpt/step_100"

    fresh = node(mounted_factory, bucket, "n2")
    for path, data in written.items():
        if "step_100" in path:
            assert (fresh.path / path).read_bytes() == data
    assert (fresh.path / "ckpt/step_100/.metadata").read_bytes() == b"metadata 100"

    admin("abandon", n0.path / "ckpt/step_200", expect=2)  # without --yes: refused
    (n0.path / "ckpt/step_300").mkdir()  # no marker waits there: nothing to give up
    refused = admin("abandon", n0.path / "ckpt/step_300", "--yes", expect=None)
    assert refused.returncode != 0 and "no marker of this node waits" in refused.stdout + refused.stderr
    out = admin("abandon", n0.path / "ckpt/step_200", "--yes").stdout
    assert "n1" in out
    wait_for(lambda: "abandoned" in admin("status", n0.path).stdout, what="status to say abandoned")
    admin("drain", n0.path, "--now")
    # Never published, and failed: waiting for it ends (it stayed staged, and wait and
    # unmount --wait waited their whole timeout for it).
    wait_for(lambda: state(n0, "ckpt/step_200/.metadata") == "failed", what="the abandoned marker failed")
    assert "abandoned" in os.getxattr(n0.path / "ckpt/step_200/.metadata", "user.burstfs.error").decode()
    assert admin("wait", n0.path / "ckpt/step_200", "--timeout", "30", expect=None).returncode == 4
    assert "ckpt/step_200/.metadata" not in bucket.keys()
    assert bucket.latest("ckpt")["dir"] == "ckpt/step_100"
    admin("retry", n0.path)  # retried, it is given up again
    wait_for(lambda: state(n0, "ckpt/step_200/.metadata") == "failed", what="the abandoned marker failed again")
    assert "ckpt/step_200/.metadata" not in bucket.keys()
    # The next checkpoint and the `latest` pointer beside the steps go out: the abandoned
    # marker, closed before them, holds neither back (it held `latest` for good).
    write(n0, "ckpt/step_300/__0_0.distcp", shard(300, 0))
    write(n0, "ckpt/step_300/.metadata", b"metadata 300")
    write(n0, "ckpt/latest", b"step_300")
    admin("wait", n0.path / "ckpt/latest", n0.path / "ckpt/step_300", "--timeout", "60")
    assert {"ckpt/latest", "ckpt/step_300/.metadata"} <= bucket.keys()
    # Nothing waits now: status said "abandoned" for good (the `latest` marker beside the steps
    # counted as the abandoned checkpoint's), and unmount said the abandoned marker drains
    # after `burstfs-admin retry` (it never does).
    wait_for(lambda: "abandoned" not in admin("status", n0.path).stdout, what="status to stop saying abandoned")
    stopped = n0.unmount("--wait", "--wait-timeout", "60")  # the abandoned marker is no reason to refuse
    assert "failed to drain" not in stopped.stdout, stopped.stdout
    assert "1 marker of abandoned checkpoints" in stopped.stdout, stopped.stdout


SAVE_LOOP = textwrap.dedent(
    """
    import os, sys, torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    def state(step, rank):
        g = torch.Generator().manual_seed(step * 100 + rank)
        return {"shared.weight": torch.arange(1000, dtype=torch.float32) * step,
                f"rank{rank}.weight": torch.randn(256, 256, generator=g),
                f"rank{rank}.step": torch.tensor([step])}

    mounts = sys.argv[1].split(",")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mnt = mounts[rank * len(mounts) // world]  # ranks spread over the mounts (nodes)
    for step in (1, 2):
        for directory in (f"ckpt/step_{step}", "ckpt/same"):  # "same": one directory, rewritten each step
            dcp.save(state(step, rank), storage_writer=FileSystemWriter(os.path.join(mnt, directory)))
        dist.barrier()
    dist.destroy_process_group()
    os.write(1, f"saved {rank}\\n".encode())  # one write: the ranks share a pipe
    """
)

LOAD = textwrap.dedent(
    """
    import os, sys, torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    mounts, directory, step, saved_by = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mnt = mounts[rank * len(mounts) // world]
    # Every rank of this (smaller) job loads what all the saving ranks wrote: resharded.
    wanted = {"shared.weight": torch.zeros(1000)}
    for r in range(saved_by):
        wanted[f"rank{r}.weight"], wanted[f"rank{r}.step"] = torch.zeros(256, 256), torch.zeros(1, dtype=torch.int64)
    dcp.load(wanted, storage_reader=FileSystemReader(os.path.join(mnt, directory)))
    assert torch.equal(wanted["shared.weight"], torch.arange(1000, dtype=torch.float32) * step)
    for r in range(saved_by):
        g = torch.Generator().manual_seed(step * 100 + r)
        assert torch.equal(wanted[f"rank{r}.weight"], torch.randn(256, 256, generator=g)), r
        assert wanted[f"rank{r}.step"].item() == step
    dist.barrier()
    dist.destroy_process_group()
    os.write(1, f"loaded {rank}\\n".encode())  # one write: the ranks share a pipe
    """
)


def torchrun(script: str, ranks: int, *args: str, timeout: float = 300) -> list[str]:
    """Run ``script`` under torchrun (gloo, CPU) with ``ranks`` processes; their output lines."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--no-python",
            sys.executable,
            "-c",
            script,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.split("\n")


def test_dcp_loop_over_two_nodes_restored_elastically(mounted_factory: type[MountedFS], bucket: Bucket) -> None:
    """4 ranks over 2 mounts save 2 steps (each into its own directory, and again into one
    rewritten directory); 3 ranks over 2 fresh mounts load them resharded, bit-exact."""
    pytest.importorskip("torch")
    n0, n1 = node(mounted_factory, bucket, "n0"), node(mounted_factory, bucket, "n1")
    out = torchrun(SAVE_LOOP, 4, f"{n0.path},{n1.path}")
    assert sorted(line for line in out if line) == [f"saved {r}" for r in range(4)]
    for fs in (n0, n1):
        admin("wait", fs.path / "ckpt", timeout=300)
    for directory in ("ckpt/step_1", "ckpt/step_2", "ckpt/same"):
        wait_for(lambda d=directory: bucket.latest(d, expect=None).get("dir") == d, what=f"{directory} committed")
    assert bucket.latest("ckpt")["dir"] in ("ckpt/step_2", "ckpt/same")
    n2, n3 = node(mounted_factory, bucket, "n2"), node(mounted_factory, bucket, "n3")
    for directory, step in (("ckpt/same", 2), ("ckpt/step_1", 1)):
        out = torchrun(LOAD, 3, f"{n2.path},{n3.path}", directory, str(step), "4")
        assert sorted(line for line in out if line) == [f"loaded {r}" for r in range(3)]


def test_two_nodes_writing_one_name_leave_one_whole_object(mounted_factory: type[MountedFS], bucket: Bucket) -> None:
    """Both nodes write ckpt/dup/blob (multipart-sized) in one round: the remote holds one
    node's bytes, whole; a fresh node reads those bytes or EIO, never a mix."""
    n0, n1 = node(mounted_factory, bucket, "n0"), node(mounted_factory, bucket, "n1")
    ours, theirs = os.urandom(12 << 20), os.urandom(12 << 20)
    write(n0, "ckpt/dup/blob", ours)
    write(n1, "ckpt/dup/blob", theirs)
    write(n0, "ckpt/dup/.metadata", b"m")
    for fs in (n0, n1):
        admin("wait", fs.path / "ckpt", timeout=120)
    wait_for(lambda: "ckpt/dup/.metadata" in bucket.keys(), what="the marker")
    stored = bucket.client.get_object(Bucket=bucket.name, Key="job/ckpt/dup/blob")["Body"].read()
    assert stored in (ours, theirs)
    fresh = node(mounted_factory, bucket, "n2")
    fresh.expect_log("event=fetch_failed")
    fresh.expect_log("mismatch")
    try:
        assert (fresh.path / "ckpt/dup/blob").read_bytes() in (ours, theirs)
    except OSError as exc:
        assert exc.errno == errno.EIO
    doc = bucket.latest("ckpt/dup", expect=None)
    assert doc["dir"] in (None, "ckpt/dup")


def test_a_temp_directory_renamed_on_every_node_publishes_and_holds_nothing_above_it(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Each node writes its shard into ck/tmp and renames ck/tmp to ck/s1 (write to a temp
    directory, then rename).  Node 0 had listed ck/tmp, so it knew node 1's shard from the
    remote, and node 1 renamed first: node 0 must neither move node 1's object nor wait for
    it (the listed entry joined its round, the move was refused, no done ever went out, and
    every later marker above, `ck/latest`, waited for good)."""
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "0")
    n1 = node(mounted_factory, bucket, "n1")
    write(n1, "ck/tmp/__1_0.distcp", shard(1, 1))
    admin("wait", n1.path / "ck/tmp")
    write(n0, "ck/tmp/__0_0.distcp", shard(1, 0))
    assert sorted(os.listdir(n0.path / "ck/tmp")) == ["__0_0.distcp", "__1_0.distcp"]  # n1's, from the remote
    (n1.path / "ck/tmp").rename(n1.path / "ck/s1")
    admin("wait", n1.path / "ck/s1")
    write(n0, "ck/tmp/.metadata", b"metadata of s1")
    (n0.path / "ck/tmp").rename(n0.path / "ck/s1")
    write(n0, "ck/latest", b"s1")
    admin("wait", n0.path / "ck/latest", n0.path / "ck/s1/.metadata", "--timeout", "60")
    assert bucket.latest("ck")["dir"] == "ck/s1"
    assert {"ck/s1/__0_0.distcp", "ck/s1/__1_0.distcp", "ck/s1/.metadata", "ck/latest"} <= bucket.keys()
    assert "relocate" not in admin("status", n0.path).stdout


def test_a_temp_directory_renamed_onto_the_step_another_node_renamed_first_joins_it(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """n1 renamed ck/tmp to ck/s1 first, and n0 had listed ck/s1 (n1's shard in it) before
    renaming its own ck/tmp there: the rename failed with ENOTEMPTY, so n0's part never
    reached the step.  The directory held only n1's file here: it is replaced, and n1's
    shard shows up in n0's ck/s1 again from the next listing."""
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "0")
    n1 = node(mounted_factory, bucket, "n1")
    theirs = shard(1, 1)
    write(n1, "ck/tmp/__1_0.distcp", theirs)
    (n1.path / "ck/tmp").rename(n1.path / "ck/s1")
    admin("wait", n1.path / "ck/s1")
    write(n0, "ck/tmp/__0_0.distcp", shard(1, 0))
    write(n0, "ck/tmp/.metadata", b"metadata of s1")
    assert os.listdir(n0.path / "ck/s1") == ["__1_0.distcp"]
    (n0.path / "ck/tmp").rename(n0.path / "ck/s1")
    assert sorted(os.listdir(n0.path / "ck/s1")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (n0.path / "ck/s1/__1_0.distcp").read_bytes() == theirs
    admin("wait", n0.path / "ck/s1", "--timeout", "60")
    latest = bucket.latest("ck")
    assert latest["dir"] == "ck/s1", latest
    assert {"ck/s1/__0_0.distcp", "ck/s1/__1_0.distcp", "ck/s1/.metadata"} <= bucket.keys()


def test_a_published_temp_directory_renamed_on_one_node_waits_for_the_others_renames(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """The Hugging Face Trainer's tmp-checkpoint-N -> checkpoint-N, after the checkpoint was
    published in the temp directory: node 0 (the index, a commit marker) renames first.  The
    marker moved into checkpoint-8 was published there at once with node 0's shard only, and
    `latest` named checkpoint-8 while node 1's shard was still under tmp-checkpoint-8.  Now it
    waits (status names node 1) until node 1 renamed its part too."""
    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1")
    write(n1, "hf/tmp-checkpoint-8/model-00002-of-00002.safetensors", shard(8, 1))
    write(n0, "hf/tmp-checkpoint-8/model-00001-of-00002.safetensors", shard(8, 0))
    write(n0, "hf/tmp-checkpoint-8/model.safetensors.index.json", b'{"weight_map": {}}')
    admin("wait", n1.path / "hf/tmp-checkpoint-8")
    admin("wait", n0.path / "hf/tmp-checkpoint-8", "--timeout", "60")
    assert bucket.latest("hf")["dir"] == "hf/tmp-checkpoint-8"
    (n0.path / "hf/tmp-checkpoint-8").rename(n0.path / "hf/checkpoint-8")
    wait_for(
        lambda: "node n1 (had a part" in admin("status", n0.path).stdout, timeout=30, what="the marker waits for n1"
    )
    assert bucket.latest("hf", expect=None).get("dir") != "hf/checkpoint-8"
    (n1.path / "hf/tmp-checkpoint-8").rename(n1.path / "hf/checkpoint-8")
    admin("wait", n1.path / "hf/checkpoint-8", "--timeout", "60")
    admin("wait", n0.path / "hf/checkpoint-8", "--timeout", "60")
    latest = bucket.latest("hf")
    assert latest["dir"] == "hf/checkpoint-8" and latest["files"] == 3, latest
    assert not {key for key in bucket.keys() if key.startswith("hf/tmp-checkpoint-8/")}


def test_a_node_that_renames_the_temp_directory_first_waits_for_the_owner_to_move_its_shard(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """The same, node 0 renaming first: node 1's shard, known here from a listing, is not node
    0's to move (refused, retried later).  A wait on ck/s1 on node 0 waits until node 1 has
    moved it, rather than failing on that refusal."""
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "0")
    n1 = node(mounted_factory, bucket, "n1")
    write(n1, "ck/tmp/__1_0.distcp", shard(1, 1))
    admin("wait", n1.path / "ck/tmp")
    write(n0, "ck/tmp/__0_0.distcp", shard(1, 0))
    assert sorted(os.listdir(n0.path / "ck/tmp")) == ["__0_0.distcp", "__1_0.distcp"]
    admin("wait", n0.path / "ck/tmp/__0_0.distcp")
    (n0.path / "ck/tmp").rename(n0.path / "ck/s1")
    wait_for(lambda: "node n1's file" in admin("status", n0.path).stdout, timeout=30, what="n0's refused move")
    before = admin("wait", n0.path / "ck/s1", "--timeout", "1", expect=None)
    assert before.returncode == 3, before.stdout + before.stderr  # waiting, not failed
    (n1.path / "ck/tmp").rename(n1.path / "ck/s1")
    admin("wait", n1.path / "ck/s1")
    admin("drain", n0.path, "--now")
    admin("wait", n0.path / "ck/s1", "--timeout", "60")
    assert {"ck/s1/__0_0.distcp", "ck/s1/__1_0.distcp"} <= bucket.keys()


def test_unmount_wait_does_not_wait_for_another_nodes_file_it_may_not_move(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """(An acceptance pass.)  n0 renamed a directory holding n1's files and n1 never renamed
    it: the move is n1's to make, so n0's `unmount --wait` (a Slurm epilog, the packaged stop)
    waited for it for good.  It waits for this node's data only; `burstfs-admin wait` still
    waits for the owner (the test above)."""
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "0")
    n1 = node(mounted_factory, bucket, "n1")
    write(n1, "ck/step_1/sub/n1.bin", shard(1, 1))
    admin("wait", n1.path / "ck/step_1")
    write(n0, "ck/step_1/sub/n0.bin", shard(1, 0))
    assert sorted(os.listdir(n0.path / "ck/step_1/sub")) == ["n0.bin", "n1.bin"]
    (n0.path / "ck/step_1").rename(n0.path / "ck/step_1_old")
    wait_for(lambda: "node n1's file" in admin("status", n0.path).stdout, timeout=30, what="n0's refused move")
    stopped = burstfs("unmount", "--wait", "--wait-timeout", "20", str(n0.path), check=False, timeout=90)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert "ck/step_1_old/sub/n0.bin" in bucket.keys() and "ck/step_1/sub/n1.bin" in bucket.keys()


def test_a_checkpoints_commit_record_outlives_an_unmount_and_is_waited_for(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """The commit record (what `latest` reads) of a marker durable here was kept in memory
    only: a remote that refused it until the node unmounted lost the checkpoint for `latest`
    for good, and `unmount --wait` (the Slurm epilog) returned before it was out.  Now both
    `burstfs-admin wait` and `unmount --wait` wait for it, and a stop keeps it in the journal."""
    from faultproxy import FaultProxy

    with FaultProxy(bucket.endpoint) as proxy:
        n0 = mounted_factory("n0", bucket.url, ("--endpoint-url", proxy.endpoint, "--node-id", "n0"))  # type: ignore[call-arg]
        n0.mount()
        n0.expect_log("event=group_record_retry")
        proxy.fail_next(100_000, status=503, match=".commit ")
        write(n0, "run/step_1/__0_0.distcp", shard(1, 0))
        write(n0, "run/step_1/.metadata", b"metadata 1")
        waited = admin("wait", "--timeout", "5", n0.path / "run/step_1", expect=3)
        assert "1 record of this node not on the remote yet" in waited.stderr, waited.stderr
        stopped = burstfs("unmount", "--wait", "--wait-timeout", "5", str(n0.path), check=False, timeout=90)
        assert stopped.returncode == 1, stopped.stdout + stopped.stderr
        assert "still waiting after 5s; 1 record of this node not on the remote yet" in stopped.stderr, stopped.stderr
        n0.unmount()
        assert "1 record of this node to go out" in admin("status", "--cache", n0.cache, n0.path).stdout
        admin("latest", "--remote", bucket.url, "--endpoint-url", bucket.endpoint, "run", expect=1)
        proxy.clear()
        n0.mount()
        admin("wait", n0.path / "run/step_1")
        assert bucket.latest("run")["dir"] == "run/step_1"
        n0.unmount("--wait")


def test_a_shard_a_forked_child_still_holds_open_holds_the_marker(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """(An acceptance pass.)  The trainer forks (a DataLoader worker) while a shard is open,
    closes the shard and writes `.metadata`: the shard drains only once the child's copy of
    the descriptor is gone, and the marker must wait for it (a change meant for logs kept
    open let `.metadata` out first, and `latest` named a step whose shard was missing)."""
    n0 = node(mounted_factory, bucket, "n0")
    step = n0.path / "ckpt/step_1"
    step.mkdir(parents=True)
    data = shard(1, 0)
    read_end, write_end = os.pipe()
    with open(step / "__0_0.distcp", "wb") as out:
        out.write(data)
        child = os.fork()
        if child == 0:  # holds its copy of the shard's descriptor until told to go
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
    os.close(read_end)
    write(n0, "ckpt/step_1/.metadata", b"metadata 1")
    time.sleep(3)
    assert "ckpt/step_1/.metadata" not in bucket.keys()
    admin("latest", "--remote", bucket.url, "--endpoint-url", bucket.endpoint, "ckpt", expect=1)
    waited = admin("wait", "--timeout", "1", step / "__0_0.distcp", expect=3)
    assert "(staged, still open in another process: drains once every copy is closed)" in waited.stderr
    os.write(write_end, b"x")
    os.close(write_end)
    os.waitpid(child, 0)
    admin("wait", "--timeout", "60", step)
    assert bucket.latest("ckpt")["dir"] == "ckpt/step_1"
    assert bucket.client.get_object(Bucket=bucket.name, Key="job/ckpt/step_1/__0_0.distcp")["Body"].read() == data


def test_a_cache_keeps_its_node_id_while_its_rounds_are_open(mounted_factory: type[MountedFS], bucket: Bucket) -> None:
    """n1's shard is staged and its intent is out; its cache is mounted again as another node
    (moved to another host: the default id is the host name).  The done went out under the
    new name, n1's intent never got one, and n0's marker waited for good."""
    n1 = mounted_factory("n1", bucket.url, ("--endpoint-url", bucket.endpoint, *HELD))  # type: ignore[call-arg]
    n1.mount("--node-id", "n1")
    write(n1, "ckpt/step_1/__1_0.distcp", shard(1, 1))
    wait_for(lambda: any(k.endswith(".intent") for k in bucket.keys()), what="n1's intent")
    n1.unmount()
    n1.expect_log("has checkpoint rounds open as node 'n1'")
    refused = burstfs(
        "mount",
        str(n1.path),
        "--cache",
        str(n1.cache),
        "--remote",
        bucket.url,
        "--endpoint-url",
        bucket.endpoint,
        "--node-id",
        "renamed",
        check=False,
    )
    assert refused.returncode != 0 and "--node-id n1" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    n1.mount()  # no --node-id: the host name by default, but the cache keeps n1
    assert json.loads(admin("status", n1.path, "--json").stdout)["node_id"] == "n1"
    n0 = node(mounted_factory, bucket, "n0")
    write(n0, "ckpt/step_1/__0_0.distcp", shard(1, 0))
    write(n0, "ckpt/step_1/.metadata", b"metadata")
    admin("drain", n1.path, "--now")
    admin("wait", n0.path / "ckpt/step_1/.metadata", "--timeout", "60")
    assert bucket.latest("ckpt")["dir"] == "ckpt/step_1"


def test_a_file_another_node_rewrites_or_removes_is_read_anew_here(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """n1 read n0's ck/latest.pt (fetched: a local copy here), then n0 rewrote it with the
    same size and removed ck/old.pt.  Once n1's listing is due again, an open of the name
    reads n0's new bytes (it read the stale copy for good; after an evict, EIO until a
    remount) and the removed file is gone (its fetched copy stayed forever)."""
    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "0")
    first, second = os.urandom(3 << 20), os.urandom(3 << 20)
    write(n0, "ck/latest.pt", first)
    write(n0, "ck/old.pt", b"old" * 1000)
    admin("wait", n0.path / "ck")
    assert (n1.path / "ck/latest.pt").read_bytes() == first
    assert (n1.path / "ck/old.pt").read_bytes() == b"old" * 1000
    assert state(n1, "ck/latest.pt") == "durable"  # fetched: a local copy
    write(n0, "ck/latest.pt", second)
    (n0.path / "ck/old.pt").unlink()
    admin("wait", n0.path / "ck")
    wait_for(lambda: "ck/old.pt" not in bucket.keys(), what="the delete of ck/old.pt")
    assert (n1.path / "ck/latest.pt").read_bytes() == second
    assert not (n1.path / "ck/old.pt").exists()
    assert sorted(os.listdir(n1.path / "ck")) == ["latest.pt"]
    third = os.urandom(3 << 20)
    write(n0, "ck/latest.pt", third)
    admin("wait", n0.path / "ck")
    admin("evict", n1.path / "ck/latest.pt")
    assert (n1.path / "ck/latest.pt").read_bytes() == third
    # A reader holds it open (nothing fetched yet) while n0 rewrites it: the next open reads
    # the new bytes at once (it was EIO while the closed handle's release was on its way).
    fourth = os.urandom(3 << 20)
    with open(n1.path / "ck/latest.pt", "rb") as held:
        write(n0, "ck/latest.pt", fourth)
        admin("wait", n0.path / "ck")
        assert (n1.path / "ck/latest.pt").read_bytes() == fourth
        try:
            assert held.read() == third  # what it opened, or EIO: never the new bytes
        except OSError as exc:
            assert exc.errno == errno.EIO
    assert (n1.path / "ck/latest.pt").read_bytes() == fourth
    assert "event=listed_file_changed" in n1.log_text()


def test_removing_a_stale_listed_file_spares_the_version_its_owner_wrote_since(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """n0 listed n1's ck/a.bin, then n1 wrote it again; n0's listing is not due yet when it
    removes the name.  n1's new file stays on the remote (it deleted it), n0's old one goes."""
    n1 = node(mounted_factory, bucket, "n1")
    write(n1, "ck/a.bin", b"first" * 1000)
    write(n1, "ck/b.bin", b"b" * 1000)
    admin("wait", n1.path / "ck")
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "3600")
    assert sorted(os.listdir(n0.path / "ck")) == ["a.bin", "b.bin"]
    write(n1, "ck/a.bin", b"second" * 1000)
    admin("wait", n1.path / "ck")
    (n0.path / "ck/a.bin").unlink()
    (n0.path / "ck/b.bin").unlink()
    wait_for(lambda: "ck/b.bin" not in bucket.keys(), what="the delete of the unchanged file")
    wait_for(lambda: "event=remote_delete_spared key=ck/a.bin" in n0.log_text(), what="the spared delete")
    body = bucket.client.get_object(Bucket=bucket.name, Key="job/ck/a.bin")["Body"].read()
    assert body == b"second" * 1000
    assert (n1.path / "ck/a.bin").read_bytes() == b"second" * 1000


def test_a_step_pruned_elsewhere_leaves_a_node_that_only_lists_its_parent(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Rank 0's keep-last-N removed a step; the other node never lists that step's directory
    again (it only makes new steps beside it), so its shard there stayed "durable" with no
    object behind it, and every pruned step stayed in its tree for the whole run."""
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "0.5")
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "0.5")
    write(n1, "ck/step_1/__1_0.distcp", shard(1, 1))
    write(n1, "ck/step_1/sub/extra.bin", b"deeper")
    write(n1, "ck/step_2/__1_0.distcp", shard(2, 1))
    admin("wait", n1.path / "ck")
    shutil.rmtree(n0.path / "ck/step_1")
    admin("wait", n0.path / "ck")
    assert not [key for key in bucket.keys() if key.startswith("ck/step_1/")]
    wait_for(lambda: os.listdir(n1.path / "ck") == ["step_2"], timeout=60, what="the pruned step gone on n1")
    assert state(n1, "ck/step_1/__1_0.distcp") is None
    assert state(n1, "ck/step_2/__1_0.distcp") == "durable"
    assert "event=deleted_elsewhere key=ck/step_1/__1_0.distcp" in n1.log_text()


def test_a_step_removed_right_after_its_listing_failed_is_listed_again_first(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Found in an acceptance pass: one 503 on n0's listing of a step while keep-last-N removed
    it. rmtree saw only n0's own shard, deleted it and removed the directory; n1's shard stayed
    on the remote for good, and the step came back (torn: no .metadata) at the next listing.
    The rmdir lists the directory again first (even right after a failed listing): n1's shard
    makes it ENOTEMPTY, and rm -r again removes every node's shard.  A remote that does not
    answer at all does not hold the rmdir (logged)."""
    from faultproxy import FaultProxy

    n1 = node(mounted_factory, bucket, "n1")
    with FaultProxy(bucket.endpoint) as proxy:
        n0 = mounted_factory(  # type: ignore[call-arg]
            "n0", bucket.url, ("--endpoint-url", proxy.endpoint, "--node-id", "n0", "--list-ttl", "0.5")
        )
        n0.mount()
        for step in (1, 2):
            write(n0, f"ck/step_{step}/__0_0.distcp", shard(step, 0))
            write(n1, f"ck/step_{step}/__1_0.distcp", shard(step, 1))
        admin("wait", n0.path / "ck")
        admin("wait", n1.path / "ck")
        time.sleep(1.0)  # n0's listings of the steps are older than its TTL
        proxy.fail_next(6, match="list-type=2")  # every try of rm -r's opendir listing
        with pytest.raises(OSError) as failed:
            shutil.rmtree(n0.path / "ck/step_1")
        assert failed.value.errno == errno.ENOTEMPTY
        shutil.rmtree(n0.path / "ck/step_1")  # n1's shard is listed now, and goes with it
        admin("wait", n0.path / "ck")
        assert not [key for key in bucket.keys() if key.startswith("ck/step_1/")], bucket.keys()
        time.sleep(1.0)
        proxy.fail_next(50, match="list-type=2")  # down for good: the rmdir does not wait for it
        shutil.rmtree(n0.path / "ck/step_2")
        assert "event=rmdir_unlisted dir=ck/step_2" in n0.log_text()
        proxy.clear()
        n0.unmount()


def test_a_step_emptied_by_deletes_elsewhere_goes_at_the_next_listing_after_a_restart(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """The directory a listing emptied was dropped at its parent's next listing only within the
    same life of the daemon: remounted (or killed) in between, it stayed for good."""
    from burstfs import client

    n0 = node(mounted_factory, bucket, "n0")
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "3600")
    write(n1, "ck/step_1/__1_0.distcp", shard(1, 1))
    write(n1, "ck/step_2/__1_0.distcp", shard(2, 1))
    admin("wait", n1.path / "ck")
    client.refresh_listings(n0.path)
    shutil.rmtree(n0.path / "ck/step_1")
    admin("wait", n0.path / "ck")
    client.refresh_listings(n1.path / "ck/step_1")  # its shard goes: an empty directory here
    assert os.listdir(n1.path / "ck/step_1") == []
    n1.unmount()
    n1.mount()
    client.refresh_listings(n1.path / "ck")
    assert os.listdir(n1.path / "ck") == ["step_2"]


def test_a_nodes_own_durable_file_another_node_deleted_goes_here_too(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """Keep-last-N on rank 0 deletes an old step's shards, other nodes' too.  The node that
    wrote a shard kept listing it, read it, and called it durable with no object behind it
    (`verify --remote` failed), so that node still showed the pruned step."""
    n0 = node(mounted_factory, bucket, "n0", "--list-ttl", "0")
    n1 = node(mounted_factory, bucket, "n1", "--list-ttl", "0")
    write(n1, "ck/step_1/__1_0.distcp", shard(1, 1))
    write(n1, "ck/step_1/kept.bin", b"kept")
    write(n1, "ck/step_1/lost.bin", b"lost")
    write(n1, "ck/step_1/halfway.bin", b"halfway")
    admin("wait", n1.path / "ck")
    (n0.path / "ck/step_1/__1_0.distcp").unlink()
    wait_for(lambda: "ck/step_1/__1_0.distcp" not in bucket.keys(), what="the delete on the remote")
    # A delete by another node caught between its object and its manifest is no loss: the
    # file stays until a listing finds both gone, and nothing is logged as lost.
    bucket.client.delete_object(Bucket=bucket.name, Key="job/ck/step_1/halfway.bin")
    # An object removed behind burstfs' back (its manifest stays: a lifecycle rule, an
    # operator) was lost, not deleted by a node: its file stays here, for verify to report.
    bucket.client.delete_object(Bucket=bucket.name, Key="job/ck/step_1/lost.bin")
    assert sorted(os.listdir(n1.path / "ck/step_1")) == ["halfway.bin", "kept.bin", "lost.bin"]
    bucket.client.delete_object(Bucket=bucket.name, Key=f"job/{manifest_key('ck/step_1/halfway.bin')}")
    wait_for(lambda: "halfway.bin" not in os.listdir(n1.path / "ck/step_1"), what="the delete seen whole")
    # Still missing with its manifest a while later (listings LOST_CONFIRM_S apart): lost.
    wait_for(
        lambda: os.listdir(n1.path / "ck/step_1") and "event=object_lost key=ck/step_1/lost.bin" in n1.log_text(),
        what="the loss logged",
    )
    assert "object_lost key=ck/step_1/halfway.bin" not in n1.log_text()
    assert (n1.path / "ck/step_1/lost.bin").read_bytes() == b"lost"
    # The kernel's entry goes by an asynchronous invalidation: a stat may beat it by a moment.
    wait_for(lambda: not (n1.path / "ck/step_1/__1_0.distcp").exists(), what="the kernel's entry dropped")
    admin("wait", n1.path / "ck", "--timeout", "30")
    assert "event=deleted_elsewhere key=ck/step_1/__1_0.distcp" in n1.log_text()
    # A file of n1's rewritten here after the delete elsewhere is n1's again, not forgotten.
    write(n1, "ck/step_1/__1_0.distcp", b"rewritten")
    admin("wait", n1.path / "ck", "--timeout", "30")
    assert sorted(os.listdir(n1.path / "ck/step_1")) == ["__1_0.distcp", "kept.bin", "lost.bin"]


def test_a_dcp_metadata_waits_for_a_shard_whose_nodes_intent_never_reached_the_remote(
    mounted_factory: type[MountedFS], bucket: Bucket
) -> None:
    """ "The residual window": n1's remote is a black hole while it writes its shard, so its
    intent never lands and n0's gate cannot see it.  n0's ``.metadata`` (written by torch's DCP
    writer, naming both ranks' shards) went out at once, and `latest` named the step while n1's
    shard was nowhere.  Now it waits for the shard it names, and goes once n1 heals."""
    from faultproxy import FaultProxy

    n0 = node(mounted_factory, bucket, "n0")
    with FaultProxy(bucket.endpoint) as proxy:
        n1 = mounted_factory(  # type: ignore[call-arg]
            "n1", bucket.url, ("--endpoint-url", proxy.endpoint, "--node-id", "n1", "--remote-wait", "0.5")
        )
        n1.mount()
        n1.expect_log("event=remote_retry")
        proxy.blackhole()
        write(n1, "ck/step_1/__1_0.distcp", shard(1, 1))  # its close waits 0.5 s for the intent, then returns
        write(n0, "ck/step_1/__0_0.distcp", shard(1, 0))
        staging = n0.path / "ck/step_1/.metadata.tmp"  # as DCP's writer does: the pickle, then a rename
        staging.write_bytes(pickle.dumps({"storage_data": {"a": "__0_0.distcp", "b": "__1_0.distcp"}}))
        os.rename(staging, n0.path / "ck/step_1/.metadata")
        wait_for(lambda: state(n0, "ck/step_1/__0_0.distcp") == "durable", timeout=60, what="n0's shard durable")
        for _ in range(40):
            assert "ck/step_1/.metadata" not in bucket.keys()
            time.sleep(0.1)
        status = admin("status", n0.path).stdout
        assert "checkpoint ck/step_1 waiting for 1 file its index names" in status, status
        assert bucket.latest("ck", expect=1)["dir"] is None
        proxy.resume()
        admin("wait", "--timeout", "120", n1.path / "ck")
        admin("wait", "--timeout", "60", n0.path / "ck")
        found = bucket.latest("ck")
        assert found["dir"] == "ck/step_1" and found["files"] == 3, found
        n1.unmount()

"""Minimal sequences the reference-model suite found, kept as regular tests.

Each drives the same in-process node as tests/test_model.py (tests/reftest.py)
through the steps hypothesis shrank a failure to, and checks what the model
checks.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from reftest import FileSide, Node, NodeOptions, fast_mover, remote_files

from burstfs.journal import ROOT_INO

UID, GID = os.getuid(), os.getgid()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with fast_mover():
        (tmp_path / "remote").mkdir()
        node = Node(tmp_path / "cache", FileSide(tmp_path / "remote"), NodeOptions())
        try:
            yield node
        finally:
            node.stop()


def write(node: Node, path: str, data: bytes) -> None:
    parent, name = node.parent_and_name(path)
    fh, inode = node.call(node.core.create, parent, name, stat.S_IFREG | 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
    node.call(node.core.forget, inode.ino, 1)
    node.call(node.core.write, fh, 0, data)
    node.call(node.core.flush, fh)
    node.call(node.core.release, fh)


def test_a_renamed_file_that_will_not_drain_leaves_no_object_at_its_old_name(node: Node, tmp_path: Path) -> None:
    """Found by the model suite (a wedged relocation on the file remote): a durable
    file renamed away while it is not durable any more (here a commit marker held
    back by a torn checkpoint) kept its old object at the old name, where nothing
    lives in the namespace; on a file remote that object also blocked, for good,
    moving a directory of the same name there."""
    node.call(node.core.mkdir, ROOT_INO, b"a", 0o755, UID, GID)
    a = node.resolve("a")
    write(node, "a/latest", b"marker v1")
    assert node.drain_until_idle() == "idle"
    assert remote_files(tmp_path / "remote") == {"a/latest": b"marker v1"}
    # A torn checkpoint: a shard, closed once, open for writing again when the daemon died ...
    write(node, "a/shard", b"whole")
    fh = node.call(node.core.open, node.resolve("a/shard"), os.O_WRONLY)
    node.call(node.core.write, fh, 0, b"half")
    node.faults.crashed = True
    node.stop()
    node = Node(node.cache, node.side, node.options)
    try:
        # ... then the marker is rewritten (held back by the torn shard) and renamed away.
        fh = node.call(node.core.open, node.resolve("a/latest"), os.O_WRONLY | os.O_TRUNC)
        node.call(node.core.write, fh, 0, b"marker v2")
        node.call(node.core.flush, fh)
        node.call(node.core.release, fh)
        node.call(node.core.rename, a, b"latest", ROOT_INO, b"latest", 0)
        node.call(node.core.mkdir, a, b"latest", 0o755, UID, GID)  # a directory where the object was
        write(node, "a/latest/shard", b"x")
        assert node.drain_until_idle(tolerated=lambda: frozenset({"latest"})) == "idle", node.pending()
        objects = remote_files(tmp_path / "remote")
        assert objects.get("a/latest/shard") == b"x"
        assert "a/latest" not in objects
        (state,) = node.rows("SELECT state FROM inodes WHERE ino=?", (node.resolve("latest"),))[0]
        assert state == "staged"  # held back by the torn shard: never published
    finally:
        node.stop()


def test_a_round_member_removed_before_a_crash_does_not_hold_a_marker_through_a_reused_number(
    node: Node, tmp_path: Path
) -> None:
    """Found by the model suite (a root marker staged for good): a file written into a
    round and removed before the daemon died left its inode number among the round's
    journaled members; the restarted daemon numbered from the highest row left, so
    the next new inode (a directory) took that number, and the round waited for a
    directory to be durable -- the marker behind it never drained."""
    write(node, "shard", b"a shard")
    shard = node.resolve("shard")
    node.call(node.core.unlink, ROOT_INO, b"shard")
    journaled = time.monotonic() + 10
    while node.rows("SELECT ino FROM inodes WHERE ino=?", (shard,)) or not any(
        shard in json.loads(value)["members"]
        for (value,) in node.rows("SELECT value FROM meta WHERE key LIKE 'group:%'")
    ):
        assert time.monotonic() < journaled, "the removal or the round was never journaled"
        time.sleep(0.01)
    node.faults.crashed = True
    node.stop()
    node = Node(node.cache, node.side, node.options)
    try:
        c = node.call(node.core.mkdir, ROOT_INO, b"c", 0o755, UID, GID)
        assert c.ino != shard  # a number is never handed out twice in one cache
        write(node, "latest", b"marker")
        assert node.drain_until_idle() == "idle", node.pending()
        assert remote_files(tmp_path / "remote") == {"latest": b"marker"}
    finally:
        node.stop()


@pytest.mark.parametrize("crash_after", range(1, 25))
def test_a_move_cut_short_by_a_crash_leaves_no_copy_when_the_file_is_renamed_back(
    tmp_path: Path, crash_after: int
) -> None:
    """Found by the random model run: the daemon died after copying a renamed file's object to
    its new key and before recording it; the file was renamed back before the next move, so
    nothing was left to move, and the copy stayed on the remote for good (a listing then
    showed it as a file nobody had).  Every crash point of the move is tried."""
    with fast_mover():
        (tmp_path / "remote").mkdir()
        node = Node(tmp_path / "cache", FileSide(tmp_path / "remote"), NodeOptions())
        try:
            write(node, "f", b"the bytes")
            assert node.drain_until_idle() == "idle"
            node.call(node.core.rename, ROOT_INO, b"f", ROOT_INO, b"a", 0)
            node.faults.crash_after = crash_after
            outcome = node.drain_until_idle()
            node.faults.crash_after = None
            if outcome == "crashed":
                node.faults.crashed = True
                node.stop()
                node = Node(node.cache, node.side, node.options)
            node.call(node.core.rename, ROOT_INO, b"a", ROOT_INO, b"f", 0)
            assert node.drain_until_idle() == "idle", node.pending()
            assert remote_files(tmp_path / "remote") == {"f": b"the bytes"}
        finally:
            node.stop()


def test_a_marker_moved_on_its_own_takes_no_other_nodes_part_along(tmp_path: Path) -> None:
    """Found by the random model run: a root `.metadata` (published with another node's round
    in its subtree) moved into a directory `a` waited there for that node to "rename its
    part" into `a`, for good.  Only a renamed directory carries its nodes along."""
    with fast_mover():
        (tmp_path / "remote").mkdir()
        side = FileSide(tmp_path / "remote")
        other = Node(tmp_path / "cache-b", side, NodeOptions(node_id="node-b"))
        node = Node(tmp_path / "cache-a", side, NodeOptions())
        try:
            other.call(other.core.mkdir, ROOT_INO, b"foreign", 0o755, UID, GID)
            write(other, "foreign/shard", b"b's shard")
            assert other.drain_until_idle() == "idle"
            write(node, ".metadata", b"root marker")
            assert node.drain_until_idle() == "idle"
            node.call(node.core.mkdir, ROOT_INO, b"a", 0o755, UID, GID)
            node.call(node.core.rename, ROOT_INO, b".metadata", node.resolve("a"), b".metadata", 0)
            assert node.drain_until_idle() == "idle", node.pending()
            assert remote_files(tmp_path / "remote").get("a/.metadata") == b"root marker"
        finally:
            node.stop()
            other.stop()

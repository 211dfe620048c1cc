"""Cross-node commits in-process: two nodes' journals and movers over one file remote, no FUSE.

Each node is a ``Front`` (the journal records core.py writes) plus its own Mover;
``writing_in`` is what core.py calls at a writable open.  The remote is a real
directory; ``HookedRemote`` holds one node's upload so the test decides when
that node's shard becomes durable.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import pickle
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from test_mover import PART, Front, HookedRemote, until

from burstfs import commitgroups
from burstfs.admin.views import _held_line
from burstfs.commitgroups import COMMITS_PREFIX, GROUPS_PREFIX, parse_record_key, record_key, records_due
from burstfs.config import DrainOptions, S3Options, check_node_id, parse_remote_url
from burstfs.errors import ConfigError, FsError, RemoteError
from burstfs.journal import DURABLE, FAILED, WRITING, drop_unlinked_ops
from burstfs.latest import find_latest
from burstfs.mover import Mover
from burstfs.remote import FileRemote


class Node:
    """One mount's journal and mover, sharing ``remote_dir`` with the others."""

    def __init__(self, tmp_path: Path, name: str, remote_dir: Path) -> None:
        cache = tmp_path / f"cache-{name}"
        cache.mkdir()
        self.front = Front(cache)
        self.remote = HookedRemote(remote_dir)
        self.mover = Mover(
            cache,
            parse_remote_url(f"file://{remote_dir}"),
            S3Options(),
            DrainOptions(part_size=PART, concurrency=2, node_id=name),
            remote=self.remote,
        )
        self.dirs: dict[str, int] = {}

    def mkdirs(self, path: str) -> int:
        parent = 1
        for depth, part in enumerate(path.split("/")):
            prefix = "/".join(path.split("/")[: depth + 1])
            if prefix not in self.dirs:
                self.dirs[prefix] = self.front.mkdir(part, parent)
            parent = self.dirs[prefix]
        return parent

    def write(self, path: str, data: bytes) -> int:
        """open(O_CREAT|O_WRONLY), write, close: as core.py journals it and tells the drain."""
        dir_key, _, name = path.rpartition("/")
        parent = self.mkdirs(dir_key)
        ino = self.front.write(name, b"", parent) if (ino := self._child(parent, name)) is None else ino
        self.mover.groups.writing_in(ino, dir_key, name.encode())
        self.front.rewrite(ino, data)
        self.mover.groups.writing_in(ino, dir_key, name.encode())  # as flush does, after the close is journaled
        return ino

    def _child(self, parent: int, name: str) -> int | None:
        row = self.front.journal.child(parent, name.encode())
        return row.ino if row else None

    def durable(self, ino: int) -> bool:
        row = self.front.journal.inode(ino)
        return row is not None and row.state == DURABLE and row.durable_generation == row.generation


def keys(remote_dir: Path, prefix: str = "") -> set[str]:
    return {
        p.relative_to(remote_dir).as_posix()
        for p in remote_dir.rglob("*")
        if p.is_file() and p.relative_to(remote_dir).as_posix().startswith(prefix)
    }


def refuse_records(node: Node, refusal: Callable[[str], RemoteError | None]) -> list[str]:
    """``node``'s record creates fail with ``refusal(key)`` (None: they go through); returns
    the list of keys refused, as they are."""
    refused: list[str] = []
    create_object = node.remote.create_object

    async def create(key: str, data: bytes) -> bool:
        error = refusal(key)
        if error is not None:
            refused.append(key)
            raise error
        return await create_object(key, data)

    node.remote.create_object = create  # type: ignore[method-assign]
    return refused


def hold_intents(node: Node) -> asyncio.Event:
    """``node``'s intent records wait until the event returned is set (its remote is down for
    them: the intent is late; its other requests go through)."""
    intent_late = asyncio.Event()
    create_object = node.remote.create_object

    async def late_create(key: str, data: bytes) -> bool:
        if key.endswith(".intent"):
            await intent_late.wait()
        return await create_object(key, data)

    node.remote.create_object = late_create  # type: ignore[method-assign]
    return intent_late


def run_nodes(nodes: list[Node], scenario: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        tasks = [asyncio.create_task(node.mover.run()) for node in nodes]
        try:
            await asyncio.wait_for(scenario(), 60)
        finally:
            for node in nodes:
                node.mover.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 30)

    asyncio.run(main())


def test_record_keys_round_trip_and_node_ids_are_validated() -> None:
    key = record_key("ckpt/step_1", "n-1.a", "0001-ab", "intent")
    assert key == f"{GROUPS_PREFIX}ckpt/step_1/n-1.a@0001-ab.intent"
    assert parse_record_key(key) == ("ckpt/step_1", "n-1.a", "0001-ab", "intent")
    assert parse_record_key(record_key("", "n0", "r", "done")) == ("", "n0", "r", "done")
    assert parse_record_key(f"{GROUPS_PREFIX}ckpt/readme.txt") is None
    for bad in ("", "a@b", "a/b", "-x", "x" * 64):
        with pytest.raises(ConfigError):
            check_node_id(bad)


def test_marker_waits_for_every_node_with_an_intent(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Node b's shard is held in its upload: node a's marker (its own shard durable) is not
    published until b's shard is durable and b's done record is out (the wait is in the log,
    where a drain of a stopped cache shows it); then the commit record names both shards and
    ``find_latest`` returns the checkpoint."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    marker = "ckpt/step_1/.metadata"

    async def scenario() -> None:
        entered, release = b.remote.hold("put", "ckpt/step_1/shard_b")
        shard_a = a.write("ckpt/step_1/shard_a", b"A" * 1000)
        b.write("ckpt/step_1/shard_b", b"B" * 1000)
        await until(lambda: entered.is_set() and a.durable(shard_a), "a durable, b uploading")
        await until(lambda: b.mover.groups.intent_out("ckpt/step_1"), "b's intent")
        assert [k.rsplit(".", 1)[1] for k in keys(remote_dir, GROUPS_PREFIX + "ckpt/step_1/b@")] == ["intent"]
        meta = a.write(marker, b"metadata")
        for _ in range(40):  # the gate polls many times meanwhile: the marker stays back
            await asyncio.sleep(0.05)
            assert marker not in keys(remote_dir)
            assert not a.durable(meta)
        waiting = a.mover.groups.waiting_markers()
        assert [w["node"] for w in waiting[0]["waiting"]] == ["b"] and waiting[0]["dir"] == "ckpt/step_1"
        assert "event=marker_waiting dir=ckpt/step_1 nodes=b " in caplog.text
        release.set()
        await until(lambda: a.durable(meta), "the marker to drain")
        assert (remote_dir / "ckpt/step_1/shard_b").read_bytes() == b"B" * 1000
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "the commit record")
        latest, skipped = await find_latest(FileRemote(parse_remote_url(f"file://{remote_dir}")), "ckpt")
        assert latest is not None and latest.dir == "ckpt/step_1" and latest.files == 3, (latest, skipped)
        commit = json.loads((remote_dir / next(iter(keys(remote_dir, COMMITS_PREFIX)))).read_bytes())
        assert sorted(f["path"] for f in commit["files"]) == ["ckpt/step_1/shard_a", "ckpt/step_1/shard_b"]

    run_nodes([a, b], scenario)


def test_drain_now_retries_a_record_backing_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An intent that failed several times backs off (doubling, up to 30 s); ``drain --now``
    (which every ``burstfs-admin wait`` and fsync --remote use) tries it again at once."""
    monkeypatch.setattr(commitgroups, "PUBLISH_BACKOFF_S", 4.0)  # the next try is 8 s away: far from "at once"
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    healthy = False
    refused = refuse_records(
        node,
        lambda key: (
            None if healthy or not key.endswith(".intent") else RemoteError("injected: intent refused", kind="denied")
        ),  # permanent: no retry inside
    )

    async def scenario() -> None:
        nonlocal healthy
        node.write("ckpt/shard", b"s")
        await until(lambda: len(refused) >= 2, "2 failed intents", timeout=10)
        healthy = True  # the remote is well again, but the next try is seconds away
        assert not node.mover.groups.intent_out("ckpt")
        node.mover.drain_now()
        await until(lambda: node.mover.groups.intent_out("ckpt"), "the intent, right after drain --now", timeout=5)

    run_nodes([node], scenario)


def test_a_record_no_remote_can_hold_is_given_up_so_a_drain_until_idle_ends(tmp_path: Path) -> None:
    """A directory whose record keys are too long for the remote (S3: 1024 bytes; its files'
    own keys fit or fail alike): the intent was retried with backoff for good, and
    ``burstfs drain --cache DIR --now`` never exited though nothing was left to drain."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    refused = refuse_records(
        node,
        lambda key: (
            RemoteError(f"key {key!r} is longer than S3's 1024 bytes", kind="key_too_long")
            if key.startswith(f"{GROUPS_PREFIX}deep/")
            else None
        ),
    )

    async def scenario() -> None:
        shard = node.write("deep/shard", b"s")
        await until(lambda: node.durable(shard), "the shard durable", timeout=10)
        await until(lambda: len(refused) >= 1, "the intent tried", timeout=10)
        assert not await node.mover.groups.has_work()
        node.mover.drain_now()
        await asyncio.sleep(0.3)
        assert len(refused) == 1  # given up, not retried
        assert not await node.mover.groups.has_work()
        # Its marker is not held by the round that can never be done (an acceptance pass: it
        # stayed staged for good, and every `unmount --wait` timed out on it).
        marker = node.write("deep/latest", b"step")
        await until(lambda: node.durable(marker), "the marker", timeout=10)
        # and its commit record, which no remote can hold either, is given up (the next pass
        # tries it: under load that came after the check above)
        await until(lambda: records_due(node.front.journal, [""]) == 0, "the marker's record given up", timeout=10)

    run_nodes([node], scenario)


def test_a_silent_remote_shows_in_the_status_from_the_first_retry_of_an_intent(tmp_path: Path) -> None:
    """A new checkpoint directory on a black-holed remote: the first requests are its intent
    record's, and the status headline (MoverStats.retrying_since) came only once a data
    upload was retried, tens of seconds later; an answer clears it."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    create_object = node.remote.create_object
    silent = True

    async def timing_out(key: str, data: bytes) -> bool:
        if silent and key.endswith(".intent"):
            raise TimeoutError("injected: no answer")  # temporary: retried
        return await create_object(key, data)

    node.remote.create_object = timing_out  # type: ignore[method-assign]

    async def scenario() -> None:
        nonlocal silent
        node.write("ckpt/shard", b"s")
        await until(lambda: node.mover.stats.retrying_since is not None, "the headline from the intent's retry")
        silent = False
        node.mover.drain_now()
        await until(lambda: node.mover.groups.intent_out("ckpt"), "the intent after the heal")
        assert node.mover.stats.retrying_since is None

    run_nodes([node], scenario)


def test_a_rewrite_of_the_same_directory_is_a_new_round(tmp_path: Path) -> None:
    """Round 2 rewrites the same names: b's round-1 done must not let round 2's marker through."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    marker = "ckpt/.metadata"

    async def scenario() -> None:
        a.write("ckpt/shard_a", b"a1")
        b.write("ckpt/shard_b", b"b1")
        meta = a.write(marker, b"m1")
        await until(lambda: a.durable(meta), "round 1's marker")
        await until(lambda: len(keys(remote_dir, COMMITS_PREFIX)) == 1, "round 1's commit")
        entered, release = b.remote.hold("put", "ckpt/shard_b")
        a.write("ckpt/shard_a", b"a2")
        b.write("ckpt/shard_b", b"b2")
        await until(lambda: entered.is_set(), "b's round-2 upload")
        await until(lambda: b.mover.groups.intent_out("ckpt"), "b's round-2 intent")
        meta = a.write(marker, b"m2")
        for _ in range(30):
            await asyncio.sleep(0.05)
            assert (remote_dir / marker).read_bytes() == b"m1"
        # Meanwhile the remote holds a's round-2 shard, b's round-1 shard and round 1's marker:
        # latest must not call that complete.
        remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))
        latest, skipped = await find_latest(remote, "")
        assert latest is None and skipped and skipped[0][0] == "ckpt", (latest, skipped)
        release.set()
        await until(lambda: a.durable(meta), "round 2's marker")
        await until(lambda: (remote_dir / marker).read_bytes() == b"m2", "round 2's marker on the remote")

        async def committed() -> bool:
            found, _ = await find_latest(remote, "")
            return found is not None

        for _ in range(200):
            if await committed():
                break
            await asyncio.sleep(0.05)
        latest, skipped = await find_latest(remote, "")
        assert latest is not None and latest.dir == "ckpt", skipped
        # b's round-1 records went when its round-2 intent came out (only b removes b's keys)
        b_records = keys(remote_dir, GROUPS_PREFIX + "ckpt/b@")
        assert len(b_records) == 2 and len({k.split("@")[1].rsplit(".")[0] for k in b_records}) == 1

    run_nodes([a, b], scenario)


def test_an_earlier_rounds_intent_that_cannot_be_deleted_keeps_its_done_and_holds_no_marker(tmp_path: Path) -> None:
    """Found in an acceptance pass: three 503s on the delete of an earlier round's intent, then
    its done deleted, left an intent without a done: an unfinished round of this very node, and
    the next marker in (or above) the directory waited for it for good, remounts included."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)
    refusing = [True]
    delete = a.remote.delete

    async def flaky_delete(key: str) -> None:
        if refusing[0] and key.endswith(".intent"):
            raise RemoteError(f"delete {key}: SlowDown", kind="unavailable")
        await delete(key)

    a.remote.delete = flaky_delete  # type: ignore[method-assign]

    def records(kind: str) -> set[str]:
        return {k for k in keys(remote_dir, GROUPS_PREFIX + "out/a@") if k.endswith("." + kind)}

    async def scenario() -> None:
        first = a.write("out/a.bin", b"a" * 100)
        await until(lambda: a.durable(first) and len(records("done")) == 1, "round 1 done")
        second = a.write("out/b.bin", b"b" * 100)
        await until(lambda: a.durable(second) and len(records("done")) == 2, "round 2 done")
        await asyncio.sleep(0.3)  # round 1's records: the intent's delete failed, so its done stays
        assert len(records("intent")) == 2 and len(records("done")) == 2
        marker = a.write("out/.metadata", b"m")
        await until(lambda: a.durable(marker), "the marker, not held by the node's own earlier round")
        refusing[0] = False
        third = a.write("out/c.bin", b"c" * 100)
        await until(lambda: a.durable(third) and len(records("intent")) == 1, "the kept round dropped by the next done")
        assert len(records("done")) == 1

    run_nodes([a], scenario)


def test_a_file_that_cannot_drain_holds_the_marker_and_a_marker_alone_needs_no_round(tmp_path: Path) -> None:
    """A closed round member that never becomes durable (its drain failed) means no done: the
    other node's marker waits; a node that only writes markers publishes no intent at all."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)

    async def scenario() -> None:
        broken = b.front.new(b.mkdirs("ckpt/s1"), "shard_b", "file", FAILED)
        b.mover.groups.writing_in(broken, "ckpt/s1", b"shard_b")
        await until(lambda: b.mover.groups.intent_out("ckpt/s1"), "b's intent")
        meta = a.write("ckpt/s1/.metadata", b"m")
        await asyncio.sleep(1.0)
        assert not a.durable(meta) and "ckpt/s1/.metadata" not in keys(remote_dir)
        assert not keys(remote_dir, GROUPS_PREFIX + "ckpt/s1/a@")  # a wrote only the marker

    run_nodes([a, b], scenario)


def test_open_files_and_later_rounds_do_not_hold_a_marker(tmp_path: Path) -> None:
    """A file opened before the marker and still open (a log kept open) does not hold it, nor
    does the next checkpoint already being written; a file closed before it but not yet
    durable does, and a file closed after the round's done starts the next round."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        log = a.front.new(a.mkdirs("run/logs"), "train.log", "file", WRITING)
        a.mover.groups.writing_in(log, "run/logs", b"train.log")
        entered, release = a.remote.hold("put", "run/step_1/shard")
        a.write("run/step_1/shard", b"s")
        meta = a.write("run/latest", b"1")
        later = a.front.new(a.mkdirs("run/step_2"), "shard", "file", WRITING)
        await asyncio.sleep(0.01)
        a.mover.groups.writing_in(later, "run/step_2", b"shard")
        await until(lambda: entered.is_set(), "the shard's upload")
        await until(lambda: a.mover.groups.groups["run/logs"].done, "the log directory's done (the log still open)")
        await asyncio.sleep(0.5)
        assert not a.durable(meta)  # the shard closed before it is not durable yet
        release.set()
        await until(lambda: a.durable(meta), "the marker, with the log and step 2 still open")
        first = a.mover.groups.groups["run/logs"].round
        a.front.rewrite(log, b"log lines")  # the log is closed after its round's done: the next round
        a.mover.groups.writing_in(log, "run/logs", b"train.log")
        assert a.mover.groups.groups["run/logs"].round != first

    run_nodes([a], scenario)


def test_a_close_joins_an_announced_round_at_once_and_nothing_else(tmp_path: Path) -> None:
    """``joined_announced`` (a close that need not wait on the mover's loop) answers True only
    for a round whose intent is out and whose done is not decided; the file it joins holds
    the round's done until it is durable, and a marker never joins."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)
    groups = a.mover.groups

    async def scenario() -> None:
        assert not groups.joined_announced(99, "ckpt", b"shard_0")  # no round yet: the long way
        _, release_first = a.remote.hold("put", "ckpt/shard_0")  # its round stays undecided meanwhile
        first = a.write("ckpt/shard_0", b"0")
        await until(lambda: groups.intent_out("ckpt") and "ckpt" in groups.groups, "the round's intent")
        assert not groups.joined_announced(first, "ckpt", b".metadata")  # a marker: never a member
        parent = a.mkdirs("ckpt")
        entered, release = a.remote.hold("put", "ckpt/shard_1")
        second = a.front.write("shard_1", b"1", parent)
        assert groups.joined_announced(second, "ckpt", b"shard_1")
        assert second in groups.groups["ckpt"].members
        release_first.set()
        a.mover.wake()
        await until(entered.is_set, "shard_1 uploading")
        await asyncio.sleep(0.3)
        assert not groups.groups["ckpt"].done  # the joined file holds the done
        release.set()
        await until(lambda: groups.groups["ckpt"].done, "the round's done")
        assert a.durable(first) and a.durable(second)
        assert not groups.joined_announced(second, "ckpt", b"shard_1")  # done decided: a new round

    run_nodes([a], scenario)


def test_a_commit_lists_the_shards_of_the_nodes_earlier_round_in_the_step(tmp_path: Path) -> None:
    """DCP's rank 0: its shard's round is done (waiting for a slow rank) before it opens
    ``.metadata.tmp``, which starts a second round; that round's intent deleted the first
    round's records, and its done had no file (the temp file became the marker), so the
    commit record left rank 0's shard out and ``latest`` never checked it.  A round's done
    lists the files of the node's earlier rounds there that are still as they were."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))
    mine = f"{GROUPS_PREFIX}ck/s1/a@"

    async def scenario() -> None:
        shard = a.write("ck/s1/shard_a", b"A" * 1000)
        await until(lambda: any(k.endswith(".done") for k in keys(remote_dir, mine)), "the shard's round done")
        first = {k.rsplit("/", 1)[1] for k in keys(remote_dir, mine)}
        a.write("ck/s1/extra", b"E" * 10)  # a second round: the first one's done is out
        meta = a.write("ck/s1/.metadata", b"metadata")
        await until(lambda: a.durable(meta) and keys(remote_dir, COMMITS_PREFIX), "the marker and its commit")
        commit = json.loads((remote_dir / next(iter(keys(remote_dir, COMMITS_PREFIX)))).read_bytes())
        assert sorted(f["path"] for f in commit["files"]) == ["ck/s1/extra", "ck/s1/shard_a"], commit
        # The first round's records went once the second round's done was out.
        await until(lambda: not first & {k.rsplit("/", 1)[1] for k in keys(remote_dir, mine)}, "the first round gone")
        (remote_dir / "ck/s1/shard_a").unlink()  # torn behind burstfs' back: latest must see it
        latest, skipped = await find_latest(remote, "ck")
        assert latest is None and "shard_a: missing" in skipped[0][1], (latest, skipped)
        assert a.durable(shard)

    run_nodes([a], scenario)


def test_a_done_carries_only_the_newest_files_of_earlier_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory written a file per round (samples, logs): each done would list every file
    ever written there.  The dones carry the newest CARRIED_FILES_MAX of earlier rounds."""
    monkeypatch.setattr(commitgroups, "CARRIED_FILES_MAX", 2)
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)
    mine = f"{GROUPS_PREFIX}logs/a@"

    def dones() -> list[dict[str, Any]]:
        return [json.loads((remote_dir / k).read_bytes()) for k in keys(remote_dir, mine) if k.endswith(".done")]

    async def scenario() -> None:
        for n in range(5):
            path = f"logs/sample_{n}"
            a.write(path, b"s" * 10)
            await until(lambda p=path: any(d["files"][-1]["path"] == p for d in dones()), f"round {n} done")  # type: ignore[misc]
        last = next(d for d in dones() if d["files"][-1]["path"] == "logs/sample_4")
        assert [f["path"] for f in last["files"]] == ["logs/sample_2", "logs/sample_3", "logs/sample_4"]

    run_nodes([a], scenario)


def test_a_round_journaled_before_earlier_rounds_were_a_list_loads() -> None:
    group = commitgroups.OwnGroup.from_json('{"dir_key": "ck", "round": "r2", "started": 1.0, "previous": "r1"}')
    assert group.previous == ["r1"]
    assert commitgroups.OwnGroup.from_json('{"dir_key": "ck", "round": "r2", "started": 1.0}').previous == []


def test_files_closed_in_no_journaled_round_join_one_when_the_mover_starts(tmp_path: Path) -> None:
    """Rounds are journaled by the mover's passes: shards closed while a pass was stuck on a
    silent remote, then a clean unmount, were in no round after the remount; their node's done
    left them out and another node's marker went out before them.  (Here: files journaled by
    the front with no round at all, as after such an unmount; the mover starts after.)"""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    step = a.mkdirs("ck/s1")
    shards = [a.front.write(f"shard_{n}", bytes([n]) * 1000, step) for n in range(3)]
    marker = "ck/s1/.metadata"

    async def scenario() -> None:
        _, release = a.remote.hold("put", "ck/s1/shard_2")
        await until(lambda: a.mover.groups.intent_out("ck/s1"), "a's round, from the journal")
        b.write("ck/s1/shard_b", b"b")
        meta = b.write(marker, b"metadata")
        await asyncio.sleep(1.0)  # b's gate polls meanwhile
        assert marker not in keys(remote_dir) and not b.durable(meta)
        release.set()
        await until(lambda: b.durable(meta), "the marker once a's shards are durable")
        assert all(a.durable(ino) for ino in shards)
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "the commit record (it follows the marker)")
        latest, _ = await find_latest(FileRemote(parse_remote_url(f"file://{remote_dir}")), "ck")
        assert latest is not None and latest.files == 5  # the marker, a's three shards, b's

    run_nodes([a, b], scenario)


def test_latest_waits_for_a_part_whose_intent_reached_the_remote_after_the_marker(tmp_path: Path) -> None:
    """Node b's intent is late (its remote slow for longer than ``--remote-wait``): a's gate
    cannot see b, and a's marker goes out over a step without b's shard.  ``latest`` then
    finds b's round, begun before the marker: the step is not complete until b's done is out
    and its shard is there (it named the step, b's shard missing, the moment the marker was
    out)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    step, marker = "ck/s1", "ck/s1/.metadata"
    intent_late = hold_intents(b)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        b.write(f"{step}/shard_b", b"B" * 1000)
        await asyncio.sleep(0.6)  # b's round began well before the marker (their clocks)
        shard_a = a.write(f"{step}/shard_a", b"A" * 1000)
        meta = a.write(marker, b"metadata")
        await until(lambda: a.durable(shard_a) and a.durable(meta), "a's marker out: b's intent is not there")
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "a's commit record")
        entered, release = b.remote.hold("put", f"{step}/shard_b")
        intent_late.set()
        await until(lambda: b.mover.groups.intent_out(step) and entered.is_set(), "b's intent, its shard uploading")
        latest, skipped = await find_latest(remote, "ck")
        assert latest is None and skipped and "node b's part" in skipped[0][1], (latest, skipped)
        release.set()
        b_done = f"{GROUPS_PREFIX}{step}/b@"
        await until(lambda: any(k.endswith(".done") for k in keys(remote_dir, b_done)), "b's done")
        latest, skipped = await find_latest(remote, "ck")
        assert latest is not None and latest.dir == step and latest.files == 3, (latest, skipped)

    run_nodes([a, b], scenario)


def test_latest_orders_checkpoints_by_when_their_marker_was_written(tmp_path: Path) -> None:
    """Commit records that land in the same second (the remote's mtime resolution), or an older
    step whose commit got out last (its node came back late): ``latest`` is still the step whose
    marker was written last."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        for step in ("step_9", "step_10"):  # step_9 sorts after step_10 as a string
            node.write(f"run/{step}/shard", step.encode())
            meta = node.write(f"run/{step}/.metadata", b"m")
            await until(lambda meta=meta: node.durable(meta), f"{step}'s marker")
        await until(lambda: len(keys(remote_dir, COMMITS_PREFIX)) == 2, "both commits")
        records = {k.split("/")[-2]: remote_dir / k for k in keys(remote_dir, COMMITS_PREFIX)}
        remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))
        same_second = int(time.time()) - 60
        for record in records.values():
            os.utime(record, (same_second, same_second))
        latest, _ = await find_latest(remote, "run")
        assert latest is not None and latest.dir == "run/step_10"
        os.utime(records["step_9"], (same_second + 30, same_second + 30))  # step_9's node came back late
        latest, _ = await find_latest(remote, "run")
        assert latest is not None and latest.dir == "run/step_10"

    run_nodes([node], scenario)


def test_a_deleted_checkpoint_takes_its_commit_record_with_it(tmp_path: Path) -> None:
    """Keep-last-N over a long run: the commit records of deleted steps go with their marker,
    so ``.burstfs/commits/`` (what ``latest`` lists) does not grow with every step ever written."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        inos = {}
        for step in ("step_1", "step_2"):
            shard = node.write(f"run/{step}/shard", step.encode())
            inos[step] = (shard, node.write(f"run/{step}/.metadata", b"m"))
            await until(lambda meta=inos[step][1]: node.durable(meta), f"{step}'s marker")
        await until(lambda: len(keys(remote_dir, COMMITS_PREFIX)) == 2, "both commits")
        for ino in inos["step_2"]:  # the newest step removed (say, found broken)
            node.front.unlink(ino)
        node.mover.namespace_changed()
        await until(lambda: len(keys(remote_dir, COMMITS_PREFIX)) == 1, "step_2's commit record deleted")
        assert "run/step_2/.metadata" not in keys(remote_dir)
        latest, skipped = await find_latest(remote, "run")
        assert latest is not None and latest.dir == "run/step_1" and skipped == []

    run_nodes([node], scenario)


def test_a_removed_checkpoint_loses_its_marker_on_the_remote_before_any_other_file(tmp_path: Path) -> None:
    """``rm -r`` of a committed step unlinks in readdir order, the marker written last perhaps
    last: the remote deletes still take the marker first.  A daemon killed between two deletes
    then leaves a step without its marker, never a marker over a torn step."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    deleted: list[str] = []
    delete = node.remote.delete

    async def observed(key: str) -> None:
        if not key.startswith(".burstfs/"):  # not the manifests and records
            deleted.append(key)
        await delete(key)

    node.remote.delete = observed  # type: ignore[method-assign]

    async def scenario() -> None:
        shards = [node.write(f"ck/s1/__{rank}_0.distcp", b"x" * 100) for rank in range(3)]
        meta = node.write("ck/s1/.metadata", b"m")
        await until(lambda: node.durable(meta), "the marker")
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "the commit record")
        node.front.unlink(shards[0])  # the first entry rm -r finds ...
        node.mover.namespace_changed()
        await asyncio.sleep(0.5)  # the mover's passes come and go
        assert deleted == [] and "ck/s1/__0_0.distcp" in keys(remote_dir)
        node.front.unlink(shards[1])  # ... and the next, before the marker
        node.front.unlink(meta)
        node.front.unlink(shards[2])
        node.mover.namespace_changed()
        await until(lambda: not node.front.journal.keys.pending_deletes(10), "the remote deletes")
        assert deleted[0] == "ck/s1/.metadata", deleted
        assert sorted(deleted[1:]) == [f"ck/s1/__{rank}_0.distcp" for rank in range(3)]
        assert not keys(remote_dir, "ck/") and not keys(remote_dir, COMMITS_PREFIX)

    run_nodes([node], scenario)


@pytest.mark.parametrize("pointer_update", ["in place", "by rename"])
def test_a_pruned_step_stays_on_the_remote_while_the_remote_latest_still_names_it(
    tmp_path: Path, pointer_update: str
) -> None:
    """keep-last-N prunes step 1 once step 3 is durable, while ``latest`` naming step 3 still
    waits for a slow shard of step 2: the remote's ``latest`` names step 1 until then, so step
    1's objects stay until the pointer that names a newer step is on the remote.  (By rename:
    the pointer waiting to drain had never been uploaded, and held nothing.)"""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)

    def remote_latest() -> bytes:
        return (remote_dir / "ck" / "latest").read_bytes()

    def point_at(step: bytes) -> int:
        if pointer_update == "in place":
            return node.write("ck/latest", step)
        written = node.write("ck/latest.tmp", step)
        node.front.rename(written, "latest", node.dirs["ck"])
        return written

    async def scenario() -> None:
        step1 = [node.write("ck/s1/__0_0.distcp", b"1" * 100), node.write("ck/s1/.metadata", b"m1")]
        pointer = point_at(b"s1")
        await until(lambda: node.durable(pointer) and all(node.durable(ino) for ino in step1), "step 1")
        _, release = node.remote.hold("put", "ck/s2/__0_0.distcp")
        node.write("ck/s2/__0_0.distcp", b"2" * 100)
        node.write("ck/s2/.metadata", b"m2")
        point_at(b"s2")
        step3 = [node.write("ck/s3/__0_0.distcp", b"3" * 100), node.write("ck/s3/.metadata", b"m3")]
        point_at(b"s3")
        await until(lambda: all(node.durable(ino) for ino in step3), "step 3")
        for ino in reversed(step1):  # prune_checkpoints: the marker first
            node.front.unlink(ino)
        node.mover.namespace_changed()
        await asyncio.sleep(1.0)  # the mover's passes come and go
        assert remote_latest() == b"s1" and {"ck/s1/.metadata", "ck/s1/__0_0.distcp"} <= keys(remote_dir, "ck/s1/")
        release.set()
        await until(lambda: not node.front.journal.keys.pending_deletes(10), "the remote deletes")
        assert remote_latest() == b"s3" and not keys(remote_dir, "ck/s1/")

    run_nodes([node], scenario)


def test_latest_replaced_by_rename_stays_on_the_remote_until_the_new_one_lands(tmp_path: Path) -> None:
    """``write latest.tmp; rename onto latest`` (an atomic pointer update): the old object's
    delete went at once, while the new ``latest`` waited for the step it names to drain, so
    the remote had no ``latest`` at all meanwhile (a restart then found no checkpoint)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        pointer = node.write("ck/latest", b"s1")
        await until(lambda: node.durable(pointer), "the first latest")
        _, release = node.remote.hold("put", "ck/s2/__0_0.distcp")
        node.write("ck/s2/__0_0.distcp", b"2" * 100)
        replacement = node.write("ck/latest.tmp", b"s2")
        node.front.rename(replacement, "latest", node.dirs["ck"])
        node.mover.namespace_changed()
        await asyncio.sleep(1.0)  # the mover's passes come and go
        assert (remote_dir / "ck" / "latest").read_bytes() == b"s1"
        release.set()
        await until(lambda: node.durable(replacement), "the new latest")
        await until(lambda: not node.front.journal.keys.pending_deletes(10), "the delete queue")
        assert (remote_dir / "ck" / "latest").read_bytes() == b"s2"

    run_nodes([node], scenario)


@pytest.mark.parametrize("given_up", [False, True])
def test_latest_replaced_by_a_drained_tmp_or_given_up_keeps_the_old_one_on_the_remote(
    tmp_path: Path, given_up: bool
) -> None:
    """``write latest.tmp; fsync; rename onto latest``: the fsync drains ``latest.tmp`` before
    the rename, so the new ``latest`` was durable (under its old key) and nothing held the old
    object's delete: the remote had no ``latest``, and no commit record, until the step it
    names was out.  And when that step is given up (``abandon``: a node is lost), the old
    ``latest`` was deleted for good: a restart found no checkpoint."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        a.write("ck/s1/shard_a", b"a1")
        first = a.write("ck/latest", b"s1")
        await until(lambda: a.durable(first) and keys(remote_dir, COMMITS_PREFIX), "the first latest, committed")
        lost, release = b.remote.hold("put", "ck/s2/shard_b")
        b.write("ck/s2/shard_b", b"b")
        await until(lambda: lost.is_set() and b.mover.groups.intent_out("ck/s2"), "b's intent, its shard stuck")
        a.write("ck/s2/shard_a", b"a2")
        tmp = a.write("ck/latest.tmp", b"s2")
        await until(lambda: a.durable(tmp), "latest.tmp drained before the rename")
        a.front.rename(tmp, "latest", a.dirs["ck"])
        a.mover.namespace_changed()
        await until(lambda: a.mover.groups.waiting_markers(), "the new latest waiting for b")
        if given_up:
            await a.mover.groups.abandon(remote, "ck")
            await until(lambda: a.front.row(tmp).state == FAILED, "the new latest given up")
        await asyncio.sleep(1.0)  # the mover's passes come and go
        assert (remote_dir / "ck/latest").read_bytes() == b"s1"
        latest, skipped = await find_latest(remote, "ck")
        assert latest is not None and latest.step == "ck/s1", (latest, skipped)
        if not given_up:
            release.set()
            await until(lambda: (remote_dir / "ck/latest").read_bytes() == b"s2", "the new latest on the remote")

    run_nodes([a, b], scenario)


def test_latest_names_the_last_step_while_a_pointer_rewritten_in_place_awaits_its_record(tmp_path: Path) -> None:
    """DeepSpeed rewrites ``latest`` in place: its new bytes are on the remote before its new
    commit record, and the one record of the pointer then named bytes no longer there, so
    ``latest`` said "no checkpoint" (exit 1: a restart script starts over) in that window.
    The step the older record names is still complete: that is the answer meanwhile."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))
    record_out = asyncio.Event()
    create_object = a.remote.create_object

    async def held_commit(key: str, data: bytes) -> bool:
        if key.startswith(COMMITS_PREFIX) and b"ck/s2/" in data:
            await record_out.wait()
        return await create_object(key, data)

    a.remote.create_object = held_commit  # type: ignore[method-assign]

    async def scenario() -> None:
        a.write("ck/s1/shard", b"1")
        pointer = a.write("ck/latest", b"s1")
        await until(lambda: a.durable(pointer) and keys(remote_dir, COMMITS_PREFIX), "the first commit")
        first = keys(remote_dir, COMMITS_PREFIX)
        a.write("ck/s2/shard", b"2")
        a.write("ck/latest", b"s2")
        await until(lambda: (remote_dir / "ck/latest").read_bytes() == b"s2", "the new latest's bytes")
        latest, skipped = await find_latest(remote, "ck")
        assert latest is not None and latest.step == "ck/s1", (latest, skipped)
        record_out.set()
        await until(lambda: keys(remote_dir, COMMITS_PREFIX) - first, "the new record")
        latest, skipped = await find_latest(remote, "ck")
        assert latest is not None and latest.step == "ck/s2", (latest, skipped)

    run_nodes([a], scenario)


def test_a_node_never_deletes_or_moves_the_object_another_node_wrote_at_its_key(tmp_path: Path) -> None:
    """Two nodes write the same path (last writer wins on the remote); the node written over
    then removes or renames its own copy: the other node's object stays, with its manifest
    (it deleted it, and that node went on calling its file durable)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, c = Node(tmp_path, "a", remote_dir), Node(tmp_path, "c", remote_dir)

    def manifest_node(key: str) -> str | None:
        path = remote_dir / ".burstfs" / "manifests" / f"{key}.json"
        return json.loads(path.read_bytes()).get("node") if path.exists() else None

    async def scenario() -> None:
        inos = {}
        for name in ("x.bin", "y.bin"):
            inos[name] = a.write(f"shared/{name}", b"A" * 1000)
            await until(lambda ino=inos[name]: a.durable(ino), f"a's {name}")
            other = c.write(f"shared/{name}", b"C" * 2000)
            await until(lambda ino=other: c.durable(ino), f"c's {name}")
            assert (remote_dir / "shared" / name).read_bytes() == b"C" * 2000 and manifest_node(f"shared/{name}") == "c"
        a.front.unlink(inos["x.bin"])
        a.front.rename(inos["y.bin"], "z.bin", a.dirs["shared"])
        a.mover.namespace_changed()
        await until(lambda: not a.front.journal.keys.pending_deletes(10), "a's delete queue done")
        await until(lambda: a.durable(inos["y.bin"]) and (remote_dir / "shared/z.bin").exists(), "a's z.bin")
        assert (remote_dir / "shared" / "z.bin").read_bytes() == b"A" * 1000  # its own bytes, not c's
        for name in ("x.bin", "y.bin"):
            assert (remote_dir / "shared" / name).read_bytes() == b"C" * 2000, name
            assert manifest_node(f"shared/{name}") == "c", name

    run_nodes([a, c], scenario)


def test_latest_names_the_step_a_latest_pointer_beside_it_points_to(tmp_path: Path) -> None:
    """A `latest` file beside the step directories is a commit marker of the parent (its commit is
    always the newest): ``latest`` still names the step, which a loader can open.  Megatron's
    tracker beside step directories that have no marker of their own names the parent."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        for step in ("step_1", "step_2"):
            node.write(f"ckpt/{step}/__0_0.distcp", step.encode())
            node.write(f"ckpt/{step}/.metadata", b"m")
            pointer = node.write("ckpt/latest", step.encode())
            await until(lambda pointer=pointer: node.durable(pointer), f"latest -> {step}")
        tracker = node.write("megatron/iter_0000100/mp_rank_00/model_optim_rng.pt", b"weights")
        tracker = node.write("megatron/latest_checkpointed_iteration.txt", b"100")
        await until(lambda: node.durable(tracker), "the tracker")
        await until(lambda: len(keys(remote_dir, COMMITS_PREFIX)) == 4, "every commit")
        latest, _ = await find_latest(remote, "ckpt")
        assert latest is not None and latest.dir == "ckpt/step_2", latest
        latest, _ = await find_latest(remote, "megatron")
        assert latest is not None and latest.dir == "megatron" and latest.marker.endswith("iteration.txt"), latest

    run_nodes([node], scenario)


def test_an_abandon_frees_only_later_checkpoints_not_an_earlier_runs_marker(tmp_path: Path) -> None:
    """Run 1: node a1 is lost after its intent; a0's marker waits, still staged (a cache drained
    later).  Run 2 writes the same directory again (b0, b1); its marker waits for a1 too, and an
    operator abandons it on b0.  Run 1's marker must not go out over run 2's shards (it did,
    and `latest` called the mix complete); a checkpoint written after the abandon does."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a0, a1, b0, b1 = (Node(tmp_path, name, remote_dir) for name in ("a0", "a1", "b0", "b1"))
    marker = "ck/s2/.metadata"
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        lost, _ = a1.remote.hold("put", "ck/s2/r1")  # never released: a1 is gone
        a1.write("ck/s2/r1", b"old1")
        await until(lambda: lost.is_set() and a1.mover.groups.intent_out("ck/s2"), "a1's intent, its shard stuck")
        a0.write("ck/s2/r0", b"old0")
        old_meta = a0.write(marker, b"meta-old")
        await until(lambda: a0.mover.groups.waiting_markers(), "run 1's marker waiting for a1")
        b0.write("ck/s2/r0", b"new0")
        b1.write("ck/s2/r1", b"new1")
        b0.write(marker, b"meta-new")
        await until(lambda: b0.mover.groups.waiting_markers(), "run 2's marker waiting for a1")
        await asyncio.sleep(0.05)  # the remote's clock moves on past run 2's intents
        given_up_dir, given_up = await b0.mover.groups.abandon(remote, "ck/s2")
        assert given_up_dir == "ck/s2" and [w.node for w in given_up] == ["a1"]
        # Run 1's marker is of the checkpoint given up: it fails (a drain of its cache ends).
        await until(lambda: a0.front.row(old_meta).state == FAILED, "run 1's marker given up")
        assert "abandoned" in (a0.front.row(old_meta).error or "")
        assert marker not in keys(remote_dir)
        latest, _ = await find_latest(remote, "ck")
        assert latest is None
        # A checkpoint written after the abandon is a later one: it goes out.
        b0.write("ck/s2/r0", b"v3-0")
        b1.write("ck/s2/r1", b"v3-1")
        new_meta = b0.write(marker, b"meta-v3")
        await until(lambda: b0.durable(new_meta), "the checkpoint written after the abandon")
        assert (remote_dir / marker).read_bytes() == b"meta-v3"
        assert not a0.durable(old_meta)

    run_nodes([a0, a1, b0, b1], scenario)


def test_latest_does_not_go_by_a_markers_mtime(tmp_path: Path) -> None:
    """A marker copied with its mtime kept (``cp -a``, ``rsync -a``, ``tar``) or touched back:
    the newer step is still the latest (the commit was named by the marker's mtime)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        node.write("run/step_1/shard", b"1")
        meta = node.write("run/step_1/.metadata", b"m1")
        await until(lambda: node.durable(meta), "step 1's marker")
        node.write("run/step_2/shard", b"2")
        parent = node.mkdirs("run/step_2")
        meta = node.front.create(".metadata", parent)
        node.front.tier.path(meta).write_bytes(b"m2")
        a_year_ago = time.time() - 365 * 86400
        os.utime(node.front.tier.path(meta), (a_year_ago, a_year_ago))
        node.front.close(meta)
        node.mover.wake()
        await until(lambda: node.durable(meta), "step 2's marker")
        await until(lambda: len(keys(remote_dir, COMMITS_PREFIX)) == 2, "both commits")
        latest, _ = await find_latest(FileRemote(parse_remote_url(f"file://{remote_dir}")), "run")
        assert latest is not None and latest.dir == "run/step_2"

    run_nodes([node], scenario)


@pytest.mark.parametrize(
    ("pointer", "names"),
    [("latest", {"s1": b"s1", "s2": b"s2"}), ("latest_checkpointed_iteration.txt", {"s1": b"1\n", "s2": b"2\n"})],
)
def test_a_pointer_waits_for_the_step_it_names_not_the_next_ones(
    tmp_path: Path, pointer: str, names: dict[str, bytes]
) -> None:
    """A pointer beside step directories (DeepSpeed's ``latest``, Megatron's tracker) waits for
    every node's round in the step it names, not for the next steps other nodes are already
    writing: gated on its whole directory it lagged tens of steps at a cadence faster than the
    drain.  Content naming no directory here gates on the whole directory, as before."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    step = {"s1": "ck/s1", "s2": "ck/s2"} if pointer == "latest" else {"s1": "ck/iter_0000001", "s2": "ck/iter_0000002"}
    tracker = f"ck/{pointer}"

    def remote_pointer() -> bytes | None:
        path = remote_dir / tracker
        return path.read_bytes() if path.exists() else None

    async def scenario() -> None:
        entered, release = b.remote.hold("put", f"{step['s2']}/shard_b")
        shards = [a.write(f"{step['s1']}/shard_a", b"A" * 100), b.write(f"{step['s1']}/shard_b", b"B" * 100)]
        await until(
            lambda: all(node.durable(ino) for node, ino in zip((a, b), shards, strict=True)), "step 1 on both nodes"
        )
        b.write(f"{step['s2']}/shard_b", b"b" * 100)  # b's next step: its upload held
        await until(lambda: entered.is_set() and b.mover.groups.intent_out(step["s2"]), "b's next step under way")
        first = a.write(tracker, names["s1"])
        await until(lambda: a.durable(first), "the pointer to step 1, with b's step 2 under way")
        assert remote_pointer() == names["s1"]
        a.write(f"{step['s2']}/shard_a", b"a" * 100)
        second = a.write(tracker, names["s2"])
        await asyncio.sleep(1.0)  # step 2 is b's too: the pointer that names it waits
        assert not a.durable(second) and remote_pointer() == names["s1"]
        assert [w["dir"] for w in a.mover.groups.waiting_markers()] == [step["s2"]]  # status names the step
        stray = a.write(tracker, b"nothing-here\n")  # names no step: the whole directory's rounds
        await asyncio.sleep(1.0)
        assert not a.durable(stray) and remote_pointer() == names["s1"]
        # Status shows what the pointer waits for now, not the step its older version named,
        # and that it was rewritten while it waited (the remote pointer does not advance).
        assert [(w["dir"], w["pointer_rewrites"]) for w in a.mover.groups.waiting_markers()] == [("ck", 1)]
        line = _held_line(a.mover.groups.waiting_markers()[0])
        assert line.startswith("checkpoint ck waiting for node b") and "rewritten once while it waited" in line
        release.set()
        await until(lambda: a.durable(stray), "the pointer once b's step 2 is done")
        assert remote_pointer() == b"nothing-here\n"

    run_nodes([a, b], scenario)


def test_a_pointer_replaced_by_rename_while_it_waits_shows_once_and_is_abandoned_by_its_step(
    tmp_path: Path,
) -> None:
    """``latest.tmp`` renamed onto ``latest`` at every step (a new inode each time) while a
    slow node holds the steps: status listed the replaced version's step beside the current one
    (and counted no rewrite), and ``abandon`` of the pointer's directory could give up that
    stale step, leaving the current pointer waiting."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        for step in ("s1", "s2", "s3"):
            b.remote.hold("put", f"ck/{step}/shard_b")  # never released: b is slow, then lost
            b.write(f"ck/{step}/shard_b", b"b")
            await until(lambda s=step: b.mover.groups.intent_out(f"ck/{s}"), f"b's intent in {step}")  # type: ignore[misc]
            a.write(f"ck/{step}/shard_a", b"a")
            tmp = a.write("ck/latest.tmp", step.encode())
            a.front.rename(tmp, "latest", a.dirs["ck"])
            a.mover.namespace_changed()
            await until(
                lambda s=step: [w["dir"] for w in a.mover.groups.waiting_markers()] == [f"ck/{s}"],  # type: ignore[misc]
                f"the pointer to {step} waiting, alone in status",
            )
        assert a.mover.groups.waiting_markers()[0]["pointer_rewrites"] == 2
        given_up_dir, _ = await a.mover.groups.abandon(remote, "ck")
        assert given_up_dir == "ck/s3"

    run_nodes([a, b], scenario)


def test_a_pointer_waiting_for_a_lost_node_is_abandoned_by_its_directory(tmp_path: Path) -> None:
    """``latest`` names a step a lost node never finished: the operator gives it up by the
    pointer's directory (where the file is) or by the step's (what status shows); either way
    the pointer fails and a later one goes out."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        lost, _ = b.remote.hold("put", "ck/s1/shard_b")  # never released: b is gone
        b.write("ck/s1/shard_b", b"b")
        await until(lambda: lost.is_set() and b.mover.groups.intent_out("ck/s1"), "b's intent, its shard stuck")
        a.write("ck/s1/shard_a", b"a")
        pointer = a.write("ck/latest", b"s1")
        await until(lambda: a.mover.groups.waiting_markers(), "the pointer waiting for b")
        given_up_dir, given_up = await a.mover.groups.abandon(remote, "ck")
        assert given_up_dir == "ck/s1" and [(w.node, w.dir_key) for w in given_up] == [("b", "ck/s1")]
        with pytest.raises(FsError) as again:  # nothing waits there any more (it gave up "none" again)
            await a.mover.groups.abandon(remote, "ck")
        assert again.value.errno == errno.ENOENT
        await until(lambda: a.front.row(pointer).state == FAILED, "the pointer given up")
        a.write("ck/s2/shard_a", b"a2")
        later = a.write("ck/latest", b"s2")
        await until(lambda: a.durable(later), "the pointer to the next step")
        assert (remote_dir / "ck/latest").read_bytes() == b"s2"

    run_nodes([a, b], scenario)


def test_latest_of_steps_without_markers_names_only_the_pointed_step(tmp_path: Path) -> None:
    """DeepSpeed's layout: step directories with no marker of their own, ``latest`` beside them.
    Its commit record names the files of the step it points at only: it named every step's
    whose records were under the directory, pruned ones too, so once keep-last-N removed a
    step ``burstfs-admin latest`` found files missing and said there was no checkpoint."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        shards = {}
        for step in ("global_step1", "global_step2", "global_step3"):
            shards[step] = [node.write(f"ck/{step}/mp_rank_0{rank}_model_states.pt", step.encode()) for rank in (0, 1)]
            pointer = node.write("ck/latest", step.encode())
            await until(lambda: node.durable(pointer), f"latest -> {step}")  # noqa: B023 (awaited here)
        for ino in shards["global_step1"]:  # keep-last-2
            node.front.unlink(ino)
        node.mover.namespace_changed()
        await until(lambda: not keys(remote_dir, "ck/global_step1/"), "the pruned step's deletes")
        found, skipped = await find_latest(remote, "ck")
        assert found is not None and found.dir == "ck" and found.files == 3, skipped
        record = json.loads((remote_dir / found.commit_key).read_bytes())
        assert sorted(f["path"] for f in record["files"]) == [
            f"ck/global_step3/mp_rank_0{rank}_model_states.pt" for rank in (0, 1)
        ]

    run_nodes([node], scenario)


def test_a_pointers_commit_lists_the_step_files_whose_done_went_out_during_the_gates_listing(tmp_path: Path) -> None:
    """The gate listed the step's records, the node's own done went out meanwhile, and the
    verdict took the round as done (its own state) with none of its files (the listing's): the
    pointer's commit record named no file, and ``latest`` answered the run directory as the
    step (a long run saw it about once in 30 steps)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))
    list_all = node.remote.list_all
    raced = []

    def done_out() -> bool:
        return any(k.endswith(".done") for k in keys(remote_dir, f"{GROUPS_PREFIX}run/step_1"))

    async def listing_overtaken_by_the_done(prefix: str):  # type: ignore[no-untyped-def]
        listed = [info async for info in list_all(prefix)]
        if "step_1" in prefix and not done_out():
            raced.append(prefix)
            await until(done_out, "the done record")  # the round's done goes out meanwhile
        for info in listed:
            yield info

    node.remote.list_all = listing_overtaken_by_the_done  # type: ignore[method-assign]

    async def scenario() -> None:
        for rank in (0, 1):
            node.write(f"run/step_1/shard{rank}.pt", b"x" * 100)
        pointer = node.write("run/latest", b"step_1")
        await until(lambda: node.durable(pointer), "the pointer")
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "its commit record")
        found, skipped = await find_latest(remote, "run")
        assert found is not None and found.step == "run/step_1", (found, skipped)
        record = json.loads((remote_dir / found.commit_key).read_bytes())
        assert sorted(f["path"] for f in record["files"]) == ["run/step_1/shard0.pt", "run/step_1/shard1.pt"]

    run_nodes([node], scenario)
    assert raced, "no gate listing raced the done record"


def test_latest_fails_rather_than_skip_a_checkpoint_it_may_not_read(tmp_path: Path) -> None:
    """A job's user asking ``latest --remote file://...`` may not read the commit records
    (root's, mode 0600): each was skipped as a bad checkpoint and the answer was "no complete
    checkpoint" (exit 1), so a restart script started over.  Not knowing is an error (exit 5)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)
    remote = FileRemote(parse_remote_url(f"file://{remote_dir}"))

    async def scenario() -> None:
        node.write("ck/step_1/__0_0.distcp", b"shard")
        marker = node.write("ck/step_1/.metadata", b"m")
        await until(lambda: node.durable(marker), "the marker")
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "its commit record")
        found, _ = await find_latest(remote, "ck")
        assert found is not None and found.dir == "ck/step_1"
        readable = remote.get_object

        async def denied(key: str) -> bytes:
            if key.startswith(COMMITS_PREFIX):
                raise RemoteError(f"{key}: permission denied", kind="access_denied")
            return await readable(key)

        remote.get_object = denied  # type: ignore[method-assign]
        with pytest.raises(RemoteError, match="permission denied"):
            await find_latest(remote, "ck")

    run_nodes([node], scenario)


def _dcp_metadata(*files: str) -> bytes:
    """A pickle shaped like DCP's ``.metadata``: its storage data names each shard file."""
    return pickle.dumps({"storage_data": {f"t{i}": (name, 0, 1000) for i, name in enumerate(files)}})


@pytest.mark.parametrize("index", ["dcp", "weight_map"])
def test_a_marker_waits_for_the_files_its_index_names_though_their_nodes_intent_is_late(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, index: str
) -> None:
    """Node b's intent does not reach the remote (its remote is down for it): no gate can see
    b, and a's ``.metadata`` went out naming b's shard, which was not there ("the residual
    window").  The index names b's shard: the marker waits until a done of some node lists
    it, says so in the status and the log, and the commit record lists both shards."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    step = "ck/s1"
    if index == "dcp":
        shard_a, shard_b, marker = "__0_0.distcp", "__1_0.distcp", ".metadata"
        content = _dcp_metadata(shard_a, shard_b)
    else:
        shard_a, shard_b, marker = "model-1-of-2.safetensors", "model-2-of-2.safetensors", "model.index.json"
        content = json.dumps({"weight_map": {"w1": shard_a, "w2": shard_b, "w3": shard_b}}).encode()
    intent_late = hold_intents(b)

    async def scenario() -> None:
        b.write(f"{step}/{shard_b}", b"B" * 1000)
        written_a = a.write(f"{step}/{shard_a}", b"A" * 1000)
        meta = a.write(f"{step}/{marker}", content)
        await until(lambda: a.durable(written_a), "a's own shard durable")
        for _ in range(40):  # the gate polls many times meanwhile: the marker stays back
            await asyncio.sleep(0.05)
            assert f"{step}/{marker}" not in keys(remote_dir) and not a.durable(meta)
        waiting = a.mover.groups.waiting_markers()
        assert [(w["dir"], w["unrecorded"]) for w in waiting] == [(step, [f"{step}/{shard_b}"])], waiting
        assert "not in any node's done record yet" in _held_line(waiting[0])
        assert f"event=marker_waiting dir={step} unrecorded=1 first={step}/{shard_b}" in caplog.text
        intent_late.set()
        await until(lambda: a.durable(meta), "the marker, once b's done lists its shard")
        await until(lambda: keys(remote_dir, COMMITS_PREFIX), "the commit record")
        commit = json.loads((remote_dir / next(iter(keys(remote_dir, COMMITS_PREFIX)))).read_bytes())
        assert sorted(f["path"] for f in commit["files"]) == sorted([f"{step}/{shard_a}", f"{step}/{shard_b}"])

    run_nodes([a, b], scenario)


def test_a_marker_waiting_for_a_file_its_index_names_is_given_up_by_abandon(tmp_path: Path) -> None:
    """A ``.metadata`` naming a shard no node ever writes (a lost node that never announced
    anything) waits; ``abandon`` on the marker's node gives the checkpoint up (never published)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        shard = a.write("ck/s1/__0_0.distcp", b"A" * 1000)
        meta = a.write("ck/s1/.metadata", _dcp_metadata("__0_0.distcp", "__1_0.distcp"))
        await until(lambda: a.durable(shard) and a.mover.groups.intent_out("ck/s1"), "a's own shard durable")
        await until(
            lambda: any(w["unrecorded"] for w in a.mover.groups.waiting_markers()), "the marker waiting for the shard"
        )
        assert [w["unrecorded"] for w in a.mover.groups.waiting_markers()] == [["ck/s1/__1_0.distcp"]]
        await asyncio.sleep(1.0)
        assert not a.durable(meta) and "ck/s1/.metadata" not in keys(remote_dir)
        assert a.mover.remote is not None
        given_up, intents = await a.mover.groups.abandon(a.mover.remote, "ck/s1")
        assert given_up == "ck/s1" and intents == []
        await until(lambda: a.front.journal.inode(meta).state == FAILED, "the marker given up")
        assert "ck/s1/.metadata" not in keys(remote_dir)

    run_nodes([a], scenario)


def test_the_rounds_of_a_removed_directory_go_from_the_remote_the_journal_and_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keep-last-N over a long run: every step directory ever written kept its intent and done
    on the remote, a journal row and an entry here (found by an acceptance pass: 2,494 records
    for 53 live steps after 1,245).  A directory removed here loses them; a live one keeps them."""
    monkeypatch.setattr(commitgroups, "FORGET_REMOVED_S", 0.2)
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        written = {step: node.write(f"run/{step}/shard", step.encode()) for step in ("step_1", "step_2")}
        for step in written:
            await until(lambda step=step: keys(remote_dir, f"{GROUPS_PREFIX}run/{step}/"), f"{step}'s records")
        await until(lambda: len([k for k in keys(remote_dir, GROUPS_PREFIX) if k.endswith(".done")]) == 2, "both dones")
        for ino in (written["step_1"], node.dirs.pop("run/step_1")):  # rm -r run/step_1
            node.front.unlink(ino)
            node.front.journal.apply(drop_unlinked_ops(ino))
        node.mover.namespace_changed()
        await until(lambda: not keys(remote_dir, f"{GROUPS_PREFIX}run/step_1/"), "step_1's records gone")
        assert len(keys(remote_dir, f"{GROUPS_PREFIX}run/step_2/")) == 2
        assert set(node.mover.groups.groups) == {"run/step_2"}
        rows = node.front.journal.meta_items("group:")
        assert [key for key, _ in rows] == ["group:run/step_2"]

    run_nodes([node], scenario)


def test_an_index_waiting_in_a_directory_renamed_meanwhile_waits_for_the_files_at_its_new_path(
    tmp_path: Path,
) -> None:
    """The index went in before its shards (``cp -r``), then the directory was renamed
    (tmp-checkpoint-N -> checkpoint-N): it kept waiting for the shards under the old path,
    for good (found by an acceptance pass)."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    node = Node(tmp_path, "a", remote_dir)

    async def scenario() -> None:
        meta = node.write("hf/tmp-10/.metadata", _dcp_metadata("__0_0.distcp"))
        await until(lambda: any(w["unrecorded"] for w in node.mover.groups.waiting_markers()), "the index waiting")
        node.front.rename(node.dirs.pop("hf/tmp-10"), "checkpoint-10", node.dirs["hf"])
        node.dirs["hf/checkpoint-10"] = node.front.journal.child(node.dirs["hf"], b"checkpoint-10").ino
        node.mover.namespace_changed()
        node.write("hf/checkpoint-10/__0_0.distcp", b"shard")
        await until(lambda: node.durable(meta), "the index published at the new path")
        assert {"hf/checkpoint-10/.metadata", "hf/checkpoint-10/__0_0.distcp"} <= keys(remote_dir)

    run_nodes([node], scenario)


def test_an_index_goes_once_a_file_it_names_is_whole_on_the_remote_though_its_nodes_records_never_come(
    tmp_path: Path,
) -> None:
    """n1's remote refused its records (503) and its shard drained after the heal; its
    `unmount --wait` returned before the records went out, and n0's index waited for good.
    A file the index names that is whole on the remote (object and manifest) counts."""
    remote_dir = tmp_path / "remote"
    remote_dir.mkdir()
    a, b = Node(tmp_path, "a", remote_dir), Node(tmp_path, "b", remote_dir)
    refuse_records(b, lambda key: RemoteError(f"{key}: 503 SlowDown", kind="throttled"))

    async def scenario() -> None:
        shard_b = b.write("ck/s1/__1_0.distcp", b"B" * 1000)
        a.write("ck/s1/__0_0.distcp", b"A" * 1000)
        meta = a.write("ck/s1/.metadata", _dcp_metadata("__0_0.distcp", "__1_0.distcp"))
        await until(lambda: b.durable(shard_b), "b's shard drained (its records refused)")
        await until(lambda: a.durable(meta), "a's index, once b's shard is whole on the remote")
        assert not keys(remote_dir, GROUPS_PREFIX + "ck/s1/b@")

    run_nodes([a, b], scenario)

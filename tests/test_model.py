"""Reference-model tests: random operation sequences, crashes and remote faults
against a plain model of what the namespace and the remote must hold.

Modelled on mountpoint-s3's reftests.  A hypothesis state machine drives one
node (core + journal + mover over a file remote, in-process: see reftest.py)
and a second node writing into the same prefix, with creates, writes,
truncates, renames of files and directories over existing targets, unlinks,
held-open writers, fsync, evictions and re-reads; drain steps, operations that
happen while a chosen upload call is in flight, daemon crashes at any journal
write or remote call of a drain, temporary and permanent remote faults and a
corrupted object.  A dict of paths to bytes is the model.

Checked after every step: the namespace and every file's bytes match the model
(evicted files are fetched back and verified: a corrupted object may give EIO,
never wrong bytes); a file the model knows as closed is never `incomplete`;
every row marked durable has its object with the journaled digest; the other
node's objects are untouched; the mover is alive.  At the end, after a full
drain: the remote holds exactly the model's files (plain bytes at their path,
a manifest each, nothing else of ours), and a fresh node over the same remote
(a cold mount) reads them all back.

The same machine runs over a file remote and over S3 (the tests' moto server,
through aiobotocore as in production).  Budget: ``BURSTFS_MODEL_EXAMPLES``
sequences (default 200) on the file remote and ``BURSTFS_MODEL_S3_EXAMPLES``
(default 15) on S3, of ``BURSTFS_MODEL_STEPS`` steps (default 50), with a fixed
seed unless ``BURSTFS_MODEL_RANDOM=1``.  The large run by hand:

    BURSTFS_MODEL_EXAMPLES=3000 BURSTFS_MODEL_RANDOM=1 .venv/bin/python -m pytest tests/test_model.py -x
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from reftest import Crash, FileSide, Node, NodeOptions, RemoteSide, S3Side, fast_mover
from s3server import fresh_bucket

from burstfs.config import DEFAULT_COMMIT_MARKERS, is_commit_marker
from burstfs.errors import BurstfsError, FsError, to_errno
from burstfs.journal import ROOT_INO
from burstfs.journal.rows import INODE_SELECT, row_from_values
from burstfs.objects import Manifest, manifest_key
from burstfs.status import arrived

UID, GID = os.getuid(), os.getgid()
DIRS = ("a", "a/b", "c")
# A directory with shards and a .metadata is a DCP checkpoint: a cold node's read-back walks its read plan.
NAMES = ("f0.distcp", "f1.distcp", "latest", ".metadata")
PATHS = tuple(f"{d}/{n}" for d in ("", *DIRS) for n in NAMES)
FOREIGN_DIR = "other"  # where the second node writes
SIZES = (0, 1, 4095, 4096, 65535, 65536, 65537, 150_000)
MAX_HELD = 2


def file_path(path: str) -> str:
    return path.lstrip("/")


def payload(seed: int, size: int) -> bytes:
    return random.Random(seed).randbytes(size)


@dataclasses.dataclass
class ModelFile:
    """What one file must contain, and what may be said of its remote copy."""

    content: bytes = b""
    dirty: bool = False  # changed through a held handle since its last close
    unclosed: bool = False  # created through a held handle, never closed
    incomplete: bool = False  # open for writing when the daemon died: never drains
    corrupt: bool = False  # its remote object was damaged on purpose
    # The damaged objects themselves: one a newer version never replaces (it was left
    # incomplete by a crash, so it never drains) stays on the remote as it was damaged.
    damaged: set[bytes] = dataclasses.field(default_factory=set)
    history: set[bytes] = dataclasses.field(default_factory=set)  # every closed version
    close_seq: int = 0  # order of its last close among all closes (0: never closed)

    def close(self, seq: int) -> None:
        """Journaled as closed; a file left incomplete stays so until it is emptied."""
        self.dirty = self.unclosed = False
        if not self.incomplete:
            self.history.add(self.content)
        self.close_seq = seq


class BurstfsModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._timing = fast_mover()
        self._timing.__enter__()
        self.base = Path(tempfile.mkdtemp(prefix="burstfs-model-"))
        self.side = self.make_remote()
        self.node = Node(self.base / "cache", self.side, NodeOptions())
        self.other: Node | None = None
        self.dirs: set[str] = set()
        self.files: dict[str, int] = {}  # path -> inode number
        self.data: dict[int, ModelFile] = {}
        self.held: list[tuple[int, int]] = []  # (fh, ino)
        self.foreign: dict[str, bytes] = {}
        self.foreign_history: dict[str, set[bytes]] = {}
        self.closes = 0

    # -- helpers ------------------------------------------------------------------

    def make_remote(self) -> RemoteSide:
        root = self.base / "remote"
        root.mkdir()
        return FileSide(root)

    def next_close(self) -> int:
        self.closes += 1
        return self.closes

    def blocked_markers(self) -> frozenset[str]:
        """Commit markers that must not drain: a file under their directory, closed
        before them, was left incomplete by a crash (a torn checkpoint), or is still open
        for writing (it drains once released)."""
        writing = {ino for _, ino in self.held}
        blocked = set()
        for path, ino in self.files.items():
            name = path.rpartition("/")[2]
            if not is_commit_marker(name, DEFAULT_COMMIT_MARKERS):
                continue
            top = path.rpartition("/")[0]
            marker = self.data[ino]
            for other, other_ino in self.files.items():
                torn = self.data[other_ino]
                if (
                    other != path
                    and (top == "" or self.under(other, top))
                    and (torn.incomplete or other_ino in writing)
                    and 0 < torn.close_seq < marker.close_seq
                ):
                    blocked.add(path)
        return frozenset(blocked)

    def drain_step(self, node: Node | None = None) -> str:
        return (node or self.node).drain_until_idle(tolerated=self.blocked_markers)

    def call(self, fn_name: str, *args: object, **kw: object) -> object:
        return self.node.call(getattr(self.node.core, fn_name), *args, **kw)

    def parent_exists(self, path: str) -> bool:
        head = path.rpartition("/")[0]
        return head == "" or head in self.dirs

    def under(self, path: str, top: str) -> bool:
        return path == top or path.startswith(top + "/")

    def restart(self) -> None:
        """The daemon died: start a new one on the same cache, as `burstfs mount` would."""
        self.node.faults.crashed = True
        self.node.stop()
        for _, ino in self.held:  # open for writing when it died
            model = self.data[ino]
            if model.unclosed and not self.create_journaled(ino):  # created, its row still deferred: gone
                for path in [p for p, i in self.files.items() if i == ino]:
                    del self.files[path]
                continue
            if model.dirty or model.unclosed:
                model.incomplete = True
                model.dirty = model.unclosed = False
        self.held.clear()
        self.node = Node(self.node.cache, self.side, self.node.options)

    def create_journaled(self, ino: int) -> bool:
        """Whether a file created here got its row committed (``GroupCommitter.defer``)."""
        inode = self.node.core.inodes.get(ino)
        batch = inode.unjournaled if inode is not None else None
        return batch is None or (batch.done.is_set() and batch.error is None)

    def write_whole(self, path: str, content: bytes, pieces: int) -> None:
        parent, name = self.node.parent_and_name(path)
        if path in self.files:
            ino = self.files[path]
            fh = self.call("open", ino, os.O_WRONLY | os.O_TRUNC)
        else:
            fh, inode = self.call("create", parent, name, stat.S_IFREG | 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
            ino = inode.ino
            self.call("forget", ino, 1)
            self.files[path] = ino
            self.data[ino] = ModelFile()
        step = max(1, -(-len(content) // pieces))
        offsets = list(range(0, len(content), step))
        if pieces > 2:
            offsets.reverse()  # write-back delivers out of order sometimes
        for offset in offsets:
            self.call("write", fh, offset, content[offset : offset + step])
        self.call("flush", fh)
        self.call("release", fh)
        model = self.data[ino]
        model.content, model.corrupt, model.incomplete = content, False, False  # O_TRUNC empties it
        model.close(self.next_close())

    def read_back(self, node: Node, ino: int) -> bytes:
        fh = node.call(node.core.open, ino, os.O_RDONLY)
        try:
            chunks = []
            offset = 0
            while True:
                data = node.call(node.core.read, fh, offset, 1 << 17)
                chunks.append(data)
                offset += len(data)
                if len(data) < 1 << 17:
                    return b"".join(chunks)
        finally:
            node.call(node.core.release, fh)

    def rename_model(self, src: str, dst: str) -> None:
        if src in self.files:
            self.files[dst] = self.files.pop(src)
            return
        moved_dirs = {d for d in self.dirs if self.under(d, src)}
        self.dirs -= moved_dirs
        self.dirs |= {dst + d[len(src) :] for d in moved_dirs}
        for path in [p for p in self.files if self.under(p, src)]:
            self.files[dst + path[len(src) :]] = self.files.pop(path)

    # -- namespace operations ---------------------------------------------------------

    @rule(d=st.sampled_from(DIRS))
    def mkdir(self, d: str) -> None:
        if d in self.dirs or d in self.files or not self.parent_exists(d):
            return
        parent, name = self.node.parent_and_name(d)
        inode = self.call("mkdir", parent, name, 0o755, UID, GID)
        self.call("forget", inode.ino, 1)  # type: ignore[attr-defined]
        self.dirs.add(d)

    @rule(path=st.sampled_from(PATHS), seed=st.integers(0, 3), size=st.sampled_from(SIZES), pieces=st.integers(1, 3))
    def write_file(self, path: str, seed: int, size: int, pieces: int) -> None:
        path = file_path(path)
        if not self.parent_exists(path) or path in self.dirs:
            return
        self.write_whole(path, payload(seed, size), pieces)

    @rule(
        path=st.sampled_from(PATHS),
        offset=st.sampled_from((0, 100, 65536, 70000)),
        seed=st.integers(0, 3),
        size=st.sampled_from((1, 4096, 65536)),
    )
    def overwrite(self, path: str, offset: int, seed: int, size: int) -> None:
        path = file_path(path)
        if path not in self.files:
            return
        ino = self.files[path]
        data = payload(seed + 10, size)
        fh = self.call("open", ino, os.O_WRONLY)
        self.call("write", fh, offset, data)
        self.call("flush", fh)
        self.call("release", fh)
        model = self.data[ino]
        old = model.content.ljust(offset, b"\0")
        model.content = old[:offset] + data + old[offset + size :]
        model.corrupt = False
        model.close(self.next_close())

    @rule(path=st.sampled_from(PATHS), size=st.sampled_from((0, 10, 65536, 100_000)))
    def truncate(self, path: str, size: int) -> None:
        path = file_path(path)
        if path not in self.files:
            return
        ino = self.files[path]
        self.call("setattr", ino, size=size)
        model = self.data[ino]
        model.content = model.content[:size].ljust(size, b"\0")
        model.corrupt = False
        if size == 0:
            model.incomplete = False  # emptied: what is written next is all of it
        if any(h_ino == ino for _, h_ino in self.held):
            model.dirty = True  # a writer holds it open: published at its close
        else:
            model.close(self.next_close())

    @rule(src=st.sampled_from(PATHS + DIRS), dst=st.sampled_from(PATHS + DIRS))
    def rename(self, src: str, dst: str) -> None:
        src, dst = file_path(src), file_path(dst)
        if src == dst or not self.parent_exists(dst) or self.under(dst, src):
            return
        if src in self.files:
            if dst in self.dirs:
                return
        elif src in self.dirs:
            if dst in self.files or (
                dst in self.dirs and any(self.under(p, dst) and p != dst for p in (*self.files, *self.dirs))
            ):
                return
        else:
            return
        sp, sn = self.node.parent_and_name(src)
        dp, dn = self.node.parent_and_name(dst)
        self.call("rename", sp, sn, dp, dn, 0)
        if src in self.files and self.files.get(dst) == self.files[src]:
            return  # two names of one file (a hard link): rename(2) does nothing
        if dst in self.files:
            del self.files[dst]
        self.dirs.discard(dst)
        self.rename_model(src, dst)

    @rule(index=st.integers(0, 63), dst=st.sampled_from(PATHS + DIRS))
    def rename_existing(self, index: int, dst: str) -> None:
        """rename of an existing file or directory (the ``index``-th): ``rename`` picks both
        names at random and seldom finds a source, so a drained file was hardly ever renamed."""
        names = sorted({*self.files, *self.dirs})
        if names:
            self.rename(names[index % len(names)], dst)

    @rule(path=st.sampled_from(PATHS))
    def unlink(self, path: str) -> None:
        path = file_path(path)
        if path not in self.files:
            return
        parent, name = self.node.parent_and_name(path)
        self.call("unlink", parent, name)
        del self.files[path]

    @rule(index=st.integers(0, 63), dst=st.sampled_from(PATHS))
    def link(self, index: int, dst: str) -> None:
        """A hard link: one more name of an existing file (the ``index``-th), drained as its own object."""
        dst = file_path(dst)
        if not self.files or dst in self.files or dst in self.dirs or not self.parent_exists(dst):
            return
        src = sorted(self.files)[index % len(self.files)]
        ino = self.files[src]
        parent, name = self.node.parent_and_name(dst)
        self.call("link", ino, parent, name)
        self.call("forget", ino, 1)
        self.files[dst] = ino

    @rule(index=st.integers(0, 63))
    def unlink_a_link(self, index: int) -> None:
        """Unlink one name of a file that has several (its other names and objects stay)."""
        names = sorted(p for p, ino in self.files.items() if list(self.files.values()).count(ino) > 1)
        if names:
            self.unlink(names[index % len(names)])

    @rule(d=st.sampled_from(DIRS))
    def rmdir(self, d: str) -> None:
        if d not in self.dirs or any(self.under(p, d) and p != d for p in (*self.files, *self.dirs)):
            return
        parent, name = self.node.parent_and_name(d)
        self.call("rmdir", parent, name)
        self.dirs.discard(d)

    # -- writers that stay open -------------------------------------------------------

    # No preconditions on state that a crash can change: whether a crash fires depends on
    # timing, and the rules hypothesis may draw must not (it replays and shrinks by draws).
    @rule(path=st.sampled_from(PATHS), seed=st.integers(0, 3), size=st.sampled_from((0, 100, 70000)))
    def hold_open(self, path: str, seed: int, size: int) -> None:
        path = file_path(path)
        if len(self.held) >= MAX_HELD or not self.parent_exists(path) or path in self.dirs:
            return
        data = payload(seed + 20, size)
        if path in self.files:
            ino = self.files[path]
            fh = self.call("open", ino, os.O_RDWR)
        else:
            parent, name = self.node.parent_and_name(path)
            fh, inode = self.call("create", parent, name, stat.S_IFREG | 0o644, os.O_RDWR | os.O_CREAT, UID, GID)
            ino = inode.ino
            self.call("forget", ino, 1)
            self.files[path] = ino
            self.data[ino] = ModelFile(unclosed=True)
        model = self.data[ino]
        if data:
            self.call("write", fh, 0, data)
            model.content = data + model.content[len(data) :]
            model.dirty, model.corrupt = True, False
        self.held.append((fh, ino))

    @rule(index=st.integers(0, MAX_HELD - 1), sync=st.booleans())
    def close_held(self, index: int, sync: bool) -> None:
        if not self.held:
            return
        fh, ino = self.held[index % len(self.held)]
        model = self.data[ino]
        linked = ino in self.files.values()
        if sync:  # fsync publishes, the handle stays open
            self.call("fsync", fh, False)
            if linked and (model.dirty or model.unclosed):
                model.close(self.next_close())
            return
        self.held.remove((fh, ino))
        self.call("flush", fh)
        self.call("release", fh)
        if linked and (model.dirty or model.unclosed):
            model.close(self.next_close())

    # -- the drain and the tier -------------------------------------------------------

    @rule()
    def drain(self) -> None:
        if self.drain_step() == "crashed":
            self.restart()

    @rule(
        at=st.integers(1, 6),
        op=st.sampled_from(("rename", "unlink", "rewrite", "rename_dir", "link")),
        src=st.sampled_from(PATHS),
        dst=st.sampled_from(PATHS + DIRS),
        seed=st.integers(0, 3),
    )
    def drain_with_interleaving(self, at: int, op: str, src: str, dst: str, seed: int) -> None:
        """An operation lands while the ``at``-th remote change of this drain is in flight,
        and that call completes only after everything else has drained."""
        faults = self.node.faults
        done: list[BaseException | None] = []

        def interleave() -> None:
            try:
                if op == "rename":
                    self.rename(src, dst)
                elif op == "rename_dir":
                    self.rename(src.split("/")[0] or "a", dst.split("/")[0] or "c")
                elif op == "unlink":
                    self.unlink(src)
                elif op == "link":
                    self.link(seed, dst)
                else:
                    self.write_file(src, seed, 70000, 1)
                    self.write_file(dst if dst not in DIRS else src, seed + 1, 100, 1)
                done.append(None)
            except BaseException as exc:  # re-raised on the test thread
                done.append(exc)

        faults.release.clear()
        faults.hold_at, faults.on_hold = self.node.remote.changing_calls + at, interleave
        outcome = self.drain_step()
        if outcome != "held" and faults.hold_at is None:
            # A call reached the hold, but the drain halted (a permanent fault) or crashed
            # while the interleaving ran: it finishes before anything else happens.
            deadline = time.monotonic() + 60
            while not done and time.monotonic() < deadline:
                time.sleep(0.003)
            assert done, "the interleaving did not finish"
            if outcome == "halted" and faults.held.is_set():
                outcome = "held"
        if outcome == "held":
            if done and done[0] is not None:
                raise done[0]
            self.node.drain_until_idle_while_held()
            faults.held.clear()
            faults.release.set()
            outcome = self.drain_step()
        faults.hold_at, faults.on_hold = None, None
        faults.release.set()
        if outcome == "crashed":
            self.restart()

    @rule(path=st.sampled_from(PATHS))
    def evict(self, path: str) -> None:
        path = file_path(path)
        if path not in self.files:
            return
        try:
            self.call("evict", self.files[path])
        except FsError as exc:
            assert exc.errno in (errno.EAGAIN, errno.EBUSY), exc

    # -- faults ------------------------------------------------------------------

    @rule(count=st.integers(1, 3))
    def temporary_faults(self, count: int) -> None:
        self.node.faults.temp_failures = count

    @rule(count=st.integers(1, 2))
    def permanent_faults(self, count: int) -> None:
        self.node.faults.permanent_failures = count
        if self.drain_step() == "crashed":
            self.restart()
        self.node.call(self.node.drain.retry_failed)  # the operator's `burstfs-admin retry` once it is fixed

    @rule(after=st.integers(1, 12))
    def crash_during_drain(self, after: int) -> None:
        self.node.faults.crash_after = after
        outcome = self.drain_step()
        self.node.faults.crash_after = None
        if outcome == "crashed":
            self.restart()

    @rule()
    def crash_between_operations(self) -> None:
        self.restart()

    @rule(path=st.sampled_from(PATHS), where=st.integers(0, 1 << 20))
    def corrupt_remote_object(self, path: str, where: int) -> None:
        """Flip a byte of a durable file's object behind burstfs' back."""
        path = file_path(path)
        if path not in self.files or not self.create_journaled(self.files[path]):
            return
        ino, row = self.files[path], self.node.name_row(path)
        rows = self.node.rows(
            "SELECT remote_key FROM inodes WHERE ino=? AND state IN ('durable','evicted') "
            "AND durable_generation=generation",
            (row,),
        )
        if not rows or rows[0][0] is None:
            return
        data = bytearray(self.side.get(rows[0][0]) or b"")
        if not data:
            return
        data[where % len(data)] ^= 0x5A
        self.side.put(rows[0][0], bytes(data))
        self.data[ino].corrupt = True
        self.data[ino].damaged.add(bytes(data))

    # -- a second node on the same prefix -------------------------------------------

    def other_node(self) -> Node:
        if self.other is None:
            self.other = Node(self.base / "cache-other", self.side, NodeOptions(node_id="node-b"))
            parent, name = self.other.parent_and_name(FOREIGN_DIR)
            try:
                self.other.call(self.other.core.mkdir, parent, name, 0o755, UID, GID)
            except FsError as exc:
                assert exc.errno == errno.EEXIST
        return self.other

    @rule(name=st.sampled_from(("latest", "shard0")), seed=st.integers(0, 3), size=st.sampled_from((10, 70000)))
    def other_node_writes(self, name: str, seed: int, size: int) -> None:
        other = self.other_node()
        parent, raw = other.parent_and_name(f"{FOREIGN_DIR}/{name}")
        content = payload(seed + 30, size)
        try:
            ino = other.resolve(f"{FOREIGN_DIR}/{name}")
            other.call(other.core.unlink, parent, raw)  # delete and rewrite, as `latest` is
            del ino
        except KeyError:
            pass
        fh, inode = other.call(other.core.create, parent, raw, stat.S_IFREG | 0o644, os.O_WRONLY | os.O_CREAT, UID, GID)
        other.call(other.core.forget, inode.ino, 1)
        other.call(other.core.write, fh, 0, content)
        other.call(other.core.flush, fh)
        other.call(other.core.release, fh)
        assert other.drain_until_idle() == "idle"
        self.foreign[name] = content
        self.foreign_history.setdefault(name, set()).add(content)

    @rule(name=st.sampled_from(("latest", "shard0")))
    def other_node_deletes(self, name: str) -> None:
        if name not in self.foreign:
            return
        other = self.other_node()
        parent, raw = other.parent_and_name(f"{FOREIGN_DIR}/{name}")
        other.call(other.core.unlink, parent, raw)
        assert other.drain_until_idle() == "idle"
        del self.foreign[name]

    @rule()
    def list_and_read_other(self) -> None:
        """This node lists what the other node drained and reads it: right bytes or EIO."""
        self.check_foreign_view(self.node)

    def check_foreign_view(self, node: Node, exact: bool = False) -> None:
        try:
            directory = node.call(node.core.lookup, ROOT_INO, FOREIGN_DIR.encode())
        except FsError as exc:
            assert exc.errno == errno.ENOENT and not (exact and self.foreign), exc
            return
        node.call(node.core.forget, directory.ino, 1)
        fh = node.call(node.core.opendir, directory.ino)
        entries = node.call(node.core.readdir, fh, 0)
        node.call(node.core.releasedir, fh)
        seen = {}
        for raw, inode in entries:
            name = os.fsdecode(raw)
            try:
                seen[name] = self.read_back(node, inode.ino)
            except BurstfsError as exc:
                assert to_errno(exc) in (errno.EIO, errno.ENOENT), (name, exc)
                assert not exact, f"{FOREIGN_DIR}/{name} unreadable on a cold node: {exc}"
                continue
            assert seen[name] in self.foreign_history.get(name, set()), f"wrong bytes for {FOREIGN_DIR}/{name}"
        if exact:
            assert seen == self.foreign

    # -- invariants ----------------------------------------------------------------

    def namespace(self, node: Node) -> dict[str, str]:
        found: dict[str, str] = {}

        def walk(ino: int, prefix: str) -> None:
            for raw, child in (node.core.inodes[ino].children or {}).items():
                path = f"{prefix}{os.fsdecode(raw)}"
                if path == FOREIGN_DIR:
                    continue
                inode = node.core.inodes[child]
                found[path] = inode.kind
                if inode.kind == "dir":
                    walk(child, path + "/")

        node.call(walk, ROOT_INO, "")
        return found

    @invariant()
    def namespace_matches(self) -> None:
        expected = {d: "dir" for d in self.dirs} | {p: "file" for p in self.files}
        assert self.namespace(self.node) == expected

    @invariant()
    def every_file_reads_back(self) -> None:
        for path, ino in self.files.items():
            model = self.data[ino]
            try:
                data = self.read_back(self.node, ino)
            except BurstfsError as exc:  # what the front turns into an errno
                assert model.corrupt and to_errno(exc) == errno.EIO, f"{path}: {exc!r}"
                continue
            assert data == model.content, f"{path}: wrong bytes ({len(data)} read, {len(model.content)} expected)"

    @invariant()
    def journal_states_match(self) -> None:
        for path, ino in self.files.items():
            model = self.data[ino]
            held = any(h_ino == ino for _, h_ino in self.held)
            if held and model.unclosed and not self.create_journaled(ino):
                continue  # created, never closed: its row rides with the next commit
            (state,) = self.node.rows("SELECT state FROM inodes WHERE ino=?", (self.node.name_row(path),))[0]
            if held and (model.dirty or model.unclosed):
                assert state == "writing", (path, state)
            elif model.incomplete:
                assert state == "incomplete", (path, state)
            else:
                assert state not in ("incomplete", "failed"), (path, state)

    @invariant()
    def durable_rows_have_their_objects(self) -> None:
        for ino, key, digest in self.node.rows(
            "SELECT COALESCE(link_of, ino), remote_key, digest FROM inodes WHERE kind='file' AND parent!=0 "
            "AND state IN ('durable','evicted') AND durable_generation=generation"
        ):
            assert key is not None, ino
            if key.startswith(FOREIGN_DIR + "/"):
                continue  # the other node's: it may delete it whenever it likes
            data = self.side.get(key)
            assert data is not None, f"durable file {key} has no object"
            model = self.data.get(ino)
            if digest and not (model and model.corrupt):
                assert xxhash.xxh3_128_hexdigest(data) == digest, f"object {key} is not its file"

    @invariant()
    def what_a_wait_calls_durable_is_on_the_remote_at_its_path(self) -> None:
        """status.arrived, behind ``burstfs-admin wait``, ``unmount --wait`` and
        ``client.wait_durable``: a file it calls durable has its object at the file's own
        path (a renamed file's object moved), holding that file's bytes."""
        for path, ino in self.files.items():
            if self.data[ino].unclosed and not self.create_journaled(ino):
                continue  # created, never closed: not journaled yet
            values = self.node.rows(f"{INODE_SELECT} WHERE ino=?", (self.node.name_row(path),))
            row = row_from_values(values[0])
            if not arrived(path, row):
                continue
            data = self.side.get(path)
            assert data is not None, f"{path} is called durable but the remote has no object there"
            if row.digest and row.durable_generation == row.generation and not self.data[ino].corrupt:
                assert xxhash.xxh3_128_hexdigest(data) == row.digest, (
                    f"{path} is called durable, remote holds other bytes"
                )

    @invariant()
    def other_nodes_objects_untouched(self) -> None:
        theirs = {
            k[len(FOREIGN_DIR) + 1 :]: v for k, v in self.side.objects().items() if k.startswith(FOREIGN_DIR + "/")
        }
        assert theirs == self.foreign

    @invariant()
    def mover_alive(self) -> None:
        assert self.node.drain.last_crash is None, f"the mover died: {self.node.drain.last_crash!r}"

    # -- the end: everything drains, the remote is exactly the model ------------------------

    def teardown(self) -> None:
        try:
            self.final_check()
        finally:
            for node in (self.node, self.other):
                if node is not None:
                    try:
                        node.stop()
                    except Crash:
                        pass
            shutil.rmtree(self.base, ignore_errors=True)
            self._timing.__exit__(None, None, None)

    def final_check(self) -> None:
        if self.node.faults.crashed:
            self.restart()
        faults = self.node.faults
        faults.temp_failures = faults.permanent_failures = 0
        faults.crash_after = None
        for fh, ino in list(self.held):
            self.call("flush", fh)
            self.call("release", fh)
            model = self.data[ino]
            if ino in self.files.values() and (model.dirty or model.unclosed):
                model.close(self.next_close())
        self.held.clear()
        self.node.call(self.node.drain.retry_failed)
        assert self.drain_step() == "idle", self.node.pending(self.blocked_markers())
        self.check_remote()
        cold = Node(self.base / "cache-cold", self.side, NodeOptions(node_id="node-cold"))
        try:
            self.check_cold(cold)
        finally:
            cold.stop()

    def unpublished(self) -> set[str]:
        """Paths whose current bytes must not be on the remote yet (may show an older version)."""
        return {p for p, i in self.files.items() if self.data[i].incomplete} | self.blocked_markers()

    def check_remote(self) -> None:
        objects = self.side.objects()
        every_key = set(objects)
        unpublished = self.unpublished()
        for path, ino in self.files.items():
            model = self.data[ino]
            if path in unpublished:
                if path in objects:
                    held = objects.pop(path)
                    assert held in model.history or model.corrupt or held in model.damaged, f"{path}: unknown bytes"
                continue
            assert path in objects, f"{path} is not on the remote"
            data = objects.pop(path)
            if not model.corrupt:
                assert data == model.content, f"{path}: the remote holds other bytes"
            manifest = Manifest.from_json(self.side.get(manifest_key(path)) or b"(no manifest)")
            if not model.corrupt:
                assert manifest.digest == xxhash.xxh3_128_hexdigest(model.content), f"{path}: stale manifest"
        for name in self.foreign:
            objects.pop(f"{FOREIGN_DIR}/{name}")
        assert not objects, f"objects the model does not have: {sorted(objects)}"
        orphans = self.side.manifest_keys() - every_key
        assert not orphans, f"manifests without their object: {sorted(orphans)}"
        assert not self.side.uploads_left(), "multipart uploads left behind"

    def check_cold(self, cold: Node) -> None:
        """A fresh node over the same remote (a restore on a new machine) reads everything back."""
        unpublished = self.unpublished()
        expected = {p: self.data[i] for p, i in self.files.items() if p not in unpublished}

        def walk(ino: int, prefix: str) -> None:
            fh = cold.call(cold.core.opendir, ino)
            entries = cold.call(cold.core.readdir, fh, 0)
            cold.call(cold.core.releasedir, fh)
            for raw, inode in entries:
                path = f"{prefix}{os.fsdecode(raw)}"
                if path == FOREIGN_DIR:
                    continue
                if inode.kind == "dir":
                    walk(inode.ino, path + "/")
                    continue
                model = expected.pop(path, None)
                if model is None:
                    assert path in unpublished, f"cold node shows {path}, which the model does not have"
                    continue
                try:
                    data = self.read_back(cold, inode.ino)
                except BurstfsError as exc:
                    assert model.corrupt and to_errno(exc) == errno.EIO, f"{path}: {exc!r}"
                    continue
                assert data == model.content, f"{path}: a cold read returned wrong bytes"

        walk(ROOT_INO, "")
        assert not expected, f"missing on a cold node: {sorted(expected)}"
        self.check_foreign_view(cold, exact=True)


def model_settings(examples: str, steps: str) -> settings:
    return settings(
        max_examples=int(examples),
        stateful_step_count=int(steps),
        deadline=None,
        derandomize=os.environ.get("BURSTFS_MODEL_RANDOM") != "1",
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
        # No explain phase: its report imports a module late, which trips a CPython 3.11.7 AST bug
        # (SystemError "AST constructor recursion depth mismatch") and ends the whole pytest run.
        phases=[
            p
            for p in Phase
            if p != Phase.explain and (p != Phase.shrink or os.environ.get("BURSTFS_MODEL_SHRINK", "1") == "1")
        ],
    )


class BurstfsModelS3(BurstfsModel):
    """The same model over S3 (the tests' moto server, spoken to by aiobotocore as in production)."""

    endpoint = ""  # set by the fixture below

    def make_remote(self) -> RemoteSide:
        return S3Side(self.endpoint, fresh_bucket(self.endpoint, "model"), "run")


@pytest.fixture
def model_s3_endpoint(s3_env: str) -> None:
    BurstfsModelS3.endpoint = s3_env


# CI budgets: ~2 minutes on the file remote, less on S3 (each step talks HTTP); the
# by-hand budgets take longer than the default per-test timeout.
TIMEOUT = pytest.mark.timeout(int(os.environ.get("BURSTFS_MODEL_TIMEOUT", "900")))
BurstfsModel.TestCase.settings = model_settings(
    os.environ.get("BURSTFS_MODEL_EXAMPLES", "200"), os.environ.get("BURSTFS_MODEL_STEPS", "50")
)
BurstfsModelS3.TestCase.settings = model_settings(
    os.environ.get("BURSTFS_MODEL_S3_EXAMPLES", "15"), os.environ.get("BURSTFS_MODEL_STEPS", "50")
)
TestBurstfsModel = TIMEOUT(BurstfsModel.TestCase)
TestBurstfsModelS3 = TIMEOUT(pytest.mark.usefixtures("model_s3_endpoint")(BurstfsModelS3.TestCase))

"""The file-system core: namespace, file data on the local tier, and the journal.

Everything POSIX means here is decided in this module, independent of FUSE: the
pyfuse3 front only translates requests and errors.  Tests drive this class
in-process (see tests/test_core.py), as s3ql drives its ``Operations``.

Invariants:
- every namespace change and every close of a changed file is committed to the
  journal before the call returns;
- the data of an inode lives in ``LocalTier.path(ino)`` while ``inode.local``;
- an inode is destroyed (row and data file) only when it has no name, no open
  handle and no kernel lookup reference.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import time
from pathlib import Path
from typing import Protocol

import trio

from . import fallocate, hardlinks
from .capacity import StatFs, TierCapacity
from .committer import GroupCommitter
from .config import TierOptions
from .errors import BurstfsError, FsError, to_errno
from .iopath import BackingFiles, IOPaths
from .journal import (
    INCOMPLETE,
    META,
    NOT_LOCAL,
    REMOTE,
    ROOT_INO,
    WRITING,
    FileState,
    InodeRow,
    Journal,
    Op,
    drop_unlinked_ops,
    event_op,
    insert_inode_op,
    link_ops,
    recovered_incomplete_ops,
    set_meta_op,
    unlink_name_ops,
    unlink_ops,
    update_inode_op,
)
from .listings import LISTING_WAIT, RemoteListings
from .localtier import LocalTier
from .nodes import NAME_MAX, RESERVED_ROOT_NAME, Handle, Inode, Undo
from .objects import StreamingDigests
from .publish import Publisher
from .xattrs import ExtendedAttributes

log = logging.getLogger("burstfs.core")

# Reads of a file being fetched go straight to the tier while they stay this far
# behind its local prefix; nearer the frontier they go through the fetcher, which
# sees them and keeps its prefetch window running ahead.
PREFETCH_MARGIN = 64 << 20
# Never kept on regular files: a checkpoint store runs no programs, and without
# them the kernel may skip a security.capability lookup on every write
# (FUSE_HANDLE_KILLPRIV_V2, see burstfs/_passthrough.c).
FILE_MODE_DROPPED = stat.S_ISUID | stat.S_ISGID


class DrainHooks(Protocol):
    """What the core needs from the mover (absent when nothing drains)."""

    def file_closed(self) -> None:
        """A file was journaled as staged: wake the drain."""

    def namespace_changed(self) -> None:
        """A rename or unlink happened: durable objects may need moving or deleting."""

    async def wait_durable(self, ino: int, generation: int) -> None:
        """Return once ``generation`` of ``ino`` is durable; raise if it cannot be."""

    def writing_in(self, ino: int, dir_key: str, name: bytes) -> None:
        """``ino`` (named ``name``) is opened for writing, or closed, in ``dir_key``: this node
        takes part in the checkpoint there (a cross-node commit round)."""

    async def intent_published(self, dir_key: str) -> None:
        """Return once this node's part in ``dir_key``'s checkpoint is announced, or after a short bound."""


class Fetcher(Protocol):
    """What the core needs from the restore path: remote listings and remote bytes."""

    async def ensure_local(self, ino: int, offset: int, size: int) -> int:
        """Make bytes [offset, offset+size) of ``ino`` local; returns the length of the
        gap-free local prefix of the file (its size once it is all local)."""

    async def list_dir(self, dir_key: str) -> tuple[list[tuple[str, int, float]], list[str]]:
        """(name, size, mtime) of the remote files directly under ``dir_key``, and subdirectory names."""

    def forget(self, ino: int) -> None:
        """The file went away: drop any fetch state."""


def _write_hashed(fd: int, data: bytes, offset: int, digests: StreamingDigests | None) -> int:
    """pwrite, then hash what landed (runs in a worker thread for large writes)."""
    written = os.pwrite(fd, data, offset)
    if digests is not None:
        digests.update(offset, data if written == len(data) else data[:written])
    return written


def _now_ns() -> int:
    return time.time_ns()


def _check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise FsError(errno.EINVAL)


def _check_new_name(parent: Inode, name: bytes) -> None:
    """A name something is about to be made or renamed to; ``.burstfs`` is the
    remote's own at the root (manifests, layout) and is refused with EPERM."""
    _check_name(name)
    if parent.ino == ROOT_INO and name == RESERVED_ROOT_NAME:
        raise FsError(errno.EPERM, ".burstfs is reserved at the root of the mount")


class BurstCore:
    """The namespace and data of one mount, journaled."""

    def __init__(
        self,
        cache_dir: Path,
        journal: Journal,
        *,
        fsync_remote: bool = False,
        offload_writes: bool = True,
        digest_chunk_size: int = 8 << 20,
        capacity: TierOptions = TierOptions(),
        list_ttl: float = 30.0,
        listing_wait: float = LISTING_WAIT,
        backing: BackingFiles | None = None,
        drain: DrainHooks | None = None,
        fetcher: Fetcher | None = None,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.journal = journal
        self.tier = LocalTier(self.cache_dir)
        self.committer = GroupCommitter(journal)
        self.drain = drain  # wakes the mover; None: nothing drains (tests, read-only tools)
        self.fetcher = fetcher  # remote listings and bytes; None: local only
        self.fsync_remote = fsync_remote
        self.offload_writes = offload_writes
        self.digest_chunk_size = digest_chunk_size
        self.listings = RemoteListings(self, ttl=list_ttl, wait=listing_wait)
        self.io_paths = IOPaths(self.tier, backing)
        self.xattrs = ExtendedAttributes(journal, self.committer)
        self.daemon_written_bytes = 0  # bytes clients wrote through the daemon (passthrough bypasses it)
        self.inodes: dict[int, Inode] = {}
        self.handles: dict[int, Handle] = {}
        self.dir_handles: dict[int, list[tuple[bytes, int]]] = {}
        self._next_fh = itertools.count(1)
        self._recover()
        self._next_ino = itertools.count(self._max_row + 1)  # hard links' rows take numbers too
        self.publisher = Publisher(self.committer, journal.max_close_seq() + 1)
        self.capacity = TierCapacity(self.tier, journal, capacity, self.inodes)

    # -- start-up -----------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the namespace from the journal after a clean stop or a crash."""
        rows = self.journal.inodes()
        if not rows:
            now = _now_ns()
            root = InodeRow(ino=ROOT_INO, parent=ROOT_INO, name=b"", kind="dir", mode=stat.S_IFDIR | 0o755,
                            uid=os.getuid(), gid=os.getgid(), atime_ns=now, mtime_ns=now, ctime_ns=now,
                            state=META, updated=time.time())  # fmt: skip
            self.journal.apply([insert_inode_op(root)])
            rows = [root]
        ops: list[Op] = []
        self._max_row = max(row.ino for row in rows)
        link_rows = [row for row in rows if row.link_of is not None]
        linked = {row.link_of for row in link_rows if row.parent}
        for row in rows:
            if row.link_of is not None:
                continue
            if row.parent == 0 and row.ino not in linked:  # unlinked while open when the daemon stopped
                ops.extend(drop_unlinked_ops(row.ino))
                continue
            if row.state == WRITING:
                # The data file is all there is of it: show its length, so that the bytes
                # can be inspected and a later extension reads zeros, not stale bytes.
                row.size = self.tier.data_size(row.ino)
                row.state, row.error = INCOMPLETE, "open for writing when the daemon stopped"
                ops.extend(recovered_incomplete_ops(row.ino, row.size, row.error))
                log.warning("event=recover_incomplete ino=%d name=%s", row.ino, row.name)
            self.inodes[row.ino] = self._inode_from_row(row)
        for ino, name, value in self.journal.xattrs():
            if ino in self.inodes:
                self.inodes[ino].xattrs[name] = value
        for inode in list(self.inodes.values()):
            if inode.ino == ROOT_INO or inode.parent == 0:  # the latter: only hard links name it
                continue
            parent = self.inodes.get(inode.parent)
            if parent is None or parent.children is None:  # parent lost: should never happen
                log.error("event=recover_orphan ino=%d parent=%d", inode.ino, inode.parent)
                continue
            parent.children[inode.name] = inode.ino
            if inode.kind == "dir":
                parent.subdirs += 1
        for row in link_rows:
            target, parent = self.inodes.get(row.link_of or 0), self.inodes.get(row.parent)
            if target is None or parent is None or parent.children is None:  # should never happen
                log.error("event=recover_orphan_link row=%d ino=%s parent=%d", row.ino, row.link_of, row.parent)
                ops.extend(unlink_name_ops(row.ino, row.name))
                continue
            target.links[row.ino] = (row.parent, row.name)
            parent.children[row.name] = target.ino
        for ino in self.tier.data_inodes() - set(self.inodes):
            self.tier.remove(ino)
        if ops:
            self.journal.apply(ops)
        log.info("event=recovered inodes=%d", len(self.inodes))

    def _inode_from_row(self, row: InodeRow) -> Inode:
        inode = Inode(
            ino=row.ino, kind=row.kind, mode=row.mode, uid=row.uid, gid=row.gid,
            parent=row.parent, name=row.name, size=row.size, atime_ns=row.atime_ns,
            mtime_ns=row.mtime_ns, ctime_ns=row.ctime_ns, target=row.target,
            generation=row.generation, local=row.state not in NOT_LOCAL,
            listed=row.state == REMOTE, incomplete=(row.error or INCOMPLETE) if row.state == INCOMPLETE else "",
        )  # fmt: skip
        if row.kind == "dir":
            inode.children = {}
        return inode

    # -- lookups ------------------------------------------------------------------

    def inode(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def _dir(self, ino: int) -> Inode:
        inode = self.inode(ino)
        if inode.children is None:
            raise FsError(errno.ENOTDIR)
        return inode

    def child(self, parent: int, name: bytes) -> Inode:
        if name == b".":
            return self._dir(parent)
        if name == b"..":
            return self.inode(self._dir(parent).parent)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        ino = self._dir(parent).children.get(name)  # type: ignore[union-attr]
        if ino is None:
            raise FsError(errno.ENOENT)
        return self.inodes[ino]

    async def lookup(self, parent: int, name: bytes) -> Inode:
        try:
            inode = self.child(parent, name)
        except FsError as exc:  # maybe another node drained it: look at the remote
            if exc.errno != errno.ENOENT or not await self.listings.refresh_bounded(self._dir(parent)):
                raise
            inode = self.child(parent, name)
        inode.lookups += 1
        self._adopt_direct_writes(inode)
        return inode

    def looked_up(self, inode: Inode) -> None:
        """The kernel took a reference to ``inode`` without a lookup (a readdirplus entry)."""
        inode.lookups += 1

    async def refresh_listing(self, directory: Inode) -> bool:
        """Merge the remote listing of ``directory`` if it is older than the TTL
        (see :meth:`RemoteListings.refresh`); True if one was merged."""
        return await self.listings.refresh(directory)

    def forget(self, ino: int, count: int) -> None:
        inode = self.inodes.get(ino)
        if inode is None:
            return
        inode.lookups = max(0, inode.lookups - count)
        self._maybe_destroy(inode)

    def path_of(self, inode: Inode) -> str | None:
        parts = []
        while inode.ino != ROOT_INO:
            if inode.parent == 0:
                return None
            parts.append(os.fsdecode(inode.name))
            inode = self.inodes[inode.parent]
        return "/".join(reversed(parts))

    # -- creating and removing names -----------------------------------------------

    def _new_inode(self, parent: Inode, name: bytes, kind: str, mode: int, uid: int, gid: int) -> Inode:
        _check_new_name(parent, name)
        if name in parent.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        if parent.parent == 0 and parent.ino != ROOT_INO:
            raise FsError(errno.ENOENT)  # removed meanwhile
        if parent.mode & stat.S_ISGID:  # BSD group semantics under a setgid directory
            gid = parent.gid
            if kind == "dir":
                mode |= stat.S_ISGID
        now = _now_ns()
        inode = Inode(next(self._next_ino), kind, mode, uid, gid, parent.ino, name,
                      atime_ns=now, mtime_ns=now, ctime_ns=now)  # fmt: skip
        if kind == "dir":
            inode.children = {}
        return inode

    def _row(self, inode: Inode, state: FileState) -> InodeRow:
        return InodeRow(ino=inode.ino, parent=inode.parent, name=inode.name, kind=inode.kind, mode=inode.mode,
                        uid=inode.uid, gid=inode.gid, size=inode.size, atime_ns=inode.atime_ns,
                        mtime_ns=inode.mtime_ns, ctime_ns=inode.ctime_ns, target=inode.target, state=state,
                        generation=inode.generation, updated=time.time())  # fmt: skip

    def _link(self, parent: Inode, inode: Inode, undo: Undo) -> None:
        """Give ``inode`` its name in ``parent``; ``undo`` takes it back."""
        times = (parent.mtime_ns, parent.ctime_ns)
        self.inodes[inode.ino] = inode
        parent.children[inode.name] = inode.ino  # type: ignore[index]
        if inode.kind == "dir":
            parent.subdirs += 1
        parent.mtime_ns = parent.ctime_ns = _now_ns()

        def unlink() -> None:
            if parent.children.get(inode.name) == inode.ino:  # type: ignore[union-attr]
                del parent.children[inode.name]  # type: ignore[union-attr]
                if inode.kind == "dir":
                    parent.subdirs -= 1
            self.inodes.pop(inode.ino, None)
            parent.mtime_ns, parent.ctime_ns = times

        undo.add(unlink)

    def _touch_parent_op(self, parent: Inode) -> Op:
        return update_inode_op(parent.ino, mtime_ns=parent.mtime_ns, ctime_ns=parent.ctime_ns)

    async def _commit_new(self, parent: Inode, inode: Inode, state: FileState, undo: Undo) -> None:
        """Journal a name just made; on failure it is gone again (no ghost in memory)."""
        await self.committer.commit([insert_inode_op(self._row(inode, state)), self._touch_parent_op(parent)],
                                    undo=undo)  # fmt: skip

    async def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        parent = self._dir(parent_ino)
        inode = self._new_inode(parent, name, "dir", stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)
        inode.listed_at = time.monotonic()  # just created here: nothing remote to merge yet
        undo = Undo()
        self._link(parent, inode, undo)
        await self._commit_new(parent, inode, META, undo)
        inode.lookups += 1
        return inode

    async def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        parent = self._dir(parent_ino)
        inode = self._new_inode(parent, name, "symlink", stat.S_IFLNK | 0o777, uid, gid)
        inode.target = target
        inode.size = len(target)
        undo = Undo()
        self._link(parent, inode, undo)
        await self._commit_new(parent, inode, META, undo)
        inode.lookups += 1
        return inode

    async def mknod_special(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        """A FIFO or a UNIX socket: a local-only node (journaled, never drained).

        The kernel opens, reads and writes FIFOs and binds sockets itself; the file
        system only keeps the name, mode and owner.  Device nodes are refused (EPERM):
        a checkpoint store has no use for them, and honouring them would let anyone
        who can write the mount reach a device through it (the mount is not ``nodev``).
        """
        parent = self._dir(parent_ino)
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise FsError(errno.EPERM, "device nodes are not supported")
        inode = self._new_inode(parent, name, "special", stat.S_IFMT(mode) | stat.S_IMODE(mode), uid, gid)
        undo = Undo()
        self._link(parent, inode, undo)
        await self._commit_new(parent, inode, META, undo)
        inode.lookups += 1
        return inode

    def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if inode.target is None:
            raise FsError(errno.EINVAL)
        return inode.target

    async def create(
        self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int, gid: int
    ) -> tuple[int, Inode]:
        """Create and open a regular file (O_EXCL is the kernel's: we only see new names)."""
        parent = self._dir(parent_ino)
        if not stat.S_ISREG(mode) and stat.S_IFMT(mode) != 0:
            raise FsError(errno.EPERM, "only regular files, directories and symlinks are supported")
        inode = self._new_inode(parent, name, "file", stat.S_IFREG | (stat.S_IMODE(mode) & ~FILE_MODE_DROPPED), uid, gid)
        inode.new = True
        inode.digests = StreamingDigests(self.digest_chunk_size)
        self.tier.create(inode.ino)
        undo = Undo()
        undo.add(lambda: self.tier.remove(inode.ino))
        self._link(parent, inode, undo)
        await self._commit_new(parent, inode, WRITING, undo)
        inode.lookups += 1
        fh = self._open_handle(inode, writable=True)
        await self._choose_io_path(inode, self.handles[fh])
        return fh, inode

    async def link(self, ino: int, new_parent_ino: int, new_name: bytes) -> Inode:
        """link(2): another name for a file, symlink or special node (directories: EPERM).

        A file known only from the remote is fetched first: the new name drains
        its own copy of the bytes from the local tier (see ``hardlinks``).
        """
        inode = self.inode(ino)
        if inode.kind == "dir":
            raise FsError(errno.EPERM, "directories cannot be hard-linked")
        parent = self._dir(new_parent_ino)
        for _ in range(3):  # evicted again meanwhile (a full tier): fetch again
            if inode.local or inode.kind != "file":
                break
            await self._ensure_local(inode)
        else:
            raise FsError(errno.EAGAIN, "the file was evicted again while it was being fetched")
        _check_new_name(parent, new_name)
        if new_name in parent.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        if (parent.parent == 0 and parent.ino != ROOT_INO) or not inode.named:
            raise FsError(errno.ENOENT)  # removed meanwhile
        row = next(self._next_ino)
        undo = Undo()
        times = (parent.mtime_ns, parent.ctime_ns, inode.ctime_ns)
        hardlinks.add_name(parent, inode, row, new_name, undo)
        parent.mtime_ns = parent.ctime_ns = inode.ctime_ns = now = _now_ns()

        def restore_times() -> None:
            parent.mtime_ns, parent.ctime_ns, inode.ctime_ns = times

        undo.add(restore_times)
        inode.pending += 1
        try:
            await self.committer.commit([*link_ops(row, ino, parent.ino, new_name, now), self._touch_parent_op(parent)],
                                        undo=undo)  # fmt: skip
        finally:
            inode.pending -= 1
        inode.lookups += 1
        self._file_closed()  # the new name has an object to drain
        return inode

    async def unlink(self, parent_ino: int, name: bytes) -> None:
        parent = self._dir(parent_ino)
        inode = self.child(parent_ino, name)
        if inode.kind == "dir":
            raise FsError(errno.EISDIR)
        await self._remove(parent, inode, name)
        self._namespace_changed()

    async def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = self._dir(parent_ino)
        inode = self.child(parent_ino, name)
        if inode.kind != "dir":
            raise FsError(errno.ENOTDIR)
        if inode.children:
            raise FsError(errno.ENOTEMPTY)
        await self._remove(parent, inode, name)

    async def _remove(self, parent: Inode, inode: Inode, name: bytes) -> None:
        undo = Undo()
        ops = self._unlink_ops(parent, name, inode, undo) + [self._touch_parent_op(parent)]
        inode.pending += 1
        try:
            await self.committer.commit(ops, undo=undo)
        finally:
            inode.pending -= 1
        self._maybe_destroy(inode)

    def _detach(self, parent: Inode, inode: Inode, undo: Undo) -> int:
        """Take ``inode``'s name away in memory; ``undo`` gives it back.  Returns the time."""
        times = (parent.mtime_ns, parent.ctime_ns, inode.ctime_ns)
        name = inode.name
        del parent.children[name]  # type: ignore[union-attr]
        if inode.kind == "dir":
            parent.subdirs -= 1
        inode.parent = 0
        now = _now_ns()
        parent.mtime_ns = parent.ctime_ns = inode.ctime_ns = now

        def relink() -> None:
            parent.children[name] = inode.ino  # type: ignore[index]
            if inode.kind == "dir":
                parent.subdirs += 1
            inode.parent, inode.name = parent.ino, name
            parent.mtime_ns, parent.ctime_ns, inode.ctime_ns = times

        undo.add(relink)
        return now

    def _unlink_ops(self, parent: Inode, name: bytes, inode: Inode, undo: Undo) -> list[Op]:
        """Detach ``inode`` from its name ``name``; the journal queues that name's remote object for deletion."""
        self.listings.remember_removed(parent, name, undo)
        row = hardlinks.name_row(inode, parent.ino, name)
        if row != inode.ino:  # a hard link's name: the inode keeps its others
            hardlinks.drop_name(parent, inode, row, undo)
            times = (parent.mtime_ns, parent.ctime_ns, inode.ctime_ns)
            parent.mtime_ns = parent.ctime_ns = inode.ctime_ns = now = _now_ns()

            def restore_times() -> None:
                parent.mtime_ns, parent.ctime_ns, inode.ctime_ns = times

            undo.add(restore_times)
            return [*unlink_name_ops(row, name), update_inode_op(inode.ino, ctime_ns=now)]
        return unlink_ops(inode.ino, inode.name, self._detach(parent, inode, undo))

    def _maybe_destroy(self, inode: Inode) -> None:
        """Drop an unlinked inode once nothing references it any more."""
        if inode.named or inode.lookups or inode.handles or inode.pending or inode.ino == ROOT_INO:
            return
        if self.inodes.get(inode.ino) is not inode:  # already dropped (or a failed create)
            return
        self.inodes.pop(inode.ino, None)
        if inode.kind == "file":
            self.capacity.release(inode.accounted)
            if not inode.local and self.fetcher is not None:
                self.fetcher.forget(inode.ino)
            self.tier.remove(inode.ino)
        # Not awaited: losing this record in a crash is harmless (start-up drops
        # unlinked rows), and forget() must not block.
        self.committer.enqueue(
            drop_unlinked_ops(inode.ino)
        )  # fmt: skip

    async def rename(self, old_parent_ino: int, old_name: bytes, new_parent_ino: int,
                     new_name: bytes, flags: int) -> None:  # fmt: skip
        """rename(2): atomically replaces a file target or an empty directory target."""
        from pyfuse3 import RENAME_EXCHANGE, RENAME_NOREPLACE

        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        old_parent = self._dir(old_parent_ino)
        new_parent = self._dir(new_parent_ino)
        _check_new_name(new_parent, new_name)
        inode = self.child(old_parent_ino, old_name)
        ops: list[Op] = []
        target_ino = new_parent.children.get(new_name)  # type: ignore[union-attr]
        target = self.inodes[target_ino] if target_ino is not None else None
        if target is inode:
            return
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if inode.kind == "dir" and target.kind != "dir":
                raise FsError(errno.ENOTDIR)
            if inode.kind != "dir" and target.kind == "dir":
                raise FsError(errno.EISDIR)
            if target.children:
                raise FsError(errno.ENOTEMPTY)
        if inode.kind == "dir":  # the VFS checks this too; keep the core safe on its own
            ancestor = new_parent
            while ancestor.ino != ROOT_INO:
                if ancestor is inode:
                    raise FsError(errno.EINVAL)
                ancestor = self.inodes[ancestor.parent]
        undo = Undo()
        if target is not None:
            ops += self._unlink_ops(new_parent, new_name, target, undo)
            target.pending += 1
        self.listings.remember_removed(old_parent, old_name, undo)
        row = hardlinks.name_row(inode, old_parent.ino, old_name)
        if row == inode.ino:
            self._detach(old_parent, inode, undo)  # restores the old name and times on failure
            inode.parent, inode.name = new_parent.ino, new_name
        else:  # one of a hard-linked file's other names moves
            old_times = (old_parent.mtime_ns, old_parent.ctime_ns, inode.ctime_ns)
            hardlinks.drop_name(old_parent, inode, row, undo)
            inode.links[row] = (new_parent.ino, new_name)

            def restore_old_times() -> None:
                old_parent.mtime_ns, old_parent.ctime_ns, inode.ctime_ns = old_times

            undo.add(restore_old_times)
        new_times = (new_parent.mtime_ns, new_parent.ctime_ns)
        new_parent.children[new_name] = inode.ino  # type: ignore[index]
        if inode.kind == "dir":
            new_parent.subdirs += 1
        now = _now_ns()
        inode.ctime_ns = old_parent.mtime_ns = old_parent.ctime_ns = now
        new_parent.mtime_ns = new_parent.ctime_ns = now

        def unmove() -> None:
            if new_parent.children.get(new_name) == inode.ino:  # type: ignore[union-attr]
                del new_parent.children[new_name]  # type: ignore[union-attr]
                if inode.kind == "dir":
                    new_parent.subdirs -= 1
            new_parent.mtime_ns, new_parent.ctime_ns = new_times

        undo.add(unmove)
        ops += [
            update_inode_op(row, parent=new_parent.ino, name=new_name, ctime_ns=now),
            update_inode_op(inode.ino, ctime_ns=now),
            self._touch_parent_op(old_parent),
            self._touch_parent_op(new_parent),
            event_op(row, "rename", f"{os.fsdecode(old_name)} -> {os.fsdecode(new_name)}"),
        ]
        try:
            await self.committer.commit(ops, undo=undo)
        finally:
            if target is not None:
                target.pending -= 1
        if target is not None:
            self._maybe_destroy(target)
        self._namespace_changed()

    def _namespace_changed(self) -> None:
        if self.drain is not None:
            self.drain.namespace_changed()

    # -- attributes -----------------------------------------------------------------

    def getattr(self, ino: int) -> Inode:
        inode = self.inode(ino)
        self._adopt_direct_writes(inode)
        return inode

    def _adopt_direct_writes(self, inode: Inode) -> None:
        """Size and times of bytes written through passthrough, read off the data file.

        The kernel writes those bytes to the tier without telling us; it asks for
        attributes again after each write, and every close comes here first
        (see :meth:`IOPaths.written_behind`).
        """
        st = self.io_paths.written_behind(inode)
        if st is None:
            return
        inode.dirty = True  # written after a close through a dup'd descriptor: the next close publishes it
        inode.size = st.st_size
        inode.mtime_ns, inode.ctime_ns = st.st_mtime_ns, st.st_ctime_ns
        inode.last_access = time.monotonic()
        self.capacity.adopt(inode, st.st_blocks * 512)  # a sparse file takes what it allocated, not its size

    async def setattr(
        self,
        ino: int,
        *,
        mode: int | None = None,
        uid: int | None = None,
        gid: int | None = None,
        size: int | None = None,
        atime_ns: int | None = None,
        mtime_ns: int | None = None,
        fh: int | None = None,
    ) -> Inode:
        inode = self.inode(ino)
        self._adopt_direct_writes(inode)  # before new times, so they are not overwritten later
        if size is not None:
            if inode.kind != "file":
                raise FsError(errno.EISDIR if inode.kind == "dir" else errno.EINVAL)
            await self._truncate_data(inode, size)
        # Attributes change in memory with the commit: a failed commit restores them.
        now = _now_ns()
        before = (inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns)
        undo = Undo()

        def restore() -> None:
            inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns = before

        undo.add(restore)
        fields: dict[str, int] = {}
        if size is not None:
            inode.mtime_ns = now
            fields.update(size=size, mtime_ns=now)
        if mode is not None:
            kept = ~FILE_MODE_DROPPED if inode.kind == "file" else ~0
            inode.mode = stat.S_IFMT(inode.mode) | (stat.S_IMODE(mode) & kept)
            fields["mode"] = inode.mode
        if uid is not None:
            inode.uid = fields["uid"] = uid
        if gid is not None:
            inode.gid = fields["gid"] = gid
        if atime_ns is not None:
            inode.atime_ns = fields["atime_ns"] = atime_ns
        if mtime_ns is not None:
            inode.mtime_ns = fields["mtime_ns"] = mtime_ns
        inode.ctime_ns = fields["ctime_ns"] = now
        ops = [update_inode_op(ino, **fields)]
        closing = size is not None and not self._has_writer(inode) and fh is None
        if closing:
            ops += self.publisher.close_ops(inode, undo, writer_left=False)  # truncate(2) on a path: a complete change
        await self.committer.commit(ops, undo=undo)
        if closing:
            self._file_closed()
        return inode

    async def _truncate_data(self, inode: Inode, size: int) -> None:
        """Set the data file's length, after journaling the file as being written.

        The bytes change on the tier here, so the in-memory size follows them
        whatever the later commit does (the row says ``writing`` until a close).
        Emptying a file that is only on the remote fetches nothing: an empty
        local file replaces it (so a corrupt object can still be overwritten).
        """
        emptying_remote = size == 0 and not inode.local
        if not emptying_remote:
            await self._ensure_local(inode)
        await self.publisher.mark_writing(inode)
        if emptying_remote and not inode.local:
            if self.fetcher is not None:
                self.fetcher.forget(inode.ino)
            await trio.to_thread.run_sync(self.tier.create, inode.ino)
            inode.local, inode.listed, inode.local_prefix = True, False, 0
            log.info("event=emptied_remote_file ino=%d note=not fetched", inode.ino)
        else:
            await trio.to_thread.run_sync(self.tier.truncate, inode.ino, size)
        if inode.direct is not None:
            inode.direct.reopened_clean = False
        # Growth adds a hole: nothing allocated, nothing counted (a file drains at its
        # logical size, but the tier holds only what was written).  Shrinking frees blocks.
        if size < inode.size:
            await self.capacity.shrunk(inode)
        inode.size = size
        if size == 0:  # emptied: what is written next is all of it
            inode.incomplete = ""
            inode.digests = None if self.io_paths.writes_direct(inode) else StreamingDigests(self.digest_chunk_size)
        elif inode.digests is not None and size != inode.digests.size:
            inode.digests = None  # the drain hashes the staged bytes instead

    def _has_writer(self, inode: Inode) -> bool:
        return any(h.writable and h.inode is inode for h in self.handles.values())

    # -- file data ------------------------------------------------------------------

    def _open_handle(self, inode: Inode, writable: bool) -> int:
        if writable and self.drain is not None and (dir_key := self._dir_key(inode)) is not None:
            self.drain.writing_in(inode.ino, dir_key, inode.name)
        self.tier.acquire(inode.ino)
        inode.handles += 1
        fh = next(self._next_fh)
        self.handles[fh] = Handle(inode, writable)
        return fh

    async def open(self, ino: int, flags: int) -> int:
        inode = self.inode(ino)
        if inode.kind == "dir":
            raise FsError(errno.EISDIR)
        if inode.kind != "file":
            raise FsError(errno.ELOOP)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        truncating = bool(flags & os.O_TRUNC) and bool(inode.size or inode.incomplete or not inode.local)
        if writable and not truncating:
            await self._ensure_local(inode)  # emptied instead of fetched when truncating
        fh = self._open_handle(inode, writable)
        try:
            if truncating:
                # Through a read-only handle (Linux truncates on O_RDONLY | O_TRUNC) no close
                # will publish the change: journal it at once, as truncate(2) does.
                await self.setattr(ino, size=0, fh=fh if writable else None)
            await self._choose_io_path(inode, self.handles[fh])
        except BaseException:
            self._drop_handle(fh)  # the open fails: no release will come for it
            raise
        return fh

    def _drop_handle(self, fh: int) -> None:
        handle = self.handles.pop(fh)
        self.io_paths.close(handle.inode, handle)
        handle.inode.handles -= 1
        self.tier.release(handle.inode.ino)
        self._maybe_destroy(handle.inode)

    async def _choose_io_path(self, inode: Inode, handle: Handle) -> None:
        """Open ``handle`` direct when it can be (:meth:`IOPaths.open_direct`); a direct
        writer journals the file as being written before any byte can land."""
        if not self.io_paths.open_direct(inode, handle) or not handle.writable:
            return
        direct = inode.direct
        assert direct is not None
        inode.digests = None  # these bytes never reach the daemon: the drain hashes the file
        if not self.publisher.unpublished(inode):
            direct.reopened_clean = True  # undone at close if nothing changes
        try:
            await self.publisher.mark_writing(inode)  # before any byte lands: a crash flags it incomplete
        except BaseException:
            direct.reopened_clean = False  # the open fails; a later close publishes normally
            raise

    def backing_id(self, fh: int) -> int:
        """The passthrough backing id of a handle; 0 when its I/O comes to the daemon."""
        return self.io_paths.backing_id(self.handles[fh])

    @property
    def passthrough(self) -> bool:
        """Opens may go direct (the kernel does their I/O on the tier)."""
        return self.io_paths.backing is not None

    def passthrough_unavailable(self) -> None:
        """The kernel did not offer passthrough at INIT: every open goes through the daemon."""
        self.io_paths.turn_off()

    async def _ensure_local(self, inode: Inode, offset: int = 0, size: int | None = None) -> None:
        """Fetch (part of) a file that is only on the remote before it is read or changed."""
        if inode.local:
            return
        if self.fetcher is None:
            raise FsError(errno.EIO, "file is not on the local tier and no remote is configured")
        await self.capacity.account(inode, inode.size)  # room for the whole file: a restore usually reads all of it
        inode.local_prefix = await self.fetcher.ensure_local(inode.ino, offset, inode.size if size is None else size)
        if inode.local_prefix >= inode.size:
            inode.local, inode.listed = True, False

    async def prefetch(self, ino: int) -> None:
        """Bring a whole file to the local tier (``burstfs-admin prefetch``)."""
        inode = self.inode(ino)
        if inode.kind == "file":
            await self._ensure_local(inode)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self.handles[fh]
        inode = handle.inode
        if not inode.local and offset + size + PREFETCH_MARGIN > inode.local_prefix:
            await self._ensure_local(inode, offset, size)
        inode.last_access = time.monotonic()
        fd = self.tier.fd(inode.ino)
        assert fd is not None
        return os.pread(fd, size, offset)  # inline: measured faster than a thread hop for 1 MiB

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        handle = self.handles[fh]
        inode = handle.inode
        if not handle.writable:
            raise FsError(errno.EBADF)
        if not inode.dirty or inode.marking is not None:
            await self.publisher.mark_writing(inode)
        end = offset + len(data)
        try:
            fd = self.tier.fd(inode.ino)
            assert fd is not None
            await self.capacity.claim_write(inode, fd, offset, end)
            if self.offload_writes and len(data) >= 65536:
                written = await trio.to_thread.run_sync(_write_hashed, fd, data, offset, inode.digests)
            else:
                written = _write_hashed(fd, data, offset, inode.digests)  # small: not worth a thread
        except (BurstfsError, OSError) as exc:
            # With the writeback cache the writer learns this only at close(); the file
            # now lacks bytes it sent, so it must never drain as if complete.
            code = to_errno(exc)
            inode.incomplete = f"a write failed with {errno.errorcode.get(code, code)}"
            raise
        if end > inode.size:
            inode.size = end
        self.daemon_written_bytes += written
        inode.last_access = time.monotonic()
        inode.mtime_ns = inode.ctime_ns = _now_ns()
        return written

    async def fallocate(self, fh: int, offset: int, length: int, mode: int) -> None:
        """fallocate(2): the default mode and ``FALLOC_FL_KEEP_SIZE`` (see ``burstfs.fallocate``).

        The range is claimed like a write first (capacity counts allocated bytes),
        and growth of the size is a change: journaled ``writing`` before it lands
        (invariant 2), published by the next close.  Allocation alone changes no
        byte, so it journals nothing.
        """
        handle = self.handles.get(fh)
        if handle is None or not handle.writable:
            raise FsError(errno.EBADF)
        if mode & ~fallocate.FALLOC_FL_KEEP_SIZE:
            raise FsError(errno.EOPNOTSUPP, "only the default mode and FALLOC_FL_KEEP_SIZE are supported")
        if offset < 0 or length <= 0:
            raise FsError(errno.EINVAL)
        inode = handle.inode
        self._adopt_direct_writes(inode)
        await self._ensure_local(inode)
        end = offset + length
        grows = not mode & fallocate.FALLOC_FL_KEEP_SIZE and end > inode.size
        if grows and (not inode.dirty or inode.marking is not None):
            await self.publisher.mark_writing(inode)
        fd = self.tier.fd(inode.ino)
        assert fd is not None
        await self.capacity.claim_write(inode, fd, offset, end)
        await trio.to_thread.run_sync(fallocate.allocate, fd, mode, offset, length)
        if grows and end > inode.size:
            inode.size = end
            inode.mtime_ns = inode.ctime_ns = _now_ns()
            if inode.direct is not None:
                inode.direct.reopened_clean = False
            if inode.digests is not None:
                inode.digests = None  # zeros nobody wrote: the drain hashes the staged bytes
        inode.last_access = time.monotonic()

    def _file_closed(self) -> None:
        if self.drain is not None:
            self.drain.file_closed()

    def _dir_key(self, inode: Inode) -> str | None:
        """The remote key of ``inode``'s directory (None once unlinked)."""
        return self.path_of(self.inodes[inode.parent]) if inode.parent else None

    async def flush(self, fh: int) -> None:
        """close(2): a changed or new file is journaled before close returns (tenet 1).

        RELEASE reaches us only after close(2) has returned, so it is too late for that.
        """
        handle = self.handles.get(fh)
        if handle is None or not handle.writable:
            return
        inode = handle.inode
        self._adopt_direct_writes(inode)  # passthrough writes since the last close make it dirty
        if not self.publisher.unpublished(inode):
            return
        if not inode.named:  # unlinked while open: nothing to publish
            inode.dirty = inode.new = False
            return
        undo = Undo()
        ops = self.publisher.publish_ops(inode, undo, writer_left=self._has_writer(inode))
        await self.committer.commit(ops, undo=undo)
        self._file_closed()
        if self.drain is not None and (dir_key := self._dir_key(inode)) is not None:
            self.drain.writing_in(inode.ino, dir_key, inode.name)  # a close after the round's done starts the next
            await self.drain.intent_published(dir_key)  # bounded (--remote-wait); never fails the close

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        inode = handle.inode
        try:
            self._adopt_direct_writes(inode)
            self.io_paths.close(inode, handle)
            if handle.writable and not self._has_writer(inode):
                if self.publisher.unpublished(inode) and inode.named:
                    undo = Undo()
                    await self.committer.commit(self.publisher.publish_ops(inode, undo, writer_left=False), undo=undo)
                    self._file_closed()
                inode.digests = None  # the last writer is gone (kept if the commit failed)
        finally:
            inode.handles -= 1
            self.tier.release(inode.ino)
            self._maybe_destroy(inode)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.handles[fh]
        inode = handle.inode
        fd = self.tier.fd(inode.ino)
        assert fd is not None
        await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, fd)
        self._adopt_direct_writes(inode)
        publish = inode.dirty or (handle.writable and self.publisher.unpublished(inode))
        undo = Undo()
        ops = []
        if publish and inode.named:
            ops = self.publisher.publish_ops(inode, undo, writer_left=self._has_writer(inode))
        await self.committer.commit(ops, sync=True, undo=undo)
        if ops:
            self._file_closed()
        if self.fsync_remote and self.drain is not None and inode.named:
            await self.drain.wait_durable(inode.ino, inode.generation)

    # -- directories ----------------------------------------------------------------

    async def opendir(self, ino: int) -> int:
        inode = self._dir(ino)
        await self.listings.refresh_bounded(inode)
        fh = next(self._next_fh)
        self.dir_handles[fh] = list(inode.children.items())  # type: ignore[union-attr]
        return fh

    def readdir(self, fh: int, start: int) -> list[tuple[bytes, Inode]]:
        """Entries from index ``start`` on (a snapshot taken at opendir)."""
        entries = self.dir_handles[fh]
        return [(name, self.inodes[ino]) for name, ino in entries[start:] if ino in self.inodes]

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    def entries(self, directory: Inode) -> list[tuple[bytes, Inode]]:
        """The names in ``directory`` now, with their inodes (no kernel reference taken)."""
        return [(name, self.inodes[ino]) for name, ino in (directory.children or {}).items() if ino in self.inodes]

    async def fsyncdir(self) -> None:
        """Namespace changes are committed before their calls return: make them durable on disk."""
        await self.committer.commit([], sync=True)

    async def set_meta(self, key: str, value: str) -> None:
        """Journal a mount-wide value (the mount point, for ``burstfs-admin`` while it is down)."""
        await self.committer.commit([set_meta_op(key, value)])

    # -- extended attributes (burstfs/xattrs.py) ------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.xattrs.get(self.inode(ino), name)

    def listxattr(self, ino: int) -> list[bytes]:
        return self.xattrs.names(self.inode(ino))

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        await self.xattrs.set(self.inode(ino), name, value)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.xattrs.remove(self.inode(ino), name)

    # -- file system ----------------------------------------------------------------

    async def statfs(self) -> StatFs:
        """The local tier's capacity (see :meth:`TierCapacity.statfs`)."""
        return self.capacity.statfs(await self.capacity.evictable_bytes())

    async def evict(self, ino: int) -> int:
        """Drop the local copy of a durable file (``burstfs-admin evict``); bytes freed."""
        return await self.capacity.evict(self.inode(ino))

    def close(self) -> None:
        """Close data descriptors.  Files still open for writing stay journaled as
        ``writing`` and are flagged incomplete by the next start."""
        self.handles.clear()
        self.tier.close_all()

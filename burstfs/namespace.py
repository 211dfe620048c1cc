"""The namespace of one mount: the inode table and its names (rebuilt by ``recovery.py``).

Every change of a name (mkdir, symlink, a FIFO or socket, unlink, rmdir, rename)
changes memory and hands the committer an undo, so a failed commit leaves memory
equal to the journal.  An inode is destroyed (row and data file) only when it has
no name, no open handle, no kernel lookup reference and no change in flight.
The core decides what a destroyed file's data means (``on_destroy``); the remote
listings are told which keys this mount removed (``remember_removed``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable

from . import hardlinks
from .committer import GroupCommitter
from .errors import FsError
from .journal import (
    META,
    ROOT_INO,
    FileState,
    InodeRow,
    Journal,
    Op,
    drop_unlinked_ops,
    event_op,
    forget_listed_ops,
    insert_inode_op,
    known_dir_op,
    link_ops,
    unlink_keeping_object_ops,
    unlink_name_ops,
    unlink_ops,
    update_inode_op,
)
from .localtier import LocalTier
from .nodes import NAME_MAX, RESERVED_ROOT_NAME, Inode, Undo
from .recovery import recover

log = logging.getLogger("burstfs.namespace")


def now_ns() -> int:
    return time.time_ns()


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FsError(errno.ENAMETOOLONG)
    if not name or name in (b".", b"..") or b"/" in name or b"\0" in name:
        raise FsError(errno.EINVAL)


def check_new_name(parent: Inode, name: bytes) -> None:
    """A name something is about to be made or renamed to; ``.burstfs`` is the
    remote's own at the root (manifests, layout) and is refused with EPERM.  A name
    that is not UTF-8 has no object key (keys, records and the journal's paths are
    UTF-8): EILSEQ, before anything of it is journaled."""
    check_name(name)
    try:
        name.decode("utf-8")
    except UnicodeDecodeError:
        raise FsError(errno.EILSEQ, f"name {name!r} is not UTF-8: object keys are") from None
    if parent.ino == ROOT_INO and name == RESERVED_ROOT_NAME:
        raise FsError(errno.EPERM, ".burstfs is reserved at the root of the mount")


# Inode numbers are handed out from blocks of this many, each block journaled before its
# first number is used: a restarted daemon starts past the last block.
INO_BLOCK = 1 << 20
_META_INO_BLOCK_END = "ino_block_end"


class InodeNumbers:
    """Inode (and link row) numbers that are never handed out twice in one cache.

    Numbering from the highest row left after a restart gave a removed file's number
    to the next new inode, and what still named the old file by number (a round's
    journaled members: ``commitgroups.py``) then meant the new one -- a directory a
    round waited on to be durable held its commit marker for good.  A block is
    journaled once per INO_BLOCK numbers (a write on the caller's thread then)."""

    def __init__(self, journal: Journal, last_row: int) -> None:
        self.journal = journal
        journaled_end = int(self.journal.get_meta(_META_INO_BLOCK_END) or 0)
        self._next = max(last_row + 1, journaled_end)
        self._journal_block()

    def _journal_block(self) -> None:
        self._end = self._next + INO_BLOCK
        self.journal.set_meta(_META_INO_BLOCK_END, str(self._end))

    def take(self) -> int:
        if self._next >= self._end:
            self._journal_block()
        number, self._next = self._next, self._next + 1
        return number


class Namespace:
    """The inodes of one mount by number, and the names that link them."""

    def __init__(
        self,
        journal: Journal,
        committer: GroupCommitter,
        tier: LocalTier,
        *,
        remember_removed: Callable[[str, Undo], None],
        on_destroy: Callable[[Inode], None],
    ) -> None:
        self.journal = journal
        self.committer = committer
        self.tier = tier
        self.remember_removed = remember_removed  # a key this mount removed: listings must not bring it back
        self.on_destroy = on_destroy  # a file inode is gone: drop its data and what is counted for it
        self.inodes, last_row = recover(journal, tier)
        self._numbers = InodeNumbers(journal, last_row)  # hard links' rows take numbers too

    def inode(self, ino: int) -> Inode:
        try:
            return self.inodes[ino]
        except KeyError:
            raise FsError(errno.ENOENT) from None

    def dir(self, ino: int) -> Inode:
        inode = self.inode(ino)
        if inode.children is None:
            raise FsError(errno.ENOTDIR)
        return inode

    def child(self, parent: int, name: bytes) -> Inode:
        if name == b".":
            return self.dir(parent)
        if name == b"..":
            return self.inode(self.dir(parent).parent)
        if len(name) > NAME_MAX:
            raise FsError(errno.ENAMETOOLONG)
        ino = self.dir(parent).children.get(name)  # type: ignore[union-attr]
        if ino is None:
            raise FsError(errno.ENOENT)
        return self.inodes[ino]

    def entries(self, directory: Inode) -> list[tuple[bytes, Inode]]:
        """The names in ``directory`` now, with their inodes (no kernel reference taken)."""
        return [(name, self.inodes[ino]) for name, ino in (directory.children or {}).items() if ino in self.inodes]

    def forget(self, ino: int, count: int) -> None:
        inode = self.inodes.get(ino)
        if inode is None:
            return
        inode.lookups = max(0, inode.lookups - count)
        self.maybe_destroy(inode)

    def dir_key_of(self, inode: Inode) -> str | None:
        """The remote key of ``inode``'s directory (None once unlinked)."""
        return self.path_of(self.inodes[inode.parent]) if inode.parent else None

    def path_of(self, inode: Inode) -> str | None:
        parts = []
        while inode.ino != ROOT_INO:
            if inode.parent == 0:
                return None
            parts.append(os.fsdecode(inode.name))
            inode = self.inodes[inode.parent]
        return "/".join(reversed(parts))

    def new_inode(self, parent: Inode, name: bytes, kind: str, mode: int, uid: int, gid: int) -> Inode:
        check_new_name(parent, name)
        if name in parent.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        if parent.parent == 0 and parent.ino != ROOT_INO:
            raise FsError(errno.ENOENT)  # removed meanwhile
        if parent.mode & stat.S_ISGID:  # BSD group semantics under a setgid directory
            gid = parent.gid
            if kind == "dir":
                mode |= stat.S_ISGID
        now = now_ns()
        inode = Inode(
            self._numbers.take(), kind, mode, uid, gid, parent.ino, name, atime_ns=now, mtime_ns=now, ctime_ns=now
        )
        if kind == "dir":
            inode.children = {}
        return inode

    def row(self, inode: Inode, state: FileState) -> InodeRow:
        return InodeRow(
            ino=inode.ino,
            parent=inode.parent,
            name=inode.name,
            kind=inode.kind,
            mode=inode.mode,
            uid=inode.uid,
            gid=inode.gid,
            size=inode.size,
            atime_ns=inode.atime_ns,
            mtime_ns=inode.mtime_ns,
            ctime_ns=inode.ctime_ns,
            target=inode.target,
            state=state,
            generation=inode.generation,
            updated=time.time(),
        )

    def attach(self, parent: Inode, inode: Inode, undo: Undo) -> None:
        """Give ``inode`` its name in ``parent``; ``undo`` takes it back."""
        times = (parent.mtime_ns, parent.ctime_ns)
        self.inodes[inode.ino] = inode
        parent.children[inode.name] = inode.ino  # type: ignore[index]
        if inode.kind == "dir":
            parent.subdirs += 1
        parent.mtime_ns = parent.ctime_ns = now_ns()

        def unlink() -> None:
            if parent.children.get(inode.name) == inode.ino:  # type: ignore[union-attr]
                del parent.children[inode.name]  # type: ignore[union-attr]
                if inode.kind == "dir":
                    parent.subdirs -= 1
            self.inodes.pop(inode.ino, None)
            inode.parent = 0  # a new file's handle may be open already: it is unlinked now
            parent.mtime_ns, parent.ctime_ns = times

        undo.add(unlink)

    def touch_parent_op(self, parent: Inode) -> Op:
        return update_inode_op(parent.ino, mtime_ns=parent.mtime_ns, ctime_ns=parent.ctime_ns)

    async def commit_new(self, parent: Inode, inode: Inode, state: FileState, undo: Undo) -> None:
        """Journal a name just made; on failure it is gone again (no ghost in memory)."""
        await self.committer.commit([insert_inode_op(self.row(inode, state)), self.touch_parent_op(parent)], undo=undo)

    def defer_new(self, parent: Inode, inode: Inode, state: FileState, undo: Undo) -> None:
        """Journal a new file's name with the next commit (its close, an fsync, any later
        change of the namespace) instead of now: a crash before that loses only a file that
        was never closed, as a local file system loses a new name its directory was not
        fsync'd for.  ``inode.unjournaled`` says whether the record failed."""
        inode.unjournaled = self.committer.defer(
            [insert_inode_op(self.row(inode, state)), self.touch_parent_op(parent)], undo
        )

    async def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        parent = self.dir(parent_ino)
        inode = self.new_inode(parent, name, "dir", stat.S_IFDIR | stat.S_IMODE(mode), uid, gid)
        inode.listed_at = time.monotonic()  # just created here: nothing remote to merge yet
        undo = Undo()
        self.attach(parent, inode, undo)
        await self.committer.commit(
            [insert_inode_op(self.row(inode, META)), known_dir_op(inode.ino), self.touch_parent_op(parent)], undo=undo
        )
        inode.lookups += 1
        return inode

    async def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        parent = self.dir(parent_ino)
        inode = self.new_inode(parent, name, "symlink", stat.S_IFLNK | 0o777, uid, gid)
        inode.target = target
        inode.size = len(target)
        undo = Undo()
        self.attach(parent, inode, undo)
        await self.commit_new(parent, inode, META, undo)
        inode.lookups += 1
        return inode

    async def mknod_special(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        """A FIFO or a UNIX socket: a local-only node (journaled, never drained).

        The kernel opens, reads and writes FIFOs and binds sockets itself; the file
        system only keeps the name, mode and owner.  Device nodes are refused (EPERM):
        a checkpoint store has no use for them, and honouring them would let anyone
        who can write the mount reach a device through it (the mount is not ``nodev``).
        """
        parent = self.dir(parent_ino)
        if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
            raise FsError(errno.EPERM, "device nodes are not supported")
        inode = self.new_inode(parent, name, "special", stat.S_IFMT(mode) | stat.S_IMODE(mode), uid, gid)
        undo = Undo()
        self.attach(parent, inode, undo)
        await self.commit_new(parent, inode, META, undo)
        inode.lookups += 1
        return inode

    def readlink(self, ino: int) -> bytes:
        inode = self.inode(ino)
        if inode.target is None:
            raise FsError(errno.EINVAL)
        return inode.target

    async def add_link(self, inode: Inode, parent: Inode, new_name: bytes) -> None:
        """Give ``inode`` (a local file, a symlink or a special node) the extra name
        ``new_name`` in ``parent``: a row of its own, journaled before this returns."""
        check_new_name(parent, new_name)
        if new_name in parent.children:  # type: ignore[operator]
            raise FsError(errno.EEXIST)
        if (parent.parent == 0 and parent.ino != ROOT_INO) or not inode.named:
            raise FsError(errno.ENOENT)  # removed meanwhile
        row = self._numbers.take()
        undo = Undo()
        times = (parent.mtime_ns, parent.ctime_ns, inode.ctime_ns)
        hardlinks.add_name(parent, inode, row, new_name, undo)
        parent.mtime_ns = parent.ctime_ns = inode.ctime_ns = now = now_ns()

        def restore_times() -> None:
            parent.mtime_ns, parent.ctime_ns, inode.ctime_ns = times

        undo.add(restore_times)
        inode.pending += 1
        try:
            await self.committer.commit(
                [*link_ops(row, inode.ino, parent.ino, new_name, now), self.touch_parent_op(parent)], undo=undo
            )
        finally:
            inode.pending -= 1

    async def unlink(self, parent_ino: int, name: bytes) -> None:
        parent = self.dir(parent_ino)
        inode = self.child(parent_ino, name)
        if inode.kind == "dir":
            raise FsError(errno.EISDIR)
        await self._remove(parent, inode, name)

    async def rmdir(self, parent_ino: int, name: bytes) -> None:
        parent = self.dir(parent_ino)
        inode = self.child(parent_ino, name)
        if inode.kind != "dir":
            raise FsError(errno.ENOTDIR)
        if inode.children:
            raise FsError(errno.ENOTEMPTY)
        await self._remove(parent, inode, name)

    async def _remove(self, parent: Inode, inode: Inode, name: bytes) -> None:
        undo = Undo()
        ops = self._unlink_ops(parent, name, inode, undo) + [self.touch_parent_op(parent)]
        inode.pending += 1
        try:
            await self.committer.commit(ops, undo=undo)
        finally:
            inode.pending -= 1
        self.maybe_destroy(inode)

    def detach(self, parent: Inode, inode: Inode, undo: Undo) -> int:
        """Take ``inode``'s name away in memory; ``undo`` gives it back.  Returns the time."""
        times = (parent.mtime_ns, parent.ctime_ns, inode.ctime_ns)
        name = inode.name
        del parent.children[name]  # type: ignore[union-attr]
        if inode.kind == "dir":
            parent.subdirs -= 1
        inode.parent = 0
        now = now_ns()
        parent.mtime_ns = parent.ctime_ns = inode.ctime_ns = now

        def relink() -> None:
            parent.children[name] = inode.ino  # type: ignore[index]
            if inode.kind == "dir":
                parent.subdirs += 1
            inode.parent, inode.name = parent.ino, name
            parent.mtime_ns, parent.ctime_ns, inode.ctime_ns = times

        undo.add(relink)
        return now

    def _removed(self, parent: Inode, name: bytes, undo: Undo) -> None:
        """``parent/name`` is removed here: its remote key goes to ``remember_removed``."""
        dir_key = self.path_of(parent)
        if dir_key is not None:
            self.remember_removed(f"{dir_key}/{os.fsdecode(name)}" if dir_key else os.fsdecode(name), undo)

    def _unlink_ops(self, parent: Inode, name: bytes, inode: Inode, undo: Undo) -> list[Op]:
        """Detach ``inode`` from its name ``name``; the journal queues that name's remote object for deletion."""
        self._removed(parent, name, undo)
        row = hardlinks.name_row(inode, parent.ino, name)
        if row != inode.ino:  # a hard link's name: the inode keeps its others
            hardlinks.drop_name(parent, inode, row, undo)
            times = (parent.mtime_ns, parent.ctime_ns, inode.ctime_ns)
            parent.mtime_ns = parent.ctime_ns = inode.ctime_ns = now = now_ns()

            def restore_times() -> None:
                parent.mtime_ns, parent.ctime_ns, inode.ctime_ns = times

            undo.add(restore_times)
            return [*unlink_name_ops(row, name), update_inode_op(inode.ino, ctime_ns=now)]
        if inode.kind == "file" and inode.handles and not inode.local and not inode.links:
            # A reader still reads it from the remote: the object stays until its copy is whole
            # here or the last handle closes (burstfs/orphans.py).
            return unlink_keeping_object_ops(inode.ino, inode.name, self.detach(parent, inode, undo))
        return unlink_ops(inode.ino, inode.name, self.detach(parent, inode, undo))

    def maybe_destroy(self, inode: Inode) -> None:
        """Drop an unlinked inode once nothing references it any more."""
        if inode.named or inode.lookups or inode.handles or inode.pending or inode.ino == ROOT_INO:
            return
        if self.inodes.get(inode.ino) is not inode:  # already dropped (or a failed create)
            return
        self.inodes.pop(inode.ino, None)
        if inode.kind == "file":
            self.on_destroy(inode)
        # Not awaited: losing this record in a crash is harmless (start-up drops
        # unlinked rows), and forget() must not block.
        self.committer.enqueue(drop_unlinked_ops(inode.ino))

    async def rename(
        self, old_parent_ino: int, old_name: bytes, new_parent_ino: int, new_name: bytes, flags: int
    ) -> bool:
        """rename(2): atomically replaces a file target or an empty directory target.
        False when there was nothing to do (the target is the same inode)."""
        from pyfuse3 import RENAME_EXCHANGE, RENAME_NOREPLACE

        if flags & RENAME_EXCHANGE:
            raise FsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        old_parent = self.dir(old_parent_ino)
        new_parent = self.dir(new_parent_ino)
        check_new_name(new_parent, new_name)
        inode = self.child(old_parent_ino, old_name)
        ops: list[Op] = []
        target_ino = new_parent.children.get(new_name)  # type: ignore[union-attr]
        target = self.inodes[target_ino] if target_ino is not None else None
        if target is inode:
            return False
        forgotten: list[Inode] = []  # a directory target's entries, only listed here
        if target is not None:
            if flags & RENAME_NOREPLACE:
                raise FsError(errno.EEXIST)
            if inode.kind == "dir" and target.kind != "dir":
                raise FsError(errno.ENOTDIR)
            if inode.kind != "dir" and target.kind == "dir":
                raise FsError(errno.EISDIR)
            others = self._others_files(target) if target.children else []
            if others is None:
                raise FsError(errno.ENOTEMPTY)
            forgotten = others
        if inode.kind == "dir":  # the VFS checks this too; keep the core safe on its own
            ancestor = new_parent
            while ancestor.ino != ROOT_INO:
                if ancestor is inode:
                    raise FsError(errno.EINVAL)
                ancestor = self.inodes[ancestor.parent]
        undo = Undo()
        ops += self._forget_tree(forgotten, undo)
        if target is not None:
            ops += self._unlink_ops(new_parent, new_name, target, undo)
            target.pending += 1
        self._removed(old_parent, old_name, undo)
        row = hardlinks.name_row(inode, old_parent.ino, old_name)
        if row == inode.ino:
            self.detach(old_parent, inode, undo)  # restores the old name and times on failure
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
        now = now_ns()
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
            self.touch_parent_op(old_parent),
            self.touch_parent_op(new_parent),
            event_op(row, "rename", f"{os.fsdecode(old_name)} -> {os.fsdecode(new_name)}"),
        ]
        try:
            await self.committer.commit(ops, undo=undo)
        finally:
            if target is not None:
                target.pending -= 1
        if target is not None:
            self.maybe_destroy(target)
        for gone in forgotten:
            self.maybe_destroy(gone)
        return True

    def _others_files(self, directory: Inode) -> list[Inode] | None:
        """What ``directory`` holds, deepest first, when that is only other nodes' files as
        listed here (``Inode.as_listed``, none being written, none read from the remote) and
        directories holding only such: nothing of this node's.  None otherwise.

        A rename onto such a directory replaces it (each node renames its own temp directory
        to the step's name, and a listing may have shown another node's renamed one here
        first): the listed entries are only forgotten, nothing is deleted on the remote, and
        the next listing of the new directory shows them in it again."""
        found: list[Inode] = []
        for ino in (directory.children or {}).values():
            child = self.inodes[ino]
            if child.kind == "dir":
                below = self._others_files(child)
                if not below:  # something of this node's, or an empty directory made here
                    return None
                found += below
            elif not self._only_listed(child):
                return None
            found.append(child)
        return found

    @staticmethod
    def _only_listed(inode: Inode) -> bool:
        """Another node's file as listed, nobody writing it, and no reader fetching it (a reader
        of a file not all local needs its key)."""
        busy = inode.writers or inode.pending or inode.links or (inode.handles and not inode.local)
        return inode.as_listed and not busy

    def _forget_tree(self, entries: list[Inode], undo: Undo) -> list[Op]:
        """Take the names of ``entries`` (``_others_files``: deepest first) here only."""
        ops: list[Op] = []
        for entry in entries:
            parent = self.inodes[entry.parent]
            if entry.kind == "dir":
                ops += unlink_ops(entry.ino, entry.name, self.detach(parent, entry, undo))
            else:
                ops += forget_listed_ops(entry.ino, entry.name, self.detach(parent, entry, undo))
        return ops

"""The file-system core: the POSIX operations of one mount, journaled.

Everything POSIX means here is decided in this module and the ones it composes,
independent of FUSE: the pyfuse3 front only translates requests and errors, and
calls only this class (one method per operation).  Tests drive it in-process
(see tests/test_core.py), as s3ql drives its ``Operations``.  Names live in
``namespace.py``, open files and their bytes in ``datapath.py``.

Invariants:
- every namespace change and every close of a changed file is committed to the
  journal before the call returns, but for a new file's name: it rides with the
  file's close (or fsync, or the next commit), at most ``committer.DEFER_S``
  later, and a close or fsync fails if that record did;
- the data of an inode lives in ``LocalTier.path(ino)`` while ``inode.local``;
- an inode is destroyed (row and data file) only when it has no name, no open
  handle and no kernel lookup reference.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from .capacity import StatFs, TierCapacity
from .committer import GroupCommitter
from .config import TierOptions
from .datapath import FILE_MODE_DROPPED, DataPath
from .digests import StreamingDigests
from .errors import FsError
from .headroom import TierHeadroom, release_reserve
from .hooks import DrainHooks, DrainLinks, Fetcher
from .iopath import BackingFiles, IOPaths
from .journal import WRITING, Journal, set_meta_op
from .listings import LISTING_WAIT, RemoteListings, Tombstones
from .localtier import LocalTier
from .namespace import Namespace
from .nodes import Inode, Undo
from .orphans import OrphanFetches
from .publish import Publisher
from .readplans import ReadPlans
from .reaper import TierReaper
from .xattrs import ExtendedAttributes

#: How long a commit that failed on a full tier waits for the files open for writing to be
#: released before the journal's reserve may be used (see BurstCore._room_for_the_journal).
WRITERS_GONE_WAIT_S = 0.5


class BurstCore:
    """The POSIX surface of one mount: one method per request of the front (and of the
    control socket), composing the namespace, the open files, capacity and xattrs."""

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
        self.committer = GroupCommitter(journal, self._room_for_the_journal)
        self.links = DrainLinks(drain, fetcher)  # shared with the data path and the listings
        tombstones = Tombstones()
        self.io_paths = IOPaths(self.tier, backing)
        self.dir_handles: dict[int, tuple[int, list[bytes]]] = {}  # directory, its names at opendir
        self._next_fh = itertools.count(1)  # one numbering for file and directory handles
        self.namespace = Namespace(
            journal,
            self.committer,
            self.tier,
            remember_removed=tombstones.remember,
            on_destroy=self._file_gone,
        )
        self.listings = RemoteListings(
            self.namespace, journal, self.committer, self.links, tombstones, ttl=list_ttl, wait=listing_wait
        )
        self.inodes = self.namespace.inodes  # the one inode table
        self.xattrs = ExtendedAttributes(
            journal, self.committer, self.links, self.namespace.path_of, self.listings.refresh_path
        )
        self.publisher = Publisher(self.committer, journal.max_close_seq() + 1)
        self.capacity = TierCapacity(self.tier, journal, capacity, self.inodes, self._forget_fetch)
        self.reaper = TierReaper(self.tier, self.capacity)  # run by the daemon's nursery
        self.headroom = TierHeadroom(  # run by the daemon's nursery
            self.tier.cache_dir, self.capacity, lambda: self.data.writers_open()
        )
        self.data = DataPath(
            self.tier,
            self.namespace,
            self.committer,
            self.publisher,
            self.capacity,
            self.io_paths,
            self.links,
            self._next_fh,
            fsync_remote=fsync_remote,
            offload_writes=offload_writes,
            digest_chunk_size=digest_chunk_size,
        )
        self.plans = ReadPlans(self.namespace, self.data)  # run by the daemon's nursery
        self.orphans = OrphanFetches(self.data)  # run by the daemon's nursery

    # -- names (burstfs/namespace.py) -------------------------------------------------

    def forget(self, ino: int, count: int) -> None:
        self.namespace.forget(ino, count)

    async def mkdir(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        inode = await self.namespace.mkdir(parent_ino, name, mode, uid, gid)
        self.listings.made_here(inode)
        return inode

    async def symlink(self, parent_ino: int, name: bytes, target: bytes, uid: int, gid: int) -> Inode:
        return await self.namespace.symlink(parent_ino, name, target, uid, gid)

    async def mknod_special(self, parent_ino: int, name: bytes, mode: int, uid: int, gid: int) -> Inode:
        return await self.namespace.mknod_special(parent_ino, name, mode, uid, gid)

    def readlink(self, ino: int) -> bytes:
        return self.namespace.readlink(ino)

    async def unlink(self, parent_ino: int, name: bytes) -> None:
        removed = self._named(parent_ino, name)
        await self.namespace.unlink(parent_ino, name)
        if removed is not None:
            self.orphans.note(removed)
        self.links.namespace_changed()

    async def rmdir(self, parent_ino: int, name: bytes) -> None:
        directory = self.namespace.child(parent_ino, name)
        await self._listed_in_full(directory)
        if directory.kind == "dir" and not directory.children:
            await self.listings.list_before_removal(directory, self._announced_in(directory))
        await self.namespace.rmdir(parent_ino, name)

    async def rename(
        self, old_parent_ino: int, old_name: bytes, new_parent_ino: int, new_name: bytes, flags: int
    ) -> None:
        # Not the target: every node of a checkpoint renames its own temp directory onto the
        # name the first one made (docs/SEMANTICS.md "Many nodes").
        await self._listed_in_full(self.namespace.child(old_parent_ino, old_name))
        replaced = self._named(new_parent_ino, new_name)
        if await self.namespace.rename(old_parent_ino, old_name, new_parent_ino, new_name, flags):
            if replaced is not None:
                self.orphans.note(replaced)
            self.links.namespace_changed()
            await self._join_rounds(self.namespace.child(new_parent_ino, new_name))

    def _announced_in(self, directory: Inode) -> bool:
        """This node announced a commit round in ``directory`` (its files there went out)."""
        dir_key = self.namespace.path_of(directory)
        return self.links.drain is not None and dir_key is not None and self.links.drain.announced_in(dir_key)

    def _named(self, parent_ino: int, name: bytes) -> Inode | None:
        """The inode ``name`` in ``parent_ino`` names now, if any (no remote lookup)."""
        directory = self.inodes.get(parent_ino)
        ino = directory.children.get(name) if directory is not None and directory.children is not None else None
        return self.inodes.get(ino) if ino is not None else None

    async def _listed_in_full(self, top: Inode) -> None:
        """A directory about to be renamed or removed: each directory at or under it that
        holds nothing here and that no listing reached yet (a fresh cache over a filled
        remote, ``RemoteListings.unseen``) is listed first.  Else the rename would take none
        of the remote files there along (they came back under the old name), and rmdir would
        pass a directory that is not empty.  EIO if one cannot be listed."""
        pending = [top]
        while pending:
            directory = pending.pop()
            unseen = directory.kind == "dir" and self.listings.unseen(directory)
            if unseen and not await self.listings.refresh_bounded(directory):
                self._never_listed(directory)
            pending += [
                child for ino in (directory.children or {}).values() if (child := self.inodes[ino]).kind == "dir"
            ]

    async def _join_rounds(self, moved: Inode) -> None:
        """Files renamed into a directory (a file, or every file of a directory) join this node's
        round there as a close there would: a checkpoint's shards moved into place from a
        staging directory, or a temp directory renamed to the step's name, hold its marker back
        until their objects are at their new keys (docs/SEMANTICS.md "Many nodes")."""
        drain = self.links.drain
        if drain is None:
            return
        joining: list[tuple[int, str, bytes]] = []
        pending = [moved]
        while pending:
            inode = pending.pop()
            if inode.kind == "dir":
                pending += [child for ino in (inode.children or {}).values() if (child := self.inodes.get(ino))]
            elif (
                inode.kind == "file" and not inode.listed and (dir_key := self.namespace.dir_key_of(inode)) is not None
            ):
                # Not a file known only from a listing: another node's (or an earlier life's),
                # which its own round vouches for.
                joining.append((inode.ino, dir_key, inode.name))
        if joining:
            await drain.renamed_in(joining)  # one bounded wait (--remote-wait); never fails

    def _forget_fetch(self, ino: int) -> None:
        if self.links.fetcher is not None:
            self.links.fetcher.forget(ino)

    def _file_gone(self, inode: Inode) -> None:
        """A file inode was destroyed: its data, its count on the tier and any fetch state go."""
        self._forget_fetch(inode.ino)
        self.reaper.remove(inode.ino, inode.size, inode.accounted)

    async def lookup(self, parent: int, name: bytes) -> Inode:
        try:
            inode = self.namespace.child(parent, name)
        except FsError as exc:  # maybe another node drained it: look at the remote
            if exc.errno != errno.ENOENT:
                raise
            directory = self.namespace.dir(parent)
            if not await self.listings.refresh_bounded(directory):
                self._never_listed(directory)
                raise
            inode = self.namespace.child(parent, name)
        inode.lookups += 1
        self.data.adopt_direct_writes(inode)
        return inode

    def looked_up(self, inode: Inode) -> None:
        """The kernel took a reference to ``inode`` without a lookup (a readdirplus entry)."""
        inode.lookups += 1

    async def create(
        self, parent_ino: int, name: bytes, mode: int, flags: int, uid: int, gid: int
    ) -> tuple[int, Inode]:
        """Create and open a regular file (O_EXCL is the kernel's: we only see new names)."""
        parent = self.namespace.dir(parent_ino)
        if not stat.S_ISREG(mode) and stat.S_IFMT(mode) != 0:
            raise FsError(errno.EPERM, "only regular files, directories and symlinks are supported")
        await self.capacity.admit_writer()
        inode = self.namespace.new_inode(
            parent, name, "file", stat.S_IFREG | (stat.S_IMODE(mode) & ~FILE_MODE_DROPPED), uid, gid
        )
        inode.new = True
        inode.digests = StreamingDigests(self.data.digest_chunk_size)
        self.tier.create(inode.ino)
        undo = Undo()
        undo.add(lambda: self.tier.remove(inode.ino))
        self.namespace.attach(parent, inode, undo)
        self.namespace.defer_new(parent, inode, WRITING, undo)  # journaled with its close
        inode.lookups += 1
        return await self.data.open_created(inode, flags), inode

    async def link(self, ino: int, new_parent_ino: int, new_name: bytes) -> Inode:
        """link(2): another name for a file, symlink or special node (directories: EPERM).

        A file known only from the remote is fetched first: the new name drains
        its own copy of the bytes from the local tier (see ``hardlinks``).
        """
        inode = self.namespace.inode(ino)
        if inode.kind == "dir":
            raise FsError(errno.EPERM, "directories cannot be hard-linked")
        parent = self.namespace.dir(new_parent_ino)
        for _ in range(3):  # evicted again meanwhile (a full tier): fetch again
            if inode.local or inode.kind != "file":
                break
            await self.data.ensure_local(inode)
        else:
            raise FsError(errno.EAGAIN, "the file was evicted again while it was being fetched")
        await self.namespace.add_link(inode, parent, new_name)
        inode.lookups += 1
        self.links.file_closed()  # the new name has an object to drain
        return inode

    # -- attributes -----------------------------------------------------------------

    def getattr(self, ino: int) -> Inode:
        inode = self.namespace.inode(ino)
        self.data.adopt_direct_writes(inode)
        return inode

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
        ctime_ns: int | None = None,
        fh: int | None = None,
    ) -> Inode:
        return await self.data.setattr(
            ino, mode=mode, uid=uid, gid=gid, size=size, atime_ns=atime_ns, mtime_ns=mtime_ns, ctime_ns=ctime_ns, fh=fh
        )

    # -- file data (burstfs/datapath.py) ----------------------------------------------

    async def open(self, ino: int, flags: int) -> int:
        await self._revalidate_listed(self.namespace.inode(ino))
        inode = self.namespace.inode(ino)
        if not flags & os.O_TRUNC and self.plans.reads_whole(inode, (flags & os.O_ACCMODE) != os.O_RDONLY):
            await self.data.fetch_whole_if_it_fits(inode, "open_whole")
        fh = await self.data.open(ino, flags)
        handle = self.data.handles[fh]
        self.plans.opened(handle.inode, handle.writable)
        return fh

    async def _revalidate_listed(self, inode: Inode) -> None:
        """An open of another node's file (``Inode.as_listed``) first merges its directory's
        listing when one is due (``--list-ttl``, bounded by ``--remote-wait``): a rewrite or
        delete by its owner is seen at the next open, not only at the next ``ls``.  If this
        inode was replaced or forgotten, ESTALE makes the kernel look the name up again."""
        if not inode.as_listed or inode.writers:
            return
        directory = self.inodes.get(inode.parent)
        if directory is None or directory.kind != "dir":
            return
        await self.listings.refresh_bounded(directory)
        if inode.parent == 0:
            raise FsError(errno.ESTALE, "rewritten or removed on the remote by its owner: look the name up again")

    def backing_id(self, fh: int) -> int:
        """The passthrough backing id of a handle; 0 when its I/O comes to the daemon."""
        return self.data.backing_id(fh)

    @property
    def passthrough(self) -> bool:
        """Opens may go direct (the kernel does their I/O on the tier)."""
        return self.io_paths.backing is not None

    def passthrough_unavailable(self) -> None:
        """The kernel did not offer passthrough at INIT: every open goes through the daemon."""
        self.io_paths.turn_off()

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        return await self.data.read(fh, offset, size)

    async def write(self, fh: int, offset: int, data: bytes) -> int:
        return await self.data.write(fh, offset, data)

    async def fallocate(self, fh: int, offset: int, length: int, mode: int) -> None:
        await self.data.fallocate(fh, offset, length, mode)

    async def flush(self, fh: int) -> None:
        await self.data.flush(fh)

    async def release(self, fh: int) -> None:
        handle = self.data.handles.get(fh)
        await self.data.release(fh)
        if handle is not None:
            self.plans.closed(handle.inode)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.data.fsync(fh, datasync)

    async def prefetch(self, ino: int) -> None:
        """Bring a whole file to the local tier (``burstfs-admin prefetch``)."""
        inode = self.namespace.inode(ino)
        if inode.kind == "file":
            await self.data.ensure_local(inode)

    # -- directories ----------------------------------------------------------------

    def _never_listed(self, directory: Inode) -> None:
        """EIO in a directory of the remote no listing has reached yet (a fresh cache while
        the remote fails, ``RemoteListings.unseen``): a missing name there is unknown, not
        absent; ENOENT would tell a restart script there is no checkpoint, and its next save
        would go over it.  A directory this cache holds entries of, or made, answers from
        them as ever (a save never waits for a sick remote)."""
        if self.listings.unseen(directory):
            raise FsError(errno.EIO, "the remote could not be listed here yet (see burstfs-admin status)")

    async def opendir(self, ino: int) -> int:
        inode = self.namespace.dir(ino)
        if not await self.listings.refresh_bounded(inode):
            self._never_listed(inode)
        fh = next(self._next_fh)
        self.dir_handles[fh] = (inode.ino, list(inode.children))  # type: ignore[arg-type]
        return fh

    def readdir_from(self, fh: int, start: int) -> Iterator[tuple[int, bytes, Inode]]:
        """The entries of the opendir snapshot from position ``start`` on, each as (the
        position after it, name, inode): the kernel resumes its next request at the position
        of the last entry it took.  Positions index the snapshot's names, which never change,
        so a name removed (or renamed away) since opendir is skipped without shifting any
        other entry: every name is returned once.  Whether a name is still there is asked of
        the directory, not of the inode table: an unlink by path looks the name up first,
        and that kernel reference keeps the removed inode in the table.  A name replaced
        meanwhile (a rename over it) comes back once, as what it names now."""
        dir_ino, names = self.dir_handles[fh]
        directory = self.inodes.get(dir_ino)
        children = directory.children if directory is not None else None
        for position in range(start, len(names)):
            name = names[position]
            ino = children.get(name) if children else None
            inode = self.inodes.get(ino) if ino is not None else None
            if inode is not None:
                yield position + 1, name, inode

    def readdir(self, fh: int, start: int) -> list[tuple[bytes, Inode]]:
        """The names and inodes of :meth:`readdir_from`, without their positions."""
        return [(name, inode) for _, name, inode in self.readdir_from(fh, start)]

    def releasedir(self, fh: int) -> None:
        self.dir_handles.pop(fh, None)

    async def fsyncdir(self) -> None:
        """Namespace changes are committed before their calls return: make them durable on disk."""
        await self.committer.commit([], sync=True)

    async def set_meta(self, key: str, value: str) -> None:
        """Journal a mount-wide value (the mount point, for ``burstfs-admin`` while it is down)."""
        await self.committer.commit([set_meta_op(key, value)])

    # -- extended attributes (burstfs/xattrs.py) ------------------------------------

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        return await self.xattrs.get(self.namespace.inode(ino), name)

    def listxattr(self, ino: int) -> list[bytes]:
        return self.xattrs.names(self.namespace.inode(ino))

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        await self.xattrs.set(self.namespace.inode(ino), name, value)

    async def removexattr(self, ino: int, name: bytes) -> None:
        await self.xattrs.remove(self.namespace.inode(ino), name)

    # -- file system ----------------------------------------------------------------

    async def statfs(self) -> StatFs:
        """The local tier's capacity (see :meth:`TierCapacity.statfs`)."""
        return self.capacity.statfs(await self.capacity.evictable_bytes())

    async def evict(self, ino: int) -> int:
        """Drop the local copy of a durable file (``burstfs-admin evict``); bytes freed."""
        return await self.capacity.evict(self.namespace.inode(ino))

    def _room_for_the_journal(self) -> bool:
        """A commit failed on a full tier: give a slice of the reserve back (blocking, in the
        committer's thread; True if it did), unless a file stays open for writing: a passthrough
        writer would take it.  A writer that just closed is waited for briefly (its RELEASE comes
        after close(2) returned: an rm right after a failed save must not fail for it)."""
        deadline = time.monotonic() + WRITERS_GONE_WAIT_S
        while self.data.writers_open():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return release_reserve(self.tier.cache_dir, "journal full")

    def close(self) -> None:
        """Close data descriptors.  Files still open for writing stay journaled as
        ``writing`` and are flagged incomplete by the next start."""
        self.data.close()

"""Open files: the handle table, reads, writes, size changes and closes on the local tier.

The core composes this (:attr:`BurstCore.data`) and stays the POSIX orchestrator;
here are the rules of file bytes: a changed file is journaled ``writing`` before
its first changed byte lands and published by a close (``publish.py``), a file
only on the remote is fetched before it is read or changed, and an open goes
direct (passthrough) when it can (``iopath.py``).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator

import trio

from . import fallocate
from .capacity import TierCapacity
from .committer import DEFER_S, GroupCommitter
from .digests import StreamingDigests
from .errors import BurstfsError, FsError, to_errno
from .hooks import DrainLinks
from .iopath import IOPaths
from .journal import held_close_op, released_op, update_inode_op
from .localtier import LocalTier
from .namespace import Namespace, now_ns
from .nodes import Handle, Inode, Undo
from .publish import Publisher

log = logging.getLogger("burstfs.core")

# Reads of a file being fetched go straight to the tier while they stay this far
# behind its local prefix; nearer the frontier they go through the fetcher, which
# sees them and keeps its prefetch window running ahead.
PREFETCH_MARGIN = 64 << 20
# Never kept on regular files: a checkpoint store runs no programs, and without
# them the kernel may skip a security.capability lookup on every write
# (FUSE_HANDLE_KILLPRIV_V2, see burstfs/_passthrough.c).
FILE_MODE_DROPPED = stat.S_ISUID | stat.S_ISGID
#: A release record whose commit failed (the journal's file system full) is tried again this
#: often until it lands.
RELEASE_RETRY_S = 1.0


def _write_hashed(fd: int, data: bytes, offset: int, digests: StreamingDigests | None) -> int:
    """pwrite, then hash what landed (runs in a worker thread for large writes)."""
    written = os.pwrite(fd, data, offset)
    if digests is not None:
        digests.update(offset, data if written == len(data) else data[:written])
    return written


class DataPath:
    """The open files of one mount and what happens to their bytes."""

    def __init__(
        self,
        tier: LocalTier,
        namespace: Namespace,
        committer: GroupCommitter,
        publisher: Publisher,
        capacity: TierCapacity,
        io_paths: IOPaths,
        links: DrainLinks,
        next_fh: Iterator[int],
        *,
        fsync_remote: bool,
        offload_writes: bool,
        digest_chunk_size: int,
    ) -> None:
        self.namespace = namespace
        self.tier = tier
        self.committer = committer
        self.publisher = publisher
        self.capacity = capacity
        self.io_paths = io_paths
        self.links = links
        self._next_fh = next_fh  # shared with directory handles
        self.fsync_remote = fsync_remote
        self.offload_writes = offload_writes
        self.digest_chunk_size = digest_chunk_size
        self.daemon_written_bytes = 0  # bytes clients wrote through the daemon (passthrough bypasses it)
        self.handles: dict[int, Handle] = {}
        #: Called with an inode whose write failed: the kernel's cached pages and size of it hold
        #: bytes the tier does not (the write-back cache sent them at close), and must go.  The
        #: FUSE front sets it.
        self.kernel_cache_stale: Callable[[int], None] = lambda ino: None
        #: The kernel keeps the mtime and ctime of regular files itself (the write-back cache,
        #: ``FUSE_WRITEBACK_CACHE``): it stamps them as it takes writes, truncations and
        #: allocations, shows its own values to stat and sends them in a SETATTR (before each
        #: FLUSH, as ``write_inode_now`` writes the inode).  Its WRITEs reach us later, in any
        #: order with that SETATTR, and stamping them here journaled times nobody saw (and a
        #: remount showed).  So the data path then stamps nothing and journals the kernel's
        #: times.  Set by the FUSE front at INIT.
        self.kernel_times = False

    # -- attributes -----------------------------------------------------------------

    def adopt_direct_writes(self, inode: Inode) -> None:
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

    # -- size and attributes ---------------------------------------------------------

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
        """chmod, chown, utimens, truncate; and the times the kernel keeps (``kernel_times``),
        which it sends with ``ctime_ns``."""
        inode = self.namespace.inode(ino)
        self.adopt_direct_writes(inode)  # before new times, so they are not overwritten later
        if size is not None:
            if inode.kind != "file":
                raise FsError(errno.EISDIR if inode.kind == "dir" else errno.EINVAL)
            await self._truncate_data(inode, size)
        # Attributes change in memory with the commit: a failed commit restores them.
        now = now_ns()
        before = (inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns)
        undo = Undo()

        def restore() -> None:
            inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns = before

        undo.add(restore)
        stamps = not self._kernel_stamps(inode)
        fields: dict[str, int] = {}
        if size is not None:
            if stamps:  # else the kernel sends its own (truncate) or stamps it itself (O_TRUNC)
                inode.mtime_ns = now
            fields.update(size=size, mtime_ns=inode.mtime_ns)
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
        if ctime_ns is not None:
            inode.ctime_ns = ctime_ns
        elif stamps:
            inode.ctime_ns = now
        fields["ctime_ns"] = inode.ctime_ns
        ops = [update_inode_op(ino, **fields)]
        closing = size is not None and not self._has_writer(inode) and fh is None
        if closing:
            ops += self.publisher.close_ops(inode, undo, writer_left=False)  # truncate(2) on a path: a complete change
            self._tier_times_follow(inode)
        await self.committer.commit(ops, undo=undo)
        if closing:
            self.links.file_closed()
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
            await self.ensure_local(inode)
        await self.publisher.mark_writing(inode)
        if emptying_remote and not inode.local:
            if self.links.fetcher is not None:  # a fetch in flight must not land on the new bytes
                await self.links.fetcher.let_go(inode.ino)
            await trio.to_thread.run_sync(self.tier.create, inode.ino)
            inode.local, inode.listed, inode.local_prefix = True, False, 0
            log.info("event=emptied_remote_file ino=%d note=not fetched", inode.ino)
        else:
            await trio.to_thread.run_sync(self.tier.truncate, inode.ino, size)
        if inode.direct is not None:
            inode.direct.reopened_clean = False
        # Our own change, not a direct writer's (the kernel holds the inode's lock through the
        # truncate): adopted at the close, the data file's mtime replaced the one the kernel
        # sends with it and keeps showing, and a remount showed another mtime.
        self.io_paths.note_daemon_change(inode)
        # Growth adds a hole: nothing allocated, nothing counted (a file drains at its
        # logical size, but the tier holds only what was written).  Shrinking frees blocks.
        if size < inode.size:
            await self.capacity.count_held_blocks(inode)
        inode.size = size
        if size == 0:  # emptied: what is written next is all of it
            inode.incomplete = ""
            inode.digests = None if self.io_paths.writes_direct(inode) else StreamingDigests(self.digest_chunk_size)
        elif inode.digests is not None and size != inode.digests.size:
            inode.digests = None  # the drain hashes the staged bytes instead

    @staticmethod
    def _check_created(inode: Inode) -> None:
        """A close or fsync fails if the file's deferred create record was not committed
        (``Namespace.defer_new``): its name is gone again, and success would be a lie."""
        batch = inode.unjournaled
        if batch is None:
            return
        if batch.error is not None:
            raise FsError(to_errno(batch.error), f"the file's creation could not be journaled: {batch.error}")
        if batch.done.is_set():
            inode.unjournaled = None

    def writers_open(self) -> bool:
        """Whether any file is open for writing (any thread: one snapshot of the handle table)."""
        return any(handle.writable for handle in list(self.handles.values()))

    def _kernel_stamps(self, inode: Inode) -> bool:
        """Whether the kernel keeps this inode's mtime and ctime (see ``kernel_times``)."""
        return self.kernel_times and inode.kind == "file"

    def _tier_times_follow(self, inode: Inode) -> None:
        """At a close journaled with the kernel's times (``kernel_times``), the data file gets
        that mtime: the kernel's clock (coarse, stamped before its WRITEs reach us) is behind
        the tier's, and the drain tells a writer it has not seen yet from bit rot by a data
        file newer than its close (``mover/upload.py``).  Never a time ahead of now (a utime
        into the future): recovery takes a data file newer than its record for one written
        after its close (``recovery.written_after_close``).  One futimens, no commit."""
        if not self.kernel_times or not inode.local:
            return
        mtime = min(inode.mtime_ns, now_ns())
        fd = self.tier.fd(inode.ino)
        try:
            os.utime(self.tier.path(inode.ino) if fd is None else fd, ns=(mtime, mtime))
        except OSError as exc:
            log.warning("event=tier_times_not_set ino=%d error=%s", inode.ino, exc)

    @staticmethod
    def _direct_stamp(inode: Inode) -> tuple[int, int] | None:
        """The data file's (size, mtime_ns) as last seen (:meth:`adopt_direct_writes`), while the
        kernel writes it directly: what a close or fsync journaling it now records."""
        direct = inode.direct
        return direct.seen if direct is not None and direct.writers else None

    def _stamp_close(self, inode: Inode, stamp: tuple[int, int] | None) -> None:
        """Tell the drain what the data file looked like when this generation was journaled
        (``DrainHooks.stamp_close``): bytes written after it are not that generation's."""
        if stamp is not None:
            self.links.stamp_close(inode.ino, inode.generation, stamp)

    def _has_writer(self, inode: Inode) -> bool:
        return any(h.writable and h.inode is inode for h in self.handles.values())

    # -- open files -----------------------------------------------------------------

    def _open_handle(self, inode: Inode, writable: bool) -> int:
        if writable and self.links.drain is not None and (dir_key := self.namespace.dir_key_of(inode)) is not None:
            self.links.drain.writing_in(inode.ino, dir_key, inode.name)
        self.tier.acquire(inode.ino)
        inode.handles += 1
        inode.writers += writable
        fh = next(self._next_fh)
        self.handles[fh] = Handle(inode, writable)
        return fh

    async def open(self, ino: int, flags: int) -> int:
        inode = self.namespace.inode(ino)
        if inode.kind == "dir":
            raise FsError(errno.EISDIR)
        if inode.kind != "file":
            raise FsError(errno.ELOOP)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        truncating = bool(flags & os.O_TRUNC) and bool(inode.size or inode.incomplete or not inode.local)
        if writable:
            await self.capacity.admit_writer()
        if writable and not truncating:
            await self.ensure_local(inode)  # emptied instead of fetched when truncating
        fh = self._open_handle(inode, writable)
        try:
            if truncating:
                # Through a read-only handle (Linux truncates on O_RDONLY | O_TRUNC) no close
                # will publish the change: journal it at once, as truncate(2) does.
                await self.setattr(ino, size=0, fh=fh if writable else None)
            await self._choose_io_path(inode, self.handles[fh], flags)
        except BaseException:
            self._drop_handle(fh)  # the open fails: no release will come for it
            raise
        return fh

    def _drop_handle(self, fh: int) -> None:
        handle = self.handles.pop(fh)
        self.io_paths.close(handle.inode, handle)
        handle.inode.handles -= 1
        handle.inode.writers -= handle.writable
        self.tier.release(handle.inode.ino)
        self.namespace.maybe_destroy(handle.inode)

    async def _choose_io_path(self, inode: Inode, handle: Handle, flags: int) -> None:
        """Open ``handle`` direct when it can be (:meth:`IOPaths.open_direct`); a direct
        writer journals the file as being written before any byte can land.

        An ``O_DIRECT`` open comes to the daemon (unless the file is open direct already:
        the kernel does not mix the two): through passthrough the tier's file system would
        ask for aligned buffers and offsets (ext4, XFS: EINVAL), which SEMANTICS promises
        nobody."""
        if flags & os.O_DIRECT and not (inode.direct and inode.direct.handles):
            return
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

    async def open_created(self, inode: Inode, flags: int) -> int:
        """The handle of a file ``create`` just made (its row deferred to the next commit)."""
        fh = self._open_handle(inode, writable=True)
        await self._choose_io_path(inode, self.handles[fh], flags)
        return fh

    def backing_id(self, fh: int) -> int:
        """The passthrough backing id of a handle; 0 when its I/O comes to the daemon."""
        return self.io_paths.backing_id(self.handles[fh])

    async def ensure_local(self, inode: Inode, offset: int = 0, size: int | None = None) -> None:
        """Fetch (part of) a file that is only on the remote before it is read or changed."""
        if inode.local:
            return
        if self.links.fetcher is None:
            raise FsError(errno.EIO, "file is not on the local tier and no remote is configured")
        await self.capacity.account(inode, inode.size)  # room for the whole file: a restore usually reads all of it
        try:
            with self.capacity.fetching(inode):
                prefix = await self.links.fetcher.ensure_local(inode.ino, offset, inode.size if size is None else size)
        except FsError as exc:
            if exc.errno == errno.ESTALE and inode.local:
                return  # emptied here meanwhile (O_TRUNC): what is local now is the file
            raise
        if inode.local:
            return  # emptied and rewritten here meanwhile: the fetch's prefix is not this file's
        inode.local_prefix = prefix
        if inode.local_prefix >= inode.size:
            inode.local, inode.listed = True, False

    async def fetch_whole_if_it_fits(self, inode: Inode, why: str) -> None:
        """Fetch all of a file that is only on the remote, in the background (read plans,
        orphans): only when it fits on the tier without evicting anything or waiting."""
        if not self.capacity.fits(inode.size - inode.accounted):
            log.info("event=%s_fetch_skipped ino=%d reason=tier_has_no_room", why, inode.ino)
            return
        await self.ensure_local(inode)
        log.info("event=%s_fetched ino=%d bytes=%d", why, inode.ino, inode.size)

    async def read(self, fh: int, offset: int, size: int) -> bytes:
        handle = self.handles[fh]
        inode = handle.inode
        if not inode.local and offset + size + PREFETCH_MARGIN > inode.local_prefix:
            await self.ensure_local(inode, offset, size)
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
            self._lost_write(inode, end)
            raise
        if end > inode.size:
            inode.size = end
        self.daemon_written_bytes += written
        inode.last_access = time.monotonic()
        if not self.kernel_times:  # else the kernel's own times come by SETATTR
            inode.mtime_ns = inode.ctime_ns = now_ns()
        return written

    def _lost_write(self, inode: Inode, end: int) -> None:
        """A write failed (a full tier): the kernel, which sent it from its write-back cache,
        already counts its bytes in the file's size, and keeps that size whatever we answer.
        The data file grows to it (a hole: no room needed), so stat, ``burstfs-admin ls`` and
        the tier agree, and the kernel's cached pages go: the lost bytes read as zeros, never
        as bytes the tier does not hold.  The file is ``incomplete``: it never drains."""
        if end > inode.size:
            fd = self.tier.fd(inode.ino)
            try:
                if fd is not None:
                    os.ftruncate(fd, end)
                inode.size = end
            except OSError as exc:
                log.warning("event=lost_write_size ino=%d error=%s", inode.ino, exc)
        self.kernel_cache_stale(inode.ino)

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
        self.adopt_direct_writes(inode)
        await self.ensure_local(inode)
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
            if not self.kernel_times:  # else the kernel stamps the growth itself
                inode.mtime_ns = inode.ctime_ns = now_ns()
            if inode.direct is not None:
                inode.direct.reopened_clean = False
            if inode.digests is not None:
                inode.digests = None  # zeros nobody wrote: the drain hashes the staged bytes
        inode.last_access = time.monotonic()

    async def flush(self, fh: int) -> None:
        """close(2): a changed or new file is journaled before close returns (tenet 1).

        RELEASE reaches us only after close(2) has returned, so it is too late for that.
        """
        handle = self.handles.get(fh)
        if handle is None or not handle.writable:
            return
        inode = handle.inode
        self._check_created(inode)
        self.adopt_direct_writes(inode)  # passthrough writes since the last close make it dirty
        stamp = self._direct_stamp(inode)
        if not inode.named:  # unlinked while open: nothing to publish
            inode.dirty = inode.new = False
            return
        if self.publisher.unpublished(inode):
            undo = Undo()
            ops = self.publisher.publish_ops(inode, undo, writer_left=self._has_writer(inode))
            self._tier_times_follow(inode)
            # Held until RELEASE (which wakes the drain): a dup'd descriptor of this open file
            # (``cmd > file``), a forked child or another open may still be writing.  Journaled
            # too: a crash before the release leaves the file incomplete (its later writes may
            # have died in the kernel's cache), never a torn version drained over the last one.
            ops.append(held_close_op(inode.ino, inode.generation))
            self.links.hold_drain(inode.ino, inode.generation)
            await self.committer.commit(ops, undo=undo)
            self._stamp_close(inode, stamp)
        # Even with nothing left to publish (an fsync did it: DCP's writer syncs each shard),
        # the close joins this node's round: the one begun at open may be done without the
        # file, decided while it was being written.
        if self.links.drain is not None and (dir_key := self.namespace.dir_key_of(inode)) is not None:
            await self.links.drain.closed_in(inode.ino, dir_key, inode.name)  # bounded (--remote-wait); never fails

    def _journal_released(self, ino: int, generation: int, within: float = DEFER_S) -> None:
        """Record that ``ino``'s last writer left (its closes up to ``generation``), with the
        next commit.  Until that record lands, a restart takes the file for one still open
        (``incomplete``): a batch that failed (the journal's file system full) is no reason to
        give up, so it is tried again each RELEASE_RETRY_S until it lands (the headroom frees
        the journal's reserve)."""
        undo = Undo()
        undo.add(lambda: self._journal_released(ino, generation, RELEASE_RETRY_S))
        self.committer.defer([released_op(ino, generation)], undo, within=within)

    async def release(self, fh: int) -> None:
        handle = self.handles.pop(fh, None)
        if handle is None:
            return
        inode = handle.inode
        last_writer = handle.writable and not self._has_writer(inode)
        try:
            self.adopt_direct_writes(inode)
            stamp = self._direct_stamp(inode)
            self.io_paths.close(inode, handle)
            if last_writer:
                if self.publisher.unpublished(inode) and inode.named:
                    undo = Undo()
                    ops = [*self.publisher.publish_ops(inode, undo, writer_left=False), released_op(inode.ino)]
                    self._tier_times_follow(inode)
                    await self.committer.commit(ops, undo=undo)
                    self._stamp_close(inode, stamp)
                    self.links.file_closed()
                else:  # rides with the next commit: a crash before it lands is within RELEASE_GRACE_S
                    self._journal_released(inode.ino, inode.generation)
                inode.digests = None  # the last writer is gone (kept if the commit failed)
            if inode.handles == 1 and not inode.local and inode.accounted:
                await self.capacity.count_held_blocks(inode)  # its fetch claimed the whole file
        finally:
            if last_writer:
                self.links.release_drain(inode.ino)  # what its closes journaled drains now
            inode.handles -= 1
            inode.writers -= handle.writable
            self.tier.release(inode.ino)
            self.namespace.maybe_destroy(inode)

    async def fsync(self, fh: int, datasync: bool) -> None:
        handle = self.handles[fh]
        inode = handle.inode
        self._check_created(inode)
        fd = self.tier.fd(inode.ino)
        assert fd is not None
        await trio.to_thread.run_sync(os.fdatasync if datasync else os.fsync, fd)
        self.adopt_direct_writes(inode)
        stamp = self._direct_stamp(inode)
        publish = inode.dirty or (handle.writable and self.publisher.unpublished(inode))
        undo = Undo()
        ops = []
        if publish and inode.named:
            ops = self.publisher.publish_ops(inode, undo, writer_left=self._has_writer(inode))
            self._tier_times_follow(inode)
        await self.committer.commit([*ops, released_op(inode.ino)], sync=True, undo=undo)
        if ops:
            self._stamp_close(inode, stamp)
            self.links.file_closed()
        self.links.release_drain(inode.ino)  # fsync asks for this version: it drains while still open
        if self.fsync_remote and self.links.drain is not None and inode.named:
            await self.links.drain.wait_durable(inode.ino, inode.generation)

    def close(self) -> None:
        """Close data descriptors.  Files still open for writing stay journaled as
        ``writing`` and are flagged incomplete by the next start."""
        self.handles.clear()
        self.tier.close_all()

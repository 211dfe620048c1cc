"""The FUSE front: pyfuse3 ``Operations`` translated onto :class:`BurstCore`.

Thin by design.  Every handler is wrapped by :func:`_errors_to_fuse`, the one
place where exceptions become errnos: a handler raises only ``FUSEError``, so no
request, however odd, can end the mount.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import stat
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from . import passthrough  # before pyfuse3: the shim interposes fuse_session_mount

# isort: split

import pyfuse3
import trio

from . import fallocate
from .core import BurstCore, Inode
from .errors import BurstfsError, FsError, to_errno

log = logging.getLogger("burstfs.fuse")

# The namespace changes only through this mount (remote listings are merged by
# the core), so the kernel may cache names and attributes for a while.
ATTR_TIMEOUT = 60.0
ENTRY_TIMEOUT = 60.0

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


def _errors_to_fuse(handler: F) -> F:
    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except (BurstfsError, OSError, sqlite3.Error) as exc:  # sqlite3: the journal (ENOSPC when full)
            code = to_errno(exc)
            if code in (errno.EIO, errno.ENOSPC):
                log.error(
                    "event=request_failed op=%s errno=%s error=%s",
                    handler.__name__,
                    errno.errorcode.get(code, code),
                    exc,
                )
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            log.exception("event=request_bug op=%s", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper  # type: ignore[return-value]


def entry_attributes(inode: Inode) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    attr.st_ino = inode.ino
    attr.generation = 0
    attr.entry_timeout = ENTRY_TIMEOUT
    attr.attr_timeout = ATTR_TIMEOUT
    attr.st_mode = inode.mode
    attr.st_nlink = inode.nlink
    attr.st_uid = inode.uid
    attr.st_gid = inode.gid
    attr.st_rdev = 0
    attr.st_size = inode.size
    attr.st_blksize = 1 << 20  # large I/O: checkpoint writers use st_blksize as buffer size
    attr.st_blocks = (inode.size + 511) // 512
    attr.st_atime_ns = inode.atime_ns
    attr.st_mtime_ns = inode.mtime_ns
    attr.st_ctime_ns = inode.ctime_ns
    return attr


def _drop_kernel_entry(parent_ino: int, name: bytes) -> None:
    """A name another node's rewrite or delete replaced: the kernel forgets its cached entry
    (queued: a request of that directory may be in flight)."""
    pyfuse3.invalidate_entry_async(parent_ino, name, ignore_enoent=True)


class BurstOperations(pyfuse3.Operations):
    """pyfuse3 handlers; each is one call into the core."""

    def __init__(
        self, core: BurstCore, *, writeback_cache: bool = True, backing: passthrough.BackingFiles | None = None
    ) -> None:
        super().__init__()
        self.core = core
        self.writeback_cache = writeback_cache
        self.backing = backing
        self.initialized = trio.Event()  # set once the kernel's INIT is answered
        core.listings.entry_dropped = _drop_kernel_entry
        core.data.kernel_cache_stale = self._drop_kernel_cache
        self._invalidating: set[int] = set()  # inodes whose cache drop is queued

    def _drop_kernel_cache(self, ino: int) -> None:
        """The kernel forgets its cached pages and attributes of ``ino`` (one drop queued per
        inode at a time).  From a thread of its own: the kernel waits for the write-back in
        flight, which the current request is part of."""
        if ino not in self._invalidating:
            self._invalidating.add(ino)
            trio.lowlevel.spawn_system_task(self._invalidate_inode, ino)

    async def _invalidate_inode(self, ino: int) -> None:
        try:
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino)
        except OSError as exc:  # ENOENT: the kernel forgot the inode meanwhile
            log.info("event=invalidate_skipped ino=%d error=%s", ino, exc)
        finally:
            self._invalidating.discard(ino)

    @property
    def enable_writeback_cache(self) -> bool:  # type: ignore[override]
        """Read by pyfuse3 while it answers INIT (after the request was read)."""
        if self.backing is not None and passthrough.kernel_offers():
            return False  # the kernel refuses passthrough together with the writeback cache
        return self.writeback_cache

    def init(self) -> None:
        # libfuse sends the INIT reply right after this returns, in the same call:
        # a task woken by this event runs once the kernel has the reply.
        self.initialized.set()
        # With the write-back cache the kernel keeps files' mtime and ctime and sends them
        # by SETATTR (pyfuse3 asked for it just before this call; every kernel since 3.15 has it).
        self.core.data.kernel_times = self.enable_writeback_cache
        if self.backing is None:
            return
        if passthrough.kernel_offers():
            log.info("event=passthrough state=on")
        else:
            log.warning("event=passthrough state=off reason=the kernel does not offer it (Linux 6.9+)")
            self.backing = None
            self.core.passthrough_unavailable()

    def _file_info(self, fh: int) -> pyfuse3.FileInfo:
        backing_id = self.core.backing_id(fh)
        if backing_id and self.backing is not None:
            self.backing.attach(fh, backing_id)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False)  # the kernel refuses page-cache flags here
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    @_errors_to_fuse
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.core.lookup(parent_inode, name))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, count in inode_list:
            try:
                self.core.forget(ino, count)
            except Exception:  # forget cannot report errors; never let it end the mount
                log.exception("event=forget_failed ino=%d", ino)

    @_errors_to_fuse
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return entry_attributes(self.core.getattr(inode))

    @_errors_to_fuse
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        updated = await self.core.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            ctime_ns=attr.st_ctime_ns if fields.update_ctime else None,  # the write-back cache's times
            fh=fh,
        )
        return entry_attributes(updated)

    @_errors_to_fuse
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return self.core.readlink(inode)

    @_errors_to_fuse
    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            return entry_attributes(await self.core.mknod_special(parent_inode, name, mode, ctx.uid, ctx.gid))
        fh, inode = await self.core.create(parent_inode, name, mode, os.O_WRONLY, ctx.uid, ctx.gid)
        await self.core.release(fh)
        return entry_attributes(inode)

    @_errors_to_fuse
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.core.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_errors_to_fuse
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.core.unlink(parent_inode, name)

    @_errors_to_fuse
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.core.rmdir(parent_inode, name)

    @_errors_to_fuse
    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.core.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_errors_to_fuse
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        await self.core.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_errors_to_fuse
    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return entry_attributes(await self.core.link(inode, new_parent_inode, new_name))

    @_errors_to_fuse
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        return self._file_info(await self.core.open(inode, flags))

    @_errors_to_fuse
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, inode = await self.core.create(parent_inode, name, mode, flags, ctx.uid, ctx.gid)
        return self._file_info(fh), entry_attributes(inode)

    @_errors_to_fuse
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.core.read(fh, off, size)

    @_errors_to_fuse
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.core.write(fh, off, buf)

    @_errors_to_fuse
    async def flush(self, fh: int) -> None:
        await self.core.flush(fh)

    @_errors_to_fuse
    async def release(self, fh: int) -> None:
        await self.core.release(fh)

    @_errors_to_fuse
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.core.fsync(fh, datasync)

    @_errors_to_fuse
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.core.opendir(inode)

    @_errors_to_fuse
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        # The offset of an entry is its position in the opendir snapshot (core.readdir_from),
        # never its index in what is left: names removed meanwhile would shift it back.
        for offset, name, inode in self.core.readdir_from(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, entry_attributes(inode), offset):
                break
            self.core.looked_up(inode)  # readdirplus: the kernel now holds a reference

    @_errors_to_fuse
    async def releasedir(self, fh: int) -> None:
        self.core.releasedir(fh)

    @_errors_to_fuse
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self.core.fsyncdir()

    @_errors_to_fuse
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        fs = await self.core.statfs()  # durable local copies are room
        data = pyfuse3.StatvfsData()
        data.f_bsize = fs.block_size
        data.f_frsize = fs.block_size
        data.f_blocks = fs.blocks
        data.f_bfree = fs.blocks_free
        data.f_bavail = fs.blocks_free
        data.f_files = fs.files
        data.f_ffree = fs.files_free
        data.f_favail = fs.files_free
        data.f_namemax = fs.name_max
        return data

    @_errors_to_fuse
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.core.getxattr(inode, name)

    @_errors_to_fuse
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return self.core.listxattr(inode)

    @_errors_to_fuse
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        if name == fallocate.XATTR_NAME:  # a FALLOCATE request, forwarded by the passthrough shim
            request = fallocate.parse_request(value)
            if request is None:
                raise FsError(errno.EPERM, "burstfs.fallocate is reserved")  # a user's setxattr of it
            fh, offset, length, mode = request
            await self.core.fallocate(fh, offset, length, mode)
            return
        await self.core.setxattr(inode, name, value)

    @_errors_to_fuse
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.core.removexattr(inode, name)

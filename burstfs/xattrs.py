"""Extended attributes: ``user.*`` names kept per inode and journaled, and the
read-only ``user.burstfs.*`` names that show a file's drain state."""

from __future__ import annotations

import contextlib
import errno
import json
import time
from collections.abc import Awaitable, Callable

import trio

from .committer import GroupCommitter
from .errors import FsError
from .hooks import DrainLinks
from .journal import DONE, MOVING, WRITING, InodeRow, Journal, remove_xattr_op, set_xattr_op
from .nodes import Inode

XATTR_USER = b"user."
XATTR_RESERVED = b"user.burstfs."  # computed, read-only attributes (drain state)
#: Of a directory: the newest complete checkpoint under it, read from the remote by the
#: daemon (client.latest for a user without the cache's journal).  Not listed: ``cp -a``
#: and ``rsync -X`` would read the remote for every directory they copy.
LATEST_XATTR = XATTR_RESERVED + b"latest"
#: One answer serves a directory's getxattr calls this long: a caller asks for the size,
#: then the value, and the two must agree.
LATEST_MEMO_S = 1.0


class ExtendedAttributes:
    """The extended attributes of inodes; every change is committed before it returns."""

    def __init__(
        self,
        journal: Journal,
        committer: GroupCommitter,
        links: DrainLinks,
        path_of: Callable[[Inode], str | None],
        show: Callable[[str], Awaitable[object]],
    ) -> None:
        self.journal = journal
        self.committer = committer
        self.links = links  # user.burstfs.latest asks the drain side
        self.path_of = path_of
        self.show = show  # lists a path afresh (RemoteListings.refresh_path)
        self._latest: dict[int, tuple[float, bytes]] = {}  # directory -> (monotonic time, answer)

    async def get(self, inode: Inode, name: bytes) -> bytes:
        if name.startswith(XATTR_RESERVED):
            return await self.reserved(inode, name)
        try:
            return inode.xattrs[name]
        except KeyError:
            raise FsError(errno.ENODATA) from None

    async def reserved(self, inode: Inode, name: bytes) -> bytes:
        """``user.burstfs.*``: the file's drain state, read from the journal; a directory's
        newest complete checkpoint (``latest``), read from the remote."""
        if inode.kind == "dir" and name == LATEST_XATTR:
            return await self.latest(inode)
        await self.committer.settle()  # a new file's row may still be deferred
        row, moving = await trio.to_thread.run_sync(self._state_of, inode.ino)
        if row is None or inode.kind != "file":
            raise FsError(errno.ENODATA)
        key = name[len(XATTR_RESERVED) :].decode(errors="replace")
        values = {
            "state": WRITING if inode.dirty else MOVING if moving else row.state,
            "generation": str(row.generation),
            "digest": row.digest or "",
            "remote_key": row.remote_key or "",
            "error": row.error or "",
        }
        if key not in values or (not values[key] and key != "state"):
            raise FsError(errno.ENODATA)
        return values[key].encode()

    def _state_of(self, ino: int) -> tuple[InodeRow | None, bool]:
        """The row standing for the file (hard links: the least drained name) and whether it is
        durable at an older name only (MOVING), from one worker thread's look."""
        row = self.journal.state_row(ino)
        return row, row is not None and row.state in DONE and self.journal.moving(ino)

    async def latest(self, directory: Inode) -> bytes:
        now = time.monotonic()
        memo = self._latest.get(directory.ino)
        if memo is not None and now - memo[0] < LATEST_MEMO_S:
            return memo[1]
        dir_key = self.path_of(directory)
        if self.links.drain is None or dir_key is None:
            raise FsError(errno.ENODATA)
        document = await self.links.drain.latest_under(dir_key)
        found = json.loads(document)["step"]
        if found is not None:
            # The step may be another node's, published since this mount listed its parent:
            # the loader's open right after this answer must find it.
            with contextlib.suppress(FsError):  # removed meanwhile: the answer stands
                await self.show(found)
        answer = document.encode()
        self._latest = {ino: m for ino, m in self._latest.items() if now - m[0] < LATEST_MEMO_S}
        self._latest[directory.ino] = (time.monotonic(), answer)
        return answer

    def names(self, inode: Inode) -> list[bytes]:
        names = list(inode.xattrs)
        if inode.kind == "file":
            names.append(XATTR_RESERVED + b"state")
        return names

    async def set(self, inode: Inode, name: bytes, value: bytes) -> None:
        if not name.startswith(XATTR_USER):
            raise FsError(errno.ENOTSUP, "only user.* extended attributes are supported")
        if name.startswith(XATTR_RESERVED):
            raise FsError(errno.EPERM, "user.burstfs.* attributes are read-only")
        before = (inode.xattrs.get(name), inode.ctime_ns)

        def restore() -> None:
            if before[0] is None:
                inode.xattrs.pop(name, None)
            else:
                inode.xattrs[name] = before[0]
            inode.ctime_ns = before[1]

        inode.xattrs[name] = value
        inode.ctime_ns = time.time_ns()
        await self.committer.commit([set_xattr_op(inode.ino, name, value)], undo=restore)

    async def remove(self, inode: Inode, name: bytes) -> None:
        if name.startswith(XATTR_RESERVED):
            raise FsError(errno.EPERM, "user.burstfs.* attributes are read-only")
        if name not in inode.xattrs:
            raise FsError(errno.ENODATA)
        value = inode.xattrs.pop(name)
        await self.committer.commit(
            [remove_xattr_op(inode.ino, name)], undo=lambda: inode.xattrs.__setitem__(name, value)
        )

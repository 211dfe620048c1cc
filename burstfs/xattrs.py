"""Extended attributes: ``user.*`` names kept per inode and journaled, and the
read-only ``user.burstfs.*`` names that show a file's drain state."""

from __future__ import annotations

import contextlib
import errno
import json
import os
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
#: ``user.burstfs.latest/SUB/DIR`` of a directory: ``latest`` of its subdirectory SUB/DIR as the
#: remote has it, which this mount may not have listed yet (another node made it within
#: ``--list-ttl``): a path that does not exist here has no attributes to ask.
LATEST_BELOW = LATEST_XATTR + b"/"
#: Of a directory: reading it lists the directory and every one below it afresh from the
#: remote, whatever ``--list-ttl`` (what the control socket's ``refresh_listings`` does, for
#: a user who may not use the socket: a job's user under a mount root made); the value is
#: how many directories were listed.  Not listed either.
LISTED_XATTR = XATTR_RESERVED + b"listed"
#: Of a directory: the mount's commit-marker patterns (``--commit-marker``), a JSON list, for
#: a user who may not ask ``status`` (``retention.prune_checkpoints`` counts only complete
#: checkpoints by them).  Not listed.
MARKERS_XATTR = XATTR_RESERVED + b"markers"
#: One answer serves a directory's getxattr calls this long: a caller asks for the size,
#: then the value, and the two must agree.
LATEST_MEMO_S = 1.0


def _below(dir_key: str, sub: bytes) -> str:
    """``dir_key``'s subdirectory ``sub`` (``a/b``): plain names only, else EINVAL."""
    parts = sub.split(b"/")
    if not all(parts) or any(part in (b".", b"..") or b"\0" in part for part in parts):
        raise FsError(errno.EINVAL, f"not a relative directory path: {sub!r}")
    rel = "/".join(os.fsdecode(part) for part in parts)
    return f"{dir_key}/{rel}" if dir_key else rel


class ExtendedAttributes:
    """The extended attributes of inodes; every change is committed before it returns."""

    def __init__(
        self,
        journal: Journal,
        committer: GroupCommitter,
        links: DrainLinks,
        path_of: Callable[[Inode], str | None],
        show: Callable[[str], Awaitable[tuple[Inode, int]]],
    ) -> None:
        self.journal = journal
        self.committer = committer
        self.links = links  # user.burstfs.latest asks the drain side
        self.path_of = path_of
        self.show = show  # lists a path afresh (RemoteListings.refresh_path)
        # (directory, name) -> (monotonic time, answer): latest and listed
        self._memo: dict[tuple[int, bytes], tuple[float, bytes]] = {}

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
        if inode.kind == "dir" and (name in (LATEST_XATTR, LISTED_XATTR) or name.startswith(LATEST_BELOW)):
            return await self._memoized(inode, name)
        if inode.kind == "dir" and name == MARKERS_XATTR:
            if self.links.drain is None:
                raise FsError(errno.ENODATA)
            return json.dumps(list(self.links.drain.commit_markers())).encode()
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

    async def _memoized(self, directory: Inode, name: bytes) -> bytes:
        now = time.monotonic()
        memo = self._memo.get((directory.ino, name))
        if memo is not None and now - memo[0] < LATEST_MEMO_S:
            return memo[1]
        dir_key = self.path_of(directory)
        if dir_key is None:
            raise FsError(errno.ENODATA)
        if name.startswith(LATEST_BELOW):
            dir_key = _below(dir_key, name[len(LATEST_BELOW) :])
        answer = await (self.listed(dir_key) if name == LISTED_XATTR else self.latest(dir_key))
        self._memo = {key: m for key, m in self._memo.items() if now - m[0] < LATEST_MEMO_S}
        self._memo[(directory.ino, name)] = (time.monotonic(), answer)
        return answer

    async def latest(self, dir_key: str) -> bytes:
        if self.links.drain is None:
            raise FsError(errno.ENODATA)
        document = await self.links.drain.latest_under(dir_key)
        found = json.loads(document)["step"]
        if found is not None:
            # The step may be another node's, published since this mount listed its parent:
            # the loader's open right after this answer must find it.
            with contextlib.suppress(FsError):  # removed meanwhile: the answer stands
                await self.show(found)
        return document.encode()

    async def listed(self, dir_key: str) -> bytes:
        _, listed = await self.show(dir_key)
        return str(listed).encode()

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

"""Files unlinked or replaced while a process still reads them from the remote.

``unlink`` of an open file leaves the open file readable, as on a local file system. When not
all of its bytes are on the tier (evicted, or only listed from the remote), the reader still
needs the remote object, so the journal row keeps the object's key: no delete, upload or move
to that key runs while it is kept (``unlink_keeping_object_ops``). The key is let go, and the
object's delete queued, once the copy on the tier is whole or the last handle closes.

So that a reader who keeps such a file open for long (a mapped model file) does not hold back
the drain of whatever replaced it, :meth:`OrphanFetches.run`, a task of the daemon's nursery,
fetches the rest of each one in the background when it fits on the tier without evicting.
"""

from __future__ import annotations

import logging

import trio

from .datapath import DataPath
from .errors import BurstfsError
from .nodes import Inode

log = logging.getLogger("burstfs.orphans")

AT_ONCE = 4  # orphans fetched at once
QUEUED = 256  # notes waiting for the task; more are dropped (the key is then let go at close)


class OrphanFetches:
    """Fetches unlinked, still open, not wholly local files whole, in the background."""

    def __init__(self, data: DataPath) -> None:
        self.data = data
        self._send, self._receive = trio.open_memory_channel[Inode](QUEUED)

    @staticmethod
    def is_orphan(inode: Inode) -> bool:
        """Unlinked, open, and read from the remote: its object is kept for its readers."""
        return inode.kind == "file" and not inode.named and bool(inode.handles) and not inode.local

    def note(self, inode: Inode) -> None:
        """From the request path: ``inode`` may just have become an orphan (never waits)."""
        if not self.is_orphan(inode):
            return
        try:
            self._send.send_nowait(inode)
        except trio.WouldBlock:
            log.info("event=orphan_fetch_dropped ino=%d", inode.ino)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        limiter = trio.CapacityLimiter(AT_ONCE)
        async with trio.open_nursery() as fetches:
            task_status.started()
            async for inode in self._receive:
                fetches.start_soon(self._fetch, inode, limiter)

    async def _fetch(self, inode: Inode, limiter: trio.CapacityLimiter) -> None:
        try:
            async with limiter:
                if self.is_orphan(inode):
                    await self.data.fetch_whole_if_it_fits(inode, "orphan")
        except (BurstfsError, OSError) as exc:  # its reader meets the error itself, if it reads on
            log.warning(
                "event=orphan_fetch_failed ino=%d path=%s error=%s", inode.ino, self.data.namespace.path_of(inode), exc
            )
        except Exception:  # a bug here must not end the mount: the object stays until the close
            log.exception("event=orphan_fetch_bug ino=%d", inode.ino)

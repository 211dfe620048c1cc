"""Which path an open file's bytes take: through the daemon, or FUSE passthrough.

A direct (passthrough) handle's reads and writes go from the kernel straight to
the tier's data file (see :mod:`burstfs.passthrough` and DESIGN-NOTES "The data
path").  This module keeps the kernel-facing state of those handles: one backing
file per inode while it has direct handles, how many of them write, and the data
file's size and mtime last seen, so that bytes the kernel wrote behind the
daemon's back are noticed.  What those bytes mean for the journal (``writing``,
a new generation at close) stays the core's.
"""

from __future__ import annotations

import logging
import os
from typing import Protocol

from .localtier import LocalTier
from .nodes import DirectIO, Handle, Inode

log = logging.getLogger("burstfs.iopath")


class BackingFiles(Protocol):
    """Hands a local-tier file to the kernel so that opens of it bypass the daemon
    (FUSE passthrough: reads, writes and mmap go straight to the tier)."""

    def open(self, fd: int) -> int:
        """A backing id for ``fd``; raises OSError when the kernel refuses."""

    def close(self, backing_id: int) -> None: ...


class IOPaths:
    """Chooses each open's data path and holds the kernel's backing files."""

    def __init__(self, tier: LocalTier, backing: BackingFiles | None) -> None:
        self.tier = tier
        self.backing = backing  # None: every open goes through the daemon

    def turn_off(self) -> None:
        """The kernel did not offer passthrough at INIT: every open goes through the daemon."""
        self.backing = None

    def open_direct(self, inode: Inode, handle: Handle) -> bool:
        """Let the kernel do ``handle``'s reads and writes on the tier itself when it can;
        True if it does.

        All direct opens of an inode share one backing file, and the kernel refuses
        to mix direct and cached opens of an inode: a file still being fetched is
        opened cached, and so is every open of it until its cached handles close.
        """
        fd = self.tier.fd(inode.ino)
        assert fd is not None
        direct = inode.direct
        others_cached = inode.handles - 1 - (direct.handles if direct else 0)  # this handle is already counted
        if self.backing is None or not inode.local or others_cached:
            return False
        if direct is None:
            direct = inode.direct = DirectIO()
        if not direct.backing_id:
            try:
                direct.backing_id = self.backing.open(fd)
            except OSError as exc:
                log.warning("event=passthrough_refused ino=%d error=%s", inode.ino, exc)
                return False
        direct.handles += 1
        handle.direct = True
        if handle.writable:
            if not direct.writers:
                st = os.fstat(fd)
                direct.seen = (st.st_size, st.st_mtime_ns)
            direct.writers += 1
        return True

    @staticmethod
    def backing_id(handle: Handle) -> int:
        """The passthrough backing id of a handle; 0 when its I/O comes to the daemon."""
        direct = handle.inode.direct
        return direct.backing_id if handle.direct and direct is not None else 0

    def close(self, inode: Inode, handle: Handle) -> None:
        """``handle`` is gone: the last direct one gives the backing file back."""
        direct = inode.direct
        if not handle.direct or direct is None:
            return
        direct.handles -= 1
        direct.writers -= handle.writable
        if not direct.handles and self.backing is not None:
            try:
                self.backing.close(direct.backing_id)
            except OSError as exc:  # the kernel drops it with the mount anyway
                log.warning("event=passthrough_close_failed ino=%d error=%s", inode.ino, exc)
            direct.backing_id = 0

    def written_behind(self, inode: Inode) -> os.stat_result | None:
        """The data file's status if direct writers changed it since it was last seen.

        The kernel writes those bytes to the tier without telling the daemon; it
        asks for attributes again after each write, and every close comes here first.
        """
        direct = inode.direct
        if direct is None or not direct.writers:
            return None
        fd = self.tier.fd(inode.ino)
        assert fd is not None
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) == direct.seen:
            return None
        direct.seen = (st.st_size, st.st_mtime_ns)
        direct.reopened_clean = False
        return st

    def note_daemon_change(self, inode: Inode) -> None:
        """The daemon itself just changed the data file (a truncate): what it is now is seen, so
        that :meth:`written_behind` does not take it for a direct writer's change."""
        direct = inode.direct
        fd = self.tier.fd(inode.ino)
        if direct is None or not direct.writers or fd is None:
            return
        st = os.fstat(fd)
        direct.seen = (st.st_size, st.st_mtime_ns)

    @staticmethod
    def writes_direct(inode: Inode) -> bool:
        """Some open handle of ``inode`` writes through passthrough (its bytes never reach the daemon)."""
        return inode.direct is not None and inode.direct.writers > 0

"""Room on the tier's file system for what the daemon does not count: passthrough writes, the journal.

With FUSE passthrough the kernel writes the tier itself: no write reaches the
daemon to claim room first (which is why a byte limit turns passthrough off).
Without a limit the file system itself fills up, and then two things break:
writers get ENOSPC although durable local copies could go, and the journal, on
the same file system, cannot commit, so nothing can be removed, evicted or
recorded durable any more (a wedge).  This task keeps the free space of the
tier's file system above a headroom by evicting durable copies (by the eviction
policy) ahead of the writers, and keeps a reserve file (``CACHE/reserve``) for the
journal: when the file system is full it gives back one slice of it at a time, so
that the journal can still commit the unlinks, evictions and drain records that
free space.  Only while no file is open for writing: a writer through passthrough,
unseen by the daemon, would take the slice before the journal does (its writes
fail with ENOSPC anyway), and then nothing could be removed or recorded for good.
The reserve is made whole again once there is room.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import trio

from .capacity import TierCapacity, headroom_bytes

log = logging.getLogger("burstfs.capacity")

#: How often the free space of the tier's file system is looked at.
CHECK_INTERVAL_S = 0.25
#: The journal's reserve is at most this large (a 32nd of smaller file systems).
RESERVE_MAX_BYTES = 64 << 20
RESERVE_NAME = "reserve"
#: The reserve is given back in this many slices (each at least RESERVE_SLICE_MIN_BYTES).
RESERVE_SLICES = 4
RESERVE_SLICE_MIN_BYTES = 256 << 10


def reserve_bytes(total: int) -> int:
    return min(RESERVE_MAX_BYTES, total // 32)


def space(path: Path) -> tuple[int, int]:
    """``(free, total)`` bytes of the file system holding ``path``, as an unprivileged writer sees it."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def reserve_slice(total: int) -> int:
    return max(RESERVE_SLICE_MIN_BYTES, reserve_bytes(total) // RESERVE_SLICES)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def release_reserve(cache_dir: Path, why: str) -> bool:
    """Give one slice of the journal's reserve back to the file system; True if there was
    any left (blocking: a thread, or at start)."""
    path = cache_dir / RESERVE_NAME
    size = _size(path)
    if not size:
        return False
    left = max(0, size - reserve_slice(space(cache_dir)[1]))
    if left:
        os.truncate(path, left)  # frees the blocks past ``left``
    else:
        path.unlink(missing_ok=True)
    log.warning("event=reserve_released left=%d free=%d why=%s", left, space(cache_dir)[0], why)
    return True


def drop_reserve_if_full(cache_dir: Path) -> None:
    """Before the journal is opened (nothing writes the tier yet): a tier left full gets a
    slice of the reserve back, or the journal could not even be opened for writing."""
    (cache_dir / f"{RESERVE_NAME}.partial").unlink(missing_ok=True)  # a crash while it was made
    free, total = space(cache_dir)
    if free < reserve_slice(total):
        release_reserve(cache_dir, "tier full at start")


class TierHeadroom:
    """Evicts durable copies while the tier's file system is short of room; keeps the journal's reserve."""

    def __init__(self, cache_dir: Path, capacity: TierCapacity, writers_open: Callable[[], bool]) -> None:
        """``writers_open()``: whether a file is open for writing (then no slice is given back)."""
        self.cache_dir = cache_dir
        self.capacity = capacity
        self.writers_open = writers_open
        self.reserve = cache_dir / RESERVE_NAME

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Look at the free space every CHECK_INTERVAL_S until cancelled."""
        task_status.started()
        while True:
            try:
                await self.check()
            except Exception as exc:  # a full or failing tier must not end the mount: look again
                log.error("event=headroom_check_failed error=%r", exc)
            await trio.sleep(CHECK_INTERVAL_S)

    async def check(self) -> None:
        free, total = space(self.cache_dir)
        reserve, headroom = reserve_bytes(total), headroom_bytes(total)
        if free < reserve_slice(total) and not self.writers_open():
            await trio.to_thread.run_sync(release_reserve, self.cache_dir, "tier full")
        if free < headroom:
            evicted = await self.capacity.evict_until(lambda: space(self.cache_dir)[0] >= headroom)
            if not evicted:
                return  # nothing durable left to evict: writers get ENOSPC from the file system
        elif free >= headroom + reserve and _size(self.reserve) < reserve:
            await trio.to_thread.run_sync(_make_reserve, self.reserve, reserve)


def _make_reserve(path: Path, size: int) -> None:
    """Allocate ``size`` bytes at ``path`` (made aside, renamed in: never a partial reserve)."""
    partial = path.with_name(f"{path.name}.partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:  # room went meanwhile: try again on a later check
        os.close(fd)
        partial.unlink(missing_ok=True)
        log.info("event=reserve_not_made size=%d error=%s", size, exc)
        return
    os.close(fd)
    os.rename(partial, path)

"""Capacity of the local tier: what files take on it, and making room for writes.

Capacity counts allocated bytes (``st_blocks``), not logical sizes: a sparse
file takes what it wrote.  A write claims its room before it lands; when the
tier is full, durable files are evicted by the policy, and when only undrained
data is left, the writer waits for the drain (backpressure) until
``full_timeout``, then fails with ENOSPC (at once when the mount is stopping:
:meth:`TierCapacity.stop_waiting`).  Undrained data is never evicted.
``statfs`` reports the same numbers, with durable local copies counted as free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Callable, Iterator

import trio

from .config import TierOptions
from .errors import FsError, NoSpaceError
from .journal import Journal
from .localtier import LocalTier, unlink_trashed
from .nodes import NAME_MAX, Inode

log = logging.getLogger("burstfs.capacity")


@dataclasses.dataclass(frozen=True)
class StatFs:
    block_size: int
    blocks: int
    blocks_free: int
    files: int
    files_free: int
    name_max: int = NAME_MAX


#: Below this much free room on the tier's file system new writers are refused (admit_writer).
WRITER_FLOOR_BYTES = 1 << 20


def headroom_bytes(total: int) -> int:
    """Free space kept ahead of the writers on a tier's file system of ``total`` bytes: 1% of
    it, at least 64 MiB, at most a quarter."""
    return min(max(64 << 20, total // 100), total // 4)


class TierCapacity:
    """Counts the bytes of files on the local tier (``local_bytes``, per inode
    ``accounted``) and frees room by evicting durable local copies."""

    def __init__(
        self,
        tier: LocalTier,
        journal: Journal,
        policy: TierOptions,
        inodes: dict[int, Inode],
        forget_fetch: Callable[[int], None] = lambda ino: None,
    ) -> None:
        """``forget_fetch(ino)``: drop what the restore path knows of a file's local bytes
        (an evicted copy is fetched again from nothing)."""
        self.tier = tier
        self.forget_fetch = forget_fetch
        self.journal = journal
        self.policy = policy
        self.inodes = inodes  # the core's inode table (eviction candidates, statfs's file count)
        for inode in inodes.values():
            inode.accounted = self.allocated(inode.ino) if inode.kind == "file" and inode.local else 0
        self.local_bytes = sum(inode.accounted for inode in inodes.values())
        self._space_freed = trio.Event()
        self._full_waited: dict[int, float] = {}  # ino -> seconds its writes waited on a full tier
        self._full_failed_at: dict[int, float] = {}  # ino -> when its wait ran out (monotonic)
        self._fetched_into: set[int] = set()  # files not (yet) local that a fetch claimed room for
        self._fetching: dict[int, int] = {}  # ino -> fetches of it under way (ensure_local calls)
        self._stopping = False  # the mount is stopping: no write waits for the drain any more

    def stop_waiting(self) -> None:
        """The mount is stopping (SIGTERM, SIGINT): writers waiting for the drain to make room
        fail with ENOSPC now, and later ones at once.  The FUSE loop ends only once every
        request is answered: a writer waiting out ``--full-timeout`` on a remote that is down
        kept the daemon from stopping for up to that long."""
        self._stopping = True
        self._space_freed.set()

    def room(self) -> int:
        """The most bytes files may take on the tier (``--cache-size``, or the tier's file system
        less ``--min-free`` and the cache dir's own files)."""
        st = self.tier.statvfs()
        room = max(0, st.f_blocks * st.f_frsize - self.policy.min_free - self.tier.overhead())
        return room if self.policy.cache_size is None else min(room, self.policy.cache_size)

    def fits(self, nbytes: int) -> bool:
        """``nbytes`` more fit on the tier now, without evicting anything: within the byte
        limit, and in the file system itself (less ``--min-free`` and the room fetches in
        flight claimed but have not written yet), whoever else fills it."""
        limit = self.policy.cache_size
        if limit is not None and self.local_bytes + nbytes > limit:
            return False
        st = self.tier.statvfs()
        return st.f_bavail * st.f_frsize - self._claimed_ahead() - nbytes >= self.policy.min_free

    def _claimed_ahead(self) -> int:
        """Bytes fetches claimed that are not on the tier's file system yet.  The file system's
        free room does not show them: without this, concurrent restore reads each saw the same
        free room, fetched at once and filled the tier."""
        ahead = 0
        for ino in list(self._fetched_into):
            inode = self.inodes.get(ino)
            if inode is None or inode.local or inode.accounted == 0:
                self._fetched_into.discard(ino)
            elif inode.handles or ino in self._fetching:
                ahead += max(0, inode.accounted - self.allocated(ino))
        return ahead

    @contextlib.contextmanager
    def fetching(self, inode: Inode) -> Iterator[None]:
        """A fetch of ``inode`` is under way: its partial copy is not evicted from under it."""
        self._fetching[inode.ino] = self._fetching.get(inode.ino, 0) + 1
        try:
            yield
        finally:
            self._fetching[inode.ino] -= 1
            if not self._fetching[inode.ino]:
                del self._fetching[inode.ino]

    async def admit_writer(self) -> None:
        """Make room on the tier's file system for a file opened for writing.

        Below the headroom (:func:`headroom_bytes`), durable copies are evicted now, before
        the open returns: through passthrough the kernel writes the tier unseen by the daemon,
        and the headroom task's next look (``burstfs/headroom.py``) could come after the
        writer's first ENOSPC.  With less than WRITER_FLOOR_BYTES still free: ENOSPC at once.
        Its writes could not land anyway, and through passthrough they would take the room
        that the journal's reserve gives back for the records that free the tier (rm, drain,
        eviction)."""
        st = self.tier.statvfs()
        headroom = headroom_bytes(st.f_blocks * st.f_frsize)
        if st.f_bavail * st.f_frsize >= headroom:
            return
        await self.evict_until(lambda: self._fs_free() >= headroom)
        if self._fs_free() < WRITER_FLOOR_BYTES:
            raise NoSpaceError(f"the local tier's file system is full ({self._fs_free()} bytes free)")

    def _fs_free(self) -> int:
        st = self.tier.statvfs()
        return int(st.f_bavail * st.f_frsize)

    async def _reserve(self, nbytes: int, inode: Inode | None = None) -> None:
        """Count ``nbytes`` more on the local tier, making room first if needed.

        Durable files are evicted by the policy; when the tier is full of data not
        yet durable, wait for the drain (backpressure), then fail with ENOSPC.
        Undrained data is never evicted.  ``--full-timeout`` bounds the *total*
        wait of one file (``_full_waited``): with the write-back cache every
        write-back batch would otherwise wait the whole timeout in turn, so once a
        file has hit ENOSPC its writes that do not fit fail at once, until it is
        emptied (truncate to 0, ``O_TRUNC``).
        """
        whole = inode.accounted if inode is not None else nbytes  # the file's claim, this one included
        if not self.fits(nbytes) and whole > self.room():
            # More than the tier can ever hold, every durable copy evicted: waiting for the drain
            # would only end in the same ENOSPC, later, and blaming data not yet durable.
            log.error("event=tier_too_small bytes=%d room=%d ino=%s", whole, self.room(), inode.ino if inode else None)
            cure = "raise --cache-size" if self.policy.cache_size is not None else "give the tier a larger file system"
            raise NoSpaceError(
                f"{whole} bytes do not fit on the local tier ({self.room()} bytes with every durable file "
                f"evicted: --cache-size, or its file system less --min-free and the cache's own files); {cure}"
            )
        if not self.fits(nbytes):
            spent = self._full_waited.get(inode.ino, 0.0) if inode is not None else 0.0
            started = time.monotonic()
            deadline = started + max(0.0, self.policy.full_timeout - spent)
            waited = False
            try:
                while not self.fits(nbytes) and not await self._evict_for(nbytes):
                    if self._stopping:
                        log.warning(
                            "event=tier_full bytes=%d used=%d ino=%s action=ENOSPC reason=stopping",
                            nbytes,
                            self.local_bytes,
                            inode.ino if inode else None,
                        )
                        raise NoSpaceError("local tier full of data not yet durable, and the mount is stopping")
                    if time.monotonic() >= deadline:
                        first = spent < self.policy.full_timeout
                        if inode is not None:
                            spent = self.policy.full_timeout  # budget spent: no more waiting for this file
                            self._full_failed_at[inode.ino] = time.monotonic()
                        if not await self._drain_may_free_room():
                            self._fail_held_by_open_files(nbytes, inode, first)
                        if first:
                            log.error(
                                "event=tier_full bytes=%d used=%d limit=%s ino=%s action=ENOSPC "
                                "note=later writes of this file that do not fit fail at once until it is emptied",
                                nbytes,
                                self.local_bytes,
                                self.policy.cache_size,
                                inode.ino if inode else None,
                            )
                        raise NoSpaceError("local tier full of data not yet durable")
                    if not waited:
                        waited = True
                        log.warning(
                            "event=tier_full bytes=%d used=%d limit=%s action=wait_for_drain wait_left=%.1f",
                            nbytes,
                            self.local_bytes,
                            self.policy.cache_size,
                            deadline - time.monotonic(),
                        )
                    with trio.move_on_after(
                        max(0.0, min(deadline - time.monotonic(), 0.5))
                    ):  # deadline is time.monotonic()
                        await self._space_freed.wait()
            finally:
                if inode is not None:
                    self._full_waited[inode.ino] = max(spent, spent + time.monotonic() - started)
        self.local_bytes += nbytes

    async def _drain_may_free_room(self) -> bool:
        """Whether the drain can make room: files not yet durable (evictable once drained)
        or open for writing (they drain once closed).  Else what fills the tier is durable
        copies of files held open and fetches in use: only their readers free it by closing
        (another process's reader soon; a reader waiting on its own open files, never)."""
        if any(inode.writers for inode in self.inodes.values()):
            return True
        undrained = await trio.to_thread.run_sync(self.journal.undrained)
        return any(files for files, _ in undrained.values())

    def _fail_held_by_open_files(self, nbytes: int, inode: Inode | None, first: bool) -> None:
        """The ENOSPC of a wait that ran out with nothing to drain: the room is open files'
        (logged the first time only: the kernel's retries of the read fail at once)."""
        held = sum(i.accounted for i in self.inodes.values() if i.kind == "file" and i.handles and i is not inode)
        if first:
            log.error(
                "event=tier_full bytes=%d used=%d limit=%s ino=%s action=ENOSPC reason=held_by_open_files held=%d",
                nbytes,
                self.local_bytes,
                self.policy.cache_size,
                inode.ino if inode else None,
                held,
            )
        off = "; eviction is off (--evict none)" if self.policy.evict == "none" else ""
        raise NoSpaceError(
            f"local tier full and no data waits to drain: {held} bytes of it are files open on this node "
            f"(a durable copy is not evicted while open){off}; close files or raise --cache-size"
        )

    async def account(self, inode: Inode, size: int) -> None:
        """Count ``inode`` as ``size`` bytes on the tier.  Concurrent writes to one
        file claim disjoint increments, so nothing is counted twice.  A fetch that failed on
        a full tier keeps its spent wait for ``full_timeout`` (the kernel asks again at once
        after a failed read: one read(2) waited the timeout twice)."""
        need = size - inode.accounted
        if need <= 0:
            return
        failed_at = self._full_failed_at.get(inode.ino)
        recent_fetch_failure = (
            not inode.local and failed_at is not None and time.monotonic() - failed_at < self.policy.full_timeout
        )
        if inode.accounted == 0 and not inode.incomplete and not recent_fetch_failure:
            self._full_waited.pop(inode.ino, None)  # written (or fetched) from empty: a fresh wait budget
            self._full_failed_at.pop(inode.ino, None)
        inode.accounted = size
        try:
            await self._reserve(need, inode)
        except BaseException:
            inode.accounted -= need
            raise
        if not inode.local:
            self._fetched_into.add(inode.ino)

    def allocated(self, ino: int) -> int:
        """Bytes the data file of ``ino`` takes on the tier (``st_blocks``; holes take none)."""
        try:
            return os.stat(self.tier.path(ino)).st_blocks * 512
        except OSError:
            return 0

    async def claim_write(self, inode: Inode, fd: int, offset: int, end: int) -> None:
        """Count the room a write of [offset, end) may allocate, before it lands.

        Capacity counts allocated bytes, not logical size: growing a file by
        truncate (or a write far past its end, as copy_file_range and seek-ahead
        writers do) leaves a hole that takes nothing, so a few such calls cannot
        make the tier look full.  Bytes past the end are new; below it, only the
        part from the first hole in the range can be (SEEK_HOLE); overwrites of
        allocated bytes claim nothing.
        """
        start = offset
        if offset < inode.size:
            try:
                start = max(offset, os.lseek(fd, offset, os.SEEK_HOLE))
            except OSError:  # no SEEK_HOLE here: assume all of it is new
                start = offset
        need = end - start
        if need <= 0:
            return
        if inode.accounted == 0 and not inode.incomplete:  # written from empty: a fresh wait budget
            self._full_waited.pop(inode.ino, None)
        inode.accounted += need
        try:
            await self._reserve(need, inode)
        except BaseException:
            inode.accounted -= need
            raise

    def adopt(self, inode: Inode, allocated: int) -> None:
        """Count bytes the kernel wrote through passthrough (no byte limit is set when it is on)."""
        if allocated > inode.accounted:
            self.local_bytes += allocated - inode.accounted
            inode.accounted = allocated

    async def count_held_blocks(self, inode: Inode) -> None:
        """Count only the blocks the file holds now, if that is less than it claimed: after a
        truncate to a smaller size, and once the readers of a file fetched in part are gone (a
        fetch claims the whole file; a reader that touched a few chunks leaves only those)."""
        claimed = inode.accounted
        allocated = await trio.to_thread.run_sync(self.allocated, inode.ino)
        if inode.accounted != claimed:
            return  # claimed or freed meanwhile (a new reader, an eviction): that count stands
        kept = min(claimed, allocated)
        self.release(claimed - kept)
        inode.accounted = kept

    async def evictable_bytes(self) -> int:
        """Bytes of local copies a write could reclaim now: durable, closed, unchanged
        (what ``statfs`` counts as free besides the unused part of the limit)."""
        if self.policy.evict == "none":
            return 0
        return self._reclaimable(await trio.to_thread.run_sync(self.journal.evictable))

    def evictable_bytes_blocking(self) -> int:
        """:meth:`evictable_bytes` in the caller's own thread (the metrics server's)."""
        return 0 if self.policy.evict == "none" else self._reclaimable(self.journal.evictable())

    def _reclaimable(self, rows: list[tuple[int, int]]) -> int:
        total = sum(inode.accounted for inode in self._partial_copies())
        for ino, _ in rows:
            inode = self.inodes.get(ino)
            if inode is not None and inode.local and not inode.dirty and not inode.handles:
                total += inode.accounted
        return total

    def partial_bytes(self) -> int:
        """Bytes held for files not local (fetches under way, what partial reads left): the
        journal does not know them, status adds them."""
        held = (
            min(inode.accounted, self.allocated(ino))
            for ino in self._fetched_into
            if (inode := self.inodes.get(ino)) is not None and not inode.local
        )
        return sum(held)

    def _partial_copies(self) -> list[Inode]:
        """What fetches left of files that are not local, nobody reads and nothing fetches (a
        restore that touched part of a file, a fetch that failed): a cache of durable bytes."""
        partial = []
        for ino in self._fetched_into:
            inode = self.inodes.get(ino)
            if (
                inode is not None
                and not inode.local
                and inode.accounted
                and not inode.handles
                and not inode.dirty
                and ino not in self._fetching
            ):
                partial.append(inode)
        return partial

    def release(self, nbytes: int) -> None:
        self.local_bytes = max(0, self.local_bytes - nbytes)
        self._space_freed.set()
        self._space_freed = trio.Event()

    async def _evict_for(self, nbytes: int) -> bool:
        """Evict durable files by policy until ``nbytes`` fit; True if they now do."""
        return await self.evict_until(lambda: self.fits(nbytes))

    async def evict_until(self, enough: Callable[[], bool]) -> bool:
        """Evict durable files by policy until ``enough()``; True if it now is."""
        if self.policy.evict == "none":
            return enough()
        for partial in self._partial_copies():  # first: no reader is coming back for these
            if enough():
                return True
            await self._drop_partial(partial)
        rows = await trio.to_thread.run_sync(self.journal.evictable)
        candidates = []
        for ino, close_seq in rows:
            inode = self.inodes.get(ino)
            if inode is not None and inode.local and not inode.dirty and not inode.handles:
                candidates.append((inode.last_access if self.policy.evict == "lru" else close_seq, inode))
        candidates.sort(key=lambda c: c[0])
        for _, inode in candidates:
            if enough():
                break
            await self._evict(inode)
        return enough()

    async def _evict(self, inode: Inode) -> int:
        changed = await trio.to_thread.run_sync(self.journal.evict, inode.ino, inode.generation)
        if not changed or inode.handles or inode.dirty:
            return 0
        inode.local = False
        await self._drop_local_bytes(inode)
        log.info("event=evicted ino=%d bytes=%d", inode.ino, inode.size)
        return inode.size

    async def _drop_local_bytes(self, inode: Inode) -> int:
        """Remove the data file of a file that is durable on the remote (and not local now);
        bytes freed."""
        inode.local_prefix = 0
        self._fetched_into.discard(inode.ino)
        # Fetch state left from this copy's restore (a reader that came in as it completed)
        # says its chunks are here: a fetch of the new copy must start from nothing.
        self.forget_fetch(inode.ino)
        # A fetch may start (and claim room) while the old copy is unlinked: it counts from 0,
        # and the old copy's bytes stay counted until they are freed.
        freed, inode.accounted = inode.accounted, 0
        trashed = self.tier.to_trash(inode.ino)  # its path is free for a fetch at once
        if trashed is not None:  # unlinking 1 GiB takes 170 ms: not on the FUSE loop
            await trio.to_thread.run_sync(unlink_trashed, trashed)
        self.release(freed)
        return freed

    async def _drop_partial(self, inode: Inode) -> int:
        freed = await self._drop_local_bytes(inode)
        log.info("event=evicted ino=%d bytes=%d partial=1", inode.ino, freed)
        return freed

    async def evict(self, inode: Inode) -> int:
        """Drop the local copy of a durable file (``burstfs-admin evict``), or what fetches left
        of one; bytes freed."""
        if inode.kind == "file" and inode.handles:  # also one partly fetched: its reader goes on
            raise FsError(errno.EBUSY, "file is open")
        if inode.kind == "file" and inode in self._partial_copies():
            return await self._drop_partial(inode)
        if inode.kind != "file" or not inode.local:
            return 0
        freed = 0 if inode.dirty else await self._evict(inode)
        if not freed and inode.size:
            raise FsError(errno.EAGAIN, "file is not durable yet")
        return freed

    def statfs(self, evictable: int = 0) -> StatFs:
        """The local tier's capacity: what a writer can still put here right now.

        ``evictable`` (from :meth:`evictable_bytes`) counts as free: a write takes
        that room by evicting durable local copies, so a tier full of durable data
        is not a full tier.
        """
        st = self.tier.statvfs()
        bsize = st.f_frsize
        avail = st.f_bavail * bsize + evictable
        blocks, free = st.f_blocks, max(0, avail - self.policy.min_free) // bsize
        if self.policy.cache_size is not None:
            blocks = min(blocks, self.policy.cache_size // bsize)
            free = min(free, max(0, self.policy.cache_size - self.local_bytes + evictable) // bsize)
        free = min(free, blocks)
        return StatFs(
            block_size=bsize,
            blocks=blocks,
            blocks_free=free,
            files=max(st.f_files, len(self.inodes)),
            files_free=st.f_favail if st.f_files else 1 << 20,
        )

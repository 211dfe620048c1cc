"""Remote listings: what other nodes drained, merged into this mount's namespace.

A lookup miss or an opendir asks for the remote listing of its directory, at most
once per TTL, and waits for it only a short bound (a slow or hung remote never
holds a request); the merge is one journal commit, applied to memory with it.
Keys this mount owns, is deleting or recently removed (tombstones) are never
brought back; entries that vanished from the remote are forgotten, never deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import time
from collections.abc import Callable

import trio
import trio.lowlevel

from .committer import GroupCommitter
from .errors import THROTTLED, FsError
from .hooks import DrainLinks, ListedFile
from .journal import (
    META,
    REMOTE,
    ROOT_INO,
    Journal,
    Op,
    forget_listed_ops,
    insert_inode_op,
    known_dir_op,
    update_inode_op,
)
from .namespace import Namespace
from .nodes import NAME_MAX, NEVER_LISTED, RESERVED_ROOT_NAME, Inode, Undo
from .remote.base import object_version

log = logging.getLogger("burstfs.listings")

#: How long this mount remembers a key it deleted: a listing that started before
#: the delete may still show it, and must not bring the file back.
TOMBSTONE_SECONDS = 600.0
#: The longest a lookup miss or an opendir waits for a remote listing; a slower
#: listing goes on in the background and the request is answered from what is local.
LISTING_WAIT = 1.0
#: The first listing of a directory this node has never listed may take this long:
#: until it lands, a restore node would not see what the remote holds at all.
#: A hung remote costs this once (then ``LISTING_BACKOFF`` applies).
FIRST_LISTING_WAIT = 10.0
#: A background listing is abandoned after this long (retried after the TTL).
LISTING_TIMEOUT = 30.0
#: After a listing failed or was slow, requests wait for none for this long.
LISTING_BACKOFF = 30.0
#: An rmdir whose directory must be listed first tries for this long (or ``--remote-wait``),
#: again and again while listings fail fast (throttling), then removes it anyway.
REMOVAL_LIST_S = 3.0
#: A directory of the remote no listing has reached yet (``unseen``) is listed again this
#: soon after a failed attempt, not after the TTL: its lookups fail with EIO meanwhile.
UNSEEN_RETRY_S = 1.0
#: An object of this node's missing from listings while its manifest stays is logged as lost
#: once two listings this far apart found it so: another node's delete removes the object,
#: then the manifest, and a listing between the two must not call it lost.
LOST_CONFIRM_S = 5.0
#: The per-inode memos (etags, directories seen) are swept of inodes gone from the namespace
#: once they hold this many entries, and then whenever they have doubled since the last sweep.
MEMO_SWEEP_MIN = 4096


class Tombstones:
    """The keys this mount removed lately (``Namespace.remember_removed``): a listing
    that started before the remote delete may still show them."""

    def __init__(self) -> None:
        self._removed: dict[str, float] = {}  # key -> monotonic time this mount removed it

    def remember(self, key: str, undo: Undo) -> None:
        before = self._removed.get(key)
        self._removed[key] = time.monotonic()

        def restore() -> None:
            if before is None:
                self._removed.pop(key, None)
            else:
                self._removed[key] = before

        undo.add(restore)

    def since(self, started: float) -> set[str]:
        """The keys removed after a listing ``started`` (less a second), old ones pruned first."""
        horizon = time.monotonic() - TOMBSTONE_SECONDS
        if self._removed and next(iter(self._removed.values())) < horizon:
            self._removed = {k: t for k, t in self._removed.items() if t >= horizon}
        return {key for key, when in self._removed.items() if when >= started - 1.0}


class RemoteListings:
    """Merges remote directory listings into the namespace (``Namespace.new_inode``,
    ``attach``, ``detach``), passing over what this mount removed (``Tombstones``)."""

    def __init__(
        self,
        namespace: Namespace,
        journal: Journal,
        committer: GroupCommitter,
        links: DrainLinks,
        tombstones: Tombstones,
        *,
        ttl: float,
        wait: float = LISTING_WAIT,
    ) -> None:
        self.namespace = namespace
        self.journal = journal  # the keys this mount owns, read before each listing
        self.committer = committer
        self.links = links  # the fetcher lists the remote
        self.tombstones = tombstones
        self.ttl = ttl  # seconds a directory's listing stays fresh
        self.wait = wait  # the longest a request waits for a listing (--remote-wait)
        self.first_wait = FIRST_LISTING_WAIT
        self.timeout = LISTING_TIMEOUT
        self.backoff = LISTING_BACKOFF
        self._slow_until = 0.0  # until then, requests wait for no listing (the last one failed or was slow)
        self._failed_at: dict[int, float] = {}  # directory -> when its last listing failed (monotonic)
        # directory -> listing in flight: (done, [merged], trio time it started, how long requests wait)
        self._in_flight: dict[int, tuple[trio.Event, list[bool], float, float]] = {}
        self._skipped_logged: set[str] = set()  # listed keys already logged as skipped
        self._lost_logged: set[str] = set()  # keys of this node's objects logged as lost
        self._lost_since: dict[str, float] = {}  # key -> when a listing first missed it (manifest there)
        # Directories whose entries are known: made here or listed (merged), in this life or an
        # earlier one (journaled: ops.KNOWN_DIR).
        self._seen: set[int] = journal.known_dirs()
        # Directory -> when the last listing of it that merged started (this life of the daemon).
        self._merged_at: dict[int, float] = {}
        # Another node's files (Inode.as_listed) -> the etag their object had when this mount first
        # listed them: a rewrite of the same size within the same second changes only that.
        self._etags: dict[int, str | None] = {}
        #: Called with (directory inode, name) for each name a merge dropped or replaced: the
        #: kernel's cached entry must go too (the FUSE front sets it), or a stat or an open by
        #: that name would find the old inode until the entry times out.
        self.entry_dropped: Callable[[int, bytes], None] = lambda directory, name: None
        self._memo_sweep_at = MEMO_SWEEP_MIN
        # Directories a merge emptied (their files deleted elsewhere): one still missing from its
        # parent's next listing goes too.  And those listed now as gone from their parent's.
        self._emptied: dict[int, int] = journal.emptied_dirs()  # ino -> its mtime_ns then
        self._following: set[int] = set()

    async def refresh_bounded(self, directory: Inode, *, force: bool = False, despite_backoff: bool = False) -> bool:
        """:meth:`refresh` for a request: wait at most ``wait`` for it (``force``: list even
        within the TTL; ``despite_backoff``: wait even right after a failed or slow listing).

        The listing runs in its own task, so a slow or hung remote never holds a
        lookup or an opendir for long: past the bound, the request is answered
        from what is local and the merge lands when the listing does.  The bound
        counts from the listing's start, so requests that arrive while a slow
        listing is in flight do not wait again; and after a listing failed or was
        slow, requests wait for none until one answers in time again
        (``_slow_until``): a hung remote costs one wait, not one per name.
        """
        if self.links.fetcher is None:
            return False
        pending = self._in_flight.get(directory.ino)
        now = time.monotonic()
        if pending is None:
            if not force and not self._due(directory, now):
                return False
            never_listed = directory.listed_at == NEVER_LISTED
            wait = max(self.wait, self.first_wait) if never_listed else self.wait
            pending = (trio.Event(), [False], trio.current_time(), wait)  # trio's clock: move_on_at below
            self._in_flight[directory.ino] = pending
            trio.lowlevel.spawn_system_task(self._list_in_background, directory, pending, force)
        done, merged, started, wait = pending
        if now < self._slow_until and not despite_backoff:
            return False  # the remote is slow or down: local work does not wait for it
        with trio.move_on_at(started + wait):
            await done.wait()
            return merged[0]
        if now >= self._slow_until:
            log.info(
                "event=listing_slow dir_ino=%d waited=%.1f note=answered from local entries",
                directory.ino,
                time.monotonic() - now,
            )
            # The request's EIO (a directory never listed) points to status: it says so now,
            # not only once the listing gives up (LISTING_TIMEOUT later).
            self._tell_status(directory, f"no answer within {wait:.0f}s (still listing)")
        self._slow_until = max(self._slow_until, time.monotonic() + self.backoff)
        return False

    async def _list_in_background(
        self, directory: Inode, pending: tuple[trio.Event, list[bool], float, float], force: bool
    ) -> None:
        """Run one listing, bounded by ``timeout`` (the remote's own retries may take minutes)."""
        done, merged, _, _ = pending
        try:
            with trio.move_on_after(self.timeout) as scope:
                merged[0] = await self._refresh_now(directory, force=force)
            if scope.cancelled_caught:
                log.warning(
                    "event=list_failed dir_ino=%d error=no answer within %.0fs note=retried after the TTL",
                    directory.ino,
                    self.timeout,
                )
                self._tell_status(directory, f"no answer within {self.timeout:.0f}s")
                self._slow_until = time.monotonic() + self.backoff
        except Exception as exc:  # a failed merge commit: retried after the TTL
            log.warning("event=listing_merge_failed dir_ino=%d error=%s", directory.ino, exc)
        finally:
            self._in_flight.pop(directory.ino, None)
            done.set()

    async def refresh_unless_down(self, directory: Inode) -> bool:
        """:meth:`refresh`, unless a listing failed or was slow within ``backoff`` (an admin
        walk, ``burstfs-admin prefetch DIR``): a hung remote costs the walk one listing's
        wait, not one per directory."""
        if time.monotonic() < self._slow_until:
            return False
        return await self.refresh(directory)

    async def refresh(self, directory: Inode, *, force: bool = False) -> bool:
        """:meth:`_refresh_now`, as a listing in flight that requests wait for as for their own
        (an admin walk's: a lookup beside ``burstfs-admin prefetch DIR`` found the directory
        neither due nor being listed, and failed EIO at once).  A listing of ``directory``
        already in flight is waited for (``force``: then this call lists afresh)."""
        while (pending := self._in_flight.get(directory.ino)) is not None:
            await pending[0].wait()
            if not force:
                return pending[1][0]
        wait = max(self.wait, self.first_wait) if directory.listed_at == NEVER_LISTED else self.wait
        pending = (trio.Event(), [False], trio.current_time(), wait)
        self._in_flight[directory.ino] = pending
        try:
            pending[1][0] = await self._refresh_now(directory, force=force)
            return pending[1][0]
        finally:
            if self._in_flight.get(directory.ino) is pending:
                del self._in_flight[directory.ino]
            pending[0].set()

    async def _refresh_now(self, directory: Inode, *, force: bool = False) -> bool:
        """Merge the remote listing of ``directory`` if it is older than the TTL (``force``: now).

        Returns True if a listing was merged.  A remote that cannot be listed
        does not block local work: the failure is logged and retried after the TTL.

        The keys this mount owns or is deleting are read *before* the listing:
        a delete that completes while the remote is listed would otherwise make
        this mount's own just-deleted file look like another node's.  Keys this
        mount deleted after that (tombstones) are ignored too.  Names that cannot
        be a file name here are skipped (logged once).  Entries that vanished
        from the remote are forgotten, never deleted: the object may be another
        node's new one.  The merge is one commit, applied to memory with it.
        """
        now = time.monotonic()
        if self.links.fetcher is None or (not self._due(directory, now) and not force):
            return False
        directory.listed_at = now
        dir_key = self.namespace.path_of(directory)
        if dir_key is None:
            return False
        try:
            known_keys = await trio.to_thread.run_sync(self.journal.keys.owned_under, dir_key)
            own_durable = await trio.to_thread.run_sync(self.journal.keys.durable_at_path_in, directory.ino, dir_key)
            files, subdirs = await self.links.fetcher.list_dir(dir_key)
        except Exception as exc:
            self._failed_at[directory.ino] = time.monotonic()
            return self._list_failed(dir_key, exc)
        self._failed_at.pop(directory.ino, None)
        prefix = f"{dir_key}/" if dir_key else ""
        at_root = directory.ino == ROOT_INO
        # Filter first (yielding on huge listings), then apply in one synchronous pass.
        wanted_files: list[tuple[bytes, int, int, str]] = []
        remote_versions: dict[bytes, tuple[int, int, str | None]] = {}  # name -> (size, mtime_ns, etag)
        for count, entry in enumerate(files, 1):
            if count % 1000 == 0:
                await trio.lowlevel.checkpoint()  # a 100,000-object listing must not stall other requests
            try:
                name, size, mtime, etag = ListedFile(*entry)
                raw = self._listed_name(dir_key, name, at_root)
                size, mtime_ns = int(size), int(mtime * 1e9)
                if size < 0:
                    raise ValueError(f"negative size {size}")
            except (TypeError, ValueError, OverflowError) as exc:
                self._skip_listed(dir_key, entry, exc)
                continue
            if raw is None:
                continue
            remote_versions[raw] = (size, mtime_ns, etag)
            if prefix + name not in known_keys:
                wanted_files.append((raw, size, mtime_ns, prefix + name))
        # A remote directory holding keys this node owns is its own layout from before
        # a rename whose objects have not moved yet: not another node's directory.
        owned_dirs = {key[len(prefix) :].split("/", 1)[0] for key in known_keys if "/" in key[len(prefix) :]}
        wanted_dirs: list[bytes] = []
        listed_dirs: set[bytes] = set()
        for name in subdirs:
            try:
                raw = self._listed_name(dir_key, name, at_root)
            except (TypeError, ValueError) as exc:
                self._skip_listed(dir_key, name, exc)
                continue
            if raw is not None:
                listed_dirs.add(raw)
                if name not in owned_dirs:
                    wanted_dirs.append(raw)
        vanished = {prefix + os.fsdecode(raw): raw for raw in own_durable if raw not in remote_versions}
        if vanished:
            try:
                deleted = await self.links.fetcher.objects_deleted(sorted(vanished))
            except Exception as exc:
                return self._list_failed(dir_key, exc)
            for key, raw in vanished.items():
                if key not in deleted:
                    del own_durable[raw]
                    self._note_lost(key, now)
        for key in [key for key in self._lost_since if key.startswith(prefix) and key not in vanished]:
            del self._lost_since[key]  # deleted with its manifest since, or back
        merged = await self._merge(
            directory, prefix, now, wanted_files, wanted_dirs, listed_dirs, remote_versions, own_durable
        )
        if merged:
            self._merged_at[directory.ino] = now
            if time.monotonic() - now <= self.wait:
                self._slow_until = 0.0  # the remote answers in time again
        return merged

    async def refresh_path(self, rel: str) -> tuple[Inode, int]:
        """List ``rel`` (a path below the root) afresh, whatever the TTL: each directory on the
        way where the next name is missing (another node made it since this mount listed there),
        then every directory at or below it.  Returns its inode and how many directories were
        listed; ENOENT if it is not there even then.  ``burstfs-admin latest`` names a step
        another node just published: a lookup of it must not miss for up to the TTL."""
        inode = self.namespace.inode(ROOT_INO)
        listed = 0
        for part in filter(None, rel.split("/")):
            name = os.fsencode(part)
            if inode.kind == "dir" and name not in (inode.children or {}):
                listed += await self._list_afresh(inode, rel)
            try:
                inode = self.namespace.child(inode.ino, name)
            except FsError as exc:
                raise FsError(exc.errno, f"/{rel}: {os.strerror(exc.errno)}") from None
        top, pending = inode, [inode]
        while pending:
            directory = pending.pop()
            if directory.kind != "dir":
                continue
            listed += await self._list_afresh(directory, rel)
            pending += [child for _, child in self.namespace.entries(directory) if child.kind == "dir"]
        return top, listed

    async def _list_afresh(self, directory: Inode, rel: str) -> int:
        """One forced listing of ``refresh_path``: EIO if the remote could not be listed (its
        caller is told, not handed the old listing as a fresh one: a prune would then leave
        the shards other nodes drained since on the remote, and the step would come back)."""
        started = time.monotonic()
        merged = await self.refresh(directory, force=True)
        if self._failed_at.get(directory.ino, -1.0) >= started:
            raise FsError(errno.EIO, f"/{rel}: the remote could not be listed (see burstfs-admin status)")
        return int(merged)

    def _note_lost(self, key: str, now: float) -> None:
        """This node's object ``key`` is missing from a listing and its manifest is not: logged
        once a listing ``LOST_CONFIRM_S`` later still finds it so (a delete between the two)."""
        first = self._lost_since.setdefault(key, now)
        if now - first >= LOST_CONFIRM_S and key not in self._lost_logged:
            self._lost_logged.add(key)
            log.error("event=object_lost key=%s note=gone from the remote, its manifest is not", key)

    def _tell_status(self, directory: Inode, reason: str) -> None:
        """A listing of ``directory`` that has not answered: status lists it (read_failed)."""
        if self.links.fetcher is not None:
            self.links.fetcher.listing_failed(self.namespace.path_of(directory) or "", reason)

    def _list_failed(self, dir_key: str, exc: Exception) -> bool:
        """A listing that could not be taken: logged, retried after the TTL; requests meanwhile
        wait for none (``backoff``) -- unless the remote answered, throttling (503 SlowDown):
        waiting for a listing costs its few quick tries then, and a fresh node's lookups in
        every other directory would fail EIO at once for the whole backoff."""
        log.warning("event=list_failed dir=%s error=%s", dir_key or "/", exc)
        if self.links.fetcher is not None:
            self.links.fetcher.listing_failed(dir_key, str(exc))
        if getattr(exc, "kind", None) != THROTTLED:
            self._slow_until = time.monotonic() + self.backoff
        return False

    async def _merge(
        self,
        directory: Inode,
        prefix: str,
        started: float,
        wanted_files: list[tuple[bytes, int, int, str]],
        wanted_dirs: list[bytes],
        listed_dirs: set[bytes],
        remote_versions: dict[bytes, tuple[int, int, str | None]],
        own_durable: dict[bytes, int],
    ) -> bool:
        """Apply a filtered listing: no await from the checks to the commit's enqueue.

        A file known from an earlier listing and unchanged here (``Inode.as_listed``, its
        copy fetched or not) whose object vanished is forgotten; one whose object's size or
        mtime changed, or its etag since this mount listed it (its owner rewrote it), is
        replaced by a new inode for the new object,
        its fetched copy dropped: the next open reads the new bytes, never the old copy
        (nor EIO for a digest that no longer matches).  A file open for writing is left as
        it is; a reader goes on with the inode it opened: what it fetched of the old version,
        EIO for the rest (its object is gone), never the new version's bytes.

        A file of this node's whose object was at its path before the listing began
        (``own_durable``), unchanged here since, and missing from it with its manifest was
        deleted by another node (keep-last-N on rank 0): it goes here too, as another
        node's would, rather than stay and be called durable with no object behind it.

        A subdirectory holding files, missing from the listing, is listed in turn once its
        files are all on the remote (``_follow_vanished``): a step another node pruned takes
        this node's shards there along, though nothing here lists it again.  A directory
        emptied that way and still missing from the remote goes too."""
        if directory.children is None or (directory.parent == 0 and directory.ino != ROOT_INO):
            return False  # removed while it was listed
        undo = Undo()
        ops: list[Op] = []
        recent = self.tombstones.since(started)
        for raw, size, mtime_ns, key in wanted_files:
            if raw in directory.children or key in recent:
                continue  # made, renamed or deleted here meanwhile: local state wins
            ops += self._add_listed(directory, raw, "file", size, mtime_ns, key, undo, remote_versions[raw][2])
        for raw in wanted_dirs:
            if raw in directory.children or prefix + os.fsdecode(raw) in recent:
                continue
            ops += self._add_listed(directory, raw, "dir", 0, time.time_ns(), None, undo)
        forgotten: list[tuple[bytes, Inode]] = []
        vanished_dirs: list[Inode] = []
        for raw, ino in list(directory.children.items()):
            gone = self.namespace.inodes[ino]
            if gone.writers or gone.pending:
                continue  # a reader keeps the inode it opened (detached), a writer keeps its file
            if gone.kind == "dir":
                if raw in listed_dirs or prefix + os.fsdecode(raw) in recent:
                    continue
                if gone.children:
                    vanished_dirs.append(gone)
                elif self._emptied.get(gone.ino) == gone.mtime_ns:  # and nothing made there since
                    log.info("event=deleted_elsewhere key=%s ino=%d note=emptied dir", prefix + os.fsdecode(raw), ino)
                    ops += self._forget_listed_ops(directory, gone, undo)
                    forgotten.append((raw, gone))
                continue
            if not (gone.listed or gone.as_listed):
                if self._deleted_elsewhere(gone, raw, own_durable, remote_versions, prefix, recent):
                    ops += self._forget_listed_ops(directory, gone, undo)
                    forgotten.append((raw, gone))
                continue
            listed = remote_versions.get(raw)
            if listed is None:
                ops += self._forget_listed_ops(directory, gone, undo)
                forgotten.append((raw, gone))
                continue
            size, mtime_ns, etag = listed
            seen_etag = self._etags.setdefault(gone.ino, etag)
            key = prefix + os.fsdecode(raw)
            if (
                gone.as_listed
                and ((size, mtime_ns) != (gone.size, gone.mtime_ns) or etag != seen_etag)
                and key not in recent
            ):
                log.info(
                    "event=listed_file_changed key=%s ino=%d size=%d new_size=%d note=rewritten by its owner",
                    key,
                    gone.ino,
                    gone.size,
                    size,
                )
                ops += self._forget_listed_ops(directory, gone, undo)
                forgotten.append((raw, gone))
                ops += self._add_listed(directory, raw, "file", size, mtime_ns, key, undo, etag)
        emptied = bool(forgotten) and not directory.children and directory.ino != ROOT_INO
        if directory.ino not in self._seen or emptied:  # its first listing in this cache: known from now on
            ops.append(known_dir_op(directory.ino, emptied=emptied))
        if ops:
            for _, gone in forgotten:
                gone.pending += 1
            try:
                await self.committer.commit(ops, undo=undo)
            finally:
                for _, gone in forgotten:
                    gone.pending -= 1
            for raw, gone in forgotten:
                self._etags.pop(gone.ino, None)
                self._emptied.pop(gone.ino, None)
                self.entry_dropped(directory.ino, raw)
                self.namespace.maybe_destroy(gone)
            if emptied:
                self._emptied[directory.ino] = directory.mtime_ns
        self._seen.add(directory.ino)
        self._sweep_memos()
        self._follow_vanished(vanished_dirs)
        return True

    def _follow_vanished(self, directories: list[Inode]) -> None:
        """List, in the background, ``directories`` (missing from their parent's listing) whose
        files are all on the remote: deleted there, they go here too (``_merge``)."""
        now = time.monotonic()
        due = [d for d in directories if d.ino not in self._following and self._due(d, now)]
        if not due or now < self._slow_until:
            return
        self._following.update(d.ino for d in due)
        trio.lowlevel.spawn_system_task(self._list_vanished, due)

    async def _list_vanished(self, directories: list[Inode]) -> None:
        try:
            whole = await trio.to_thread.run_sync(self.journal.keys.all_on_remote, [d.ino for d in directories])
            for directory in directories:
                if directory.ino in whole and directory.parent and time.monotonic() >= self._slow_until:
                    with trio.move_on_after(self.timeout):
                        await self.refresh(directory)
        except Exception as exc:  # a failed merge commit: tried again at the parent's next listing
            log.warning("event=listing_merge_failed dirs=%d error=%s", len(directories), exc)
        finally:
            self._following.difference_update(d.ino for d in directories)

    def _sweep_memos(self) -> None:
        """Drop the memos of inodes gone from the namespace (a listed file removed here, a
        directory deleted): over a long run, checkpoints come and go, and so must their entries."""
        if len(self._etags) + len(self._seen) < self._memo_sweep_at:
            return
        alive = self.namespace.inodes
        self._etags = {ino: etag for ino, etag in self._etags.items() if ino in alive}
        self._seen = {ino for ino in self._seen if ino in alive}
        self._emptied = {ino: mtime for ino, mtime in self._emptied.items() if ino in alive}
        self._merged_at = {ino: at for ino, at in self._merged_at.items() if ino in alive}
        self._memo_sweep_at = max(MEMO_SWEEP_MIN, 2 * (len(self._etags) + len(self._seen)))

    async def list_before_removal(self, directory: Inode, reached_remote: bool) -> None:
        """``directory`` (empty here) is about to be removed: list it first unless a listing
        merged within the TTL, even right after a failed one, trying again while listings
        fail fast for up to REMOVAL_LIST_S (or ``--remote-wait``).  Other nodes' files in it
        (a step's shards: keep-last-N on one node prunes every node's) show only in a
        listing: after one 503 on the listing of ``rm -r``, the rmdir passed, their objects
        stayed on the remote for good and the step came back, torn, at the next listing.
        Merged now, they make the rmdir ENOTEMPTY (``rm -r`` again removes them).  A remote
        that does not answer by then does not hold the rmdir longer (a save never waits for
        a sick remote): logged, their files then stay on it.  Not asked at all: a directory
        this life never listed, with no key of this node under it and where this node's
        files never ``reached_remote`` (a save's temp directory)."""
        if self.links.fetcher is None:
            return
        merged_at = self._merged_at.get(directory.ino)
        if merged_at is not None and time.monotonic() - merged_at < self.ttl:
            return
        dir_key = self.namespace.path_of(directory)
        if dir_key is None:
            return
        if (
            merged_at is None
            and not reached_remote
            and not await trio.to_thread.run_sync(self.journal.keys.owned_under, dir_key)
        ):
            return
        deadline = time.monotonic() + max(self.wait, REMOVAL_LIST_S)
        pause = 0.1
        while True:
            in_flight = self._in_flight.get(directory.ino)
            if in_flight is not None:  # a request's listing, still trying: its outcome, not a new one
                done, merged, _, _ = in_flight
                with trio.move_on_after(max(0.0, deadline - time.monotonic())):
                    await done.wait()
                if merged[0]:
                    return
            elif await self.refresh_bounded(directory, force=True, despite_backoff=True):
                return
            if time.monotonic() + pause >= deadline:
                log.warning(
                    "event=rmdir_unlisted dir=%s note=the remote did not answer: other nodes' files there stay on it",
                    dir_key,
                )
                return
            await trio.sleep(pause)  # a longer burst of 503s than a listing's own tries: again
            pause *= 2

    def made_here(self, directory: Inode) -> None:
        """``directory`` was just made on this node: what it holds is known (nothing)."""
        self._seen.add(directory.ino)

    def unseen(self, directory: Inode) -> bool:
        """``directory`` holds nothing here, was not made here, and no listing of it was
        merged since the mount started: what is in it is not known (core.lookup answers
        EIO, not ENOENT)."""
        return self.links.fetcher is not None and not directory.children and directory.ino not in self._seen

    def _due(self, directory: Inode, now: float) -> bool:
        ttl = min(self.ttl, UNSEEN_RETRY_S) if self.unseen(directory) else self.ttl
        return now - directory.listed_at >= ttl

    def _listed_name(self, dir_key: str, name: str, at_root: bool) -> bytes | None:
        """The file name a listed key stands for; None for the remote's own ``.burstfs``.
        Raises ValueError for a name no file here can have."""
        if not isinstance(name, str):
            raise TypeError(f"not a name: {name!r}")
        raw = os.fsencode(name)
        if not raw or raw in (b".", b"..") or b"/" in raw or b"\0" in raw:
            raise ValueError("not a valid file name")
        if len(raw) > NAME_MAX:
            raise ValueError(f"longer than {NAME_MAX} bytes")
        if at_root and raw == RESERVED_ROOT_NAME:
            return None
        return raw

    def _skip_listed(self, dir_key: str, entry: object, exc: Exception) -> None:
        """A listed key that cannot be shown: skipped, logged once per mount."""
        what = f"{dir_key}:{entry!r}"
        if what in self._skipped_logged:
            return
        if len(self._skipped_logged) < 10000:
            self._skipped_logged.add(what)
        log.warning("event=listing_entry_skipped dir=%s key=%r reason=%s", dir_key or "/", entry, exc)

    @staticmethod
    def _deleted_elsewhere(
        inode: Inode,
        raw: bytes,
        own_durable: dict[bytes, int],
        remote_versions: dict[bytes, tuple[int, int, str | None]],
        prefix: str,
        recent: set[str],
    ) -> bool:
        """Whether this node's durable file ``raw`` lost its object to another node's delete."""
        key = prefix + os.fsdecode(raw)
        if (
            inode.kind != "file"
            or raw in remote_versions
            or own_durable.get(raw) != inode.generation
            or inode.dirty
            or inode.new
            or inode.links
            or key in recent
        ):
            return False
        log.warning("event=deleted_elsewhere key=%s ino=%d note=its object is gone from the remote", key, inode.ino)
        return True

    def _forget_listed_ops(self, directory: Inode, inode: Inode, undo: Undo) -> list[Op]:
        """A listed file that vanished from the remote: drop it here, delete nothing there."""
        return forget_listed_ops(inode.ino, inode.name, self.namespace.detach(directory, inode, undo))

    def _add_listed(
        self,
        directory: Inode,
        name: bytes,
        kind: str,
        size: int,
        mtime_ns: int,
        key: str | None,
        undo: Undo,
        etag: str | None = None,
    ) -> list[Op]:
        mode = stat.S_IFDIR | 0o755 if kind == "dir" else stat.S_IFREG | 0o644
        inode = self.namespace.new_inode(directory, name, kind, mode, directory.uid, directory.gid)
        inode.size, inode.mtime_ns, inode.ctime_ns = size, mtime_ns, mtime_ns
        if kind == "file":
            inode.local, inode.listed = False, True
            self._etags[inode.ino] = etag

            def unseen() -> None:
                self._etags.pop(inode.ino, None)

            undo.add(unseen)
        self.namespace.attach(directory, inode, undo)
        row = self.namespace.row(inode, REMOTE if kind == "file" else META)
        row.remote_key = key
        if kind == "dir":
            return [insert_inode_op(row)]
        return [insert_inode_op(row), update_inode_op(inode.ino, listed_version=object_version(etag, mtime_ns))]

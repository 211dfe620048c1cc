"""Remote deletes and relocations: the keys this node gives up or moves (DESIGN-NOTES invariant 6).

Decided one at a time on the mover's loop, between claims: no claim or move
runs while a pass looks at a key, and an upload in flight holds its key.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..commitgroups import POINTER_MARKERS, dir_of
from ..errors import HALT, OBJECT, CorruptDataError, RemoteError, error_scope
from ..journal import UNLINK_LISTED
from . import timing

if TYPE_CHECKING:
    from .scheduler import Mover

log = logging.getLogger("burstfs.mover")

# _relocate_one's answer when the remote (not one file) failed: end the pass.
_STOP = -1


class KeyMoves:
    """Deletes of objects nobody owns any more, and moves of renamed durable files' objects."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        # A full scan at start (and now and then), otherwise only the subtrees of
        # renames journaled since `_rename_seq`.
        self._needed = True
        self._full = True
        self._next_full_scan = 0.0
        self._rename_seq = 0
        self._roots: set[int] = set()
        self._retry: dict[int, float] = {}  # ino -> earliest retry of its relocation
        self._failures: dict[int, int] = {}
        self._delete_retry: dict[str, float] = {}  # key -> earliest retry of its delete
        # The whole queue's commit markers (not only the pass's window of it), read
        # incrementally: request id -> key, the last request id read, and when the queue
        # last grew (monotonic).
        self._marker_deletes: dict[int, str] = {}
        self._read_to = 0
        self._grew_at = 0.0

    def restart(self) -> None:
        """A new run of the mover: walk the whole namespace (and the delete queue) first."""
        self._needed = self._full = True
        self._marker_deletes.clear()
        self._read_to = 0

    def changed(self) -> None:
        """A rename was journaled: walk the subtrees renamed since the last pass."""
        self._needed = True

    def want(self, ino: int) -> None:
        """Look at ``ino``'s object on the next pass (renamed during its upload, or it holds a key)."""
        self._roots.add(ino)
        self._needed = True

    def failed(self, ino: int) -> bool:
        """Whether moving ``ino``'s object failed for that file alone (its source object gone,
        say): retried with backoff, but ``drain --cache`` does not wait for it."""
        return ino in self._failures

    def retry_now(self) -> None:
        """``drain --now``: relocations backing off are due at once."""
        self._retry = dict.fromkeys(self._retry, 0.0)

    async def process_deletes(self) -> None:
        """Delete objects of unlinked or replaced files (never a key another inode owns or uploads to).

        A checkpoint's commit marker goes before its other files (``_held_for_marker``): a
        crash part-way through removing a checkpoint leaves it without its marker, not a
        marker that publishes a torn checkpoint.
        """
        assert self.mover.store is not None
        now = time.time()
        # One read of the queue with each key's holder: no claim or move runs during this
        # pass, and an upload in flight holds its key from its claim on, so a key free
        # now stays free until its delete.
        flying = frozenset(self.mover.in_flight.values())  # skipped below in any case
        # The markers' requests too, wherever they are in the queue (as of the last read): the
        # files they hold back may fill the window.
        pending = await self.mover.db(
            self.mover.journal.keys.pending_deletes_held, 500, flying, list(self._marker_deletes)
        )
        owned = [
            row_id
            for row_id, key, _, _, holder in pending
            if holder is not None
            and holder not in self.mover.in_flight
            and key not in self.mover.in_flight.values()
            and self._delete_retry.get(key, 0.0) <= now
        ]
        if owned:  # live files own these keys now: nothing to delete
            await self.mover.db(self.mover.journal.keys.drop_deletes, owned)
        # Every request read above is noted here too (and any queued since): a queued marker
        # holds the files below it, and whether removals are still coming in is known before
        # the markers still in place are looked for.
        await self._read_marker_deletes()
        live_markers = await self._live_marker_dirs(
            [key for _, key, _, _, holder in pending if holder is None and not self._is_marker_key(key)]
        )
        # Again: a marker unlinked since the read above is neither in place nor noted yet.
        await self._read_marker_deletes()
        # A removed file's object (keep-last-N, a replace by rename) waits for the new object at
        # its key, and for a newer pointer above it (``_held_for_pointer``).
        removed = [key for _, key, reason, _, holder in pending if holder is None and reason in UNLINKED]
        pointers, overwritten = await self._removals_held(removed)
        # Markers first; a pass may then delete, after a marker, the files it held back.
        pending.sort(key=lambda row: not self._is_marker_key(row[1]))
        for row_id, key, reason, version, holder in pending:
            if holder is not None or key in self.mover.in_flight.values() or self._delete_retry.get(key, 0.0) > now:
                continue
            if key in overwritten or (reason in UNLINKED and _held_for_pointer(key, pointers)):
                continue
            if self._held_for_marker(key, live_markers):
                continue
            try:
                if reason == UNLINK_LISTED:
                    await self.mover.store.delete(key, spare_foreign=False, listed_version=version)
                else:
                    await self.mover.store.delete(key)
            except Exception as exc:
                if not isinstance(exc, RemoteError):  # a bug hit by this key: retried later, not lost
                    log.exception("event=remote_delete_bug key=%s", key)
                    self.mover.stats.error("internal", f"delete {key}: {exc!r}")
                    self._delete_retry[key] = now + timing.RELOCATE_BACKOFF_S
                    continue
                scope = error_scope(exc)
                if scope == OBJECT:  # no object can exist (or be removed) under such a key: the request is void
                    log.warning("event=remote_delete_skipped key=%s reason=%s error=%s", key, reason, exc)
                    self.mover.stats.error(exc.kind, f"delete {key}: {exc}")
                    await self.mover.db(self.mover.journal.keys.drop_delete, row_id)
                    self._marker_deletes.pop(row_id, None)
                    continue
                if scope == HALT:
                    self.mover.halt(exc)
                else:
                    self.mover.stats.error(exc.kind, str(exc))
                return
            self._delete_retry.pop(key, None)
            await self.mover.db(self.mover.journal.keys.drop_delete, row_id)
            self._marker_deletes.pop(row_id, None)  # after its row is gone: a crash before leaves it queued
            log.info("event=remote_delete key=%s reason=%s", key, reason)
            if self._is_marker_key(key):
                await self.mover.groups.marker_deleted(self.mover.store.remote, key)

    def _is_marker_key(self, key: str) -> bool:
        return self.mover.is_marker_name(key.rpartition("/")[2])

    async def _read_marker_deletes(self) -> None:
        """Note the commit markers among the removals queued since the last pass, and forget
        those no longer queued (deleted, or owned by a live file again)."""
        new = await self.mover.db(self.mover.journal.keys.removals_after, self._read_to)
        if new:
            self._read_to = new[-1][0]
            self._grew_at = time.monotonic()
            self._marker_deletes.update((row_id, key) for row_id, key in new if self._is_marker_key(key))
        if self._marker_deletes:
            queued = await self.mover.db(self.mover.journal.keys.still_queued, list(self._marker_deletes))
            self._marker_deletes = {row_id: key for row_id, key in self._marker_deletes.items() if row_id in queued}

    async def _live_marker_dirs(self, keys: list[str]) -> set[str]:
        """The directories at or above ``keys`` that still hold a commit marker on the remote,
        while removals keep coming in (``timing.DELETE_SETTLE_S``): an ``rm -r`` in progress
        may unlink that marker next, after the files it lists (its order is readdir's)."""
        if not keys or time.monotonic() - self._grew_at >= timing.DELETE_SETTLE_S:
            return set()
        dirs = {above for key in keys for above in _dirs_above(key)}
        return await self.mover.db(self.mover.journal.keys.dirs_holding, dirs, self.mover.is_marker_name)

    async def _removals_held(self, removed: list[str]) -> tuple[dict[str, str], set[str]]:
        """For the deletes of removed files' objects ``removed``: the pointer markers (``latest``...)
        whose remote version is older than this node's (``_held_for_pointer``), and the keys a
        file closed here at that path will overwrite."""
        if not removed:
            return {}, set()
        names = [name for name in POINTER_MARKERS if self.mover.is_marker_name(name)]
        pointers = await self.mover.db(self.mover.journal.keys.pointers_being_replaced, names)
        return pointers, await self.mover.db(self.mover.journal.keys.to_be_overwritten, removed)

    def _held_for_marker(self, key: str, live_markers: set[str]) -> bool:
        """Whether ``key``, not a marker, waits for the marker of a checkpoint it is in: one
        whose delete is queued and not done yet, or one still in place (``live_markers``)."""
        if self._is_marker_key(key):
            return False
        above = _dirs_above(key)
        if not live_markers.isdisjoint(above):
            return True
        return any(dir_of(marker) in above for marker in self._marker_deletes.values())

    async def relocate_renamed(self) -> None:
        """Durable files whose path changed move with a server-side copy; their old key is queued for deletion.

        Only the subtrees renamed since the last pass are walked (plus files whose
        move is due for a retry); the whole namespace at start and every
        timing.RELOCATE_FULL_SCAN_S.
        """
        now = time.time()
        due = [ino for ino, at in self._retry.items() if at <= now]
        if now >= self._next_full_scan:
            self._full = True
        if not (self._needed or self._full or due):
            return
        self._needed = False  # before reading the events: a rename committed meanwhile sets it again
        roots: set[int] | None
        if self._full:
            self._rename_seq = await self.mover.db(self.mover.journal.latest_event_seq)
            roots = None
            self._full = False
            self._next_full_scan = now + timing.RELOCATE_FULL_SCAN_S
        else:
            renamed, self._rename_seq = await self.mover.db(self.mover.journal.renamed_since, self._rename_seq)
            roots = {*renamed, *due, *self._roots}
        self._roots.clear()
        for ino in due:
            self._retry.pop(ino, None)
        for ino, key in await self.mover.db(
            self.mover.journal.keys.drop_stale_keys, roots, frozenset(self.mover.in_flight)
        ):
            log.info("event=stale_key ino=%d key=%s action=delete", ino, key)
        candidates = await self.mover.db(self.mover.journal.keys.relocation_candidates, roots)
        pending = list(dict.fromkeys(ino for ino, _, _ in candidates))
        for _ in range(len(pending) + 2):  # each round moves or parks at least one file, or ends the pass
            pending = [ino for ino in pending if ino not in self._retry]
            blocked: dict[int, int] = {}
            progressed = False
            for ino in pending:
                result = await self._relocate_one(ino)
                if result == _STOP:
                    return  # the remote is down or halted: try again on a later pass
                if result is None:
                    progressed = True
                else:
                    blocked[ino] = result
            if not blocked:
                return
            if not progressed:
                cycle = await self.mover.db(self.mover.journal.keys.rename_cycle, blocked)
                if cycle is None:
                    for ino in blocked:  # waiting for an upload or another file's move
                        self._retry[ino] = time.time() + timing.KEY_BUSY_RETRY_S
                    return
                if await self._park(cycle) == _STOP:
                    return
            pending = list(blocked)
        for ino in pending:
            self._retry.setdefault(ino, time.time() + timing.KEY_BUSY_RETRY_S)

    async def _relocate_one(self, ino: int) -> int | None:
        """Move one file's object to its path: None if moved (or nothing to do, or failed for
        this file only), the inode holding the target key if it must wait, _STOP if the
        remote failed (end the pass)."""
        assert self.mover.store is not None
        if ino in self.mover.in_flight:
            return None
        move = await self.mover.db(self.mover.journal.keys.relocation, ino)
        if move is None:
            return None
        path, old_key, holder = move
        if holder is not None:
            return holder
        marker = self.mover.is_marker_name(path.rpartition("/")[2])
        if marker and dir_of(old_key) != dir_of(path) and self.mover.remote is not None:
            try:
                await self.mover.groups.carry(self.mover.remote, dir_of(old_key), dir_of(path))
            except Exception as exc:
                return await self._relocation_failed(ino, old_key, path, exc)
        if marker and await self.mover.db(self.mover.journal.keys.restage_durable, ino, old_key):
            # A commit marker renamed into place (DCP's .metadata.tmp -> .metadata) publishes
            # a checkpoint: it drains as an upload, behind its directory's files and the
            # commit gate, never as a server-side copy that would bypass both.  Its old
            # key is dropped as stale.
            log.info("event=marker_restaged ino=%d from=%s to=%s", ino, old_key, path)
            self._roots.add(ino)  # the next pass drops the old key
            self._needed = True
            self.mover.wake()
            return None
        intent = await self.mover.db(self.mover.journal.keys.intend_move, path)
        try:
            await self.mover.store.rename(old_key, path, delete_source=False)
        except Exception as exc:
            return await self._relocation_failed(ino, old_key, path, exc)
        moved = await self.mover.db(self.mover.journal.keys.finish_relocation, ino, old_key, path, intent)
        self._failures.pop(ino, None)
        log.info("event=remote_rename from=%s to=%s recorded=%s", old_key, path, moved)
        return None

    async def _relocation_failed(self, ino: int, old_key: str, path: str, exc: BaseException) -> int | None:
        """A failed move is that file's problem (retried later, or re-uploaded), unless the remote is down."""
        scope = error_scope(exc)
        if isinstance(exc, RemoteError) and scope != OBJECT:
            self.mover.stats.error(exc.kind, str(exc))
            self._roots.add(ino)
            self._needed = True
            if scope == HALT:
                self.mover.halt(exc)
            return _STOP
        if not isinstance(exc, (RemoteError, CorruptDataError)):
            log.exception("event=relocate_bug ino=%d from=%s to=%s", ino, old_key, path)
        message = f"cannot move {old_key} to {path}: {exc!r}"
        self.mover.stats.error("relocate", message)
        await self.mover.db(self.mover.journal.set_error, ino, message)
        if await self.mover.db(
            self.mover.journal.keys.restage_durable, ino, old_key
        ):  # still local: upload it again at its path
            log.error("event=relocate_failed ino=%d from=%s to=%s action=reupload error=%r", ino, old_key, path, exc)
            self.mover.wake()
            return None
        failures = self._failures.get(ino, 0) + 1
        self._failures[ino] = failures
        delay = min(timing.RELOCATE_BACKOFF_MAX_S, timing.RELOCATE_BACKOFF_S * 2 ** (failures - 1))
        self._retry[ino] = time.time() + delay
        log.error("event=relocate_failed ino=%d from=%s to=%s retry_in=%.0f error=%r", ino, old_key, path, delay, exc)
        return None

    async def _park(self, ino: int) -> int | None:
        """Move ``ino``'s object to a private key so that the key it holds frees up."""
        assert self.mover.store is not None
        target = await self.mover.db(self.mover.journal.keys.relocation_target, ino)
        if target is None:
            return None
        _, old_key = target
        parked = f"{timing.PARK_PREFIX}{ino}"
        intent = await self.mover.db(self.mover.journal.keys.intend_move, parked)
        try:
            await self.mover.store.rename(old_key, parked, delete_source=False)
        except Exception as exc:
            return await self._relocation_failed(ino, old_key, parked, exc)
        await self.mover.db(self.mover.journal.keys.finish_relocation, ino, old_key, parked, intent)
        log.info("event=remote_rename_parked from=%s to=%s", old_key, parked)
        return None


#: The delete reasons of unlinked files' objects (a prune, a replace by rename): only these wait
#: for a pointer above them or a new object at their key; the clean-up of a cut-short upload or
#: a stale key holds no step a pointer could name.
UNLINKED = frozenset({"unlink", UNLINK_LISTED})


def _held_for_pointer(key: str, pointers: dict[str, str]) -> bool:
    """Whether ``key`` waits for a pointer marker above it to drain: keep-last-N prunes the
    step the remote's older ``latest`` still names once newer steps are durable here, and a
    restart that reads it must find that step until the pointer names a newer one."""
    return any(
        key != pointer and key.startswith(f"{folder}/" if folder else "") for folder, pointer in pointers.items()
    )


def _dirs_above(key: str) -> set[str]:
    """The directories ``key`` is in: its own, each one above it, and the root ("")."""
    parts = key.split("/")[:-1]
    return {"/".join(parts[:depth]) for depth in range(len(parts) + 1)}

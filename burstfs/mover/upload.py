"""Draining one claimed file: its upload, and the record of it (durable, requeued or failed).

Every journal transition is conditional on the generation the upload read
(DESIGN-NOTES invariant 3); a file rewritten under its upload is superseded,
not corrupt (invariant 4).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from ..errors import HALT, OBJECT, CorruptDataError, RemoteError, UploadCancelled, error_scope
from ..journal import InodeRow
from ..objects import FileDigests
from ..recovery import written_after_close
from . import timing

if TYPE_CHECKING:
    from .scheduler import Mover

log = logging.getLogger("burstfs.mover")


class FileDrain:
    """The upload of one file at a time per call; part of a :class:`Mover`, on its loop."""

    def __init__(self, mover: Mover) -> None:
        self.mover = mover
        self._mismatches: dict[tuple[int, int], int] = {}  # (ino, generation) -> checksum mismatches seen

    async def run(self, row: InodeRow, key: str, intent: int, started: float) -> None:
        """Upload ``generation`` of ``row`` to ``key`` (claimed, ``intent`` journaled); record it, or
        requeue or fail the file.  Never raises but for cancellation."""
        ino, generation = row.ino, row.generation
        try:
            digests = self._journaled_digests(row)
            assert self.mover.store is not None
            manifest = await self.mover.store.upload_file(
                key,
                self.mover.tier_paths.path(row.data_ino),
                digests,
                chunk_size=self.mover.options.part_size,
                generation=generation,
                mtime_ns=row.mtime_ns,
                mode=row.mode,
                concurrency=self.mover.options.concurrency,
                compress=self.mover.options.compress,
                cancel_check=functools.partial(self._cancelled, row),
                pace=self._yield_to_writers,
                sent=functools.partial(self.mover.stats.sent, ino),
            )
            # Digests taken during the upload are journaled with its record (for verify and the xattr).
            taken = None
            if digests is None:
                chunks = tuple(c.xxh3 for c in manifest.chunks)
                taken = FileDigests(manifest.size, manifest.chunk_size, chunks, manifest.digest)
            commit = None
            if self.mover.is_marker_name(os.fsdecode(row.name)):
                commit = self.mover.groups.commit_due(row, key, manifest.size, manifest.digest)
            await self._finish(row, key, manifest.size, started, intent, taken, commit)
        except (asyncio.CancelledError, UploadCancelled) as exc:
            await self._requeue(ino, generation, None)  # stopping, or the file changed: drains again
            if isinstance(exc, asyncio.CancelledError):
                raise
        except CorruptDataError as exc:
            if await self._changed_under_upload(row):
                log.info("event=drain_superseded ino=%d generation=%d reason=%r", ino, generation, str(exc))
                await self._requeue(ino, generation, None)  # rewritten under us: drains again, not corrupt
            else:
                await self._fail(ino, generation, exc)
        except RemoteError as exc:
            scope = error_scope(exc)
            if scope == OBJECT and await self._superseded(ino, generation):
                await self._requeue(ino, generation, None)  # renamed or changed meanwhile: try the new key/bytes
            elif exc.kind == "key_conflict" and row.attempts < timing.KEY_CONFLICT_RETRIES:
                # A file remote's file/directory clash may be this node's own object on its way
                # out (a delete or a move still queued): try again before failing the file.
                await self._requeue(ino, generation, exc)
            elif scope == OBJECT:  # this object only: the file fails, the drain goes on
                await self._fail(ino, generation, exc)
            else:
                await self._requeue(ino, generation, exc)
                if scope == HALT:
                    self.mover.halt(exc)
        except FileNotFoundError as exc:
            if await self._superseded(ino, generation):
                await self._requeue(ino, generation, None)  # unlinked under us: nothing to drain
            else:
                await self._fail(ino, generation, exc)
        except Exception as exc:
            log.exception("event=drain_bug ino=%d", ino)
            if await self._changed_under_upload(row):
                await self._requeue(ino, generation, None)
            else:
                await self._fail(ino, generation, exc)
        finally:
            self.mover.in_flight.pop(ino, None)
            self.mover.stats.upload_over(ino)
            self.mover.upload_ended(row.size)

    async def _yield_to_writers(self) -> None:
        """Wait while files opened for writing in the last WRITER_YIELD_S seconds are open."""
        # Polled: the writers are stamped by the FUSE thread, which has no event to set here.
        while not self.mover.stopping and self.mover.bursts.recent_writer():  # noqa: ASYNC110
            await asyncio.sleep(timing.WRITER_POLL_S)

    async def _cancelled(self, row: InodeRow) -> bool:
        """The upload's cancel check, between its reads and before its object becomes visible:
        superseded in the journal, or its data file written since ``row``'s record.  With
        passthrough the kernel writes the data file without the daemon: an fsync'd file that
        is written on (a log, a streamed checkpoint) holds no closed version until its next
        close, and the drain sent the fsync'd generation with the later bytes in it.  Such a
        generation waits, like one closed while another writer stays open, for that writer's
        next fsync or last close (which journal its later bytes): not re-read and logged again
        every retry while a log stays open."""
        if await self._superseded(row.ino, row.generation):
            return True
        if not self._written_since(row):
            return False
        self.mover.hold_drain(row.data_ino, row.generation)
        log.info(
            "event=drain_deferred ino=%d generation=%d reason=%r",
            row.ino,
            row.generation,
            "written after its journaled close or fsync: drains at its next close",
        )
        return True

    def _written_since(self, row: InodeRow) -> bool:
        """Whether ``row``'s data file changed after its generation was journaled: one stat of the
        local tier.  Exact while the daemon that journaled it lives (the file's size and mtime then,
        ``Mover.close_stamps``: an in-place write a moment after an fsync moves neither the size nor
        the mtime past the record's slack); else by the record's size and time, as recovery does."""
        data_file = self.mover.tier_paths.path(row.data_ino)
        stamped = self.mover.close_stamps.get(row.data_ino)
        if stamped is None or stamped[0] != row.generation:
            return written_after_close(data_file, row)
        try:
            st = os.stat(data_file, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_size, st.st_mtime_ns) != stamped[1]

    async def _superseded(self, ino: int, generation: int) -> bool:
        """A newer close, a writer or an unlink since ``generation`` (the upload's cancel check too)."""
        return await self.mover.db(self.mover.journal.drain.superseded, ino, generation)

    def _journaled_digests(self, row: InodeRow) -> FileDigests | None:
        """The digests journaled at close for this generation, if taken in the drain's chunk size."""
        if row.digest and row.chunk_size == self.mover.options.part_size:
            return FileDigests(row.size, row.chunk_size, row.chunk_digests(), row.digest)
        return None

    async def _changed_under_upload(self, row: InodeRow) -> bool:
        """True if the file was (or may be being) rewritten since ``row`` was closed: superseded, not corrupt.

        A newer close, an unlink or a writer (``writing``) is in the journal; a
        staged file whose size or mtime moved has a writer the journal has not
        seen yet (a handle still open).  Bit rot moves neither; a mismatch that
        keeps coming back without any change is corruption after a few tries.
        """
        if await self._superseded(row.ino, row.generation):
            return True
        try:
            st = os.stat(self.mover.tier_paths.path(row.data_ino))
        except FileNotFoundError:
            return False
        if st.st_size == row.size and st.st_mtime_ns <= row.mtime_ns:
            return False
        seen = self._mismatches.get((row.ino, row.generation), 0) + 1
        self._mismatches[(row.ino, row.generation)] = seen
        if seen > timing.MISMATCH_RETRIES:
            return False
        self.mover.not_before[row.ino] = time.time() + timing.REQUEUE_BACKOFF_S * seen
        return True

    async def _finish(
        self,
        row: InodeRow,
        key: str,
        size: int,
        started: float,
        intent: int,
        taken: FileDigests | None,
        commit: tuple[str, dict[str, Any]] | None,
    ) -> None:
        """Record the upload, with the digests ``taken`` during it and the ``commit`` record a
        marker's upload makes due, in one journal call; the ``intent`` row stays as a delete
        request if the file went away."""
        detail = f"key={key} generation={row.generation} size={size}"
        journal = self.mover.journal

        def record() -> tuple[bool, str | None]:
            if taken is not None:
                journal.drain.record_digests(row.ino, row.generation, taken.digest, taken.chunks, taken.chunk_size)
            if not journal.drain.finish_upload(row.ino, row.generation, key, intent, detail):
                return False, None
            if commit is not None:
                self.mover.groups.journal_commit(commit)
            return True, journal.path_of(row.ino)

        recorded, path = await self.mover.db(record)
        if not recorded:
            log.info("event=upload_superseded ino=%d key=%s generation=%d", row.ino, key, row.generation)
            return
        if commit is not None:
            self.mover.groups.commit_recorded(commit)
        self._mismatches.pop((row.ino, row.generation), None)
        self.mover.groups.retry_now()  # the remote takes requests again: records backing off are due
        if path != key:  # renamed during the upload: move the object
            self.mover.key_moves.want(row.ino)
        latency = time.time() - started
        self.mover.stats.files_drained += 1
        await self.mover.note_durable()
        self.mover.stats.bytes_drained += size
        self.mover.stats.bytes_drained_recent.append((time.time(), size))
        self.mover.stats.drain_latencies.append(latency)
        for listener in self.mover.durable_listeners:
            listener(size, latency)
        self.mover.not_before.pop(row.ino, None)
        stamped = self.mover.close_stamps.pop(row.data_ino, None)  # the FUSE thread may stamp a newer one
        if stamped is not None and stamped[0] != row.generation:
            self.mover.close_stamps.setdefault(row.data_ino, stamped)
        log.info("event=durable key=%s generation=%d bytes=%d seconds=%.3f", key, row.generation, size, latency)

    async def _requeue(self, ino: int, generation: int, exc: BaseException | None) -> None:
        attempts = 0
        if exc is not None:
            self.mover.stats.error(getattr(exc, "kind", "remote"), str(exc))
            attempts = await self.mover.db(self.mover.journal.drain.attempts, ino) + 1
            delay = min(timing.REQUEUE_BACKOFF_MAX_S, timing.REQUEUE_BACKOFF_S * 2 ** (attempts - 1))
            self.mover.not_before[ino] = time.time() + delay
            log.warning("event=drain_retry ino=%d attempts=%d delay=%.1f error=%s", ino, attempts, delay, exc)
        await self.mover.db(self.mover.journal.drain.requeue, ino, generation, str(exc) if exc else None, attempts)

    async def _fail(self, ino: int, generation: int, exc: BaseException) -> None:
        if isinstance(exc, CorruptDataError):
            kind = "corrupt"
        elif isinstance(exc, RemoteError):
            kind = exc.kind
        else:
            kind = "internal"
        message = str(exc) or repr(exc)
        self.mover.stats.error(kind, message)
        self._mismatches.pop((ino, generation), None)
        if await self.mover.db(self.mover.journal.drain.fail, ino, generation, message):
            log.error("event=drain_failed ino=%d generation=%d kind=%s error=%s", ino, generation, kind, message)
        else:
            await self.mover.db(self.mover.journal.drain.requeue, ino, generation, None, 0)

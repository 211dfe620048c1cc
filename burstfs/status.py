"""What a mount's journal says: the status queries behind ``burstfs-admin`` and the control socket.

Pure functions of a :class:`~burstfs.journal.Journal` (and the cache dir's
files), blocking: the daemon runs them in worker threads on a read-only
connection of its own, ``burstfs-admin`` and ``burstfs`` against the journal of
a stopped mount.  One function answers each question (status, which files,
what is left behind, is it durable yet), so the tools never count twice.
"""

from __future__ import annotations

import errno
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FsError
from .journal import (
    ABANDONED_MARKER,
    BROKEN,
    CLOSED_UNDRAINED,
    DONE,
    DRAINING,
    DURABLE,
    EVICTED,
    FAILED,
    FILE_STATES,
    INCOMPLETE,
    MOVING,
    QUEUED,
    ROOT_INO,
    STAGED,
    WRITING,
    FileState,
    InodeRow,
    Journal,
)
from .localtier import LocalTier
from .recovery import incomplete_at_next_start

SCHEMA = 1  # version of the JSON documents (docs/ADMIN.md); bump on incompatible change
WAIT_POLL_S = 0.1  # journal reads are cheap (WAL readers never block the daemon)
HALT_POLL_S = 1.0  # asking the daemon whether the drain is halted costs a socket round trip


def lookup(journal: Journal, rel: str) -> InodeRow | None:
    """The inode at ``rel`` (relative to the file-system root, "" = root), or None."""
    row = journal.inode(ROOT_INO)
    for part in filter(None, rel.split("/")):
        if row is None:
            return None
        row = journal.child(row.ino, os.fsencode(part))
    return row


def files_under(journal: Journal, rel: str) -> list[tuple[str, InodeRow]]:
    """(path, row) of the file at ``rel``, or of every file below the directory ``rel``.

    Raises FsError(ENOENT) when nothing is there, so a typo is an error, not an empty result.
    """
    top = lookup(journal, rel)
    if top is None:
        raise FsError(errno.ENOENT, f"/{rel}: {os.strerror(errno.ENOENT)}")
    if top.kind != "dir":
        return [(rel, top)] if top.kind == "file" else []
    rows = journal.subtree(top.ino)
    by_ino = {row.ino: row for row in rows}
    paths: dict[int, str] = {top.ino: rel}

    def path(row: InodeRow) -> str:
        if row.ino not in paths:
            parent = path(by_ino[row.parent])
            paths[row.ino] = f"{parent}/{os.fsdecode(row.name)}" if parent else os.fsdecode(row.name)
        return paths[row.ino]

    found = [(path(row), row) for row in rows if row.kind == "file"]
    return sorted(found, key=lambda item: item[0])


def files_at(journal: Journal, rels: list[str]) -> list[tuple[str, InodeRow]]:
    """files_under for several paths, each file once."""
    seen: dict[int, tuple[str, InodeRow]] = {}
    for rel in rels:
        for path, row in files_under(journal, rel):
            seen.setdefault(row.ino, (path, row))
    return list(seen.values())


def shown_state(state: FileState, uploads_live: bool) -> FileState:
    """``state`` as an operator should read it: with no process holding the cache, an upload
    journaled as in flight is not (its drain was killed): the file is staged, and drains at
    the next start."""
    return STAGED if state == DRAINING and not uploads_live else state


def file_info(path: str, row: InodeRow, uploads_live: bool = True) -> dict[str, Any]:
    """One file of ``ls`` (docs/ADMIN.md: ls)."""
    return {
        "path": path,
        "ino": row.ino,
        "state": shown_state(row.state, uploads_live),
        "size": row.size,
        "generation": row.generation,
        "durable_generation": row.durable_generation,
        "digest": row.digest,
        "remote_key": row.remote_key,
        "local_bytes": row.local_bytes,
        "mtime": row.mtime_ns / 1e9,
        "error": row.error,
    }


def list_files(journal: Journal, rel: str, uploads_live: bool = True) -> dict[str, Any]:
    """``ls`` of the files under ``rel``; ``uploads_live`` false: no process holds the cache."""
    files = [file_info(path, row, uploads_live) for path, row in files_under(journal, rel)]
    return {"schema": SCHEMA, "files": files}


def _closed_at(journal: Journal, ino: int, fallback: float) -> float:
    # Newest 'closed' event of the file, scanning back from the end of the log: the
    # oldest undrained file is usually recent, so the scan stays short.
    closed = journal.last_closed_at(ino)
    return fallback if closed is None else closed


#: Error kinds that say the remote cannot be reached or is not answering (vs. a refusal
#: or a per-file problem): temporary failures after retries, a failed start-up probe.
UNREACHABLE_KINDS = frozenset({"unavailable", "unreachable"})
#: The error kind of a drain stopped by its own journal (a full or damaged local tier), not the remote.
LOCAL_TIER_KIND = "local_tier"
#: The error kind of a read that failed on a remote object not matching its digests: listed by
#: status, but not a drain in trouble (no outage headline).
CORRUPT_READ_KIND = "corrupt_read"
#: The error kind of a listing or a read that the remote did not serve (unreachable, failing):
#: listed by status (a restore-only node drains nothing, so no outage headline says it).
READ_FAILED_KIND = "read_failed"
#: Kinds of what reads hit, not the drain: they start no outage.
READ_KINDS = frozenset({CORRUPT_READ_KIND, READ_FAILED_KIND})
#: The outage kind of requests still being retried (none has spent its retries yet).
RETRYING_KIND = "retrying"
#: An outage is reported while its latest error is at most this old.
OUTAGE_FRESH_S = 300.0


def short_reason(message: str) -> str:
    """An error message for a headline: URLs cut to their host (no upload ids, no keys), bounded."""
    text = re.sub(r"https?://([^/\s'\"]+)[^\s'\"]*", r"\1", " ".join(message.split()))
    return text if len(text) <= 200 else text[:197] + "..."


def drain_rate(stats: Any, outage: dict[str, Any] | None) -> float:
    """The drain's rate over the last 30 s; 0 during an ``outage`` (:func:`outage_of`): an
    outage stops the drain now, not 30 s later.  Status and the metric say the same."""
    return 0.0 if outage else float(stats.throughput())


def outage_of(stats: Any, now: float | None = None) -> dict[str, Any] | None:
    """The drain's trouble since its last progress: ``{"since", "reason", "kind", "errors",
    "unreachable"}``, or None while files drain (or nothing failed).

    Errors recorded after the newest durable file (or part landed), the latest within
    OUTAGE_FRESH_S, make an outage.  It started at the first failed attempt of the
    retries that led to them (``MoverStats.retrying_since``), else at the first of them
    (``MoverStats.trouble_since``: the deque of recent errors forgets the oldest).
    ``unreachable`` comes from the error's kind, never from its message text.
    """
    now = time.time() if now is None else now
    last_progress = stats.last_progress()
    errors = [(t, k, m) for t, k, m in list(stats.recent_errors) if t > last_progress and k not in READ_KINDS]
    if not errors or now - errors[-1][0] > OUTAGE_FRESH_S:
        return _retrying(stats, last_progress, now)
    _, kind, reason = errors[-1]
    since = getattr(stats, "trouble_since", None)
    if since is None or since <= last_progress or since > errors[0][0]:
        since = errors[0][0]
    retrying_since = getattr(stats, "retrying_since", None)
    if retrying_since is not None and last_progress < retrying_since < since:
        since = retrying_since  # the outage began with the retries that preceded these errors
    return {
        "since": since,
        "reason": short_reason(reason),
        "kind": kind,
        "errors": len(errors),
        "unreachable": kind in UNREACHABLE_KINDS,
    }


def _retrying(stats: Any, last_progress: float, now: float) -> dict[str, Any] | None:
    """Requests being retried with none answered since, and no file durable since they began:
    the outage before any request has spent its retries (``kind`` RETRYING_KIND)."""
    since, last = getattr(stats, "retrying_since", None), getattr(stats, "last_retry", None)
    if since is None or last is None or since <= last_progress or now - last[0] > OUTAGE_FRESH_S:
        return None
    return {
        "since": since,
        "reason": short_reason(last[1]),
        "kind": RETRYING_KIND,
        "errors": stats.retries,
        "unreachable": not last[2],  # no answer, or 5xx (as "unavailable" once retries run out); not a throttle
    }


def _held_bytes(journal: Journal, data_dir: Path) -> int:
    """Bytes the local tier holds for files: each file's journaled local bytes, but no
    more than its data file has allocated (``st_blocks * 512``), so a sparse file
    (an ``incomplete`` one a write failed in, a hole-punched one) counts what it
    takes, not its logical size."""
    total = 0
    for ino, local in journal.local_bytes_by_file():
        try:
            allocated = (
                os.stat(data_dir / f"{int(ino):016x}").st_blocks * 512
            )  # LocalTier.path; no LocalTier: it mkdirs
        except OSError:  # removed meanwhile (evicted, unlinked): holds nothing
            continue
        total += min(int(local), allocated)
    return total


def drain_eta(
    states: Mapping[FileState, Mapping[str, int]], throughput_bps: float | None, landed: int = 0
) -> float | None:
    """Seconds until the queued bytes of ``states`` (a status document's), less the ``landed``
    bytes of uploads under way, are drained at ``throughput_bps``: 0 when nothing is queued,
    None when the rate is unknown or zero."""
    queued = sum(states[s]["bytes"] for s in QUEUED)
    if not queued:
        return 0.0
    return max(queued - landed, 0) / throughput_bps if throughput_bps else None


def journal_status(journal: Journal, cache_dir: Path, uploads_live: bool = True) -> dict[str, Any]:
    """Everything status can tell from the journal and the cache dir alone (no daemon);
    ``uploads_live`` false: no process holds the cache (:func:`shown_state`)."""
    states = {state: {"files": 0, "bytes": 0} for state in FILE_STATES}
    for state, (files, nbytes) in journal.state_counts().items():
        shown = states.setdefault(shown_state(state, uploads_live), {"files": 0, "bytes": 0})
        shown["files"] += files
        shown["bytes"] += nbytes
    local_bytes = _held_bytes(journal, cache_dir / "data")
    oldest = journal.oldest_closed_undrained()
    oldest_closed = _closed_at(journal, *oldest) if oldest else None
    tier = os.statvfs(LocalTier(cache_dir).data_dir) if (cache_dir / "data").is_dir() else None
    return {
        "schema": SCHEMA,
        "live": False,
        "mountpoint": journal.get_meta("mountpoint"),
        "cache_dir": str(cache_dir),
        "remote": journal.get_meta("remote"),
        "pid": None,
        "data_path": None,
        "daemon_written_bytes": None,
        "states": states,
        "undrained": {
            "files": sum(states[s]["files"] for s in CLOSED_UNDRAINED),
            "bytes": sum(states[s]["bytes"] for s in CLOSED_UNDRAINED),
            "oldest_closed_at": oldest_closed,
            "oldest_age_s": None if oldest_closed is None else max(0.0, time.time() - oldest_closed),
        },
        "remote_work": remote_work(journal),
        "drain": {
            "throughput_bps": None,
            "eta_s": drain_eta(states, None),
            "files_drained": None,
            "bytes_drained": None,
            "outage": None,
            "halted": None,
            "mover_crashed": None,
            "errors_by_kind": {},
            "recent_errors": [],
        },
        "local_tier": {
            "path": str(cache_dir / "data"),
            "used_bytes": local_bytes,
            "fs_total_bytes": tier.f_blocks * tier.f_frsize if tier else None,
            "fs_free_bytes": tier.f_bavail * tier.f_frsize if tier else None,
            "limit_bytes": None,
            "mount_total_bytes": None,
            "mount_free_bytes": None,
        },
    }


def remote_work(journal: Journal) -> dict[str, int]:
    """Remote work beyond uploads: durable files whose object still has to follow a rename
    (``moving``), deletes of objects of removed or replaced files (``deletes``), and this
    node's records not out yet (``records``: dones of its rounds, commits of its markers).  A cache
    removed before they are done leaves the remote behind the mount (``unmount --wait`` waits)."""
    from .commitgroups import records_due  # commitgroups reads files through this module

    return {
        "moving": len(journal.keys.relocation_candidates()),
        "deletes": journal.keys.removals_queued(),
        "records": records_due(journal, [""]),
    }


def journal_events(journal: Journal, since: float, rel: str = "", limit: int = 1000) -> dict[str, Any]:
    """Events since ``since`` (epoch seconds), only those of files under ``rel`` when given."""
    wanted = None if not rel else {row.ino for _, row in files_under(journal, rel)}
    events = []
    for when, ino, event, detail in journal.events(since, limit):
        if wanted is not None and ino not in wanted:
            continue
        path = journal.path_of(ino) if ino is not None else None
        events.append({"time": when, "ino": ino, "path": path, "event": event, "detail": detail})
    return {"schema": SCHEMA, "events": events}


#: What a stopped mount leaves behind, by fate: it drains at the next start, it waits for
#: ``burstfs-admin retry``, or it never drains (a file still ``writing`` in the journal of a
#: stopped daemon becomes ``incomplete`` at the next start; the marker of an abandoned
#: checkpoint, counted apart as "abandoned", is failed but never published, even by retry).
LEFT_BEHIND_FATES: dict[str, frozenset[FileState]] = {
    "drains": QUEUED,
    "failed": frozenset({FAILED}),
    "incomplete": frozenset({INCOMPLETE, WRITING}),
}


def left_behind(journal: Journal, tier: LocalTier | None = None) -> dict[str, tuple[int, int]]:
    """(files, bytes) per fate of LEFT_BEHIND_FATES, for the fates that have any.  Given the
    stopped daemon's ``tier``, a file its next start flags ``incomplete`` counts there, with the
    bytes its data file holds (a crash: passthrough writes the journal never saw)."""
    counts = journal.state_counts()
    if tier is not None:
        counts = dict(counts)
        for row, size, _ in incomplete_at_next_start(journal, tier):
            files, nbytes = counts[row.state]
            counts[row.state] = (files - 1, nbytes - row.size)
            files, nbytes = counts.get(INCOMPLETE, (0, 0))
            counts[INCOMPLETE] = (files + 1, nbytes + size)
    abandoned = journal.abandoned_markers()
    if abandoned[0]:
        files, nbytes = counts[FAILED]
        counts = {**counts, FAILED: (files - abandoned[0], nbytes - abandoned[1])}
    left = {"abandoned": abandoned} if abandoned[0] else {}
    for fate, states in LEFT_BEHIND_FATES.items():
        files = sum(counts[s][0] for s in states if s in counts)
        if files:
            left[fate] = (files, sum(counts[s][1] for s in states if s in counts))
    return left


#: Durable files whose object this node uploaded (not REMOTE: another node's, from a listing).
OWN_DONE = frozenset({DURABLE, EVICTED})


def arrived(path: str, row: InodeRow) -> bool:
    """Whether the remote holds ``row``'s data at ``path``: durable, and its object not left at an
    older name by a rename (the mover copies it over; until then a restore of ``path`` finds nothing)."""
    return row.state in DONE and (row.remote_key is None or row.remote_key == path)


def stuck(path: str, row: InodeRow) -> bool:
    """Whether ``row`` will not reach the remote at ``path`` by itself: failed or incomplete, or
    this node's durable file at an older name whose move failed for it alone (``row.error`` says
    why: its object gone from the remote, say; a local copy would have been uploaded again).
    Another node's file known from a listing (REMOTE) is moved by its owner: a move refused here
    is waited out."""
    return row.state in BROKEN or (row.state in OWN_DONE and not arrived(path, row) and bool(row.error))


def stuck_moves(journal: Journal) -> int:
    """This node's durable files whose object could not be moved to their new name for good
    (:func:`stuck`); another node's listed files wait for their owner, and are not counted."""
    return sum(1 for path, row in files_under(journal, "") if row.state in OWN_DONE and stuck(path, row))


def wait_state(path: str, row: InodeRow) -> str:
    """The state a wait reports for a file: its own, or MOVING for one durable at an older name."""
    return MOVING if row.state in DONE and not arrived(path, row) else str(row.state)


@dataclass(frozen=True)
class Durability:
    """Where the files of a wait stand: all of them, those the remote holds at their path, the
    ones that will not drain by themselves, remote deletes still queued under the waited paths,
    why the drain is halted (None: it is not), and this node's records still due there (the
    dones other nodes' markers wait for, the commit records ``latest`` reads)."""

    files: list[tuple[str, InodeRow]]
    done: list[tuple[str, InodeRow]]
    broken: list[tuple[str, InodeRow]]
    halted: str | None = None
    deletes: int = 0
    outage: dict[str, Any] | None = None  # the daemon's (outage_of), when a wait asked it
    records: int = 0
    held: frozenset[int] = frozenset()  # files closed while a copy of their descriptor lives on

    def state_of(self, path: str, row: InodeRow) -> str:
        """``wait_state``, and why a closed file held open elsewhere does not drain yet (a wait
        on it lasts until that process closes it: a forked worker may hold it for good)."""
        state = wait_state(path, row)
        if row.ino in self.held and row.state in QUEUED:
            return f"{state}, still open in another process: drains once every copy is closed"
        return state

    @property
    def pending(self) -> list[tuple[str, InodeRow]]:
        return [(path, row) for path, row in self.files if not arrived(path, row)]

    @property
    def result(self) -> str:
        """durable, failed (a file broken, or the drain halted with work left: waiting longer
        will not help) or waiting."""
        if self.broken:
            return "failed"
        if not self.pending and not self.deletes and not self.records:
            return "durable"
        return "failed" if self.halted else "waiting"


def durability(
    journal: Journal,
    rels: list[str],
    ignore: frozenset[FileState] = frozenset(),
    halted: str | None = None,
    *,
    skip_abandoned: bool = False,
) -> Durability:
    """The files at or under ``rels`` (those in ``ignore`` states left out, and with
    ``skip_abandoned`` the markers of abandoned checkpoints) and how far they are; deletes of
    objects at or under ``rels`` still queued count too (the remote should show what the mount
    does), and so do this node's records due for directories there."""
    from .commitgroups import records_due  # commitgroups reads files through this module

    files = [
        (path, row)
        for path, row in files_at(journal, rels)
        if row.state not in ignore and not (skip_abandoned and row.state == FAILED and row.error == ABANDONED_MARKER)
    ]
    done = [(path, row) for path, row in files if arrived(path, row)]
    return Durability(
        files,
        done,
        [(path, row) for path, row in files if stuck(path, row)],
        halted,
        len(set().union(*(journal.keys.deletes_queued_under(rel) for rel in rels))),
        records=records_due(journal, rels),
        held=frozenset(journal.held_closes()),
    )


def wait_durable(
    journal: Journal,
    rels: list[str],
    *,
    timeout: float | None,
    halted: Callable[[], str | None] | None = None,
    on_poll: Callable[[Durability], None] | None = None,
    ignore: frozenset[FileState] = frozenset(),
    skip_abandoned: bool = False,
) -> Durability:
    """Block until the files at or under ``rels`` are durable, one of them will not drain by
    itself (failed, incomplete), ``halted()`` (asked every HALT_POLL_S: a socket round trip)
    names why the drain is halted, or ``timeout`` passes (``result`` "waiting"); returns the
    last poll, which ``on_poll`` sees too (progress).  The one wait behind
    ``burstfs-admin wait``, ``burstfs unmount --wait`` and ``burstfs.client.wait_durable``.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    halted_reason: str | None = None
    next_halt_check = 0.0
    while True:
        if halted is not None and time.monotonic() >= next_halt_check:
            halted_reason = halted()
            next_halt_check = time.monotonic() + HALT_POLL_S
        state = durability(journal, rels, ignore, halted_reason, skip_abandoned=skip_abandoned)
        if on_poll is not None:
            on_poll(state)
        if state.result != "waiting" or (deadline is not None and time.monotonic() > deadline):
            return state
        time.sleep(WAIT_POLL_S)

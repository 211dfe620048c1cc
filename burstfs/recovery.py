"""Recovery: the in-memory namespace rebuilt from the journal at start.

A clean stop and a crash look the same here: files open for writing are
flagged incomplete (their data file is all there is of them; also one whose
close was journaled while a descriptor of it stayed open), files unlinked
while open are dropped, hard links' extra names are attached to their inodes,
and data files with no row are removed.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import trio

from .journal import (
    DRAINING,
    DURABLE,
    INCOMPLETE,
    META,
    NOT_LOCAL,
    REMOTE,
    ROOT_INO,
    STAGED,
    WRITING,
    InodeRow,
    Journal,
    Op,
    drop_unlinked_ops,
    insert_inode_op,
    recovered_incomplete_ops,
    unlink_name_ops,
)
from .localtier import LocalTier
from .nodes import NAME_MAX, Inode

log = logging.getLogger("burstfs.namespace")

#: Closed, with a local copy that is that close's bytes.
CLOSED_LOCAL = frozenset({STAGED, DRAINING, DURABLE})
#: A data file's mtime may pass its record's time by this much before it counts as written after.
CLOCK_SLACK_S = 1.0
#: The daemon touches this file in the cache dir every ALIVE_PERIOD_S (stamp_alive).
ALIVE_FILE = "alive"
ALIVE_PERIOD_S = 0.5
#: RELEASE follows the last close(2) of an open file within milliseconds: a journaled close
#: not released after this long (while the daemon lived) had a descriptor still open.
RELEASE_GRACE_S = 2.0


def _last_alive(cache_dir: Path) -> float | None:
    try:
        return (cache_dir / ALIVE_FILE).stat().st_mtime
    except FileNotFoundError:
        return None


def _held_open(held: tuple[int, float] | None, row: InodeRow, last_alive: float | None) -> bool:
    """A FLUSH journaled ``row``'s generation and no RELEASE followed while the daemon lived on
    for RELEASE_GRACE_S: a descriptor of the open file stayed open for writing (a forked
    child's exec or a dup closed, the writer went on), so writes may have died in the kernel's
    cache.  Within the grace it was the writer's own close(2), RELEASE still on its way."""
    if held is None or held[0] != row.generation or last_alive is None:  # None: no daemon stamped it
        return False
    return last_alive - held[1] > RELEASE_GRACE_S


async def stamp_alive(cache_dir: Path) -> None:
    """Touch CACHE/alive every ALIVE_PERIOD_S while the daemon runs: after a crash its mtime
    says how long the daemon lived after a journaled close (``_held_open``)."""
    path = cache_dir / ALIVE_FILE
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    while True:
        os.utime(path, follow_symlinks=False)
        await trio.sleep(ALIVE_PERIOD_S)


def _utf8_names(rows: list[InodeRow]) -> list[Op]:
    """Rename (in ``rows``, and ops to journal it) each name that is not UTF-8 to its bytes
    written as ``\\xNN``: a cache from a burstfs that let such names be made (they have no
    object key) otherwise wedged every drain pass, and the name could not be removed."""
    ops: list[Op] = []
    taken: set[tuple[int, bytes]] = {(row.parent, row.name) for row in rows if row.parent}
    for row in rows:
        try:
            row.name.decode("utf-8")
            continue
        except UnicodeDecodeError:
            pass
        base = row.name.decode("utf-8", "backslashreplace").encode()[: NAME_MAX - 8]
        name, n = base, 1
        while (row.parent, name) in taken:
            name, n = base + b"~%d" % n, n + 1
        log.warning("event=name_repaired ino=%d name=%r new_name=%r reason=not_utf8", row.ino, row.name, name)
        taken.add((row.parent, name))
        row.name = name
        ops.append(("UPDATE inodes SET name=? WHERE ino=?", (name, row.ino)))
    return ops


def recover(journal: Journal, tier: LocalTier) -> tuple[dict[int, Inode], int]:
    """Rebuild the namespace from the journal after a clean stop or a crash: the inodes
    by number (names linked), and the highest row number in use."""
    inodes: dict[int, Inode] = {}
    rows = journal.inodes()
    if not rows:
        now = time.time_ns()
        root = InodeRow(
            ino=ROOT_INO,
            parent=ROOT_INO,
            name=b"",
            kind="dir",
            mode=stat.S_IFDIR | 0o755,
            uid=os.getuid(),
            gid=os.getgid(),
            atime_ns=now,
            mtime_ns=now,
            ctime_ns=now,
            state=META,
            updated=time.time(),
        )
        journal.apply([insert_inode_op(root)])
        rows = [root]
    ops: list[Op] = _utf8_names(rows)
    last_row = max(row.ino for row in rows)
    held = journal.held_closes()
    last_alive = _last_alive(tier.cache_dir)
    link_rows = [row for row in rows if row.link_of is not None]
    linked = {row.link_of for row in link_rows if row.parent}
    for row in rows:
        if row.link_of is not None:
            continue
        if row.parent == 0 and row.ino not in linked:  # unlinked while open when the daemon stopped
            ops.extend(drop_unlinked_ops(row.ino))
            continue
        why = _incomplete_reason(row, held, last_alive, tier)
        if why is not None:
            # The data file is all there is of it: show its length, so that the bytes
            # can be inspected and a later extension reads zeros, not stale bytes.
            row.size = tier.data_size(row.ino)
            row.state, row.error = INCOMPLETE, why
            ops.extend(recovered_incomplete_ops(row.ino, row.size, row.error))
            log.warning("event=recover_incomplete ino=%d name=%s reason=%r", row.ino, row.name, why)
        inodes[row.ino] = inode_from_row(row)
    if held:
        ops.append(("DELETE FROM held_closes", ()))
    for ino, name, value in journal.xattrs():
        if ino in inodes:
            inodes[ino].xattrs[name] = value
    for inode in list(inodes.values()):
        if inode.ino == ROOT_INO or inode.parent == 0:  # the latter: only hard links name it
            continue
        parent = inodes.get(inode.parent)
        if parent is None or parent.children is None:  # parent lost: should never happen
            log.error("event=recover_orphan ino=%d parent=%d", inode.ino, inode.parent)
            continue
        parent.children[inode.name] = inode.ino
        if inode.kind == "dir":
            parent.subdirs += 1
    for row in link_rows:
        target, parent = inodes.get(row.link_of or 0), inodes.get(row.parent)
        if target is None or parent is None or parent.children is None:  # should never happen
            log.error("event=recover_orphan_link row=%d ino=%s parent=%d", row.ino, row.link_of, row.parent)
            ops.extend(unlink_name_ops(row.ino, row.name))
            continue
        target.links[row.ino] = (row.parent, row.name)
        parent.children[row.name] = target.ino
    # Data files of no inode, and those of files that are not local: what a fetch cut short by
    # the stop left (or an eviction the stop caught between journal and unlink).  No fetch state
    # trusts those bytes and the tier's count starts without them: kept, they took room for good.
    kept = {ino for ino, inode in inodes.items() if inode.kind != "file" or inode.local}
    for ino in tier.data_inodes() - kept:
        tier.remove(ino)
    if ops:
        journal.apply(ops)
    log.info("event=recovered inodes=%d", len(inodes))
    return inodes, last_row


def _incomplete_reason(
    row: InodeRow, held: dict[int, tuple[int, float]], last_alive: float | None, tier: LocalTier
) -> str | None:
    """Why the stopped daemon's file ``row`` may lack bytes of its last version (it becomes
    ``incomplete`` at the next start), or None."""
    if row.state == WRITING:
        return "open for writing when the daemon stopped"
    if row.kind != "file" or row.state not in CLOSED_LOCAL:
        return None
    if _held_open(held.get(row.ino), row, last_alive):
        return "open for writing when the daemon stopped (a close of one of its descriptors was journaled)"
    if written_after_close(tier.path(row.ino), row):
        return "written after its last close when the daemon stopped"
    return None


def incomplete_at_next_start(journal: Journal, tier: LocalTier) -> list[tuple[InodeRow, int, str]]:
    """The named files of a stopped daemon's cache that its next start flags ``incomplete``
    (as :func:`recover` does), each with the length of its data file (all there is of it: with
    passthrough the journal never saw the bytes written) and why."""
    held = journal.held_closes()
    last_alive = _last_alive(tier.cache_dir)
    found = []
    for row in journal.inodes():
        if row.link_of is None and row.parent != 0 and row.kind == "file":
            why = _incomplete_reason(row, held, last_alive, tier)
            if why is not None:
                found.append((row, tier.data_size(row.ino), why))
    return found


def flag_incomplete(journal: Journal, tier: LocalTier) -> list[tuple[InodeRow, int, str]]:
    """What a start does first to a stopped daemon's cache, for the tools that take over a cache
    without mounting it (``burstfs drain``; ``burstfs unmount`` of a dead mount): a file that may
    lack bytes of its last version (open for writing, or written after its close, when the
    daemon died) becomes ``incomplete``, so that no drain publishes it as a closed version.
    The caller holds the cache lock.  Returns the files it flagged (incomplete_at_next_start)."""
    found = incomplete_at_next_start(journal, tier)
    ops: list[Op] = []
    for row, size, why in found:
        ops.extend(recovered_incomplete_ops(row.ino, size, why))
    if journal.held_closes():
        ops.append(("DELETE FROM held_closes", ()))
    if ops:
        journal.apply(ops)
    return found


def written_after_close(data_file: Path, row: InodeRow) -> bool:
    """The data file of a closed file changed after its last record: a descriptor of it
    stayed open for writing past a close of another one (``cmd > file``, a forked child)
    or past an fsync, and with passthrough the kernel went on writing there without the
    daemon.  Its bytes are no closed version (the journal has another size, or older
    times): drained, they would publish a mix.  Times written before the record are never
    later than it (the kernel's file times are coarse, never ahead of the clock); the slack
    keeps a clock stepped back between a write and its close from flagging a closed file."""
    try:
        st = os.stat(data_file, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return st.st_size != row.size or st.st_mtime > row.updated + CLOCK_SLACK_S


def inode_from_row(row: InodeRow) -> Inode:
    inode = Inode(
        ino=row.ino,
        kind=row.kind,
        mode=row.mode,
        uid=row.uid,
        gid=row.gid,
        parent=row.parent,
        name=row.name,
        size=row.size,
        atime_ns=row.atime_ns,
        mtime_ns=row.mtime_ns,
        ctime_ns=row.ctime_ns,
        target=row.target,
        generation=row.generation,
        local=row.state not in NOT_LOCAL,
        listed=row.state == REMOTE,
        incomplete=(row.error or INCOMPLETE) if row.state == INCOMPLETE else "",
    )
    if row.kind == "dir":
        inode.children = {}
    return inode

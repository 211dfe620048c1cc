"""The records of file and namespace changes, as operations for one transaction.

Pure builders: the front's group committer (and recovery) collects them and
applies them with ``Journal.apply`` in one commit; nothing here touches the
database.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from .rows import INODE_COLUMNS, InodeRow, Op
from .states import DURABLE, INCOMPLETE, META, STAGED, WRITING, state_marks

_INSERT_INODE = (
    f"INSERT OR REPLACE INTO inodes ({', '.join(INODE_COLUMNS)}) VALUES ({', '.join('?' * len(INODE_COLUMNS))})"
)


def insert_inode_op(row: InodeRow) -> Op:
    # Field by field: dataclasses.astuple deep-copies every value (a third of a create's time).
    return (_INSERT_INODE, tuple(getattr(row, name) for name in INODE_COLUMNS))


def update_inode_op(ino: int, **fields: Any) -> Op:
    assignments = ", ".join(f"{name}=?" for name in fields)
    return (f"UPDATE inodes SET {assignments} WHERE ino=?", (*fields.values(), ino))


#: ``listed_version`` of a directory whose entries this cache knows: it made the directory, or
#: merged a listing of it.  After a restart while the remote is down, such a directory answers
#: from its entries, even none (``RemoteListings.unseen``), as it did before the restart.
KNOWN_DIR = "known"


#: ... and whose files a listing dropped, deleted by another node (keep-last-N elsewhere):
#: still empty and missing from the remote, the next listing of its parent drops it too.
EMPTIED_DIR = "emptied"


def known_dir_op(ino: int, *, emptied: bool = False) -> Op:
    return update_inode_op(ino, listed_version=EMPTIED_DIR if emptied else KNOWN_DIR)


# -- records the front's group committer applies (core.py builds none of its own SQL) ----


def event_op(ino: int | None, event: str, detail: str = "") -> Op:
    return ("INSERT INTO events (time, ino, event, detail) VALUES (?, ?, ?, ?)", (time.time(), ino, event, detail))


def update_file_op(ino: int, **fields: Any) -> Op:
    """``update_inode_op`` for the rows of every name of the file (its hard links too):
    what its bytes are (state, generation, digests) is the same under each name."""
    assignments = ", ".join(f"{name}=?" for name in fields)
    return (f"UPDATE inodes SET {assignments} WHERE ino=? OR link_of=?", (*fields.values(), ino, ino))


def mark_writing_op(ino: int) -> Op:
    """The first change after a close (invariant 2): ``writing`` until the next close, under every name."""
    return update_file_op(ino, state=WRITING, updated=time.time())


def close_ops(
    ino: int,
    *,
    generation: int,
    close_seq: int,
    size: int,
    mtime_ns: int,
    ctime_ns: int,
    digest: str | None,
    chunks: Sequence[str] | None,
    chunk_size: int | None,
    incomplete: str | None,
) -> list[Op]:
    """A changed file closed (invariant 1): a new generation, ``staged`` to drain with its
    digests, or ``incomplete`` (with the reason) when it may lack bytes."""
    state = INCOMPLETE if incomplete else STAGED
    return [
        update_file_op(
            ino,
            state=state,
            generation=generation,
            close_seq=close_seq,
            size=size,
            mtime_ns=mtime_ns,
            ctime_ns=ctime_ns,
            digest=digest,
            chunks=json.dumps(list(chunks)) if chunks is not None else None,
            chunk_size=chunk_size,
            error=incomplete,
            attempts=0,
            updated=time.time(),
        ),
        update_inode_op(ino, local_bytes=size),
        event_op(
            ino,
            "closed" if state == STAGED else "incomplete",
            f"generation={generation} size={size} {incomplete or ''}".rstrip(),
        ),
    ]


def unchanged_close_op(ino: int) -> Op:
    """A file opened for writing and closed unchanged: back to the state it had (``durable``
    if the remote holds its generation, else ``staged``)."""
    return (
        "UPDATE inodes SET state=CASE WHEN durable_generation=generation THEN ? ELSE ? END "
        "WHERE (ino=? OR link_of=?) AND state=?",
        (DURABLE, STAGED, ino, ino, WRITING),
    )


def recovered_incomplete_ops(ino: int, size: int, error: str) -> list[Op]:
    """At start-up: a file the stopped daemon had open for writing is ``incomplete``."""
    return [
        update_file_op(ino, state=INCOMPLETE, size=size, error=error, updated=time.time()),
        update_inode_op(ino, local_bytes=size),
        event_op(ino, "incomplete", "open for writing at crash"),
    ]


def held_close_op(ino: int, generation: int) -> Op:
    """A close(2) journaled ``generation`` while the open file may live on (FLUSH comes before
    RELEASE, and a forked child's exec or a dup'd descriptor sends one too), and when."""
    return ("INSERT OR REPLACE INTO held_closes VALUES (?, ?, ?)", (ino, generation, time.time()))


def released_op(ino: int, generation: int | None = None) -> Op:
    """The last writable open of ``ino`` was released (or fsync asked for its bytes); with
    ``generation``, only the closes journaled up to it (a record tried again after a failed
    commit must not take back the hold of a writer that opened the file since)."""
    if generation is None:
        return ("DELETE FROM held_closes WHERE ino=?", (ino,))
    return ("DELETE FROM held_closes WHERE ino=? AND generation<=?", (ino, generation))


#: The delete reason of an unlinked name's object (see unlink_ops).
UNLINK_LISTED = "unlink_listed"
_UNLINK_REASON = f"CASE WHEN generation = 0 THEN '{UNLINK_LISTED}' ELSE 'unlink' END"
#: The delete request of an unlinked name's object: its key, why, and for another node's file
#: the version this node listed (only that version is deleted; see ``ObjectStore.delete``).
_QUEUE_DELETE = (
    "INSERT INTO remote_deletes (key, reason, version) "
    f"SELECT remote_key, {_UNLINK_REASON}, CASE WHEN generation = 0 THEN listed_version END FROM inodes "
)


def unlink_ops(ino: int, name: bytes, ctime_ns: int) -> list[Op]:
    """``ino`` loses its name; its object (if any) is queued for deletion (invariant 6):
    ``unlink`` for an object this node uploaded, ``unlink_listed`` for a file it only listed
    (generation 0: another node's, deleted on purpose, say by keep-last-N on rank 0)."""
    return [
        (_QUEUE_DELETE + "WHERE ino=? AND remote_key IS NOT NULL", (ino,)),
        update_inode_op(ino, parent=0, remote_key=None, ctime_ns=ctime_ns),
        event_op(ino, "unlink", os.fsdecode(name)),
    ]


def unlink_keeping_object_ops(ino: int, name: bytes, ctime_ns: int) -> list[Op]:
    """``ino`` loses its name while a process still reads it and not all of its bytes are on
    the tier: its row keeps its key, which holds the object against a delete, an upload or a
    move to that key, until the copy is whole (``Journal.finish_fetch``) or the row goes
    (``drop_unlinked_ops``), which queue its delete then."""
    return [
        update_inode_op(ino, parent=0, ctime_ns=ctime_ns),
        event_op(ino, "unlink", f"{os.fsdecode(name)} (its object stays while the file is open)"),
    ]


def released_object_ops(ino: int) -> list[Op]:
    """An unlinked inode's kept object (see ``unlink_keeping_object_ops``) is not needed any
    more: its delete is queued and the key let go."""
    return [
        (_QUEUE_DELETE + "WHERE ino=? AND parent=0 AND link_of IS NULL AND remote_key IS NOT NULL", (ino,)),
        ("UPDATE inodes SET remote_key=NULL WHERE ino=? AND parent=0 AND link_of IS NULL", (ino,)),
    ]


def link_ops(row: int, ino: int, parent: int, name: bytes, ctime_ns: int) -> list[Op]:
    """``ino`` gets another name (a hard link): row ``row`` in ``parent``, with no object yet.

    The new name drains the file's current generation to its own key (``staged``),
    unless the file is being written or incomplete: then it waits, like the others.
    """
    marks, states = state_marks({WRITING, INCOMPLETE, META})
    columns = [
        c
        for c in INODE_COLUMNS
        if c
        not in (
            "ino",
            "parent",
            "name",
            "remote_key",
            "durable_generation",
            "attempts",
            "local_bytes",
            "link_of",
            "state",
            "updated",
        )
    ]
    return [
        (
            f"INSERT INTO inodes (ino, parent, name, state, updated, link_of, {', '.join(columns)}) "
            f"SELECT ?, ?, ?, CASE WHEN state IN ({marks}) THEN state ELSE ? END, ?, ino, {', '.join(columns)} "
            "FROM inodes WHERE ino=?",
            (row, parent, name, *states, STAGED, time.time(), ino),
        ),
        update_inode_op(ino, ctime_ns=ctime_ns),
        event_op(row, "link", f"{os.fsdecode(name)} of inode {ino}"),
    ]


def unlink_name_ops(row: int, name: bytes) -> list[Op]:
    """A hard link's name goes: its row goes, its object (if any) is queued for deletion."""
    return [
        (_QUEUE_DELETE + "WHERE ino=? AND remote_key IS NOT NULL", (row,)),
        ("DELETE FROM inodes WHERE ino=? AND link_of IS NOT NULL", (row,)),
        event_op(row, "unlink", os.fsdecode(name)),
    ]


def forget_listed_ops(ino: int, name: bytes, ctime_ns: int) -> list[Op]:
    """A listed file that vanished from the remote: dropped here, nothing deleted there."""
    return [
        update_inode_op(ino, parent=0, remote_key=None, ctime_ns=ctime_ns),
        event_op(ino, "forgotten", os.fsdecode(name)),
    ]


def drop_unlinked_ops(ino: int) -> list[Op]:
    """An unlinked inode nothing references any more: its row and xattrs go (and the object it
    kept while it was open, if any, is queued for deletion)."""
    return [
        *released_object_ops(ino),
        ("DELETE FROM inodes WHERE ino=? AND parent=0", (ino,)),
        ("DELETE FROM xattrs WHERE ino=?", (ino,)),
    ]


def set_xattr_op(ino: int, name: bytes, value: bytes) -> Op:
    return ("INSERT OR REPLACE INTO xattrs VALUES (?, ?, ?)", (ino, name, value))


def remove_xattr_op(ino: int, name: bytes) -> Op:
    return ("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name))


def set_meta_op(key: str, value: str) -> Op:
    return ("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

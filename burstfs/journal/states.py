"""The file states and their named sets: every module asks these, none spells its own."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class FileState(enum.StrEnum):
    """The ``state`` column, in the order a checkpoint file normally walks through the states.

    A ``str`` enum: the stored values stay the plain strings, rows compare equal
    to them, and members go into SQL parameters as they are.
    """

    WRITING = "writing"  # open and changed since its last journaled close
    STAGED = "staged"  # closed and journaled; waiting to drain
    DRAINING = "draining"  # an upload of this generation is in flight
    DURABLE = "durable"  # the remote holds this generation; a local copy exists
    EVICTED = "evicted"  # durable, local copy dropped to make room
    REMOTE = "remote"  # known only from a remote listing (another node wrote it)
    FAILED = "failed"  # the drain hit a permanent error; data stays staged
    INCOMPLETE = "incomplete"  # open for writing when the daemon died, or lost a write: not drained
    META = "meta"  # directories and symlinks: nothing to drain


WRITING = FileState.WRITING
STAGED = FileState.STAGED
DRAINING = FileState.DRAINING
DURABLE = FileState.DURABLE
EVICTED = FileState.EVICTED
REMOTE = FileState.REMOTE
FAILED = FileState.FAILED
INCOMPLETE = FileState.INCOMPLETE
META = FileState.META

#: Every state a file (not a directory or symlink) can be in, in display order.
FILE_STATES: tuple[FileState, ...] = tuple(s for s in FileState if s is not META)
#: The remote holds the file's object: nothing left to wait for (and the object follows a
#: rename: a listed file renamed here moves too, else its key would stay held and block a
#: new file at the old name for good).
DONE = frozenset({DURABLE, EVICTED, REMOTE})
#: Not a stored state: what waits and ``user.burstfs.state`` report for a file in DONE whose
#: object is still at an older name (renamed after its upload; the mover copies it over).
MOVING = "moving"
#: Not (yet) on the remote: holds back a commit marker closed after it, and is what
#: ``burstfs-admin wait`` waits for (an incomplete file never becomes durable on its own).
NOT_YET_DURABLE = frozenset(FILE_STATES) - DONE
#: Will not drain without someone acting (``burstfs-admin retry``, rewriting the file).
BROKEN = frozenset({FAILED, INCOMPLETE})
#: Not yet durable and staying in the cache for a later drain (what unmount reports and
#: ``unmount --wait`` waits for): NOT_YET_DURABLE less ``incomplete``, which never drains.
UNDRAINED = NOT_YET_DURABLE - {INCOMPLETE}
#: Closed and journaled but not yet durable: status's "undrained" (a file being written is not counted).
CLOSED_UNDRAINED = UNDRAINED - {WRITING}
#: Waiting to drain or draining: the drain queue.
QUEUED = frozenset({STAGED, DRAINING})
#: No complete local copy: reads fetch from the remote.
NOT_LOCAL = frozenset({EVICTED, REMOTE})
#: Renamed while in one of these, a file's object is an older version at a name that no
#: longer exists here and nothing will move it (``stale_keys``).
RESTAGED = frozenset({STAGED, INCOMPLETE, FAILED})


def state_marks(states: Iterable[FileState]) -> tuple[str, tuple[FileState, ...]]:
    """``"?, ?, ..."`` and the parameters for ``state IN (...)`` over ``states``."""
    ordered = tuple(sorted(states))
    return ", ".join("?" * len(ordered)), ordered

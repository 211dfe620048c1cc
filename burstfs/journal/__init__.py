"""The journal package: the state machine of every file, in SQLite.

``states`` (FileState and the named sets), ``rows`` (InodeRow), ``schema``
(tables, version check, migrations), ``connection`` (the connection, its lock
and transactions), ``ops`` (the front's records), ``store`` (:class:`Journal`),
``drain`` (``journal.drain``: the drain queue) and ``keys`` (``journal.keys``:
who owns which remote key).  No SQL text lives outside this package.
"""

from .drain import ABANDONED_MARKER, DrainQueue
from .keys import KeyOwnership
from .ops import (
    UNLINK_LISTED,
    close_ops,
    drop_unlinked_ops,
    event_op,
    forget_listed_ops,
    held_close_op,
    insert_inode_op,
    link_ops,
    mark_writing_op,
    recovered_incomplete_ops,
    released_op,
    remove_xattr_op,
    set_meta_op,
    set_xattr_op,
    unchanged_close_op,
    unlink_name_ops,
    unlink_ops,
    update_file_op,
    update_inode_op,
)
from .rows import INODE_COLUMNS, ROOT_INO, InodeRow, Op
from .schema import SCHEMA_VERSION
from .states import (
    BROKEN,
    CLOSED_UNDRAINED,
    DONE,
    DRAINING,
    DURABLE,
    EVICTED,
    FAILED,
    FILE_STATES,
    INCOMPLETE,
    META,
    NOT_LOCAL,
    NOT_YET_DURABLE,
    QUEUED,
    REMOTE,
    STAGED,
    UNDRAINED,
    WRITING,
    FileState,
)
from .store import Journal

__all__ = [
    "ABANDONED_MARKER",
    "BROKEN",
    "CLOSED_UNDRAINED",
    "DONE",
    "DRAINING",
    "DURABLE",
    "EVICTED",
    "FAILED",
    "FILE_STATES",
    "INCOMPLETE",
    "INODE_COLUMNS",
    "META",
    "NOT_LOCAL",
    "NOT_YET_DURABLE",
    "QUEUED",
    "REMOTE",
    "ROOT_INO",
    "SCHEMA_VERSION",
    "STAGED",
    "UNDRAINED",
    "UNLINK_LISTED",
    "WRITING",
    "DrainQueue",
    "FileState",
    "InodeRow",
    "Journal",
    "KeyOwnership",
    "Op",
    "close_ops",
    "drop_unlinked_ops",
    "event_op",
    "forget_listed_ops",
    "held_close_op",
    "insert_inode_op",
    "link_ops",
    "mark_writing_op",
    "recovered_incomplete_ops",
    "released_op",
    "remove_xattr_op",
    "set_meta_op",
    "set_xattr_op",
    "unchanged_close_op",
    "unlink_name_ops",
    "unlink_ops",
    "update_file_op",
    "update_inode_op",
]

"""A row of the ``inodes`` table, built by keyword only, and its decoding from SQLite."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from .states import FileState

ROOT_INO = 1

#: One statement of a transaction: SQL text (built in this package only) and its parameters.
Op = tuple[str, Sequence[Any]]

INODE_COLUMNS = (
    "ino",
    "parent",
    "name",
    "kind",
    "mode",
    "uid",
    "gid",
    "size",
    "atime_ns",
    "mtime_ns",
    "ctime_ns",
    "target",
    "state",
    "generation",
    "close_seq",
    "digest",
    "chunk_size",
    "chunks",
    "remote_key",
    "durable_generation",
    "error",
    "attempts",
    "updated",
    "local_bytes",
    "link_of",
)


@dataclasses.dataclass(kw_only=True)
class InodeRow:
    """One row of the ``inodes`` table, as stored (built by keyword only: 25 fields)."""

    ino: int
    parent: int
    name: bytes
    kind: str
    mode: int
    uid: int
    gid: int
    size: int = 0
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes | None = None
    state: FileState
    generation: int = 0
    close_seq: int = 0
    digest: str | None = None
    chunk_size: int | None = None
    chunks: str | None = None
    remote_key: str | None = None
    durable_generation: int | None = None
    error: str | None = None
    attempts: int = 0
    updated: float = 0.0
    local_bytes: int = 0
    link_of: int | None = None  # an extra name (hard link) of this inode: its data file and attributes

    @property
    def data_ino(self) -> int:
        """The inode whose data file holds this row's bytes (``data/<ino>``)."""
        return self.link_of if self.link_of is not None else self.ino

    def chunk_digests(self) -> tuple[str, ...]:
        return tuple(json.loads(self.chunks)) if self.chunks else ()


def row_from_values(values: Sequence[Any]) -> InodeRow:
    """An :class:`InodeRow` from the values of ``SELECT <INODE_COLUMNS>``."""
    fields = dict(zip(INODE_COLUMNS, values, strict=True))
    fields["state"] = FileState(fields["state"])
    return InodeRow(**fields)


#: The select list that :func:`row_from_values` decodes.
INODE_SELECT = f"SELECT {', '.join(INODE_COLUMNS)} FROM inodes"

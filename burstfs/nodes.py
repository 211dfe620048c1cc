"""The in-memory records the core and its collaborators share: inodes, handles, undo steps.

They live apart from :mod:`burstfs.core` so that the collaborators (remote
listings, capacity, the passthrough data path) can build and read them without
importing the core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from .digests import StreamingDigests

if TYPE_CHECKING:
    from .committer import Batch

NAME_MAX = 255
#: The remote's own directory (manifests, layout) at the root of the prefix: no
#: file, directory or symlink of that name can be made at the root of the mount.
RESERVED_ROOT_NAME = b".burstfs"
#: ``Inode.listed_at`` of a directory whose remote listing was never merged.
NEVER_LISTED = -1e9


@dataclasses.dataclass(slots=True, eq=False)
class DirectIO:
    """The passthrough state of one inode, made at its first direct open."""

    backing_id: int = 0  # passthrough backing file registered with the kernel while opened direct
    handles: int = 0  # open handles whose I/O bypasses the daemon
    writers: int = 0  # ... of which writable
    seen: tuple[int, int] = (0, 0)  # (size, mtime_ns) of the data file when last adopted
    reopened_clean: bool = False  # marked writing by a direct open, and nothing changed since


@dataclasses.dataclass(slots=True, eq=False)
class Inode:
    """In-memory state of one file, directory or symlink."""

    ino: int
    kind: str  # "file" | "dir" | "symlink" | "special" (a FIFO or socket: local only)
    mode: int  # full st_mode, type bits included
    uid: int
    gid: int
    parent: int  # 0 once unlinked
    name: bytes
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    target: bytes | None = None
    children: dict[bytes, int] | None = None
    subdirs: int = 0
    xattrs: dict[bytes, bytes] = dataclasses.field(default_factory=dict)
    generation: int = 0
    dirty: bool = False  # changed since its last journaled close
    new: bool = False  # created here and not yet journaled as closed (its row says writing)
    unjournaled: Batch | None = None  # created, its row deferred to this batch (GroupCommitter.defer)
    local: bool = True  # data complete on the local tier
    lookups: int = 0  # kernel references (lookup/forget)
    handles: int = 0  # open file handles
    writers: int = 0  # of them, open for writing
    last_access: float = 0.0  # monotonic time of the last open/read/write (eviction order)
    listed: bool = False  # known only from a remote listing (state remote)
    listed_at: float = NEVER_LISTED  # directories: monotonic time of the last remote listing merge
    accounted: int = 0  # bytes of this file counted in TierCapacity.local_bytes
    digests: StreamingDigests | None = None  # computed as written; None: the drain hashes the file
    local_prefix: int = 0  # a file being fetched: bytes from its start known to be local
    incomplete: str = ""  # why bytes may be missing (a lost write, a crash); cleared when emptied
    direct: DirectIO | None = None  # passthrough state, from the first direct open on (burstfs/iopath.py)
    marking: trio.Event | None = None  # set while the `writing` record of a first change commits
    pending: int = 0  # namespace changes of this inode in flight (not destroyed meanwhile)
    links: dict[int, tuple[int, bytes]] = dataclasses.field(default_factory=dict)  # hard links: row -> (parent, name)

    @property
    def nlink(self) -> int:
        if self.kind == "dir":
            return 2 + self.subdirs
        return (1 if self.parent else 0) + len(self.links)

    @property
    def as_listed(self) -> bool:
        """A file known from the remote listing (another node's) and unchanged here since, its
        copy fetched or not: never closed changed here (generation 0), not left incomplete, and
        its metadata untouched (a rename, link, chmod, utime or xattr sets ctime).  A rewrite
        or delete of its object by its owner replaces or forgets it here (listings.py)."""
        return (
            self.kind == "file"
            and self.generation == 0
            and not (self.dirty or self.new or self.incomplete)
            and self.ctime_ns == self.mtime_ns
        )

    @property
    def named(self) -> bool:
        """Has a name (its own or a hard link's): not unlinked."""
        return bool(self.parent or self.links)


@dataclasses.dataclass(slots=True, eq=False)
class Handle:
    inode: Inode
    writable: bool
    direct: bool = False  # FUSE passthrough: the kernel does this handle's I/O on the tier itself


class Undo:
    """Steps that restore memory changed ahead of a journal commit, run newest
    first if the commit fails (the committer calls it)."""

    __slots__ = ("_steps",)

    def __init__(self) -> None:
        self._steps: list[Callable[[], None]] = []

    def add(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def __call__(self) -> None:
        for step in reversed(self._steps):
            step()

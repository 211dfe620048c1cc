"""What the FUSE side needs from the drain side: the mover's hooks and remote bytes.

The core, its data path and the remote listings share one :class:`DrainLinks`
record, so wiring the drain side in (the daemon, tests) is one assignment.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Protocol


class ListedFile(NamedTuple):
    """One remote file of a directory listing; ``etag`` tells a rewrite of the same size
    within the same second apart (None where the remote has none: a file remote's mtime does)."""

    name: str
    size: int
    mtime: float
    etag: str | None = None


Listing = tuple[list[ListedFile], list[str]]


class DrainHooks(Protocol):
    """What the core needs from the mover (absent when nothing drains)."""

    def file_closed(self) -> None:
        """A file was journaled as staged: wake the drain."""

    def namespace_changed(self) -> None:
        """A rename or unlink happened: durable objects may need moving or deleting."""

    async def wait_durable(self, ino: int, generation: int) -> None:
        """Return once ``generation`` of ``ino`` is durable; raise if it cannot be."""

    def writing_in(self, ino: int, dir_key: str, name: bytes) -> None:
        """``ino`` (named ``name``) is opened for writing in ``dir_key``: this node takes part
        in the checkpoint there (a cross-node commit round)."""

    def announced_in(self, dir_key: str) -> bool:
        """Whether this node's round in ``dir_key`` was announced on the remote."""

    def hold_drain(self, ino: int, generation: int) -> None:
        """``generation`` of ``ino`` was journaled by a close(2) (FLUSH): other descriptors of
        the open file may still write, so it drains only after :meth:`release_drain`."""

    def release_drain(self, ino: int) -> None:
        """No writable open of ``ino`` is left (RELEASE), or it was fsync'd: a held generation drains."""

    def stamp_close(self, ino: int, generation: int, stamp: tuple[int, int]) -> None:
        """``generation`` of ``ino`` was journaled while the kernel writes its data file directly
        (passthrough): ``stamp`` is that file's (size, mtime_ns) then.  Any later write moves it,
        so the drain can tell the journaled bytes from bytes written since."""

    def commit_markers(self) -> tuple[str, ...]:
        """The mount's commit-marker patterns (``--commit-marker``; ``user.burstfs.markers``)."""

    async def latest_under(self, dir_key: str) -> str:
        """The newest complete checkpoint under ``dir_key`` as a JSON document (``dir`` null:
        none), read from the remote by the daemon (``user.burstfs.latest``); bounded, raises
        FsError when the remote cannot say."""

    async def closed_in(self, ino: int, dir_key: str, name: bytes) -> None:
        """``ino`` was closed in ``dir_key``: it joins this node's round there; return once
        this node's part in the checkpoint is announced, or after a short bound."""

    async def renamed_in(self, files: list[tuple[int, str, bytes]]) -> None:
        """Files ``(ino, dir_key, name)`` were renamed into those directories: each joins this
        node's round there, as a close would; return once announced, or after a short bound."""


class Fetcher(Protocol):
    """What the core needs from the restore path: remote listings and remote bytes."""

    async def ensure_local(self, ino: int, offset: int, size: int) -> int:
        """Make bytes [offset, offset+size) of ``ino`` local; returns the length of the
        gap-free local prefix of the file (its size once it is all local)."""

    async def list_dir(self, dir_key: str) -> Listing:
        """The remote files directly under ``dir_key``, and subdirectory names."""

    async def objects_deleted(self, keys: list[str]) -> set[str]:
        """Of ``keys``, missing from a listing, those deleted with their manifest (by burstfs)."""

    def listing_failed(self, dir_key: str, reason: str) -> None:
        """A listing of ``dir_key`` failed (or got no answer in time): status lists it."""

    def forget(self, ino: int) -> None:
        """The file went away: drop any fetch state."""

    async def let_go(self, ino: int) -> None:
        """Drop any fetch state and return once no fetch can write the file's data again
        (its bytes are about to be replaced in place); waits on no remote."""


@dataclasses.dataclass(slots=True)
class DrainLinks:
    """The drain side as the FUSE side sees it; None: nothing drains, or local only (tests, tools)."""

    drain: DrainHooks | None = None  # wakes the mover
    fetcher: Fetcher | None = None  # remote listings and bytes

    def file_closed(self) -> None:
        if self.drain is not None:
            self.drain.file_closed()

    def namespace_changed(self) -> None:
        if self.drain is not None:
            self.drain.namespace_changed()

    def hold_drain(self, ino: int, generation: int) -> None:
        if self.drain is not None:
            self.drain.hold_drain(ino, generation)

    def release_drain(self, ino: int) -> None:
        if self.drain is not None:
            self.drain.release_drain(ino)

    def stamp_close(self, ino: int, generation: int, stamp: tuple[int, int]) -> None:
        if self.drain is not None:
            self.drain.stamp_close(ino, generation, stamp)

"""The local tier: where file bytes live on the node (tmpfs or NVMe).

Each file's data is one plain file ``CACHE/data/<ino as hex>``, so renames in the
namespace never move data and the mover can read a staged file with ordinary
``pread`` calls.  Open descriptors are shared per inode and reference counted.
Data files are opened with ``O_NOFOLLOW``: a link planted in ``data/`` is never
written through (the cache dir is 0700, so only root could plant one; still).
Large data files go through ``trash/`` on their way out (:mod:`burstfs.reaper`).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("burstfs.tier")

#: Every open of a data file: never through a symlink, never inherited by children.
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


def holds_data(cache_dir: Path) -> bool:
    """Whether ``cache_dir`` has file data on its tier (read-only: a refused mount changes nothing)."""
    try:
        with os.scandir(Path(cache_dir) / "data") as entries:
            return any(True for _ in entries)
    except (FileNotFoundError, NotADirectoryError):
        return False


class LocalTier:
    """Data files of the cache directory, and the descriptors open on them."""

    def __init__(self, cache_dir: Path) -> None:
        self.cache_dir = Path(cache_dir)
        self.data_dir = self.cache_dir / "data"
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if stat.S_IMODE(self.data_dir.stat().st_mode) != 0o700:  # made by an older burstfs, or by hand
            os.chmod(self.data_dir, 0o700)
        self._fds: dict[int, tuple[int, int]] = {}  # ino -> (fd, refcount)
        self.trash_dir = self.cache_dir / "trash"
        self.trash_dir.mkdir(mode=0o700, exist_ok=True)
        self.empty_trash()  # left by a crash

    def path(self, ino: int) -> Path:
        return self.data_dir / f"{ino:016x}"

    def create(self, ino: int) -> None:
        """An empty data file for a new inode (replacing a stale one)."""
        fd = os.open(self.path(ino), _OPEN_FLAGS | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)

    def open_data(self, ino: int, *, create: bool = False) -> int:
        """A new read-write descriptor on the inode's data (the caller closes it)."""
        return os.open(self.path(ino), _OPEN_FLAGS | (os.O_CREAT if create else 0), 0o600)

    def acquire(self, ino: int) -> int:
        """A read-write descriptor on the inode's data, shared by all its handles."""
        fd, refs = self._fds.get(ino, (-1, 0))
        if fd < 0:
            fd = os.open(self.path(ino), _OPEN_FLAGS | os.O_CREAT, 0o600)
        self._fds[ino] = (fd, refs + 1)
        return fd

    def release(self, ino: int) -> None:
        fd, refs = self._fds[ino]
        if refs <= 1:
            del self._fds[ino]
            os.close(fd)
        else:
            self._fds[ino] = (fd, refs - 1)

    def fd(self, ino: int) -> int | None:
        entry = self._fds.get(ino)
        return entry[0] if entry else None

    def truncate(self, ino: int, size: int) -> None:
        fd = self.fd(ino)
        if fd is not None:
            os.ftruncate(fd, size)
        else:
            fd = os.open(self.path(ino), _OPEN_FLAGS)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)

    def remove(self, ino: int) -> None:
        try:
            os.unlink(self.path(ino))
        except FileNotFoundError:
            pass

    def to_trash(self, ino: int) -> Path | None:
        """Move the inode's data file into the trash (its path is free at once); None if it had none."""
        trashed = self.trash_dir / f"{ino:016x}-{os.urandom(4).hex()}"
        try:
            os.rename(self.path(ino), trashed)
        except FileNotFoundError:
            return None
        return trashed

    def empty_trash(self) -> None:
        for entry in os.scandir(self.trash_dir):
            unlink_trashed(Path(entry.path))

    def data_size(self, ino: int) -> int:
        """Length of the inode's data file (0 when it has none)."""
        try:
            return os.stat(self.path(ino), follow_symlinks=False).st_size
        except FileNotFoundError:
            return 0

    def data_inodes(self) -> set[int]:
        """Inode numbers that have a data file (to find orphans after a crash)."""
        found = set()
        for entry in os.scandir(self.data_dir):
            try:
                found.add(int(entry.name, 16))
            except ValueError:
                continue
        return found

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.data_dir)

    def overhead(self) -> int:
        """Bytes the cache dir's own files take beside the data files (the journal and its WAL,
        the journal's reserve, the log): room that no eviction gives to files."""
        total = 0
        with os.scandir(self.cache_dir) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def close_all(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def unlink_trashed(path: Path) -> None:
    """Unlink a data file moved to the trash (blocking: large ones in a worker thread)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # the next start empties the trash
        log.warning("event=trash_unlink_failed path=%s error=%r", path, str(exc))

"""One process at a time owns a cache directory (a mount or a stand-alone drain).

The cache holds every checkpoint byte and the journal of file names, so it is
private: the directory is 0700, owned by the daemon's user, and files in it are
0600 (the daemon and ``burstfs drain`` run with umask 077).
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

from .errors import ConfigError

#: What a cache dir holds at its top level that an older burstfs may have left 0644.
_PRIVATE_FILES = ("journal.db", "journal.db-wal", "journal.db-shm", "burstfs.log", "lock")
#: Everything the daemon and `burstfs drain` create is private to their user.
PRIVATE_UMASK = 0o077
#: Every name burstfs puts at the top of a cache dir (the journal and SQLite's side files, the
#: log, the lock, data/, trash/, headroom's reserve, recovery's ``alive``, the control socket):
#: a directory holding only these is a cache, or what a first start that died part-way left.
CACHE_NAMES = frozenset(
    {
        "journal.db",
        "journal.db-wal",
        "journal.db-shm",
        "journal.db-journal",
        "burstfs.log",
        "lock",
        "data",
        "trash",
        "reserve",
        "reserve.partial",
        "alive",
        "control.sock",
    }
)
#: What a fresh file system's root holds (ext4): a cache dir at the root of a new NVMe.
_FRESH_FS_NAMES = frozenset({"lost+found"})


def secure_cache_dir(cache_dir: Path, *, create: bool = True) -> None:
    """Make ``cache_dir`` private before anything is written in it.

    Creates it 0700 (if ``create``), refuses (ConfigError, :func:`check_cache_dir`)
    one owned by another user (who could read the checkpoints or plant links the
    root daemon would follow) or holding files that are not burstfs's, and
    tightens an existing 0755 directory and the journal/log files an older
    burstfs left 0644.
    """
    cache_dir = Path(cache_dir)
    if create:
        try:
            cache_dir.mkdir(mode=0o700)
        except FileExistsError:  # a directory (fine), a file or a link: checked below
            pass
        except OSError as exc:  # e.g. /proc/x, a read-only file system
            raise ConfigError(f"cannot create cache dir {cache_dir}: {exc.strerror}") from None
    st = check_cache_dir(cache_dir)
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(cache_dir, 0o700)
    for name in _PRIVATE_FILES:
        try:
            fd = os.open(cache_dir / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:  # missing (or a link: never chmod through it)
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode) and stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
                os.fchmod(fd, 0o600)
        finally:
            os.close(fd)


def check_cache_dir(cache_dir: Path) -> os.stat_result:
    """Refuse (ConfigError), changing nothing, an existing ``cache_dir`` that cannot be a cache:
    not a directory, another user's, or one holding files that are not burstfs's.  Returns its
    stat (of the link's target for a link)."""
    try:
        st = os.stat(cache_dir, follow_symlinks=False)
    except FileNotFoundError:
        raise ConfigError(f"cache dir {cache_dir} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        st = _link_target_stat(cache_dir)  # a link to the real cache (the operator's choice): check its target
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"cache dir {cache_dir} is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"cache dir {cache_dir} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
            "use a cache dir of your own"
        )
    _refuse_foreign_files(cache_dir)
    return st


def _refuse_foreign_files(cache_dir: Path) -> None:
    """A directory with files burstfs did not make and no journal is no cache (``--cache /tmp``
    by a typo, a shared scratch dir): made 0700 and filled, it would lock its other users out
    of their files for good.  Empty, ``lost+found`` alone, or burstfs's own names are fine."""
    try:
        with os.scandir(cache_dir) as entries:
            names = sorted(entry.name for entry in entries)
    except OSError as exc:
        raise ConfigError(f"cannot read cache dir {cache_dir}: {exc.strerror}") from None
    if "journal.db" in names:
        return  # an existing cache (what else the operator keeps beside it is theirs)
    foreign = [name for name in names if not _ours(name)]
    if foreign:
        sample = ", ".join(repr(name) for name in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ConfigError(
            f"cache dir {cache_dir} is not empty and is not a burstfs cache dir (no journal.db; not made by "
            f"burstfs: {sample}); use an empty or new directory for --cache"
        )


def _ours(name: str) -> bool:
    """Whether ``name`` at the top of a cache dir is burstfs's own (rotated logs included) or a
    fresh file system's."""
    return name in CACHE_NAMES or name in _FRESH_FS_NAMES or name.startswith("burstfs.log.")


def _link_target_stat(link: Path) -> os.stat_result:
    """The stat of what the cache dir link points to; a dangling link is a ConfigError that
    names its target (typically a local NVMe that is not mounted yet)."""
    try:
        return os.stat(link)
    except FileNotFoundError:
        raise ConfigError(
            f"cannot use cache dir {link}: it is a symbolic link to {os.readlink(link)}, which does not exist "
            "(is its file system mounted?)"
        ) from None
    except OSError as exc:  # a loop of links, a target we may not search
        raise ConfigError(f"cannot use cache dir {link}: {exc.strerror}") from None


class CacheLock:
    """An exclusive ``flock`` on ``CACHE/lock`` holding the owner's PID."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = Path(cache_dir) / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"cache dir {self.path.parent} is in use by another burstfs process (pid {owner})"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:  # a full file system: no lock held
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def owner_pid(self) -> int | None:
        """PID of the process holding the lock, or None when nobody does."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else None
        finally:
            os.close(fd)
        return None

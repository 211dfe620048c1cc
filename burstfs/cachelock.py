"""One process at a time owns a cache directory (a mount or a stand-alone drain)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import ConfigError


class CacheLock:
    """An exclusive ``flock`` on ``CACHE/lock`` holding the owner's PID."""

    def __init__(self, cache_dir: Path) -> None:
        self.path = Path(cache_dir) / "lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"cache dir {self.path.parent} is in use by another burstfs process (pid {owner})"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
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

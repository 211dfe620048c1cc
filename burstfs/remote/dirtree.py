"""The remote directory of a file remote, walked without ever following a symlink.

The directory is shared (other nodes, other users) and the daemon runs as
root, so no path below the root is ever resolved by the kernel through a
symlink: every call walks the key one component at a time with ``openat``
and ``O_NOFOLLOW`` (one ``openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS)`` call
where the kernel has it) and works relative to the directory descriptors it
got.  A symlink anywhere in a key fails that one object with
``RemoteError(kind="refused")``; scans report symlinks as what they are.  The
root itself is the operator's choice and may be reached through links.

Everything here blocks: :class:`~burstfs.remote.file.FileRemote` calls it in
worker threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import platform
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..config import RemoteURL
from ..errors import RemoteError, RemoteNotFound
from .base import INTERNAL_DIR

log = logging.getLogger("burstfs.remote.file")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted at a key must not hang the open.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_MODE = 0o755


class DirTree:
    """Keys as paths under ``url``'s directory: resolved, created, replaced and removed
    relative to directory descriptors, never through a symlink."""

    def __init__(self, url: RemoteURL) -> None:
        self.url = url
        self.root = Path(url.prefix)
        # Set once the root was seen holding INTERNAL_DIR (or made to by ``check``): from then
        # on a root without it is not an empty remote but another directory in its place.
        self.established = False

    def parts(self, key: str) -> list[str]:
        """The components of ``key``; refuses keys that could escape the directory."""
        parts = key.split("/")
        if not key or "\0" in key or any(p in ("", ".", "..") for p in parts):
            raise RemoteError(f"invalid object key {key!r}", kind="bad_key")
        return parts

    def dir_parts(self, dir_key: str) -> list[str]:
        dir_key = dir_key.strip("/")
        return self.parts(dir_key) if dir_key else []

    def refused(self, key: str, where: Sequence[str]) -> RemoteError:
        return RemoteError(
            f"{self.url}: {key}: refusing to follow the symlink {'/'.join(where)!r} in the remote directory",
            kind="refused",
        )

    def open_root(self) -> int:
        """A descriptor on the root, which must exist and, once established, hold INTERNAL_DIR.

        A parallel file system unmounted under a running daemon leaves its mount point: an
        empty directory at the root's path.  Taken for the remote, it would list as empty
        and take this node's uploads onto the local disk as "durable"; every call on it is
        refused instead (a remote-wide error: the drain halts and resumes once it is back).
        """
        try:
            fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            raise RemoteError(f"remote directory {self.root} does not exist", kind="no_directory") from None
        # Read the flag before looking: a look that began before another thread's mkdir of
        # INTERNAL_DIR may miss it while that thread's next call already set the flag.
        was_established = self.established
        if _is_dir(fd, INTERNAL_DIR):
            self.established = True
        elif was_established:
            os.close(fd)
            raise RemoteError(
                f"remote directory {self.root} no longer holds {INTERNAL_DIR}/: another directory is in its "
                "place (a file system unmounted under it?); nothing is written or read there until it is back "
                f"(emptied on purpose? make {self.root}/{INTERNAL_DIR} to drain there again)",
                kind="no_directory",
            )
        return fd

    def open_dir(self, parts: Sequence[str], *, create: bool, key: str) -> int:
        """A descriptor on ``root/parts...``, reached without following any symlink.

        ``create`` makes missing directories (0755).  Raises FileNotFoundError /
        NotADirectoryError for a missing path or a file in the way, and
        ``RemoteError(kind="refused")`` for a symlink.
        """
        root = self.open_root()
        if not parts:
            return root
        if _openat2_usable():
            try:
                fd = _openat2(root, "/".join(parts), _DIR_FLAGS)
            except OSError as exc:
                if exc.errno in (errno.ENOSYS, errno.EPERM, errno.EINVAL):  # seccomp or an old kernel
                    _disable_openat2()
                elif exc.errno == errno.ENOENT and not create:
                    os.close(root)
                    raise
                # Anything else (a link, a file in the way, dirs to make): the walk says exactly what.
            else:
                os.close(root)
                return fd
        return self._walk_dirs(root, parts, create=create, key=key)

    def _walk_dirs(self, fd: int, parts: Sequence[str], *, create: bool, key: str) -> int:
        """Descend from ``fd`` (consumed) one ``openat(O_NOFOLLOW)`` at a time."""
        try:
            for i, name in enumerate(parts):
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    try:
                        os.mkdir(name, _DIR_MODE, dir_fd=fd)
                        created = True
                    except FileExistsError:
                        created = False
                    try:
                        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except OSError as exc:
                        self.check_link(exc, fd, name, key, parts[: i + 1])
                        raise
                    if created:
                        os.fchmod(child, _DIR_MODE)  # regardless of the daemon's umask 077
                except OSError as exc:
                    self.check_link(exc, fd, name, key, parts[: i + 1])
                    raise
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def check_link(self, exc: OSError, dir_fd: int, name: str, key: str, where: Sequence[str]) -> None:
        """Raise ``refused`` if ``exc`` came from a symlink at ``name`` (O_NOFOLLOW gives ELOOP or ENOTDIR)."""
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO) and _is_link(dir_fd, name):
            raise self.refused(key, where) from None

    @contextlib.contextmanager
    def parent(self, parts: Sequence[str], *, create: bool, key: str) -> Iterator[int]:
        fd = self.open_dir(parts[:-1], create=create, key=key)
        try:
            yield fd
        finally:
            os.close(fd)

    def open_object(self, parts: Sequence[str], key: str) -> int:
        """A read-only descriptor on the regular file at ``key``; RemoteNotFound for anything else."""
        with self.parent(parts, create=False, key=key) as parent:
            try:
                fd = os.open(parts[-1], READ_FLAGS, dir_fd=parent)
            except OSError as exc:
                self.check_link(exc, parent, parts[-1], key, parts)
                raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RemoteNotFound(f"{self.url}: {key}: not found (not a regular file)")
        return fd

    def refuse_link_at(self, parent: int, name: str, key: str, parts: Sequence[str]) -> None:
        if _is_link(parent, name):
            raise self.refused(key, parts)

    def _new_temp(self) -> tuple[int, str, int]:
        """(dir fd, name, write fd) of a new 0600 temp file under ``.burstfs/tmp``."""
        tmp_dir = self.open_dir((INTERNAL_DIR, "tmp"), create=True, key=f"{INTERNAL_DIR}/tmp")
        name = uuid.uuid4().hex
        try:
            fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=tmp_dir)
        except BaseException:
            os.close(tmp_dir)
            raise
        return tmp_dir, name, fd

    @contextlib.contextmanager
    def temp(self) -> Iterator[tuple[int, str, int]]:
        """A temp file, removed afterwards unless it was installed."""
        tmp_dir, name, fd = self._new_temp()
        try:
            yield tmp_dir, name, fd
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=tmp_dir)
            os.close(tmp_dir)

    def install(self, src_dir: int, src_name: str, parts: Sequence[str], key: str) -> None:
        """Atomically move a complete, fsynced file to ``key`` and make the rename durable."""
        # A concurrent delete may prune the empty parent between mkdir and rename; retry a little.
        for _ in range(3):
            try:
                parent = self.open_dir(parts[:-1], create=True, key=key)
            except NotADirectoryError:
                raise self.conflict(key) from None
            try:
                self.refuse_link_at(parent, parts[-1], key, parts)
                os.rename(src_name, parts[-1], src_dir_fd=src_dir, dst_dir_fd=parent)
                os.fsync(parent)
                return
            except FileNotFoundError:
                if not _exists(src_dir, src_name):
                    raise
            except (IsADirectoryError, NotADirectoryError):
                raise self.conflict(key) from None
            finally:
                os.close(parent)
        raise RemoteError(f"{self.url}: could not create the parent directory of {key}", kind="io_error")

    def install_new(self, src_dir: int, src_name: str, parts: Sequence[str], key: str) -> bool:
        """Link a complete, fsynced file at ``key`` unless something is there (O_EXCL's link(2) form)."""
        try:
            parent = self.open_dir(parts[:-1], create=True, key=key)
        except NotADirectoryError:
            raise self.conflict(key) from None
        try:
            os.link(src_name, parts[-1], src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
            os.fsync(parent)
        except FileExistsError:
            return False
        finally:
            os.close(parent)
        return True

    def conflict(self, key: str) -> RemoteError:
        return RemoteError(
            f"{self.url}: {key}: a file and a directory cannot share a path on a file remote", kind="key_conflict"
        )

    def scan(self, parts: Sequence[str], key: str) -> list[tuple[str, os.stat_result]]:
        """Names and lstat results in the directory ``parts``; empty if it is missing or not a directory."""
        try:
            fd = self.open_dir(parts, create=False, key=key)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            with os.scandir(fd) as it:
                entries = []
                for entry in it:
                    try:
                        entries.append((entry.name, entry.stat(follow_symlinks=False)))
                    except FileNotFoundError:  # removed meanwhile
                        continue
                return entries
        finally:
            os.close(fd)

    def set_mode(self, parts: Sequence[str], key: str, mode: int) -> None:
        fd = self.open_object(parts, key)
        try:
            os.fchmod(fd, stat.S_IMODE(mode) & 0o666)
        finally:
            os.close(fd)

    def remove(self, parts: Sequence[str], key: str) -> None:
        """Unlink the object at ``key`` (never through a link) and prune the directories it
        leaves empty, as S3 has no empty "directories"; a missing object is no error."""
        # Keep every directory descriptor: the prune below works on them, never on paths.
        fds = [self.open_root()]
        try:
            for i, name in enumerate(parts[:-1]):
                try:
                    fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
                except (FileNotFoundError, NotADirectoryError) as exc:
                    self.check_link(exc, fds[-1], name, key, parts[: i + 1])
                    return
                except OSError as exc:
                    self.check_link(exc, fds[-1], name, key, parts[: i + 1])
                    raise
            self.refuse_link_at(fds[-1], parts[-1], key, parts)
            try:
                os.unlink(parts[-1], dir_fd=fds[-1])
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return
            except PermissionError as exc:  # EISDIR is reported as EPERM by some file systems
                if exc.errno == errno.EPERM and _is_dir(fds[-1], parts[-1]):
                    return
                raise
            # Like S3, a "directory" exists only while it holds objects; INTERNAL_DIR stays (open_root).
            for depth in range(len(parts) - 1, 1 if parts[0] == INTERNAL_DIR else 0, -1):
                try:
                    os.rmdir(parts[depth - 1], dir_fd=fds[depth - 1])
                except OSError:  # not empty, or already gone
                    break
        finally:
            for fd in fds:
                os.close(fd)


def _lstat_mode(dir_fd: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except OSError:
        return None


def _is_link(dir_fd: int, name: str) -> bool:
    mode = _lstat_mode(dir_fd, name)
    return mode is not None and stat.S_ISLNK(mode)


def _is_dir(dir_fd: int, name: str) -> bool:
    mode = _lstat_mode(dir_fd, name)
    return mode is not None and stat.S_ISDIR(mode)


def _exists(dir_fd: int, name: str) -> bool:
    return _lstat_mode(dir_fd, name) is not None


# -- openat2(2): the whole path in one call, where the kernel (5.6+) and seccomp allow it --------

_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine())
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_openat2_state: dict[str, object] = {"usable": _SYS_OPENAT2 is not None, "syscall": None}


def _openat2_usable() -> bool:
    return bool(_openat2_state["usable"])


def _disable_openat2() -> None:
    _openat2_state["usable"] = False
    log.info("event=openat2_unavailable note=walking remote paths with openat(O_NOFOLLOW)")


def _openat2(dir_fd: int, path: str, flags: int) -> int:
    """``openat2(dir_fd, path, flags, RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS)``; OSError on failure."""
    syscall = _openat2_state["syscall"]
    if syscall is None:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
        syscall.restype = ctypes.c_long
        _openat2_state["syscall"] = syscall
    how = _OpenHow(flags, 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    assert _SYS_OPENAT2 is not None  # _openat2_usable() is false without it
    fd = syscall(  # type: ignore[operator]
        ctypes.c_long(_SYS_OPENAT2),
        ctypes.c_int(dir_fd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(fd)

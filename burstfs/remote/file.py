"""A directory (typically on a parallel file system) as a remote.

Objects are plain files at ``DIR/<key>``, so the remote holds exactly the
user's files.  Every write lands in a temp file under ``DIR/.burstfs/`` and is
published with fsync + ``rename``, so readers never see a partial object.
A multipart upload is one file under ``DIR/.burstfs/uploads/<id>`` that parts
are ``pwrite``-ed into at their final offset (no concatenation copy at the
end); a sidecar ``<id>.key`` names its destination so that uploads left by a
crash can be listed and aborted.  All blocking I/O runs in worker threads.

The directory is shared (other nodes, other users) and the daemon runs as
root, so no path below the root is ever resolved by the kernel through a
symlink: every call walks the key one component at a time with ``openat``
and ``O_NOFOLLOW`` (one ``openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS)`` call
where the kernel has it) and works relative to the directory descriptors it
got.  A symlink anywhere in a key fails that one object with
``RemoteError(kind="refused")``; listings skip symlinks.  The root itself is
the operator's choice and may be reached through links.

Modes: objects and temp files are created 0600; when the manifest of an object
is written (it records the file's mode), the object gets that mode & 0o666, so a
0600 checkpoint never shows up world-readable.  Directories are created 0755
(their modes are not recorded anywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import logging
import os
import platform
import stat
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

from ..config import RemoteURL
from ..errors import RemoteError, RemoteNotFound
from ..fileio import copy_fd, pread_full, pwrite_full
from .base import INTERNAL_DIR, ObjectInfo, Remote, UploadedPart

T = TypeVar("T")

log = logging.getLogger("burstfs.remote.file")

#: OSError numbers that a network/parallel file system returns transiently.
_TEMP_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.ECONNRESET})

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted at a key must not hang the open.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_MODE = 0o755
_MANIFEST_PREFIX = f"{INTERNAL_DIR}/manifests/"


class FileRemote(Remote):
    """``file:///DIR``: objects are files under an existing directory."""

    def __init__(self, url: RemoteURL) -> None:
        if url.scheme != "file":
            raise ValueError(f"FileRemote needs a file:// URL, not {url}")
        self.url = url
        self.root = Path(url.prefix)

    # -- path resolution (blocking: called in threads) -------------------------------

    def _parts(self, key: str) -> list[str]:
        """The components of ``key``; refuses keys that could escape the directory."""
        parts = key.split("/")
        if not key or "\0" in key or any(p in ("", ".", "..") for p in parts):
            raise RemoteError(f"invalid object key {key!r}", kind="bad_key")
        return parts

    def _dir_parts(self, dir_key: str) -> list[str]:
        dir_key = dir_key.strip("/")
        return self._parts(dir_key) if dir_key else []

    def _refused(self, key: str, where: Sequence[str]) -> RemoteError:
        return RemoteError(
            f"{self.url}: {key}: refusing to follow the symlink {'/'.join(where)!r} in the remote directory",
            kind="refused",
        )

    def _open_root(self, create: bool) -> int:
        try:
            return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            if create:
                raise RemoteError(f"remote directory {self.root} does not exist", kind="no_directory") from None
            raise

    def _open_dir(self, parts: Sequence[str], *, create: bool, key: str) -> int:
        """A descriptor on ``root/parts...``, reached without following any symlink.

        ``create`` makes missing directories (0755).  Raises FileNotFoundError /
        NotADirectoryError for a missing path or a file in the way, and
        ``RemoteError(kind="refused")`` for a symlink.
        """
        root = self._open_root(create)
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
                        self._check_link(exc, fd, name, key, parts[: i + 1])
                        raise
                    if created:
                        os.fchmod(child, _DIR_MODE)  # regardless of the daemon's umask 077
                except OSError as exc:
                    self._check_link(exc, fd, name, key, parts[: i + 1])
                    raise
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _check_link(self, exc: OSError, dir_fd: int, name: str, key: str, where: Sequence[str]) -> None:
        """Raise ``refused`` if ``exc`` came from a symlink at ``name`` (O_NOFOLLOW gives ELOOP or ENOTDIR)."""
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO) and _is_link(dir_fd, name):
            raise self._refused(key, where) from None

    @contextlib.contextmanager
    def _parent(self, parts: Sequence[str], *, create: bool, key: str) -> Iterator[int]:
        fd = self._open_dir(parts[:-1], create=create, key=key)
        try:
            yield fd
        finally:
            os.close(fd)

    def _open_object(self, parts: Sequence[str], key: str) -> int:
        """A read-only descriptor on the regular file at ``key``; RemoteNotFound for anything else."""
        with self._parent(parts, create=False, key=key) as parent:
            try:
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=parent)
            except OSError as exc:
                self._check_link(exc, parent, parts[-1], key, parts)
                raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RemoteNotFound(f"{self.url}: {key}: not found (not a regular file)")
        return fd

    def _refuse_link_at(self, parent: int, name: str, key: str, parts: Sequence[str]) -> None:
        if _is_link(parent, name):
            raise self._refused(key, parts)

    def _new_temp(self) -> tuple[int, str, int]:
        """(dir fd, name, write fd) of a new 0600 temp file under ``.burstfs/tmp``."""
        tmp_dir = self._open_dir((INTERNAL_DIR, "tmp"), create=True, key=f"{INTERNAL_DIR}/tmp")
        name = uuid.uuid4().hex
        try:
            fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=tmp_dir)
        except BaseException:
            os.close(tmp_dir)
            raise
        return tmp_dir, name, fd

    @contextlib.contextmanager
    def _temp(self) -> Iterator[tuple[int, str, int]]:
        """A temp file, removed afterwards unless it was installed."""
        tmp_dir, name, fd = self._new_temp()
        try:
            yield tmp_dir, name, fd
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=tmp_dir)
            os.close(tmp_dir)

    def _install(self, src_dir: int, src_name: str, parts: Sequence[str], key: str) -> None:
        """Atomically move a complete, fsynced file to ``key`` and make the rename durable."""
        # A concurrent delete may prune the empty parent between mkdir and rename; retry a little.
        for _ in range(3):
            try:
                parent = self._open_dir(parts[:-1], create=True, key=key)
            except NotADirectoryError:
                raise self._conflict(key) from None
            try:
                self._refuse_link_at(parent, parts[-1], key, parts)
                os.rename(src_name, parts[-1], src_dir_fd=src_dir, dst_dir_fd=parent)
                os.fsync(parent)
                return
            except FileNotFoundError:
                if not _exists(src_dir, src_name):
                    raise
            except (IsADirectoryError, NotADirectoryError):
                raise self._conflict(key) from None
            finally:
                os.close(parent)
        raise RemoteError(f"{self.url}: could not create the parent directory of {key}", kind="io_error")

    def _conflict(self, key: str) -> RemoteError:
        return RemoteError(
            f"{self.url}: {key}: a file and a directory cannot share a path on a file remote", kind="key_conflict"
        )

    def _translate(self, exc: OSError, what: str) -> BaseException:
        """Map a permanent OSError to a RemoteError; temporary ones stay raw for retrying()."""
        if exc.errno in _TEMP_ERRNOS:
            return exc
        if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            return RemoteNotFound(f"{self.url}: {what}: not found")
        if exc.errno == errno.ELOOP:
            return RemoteError(f"{self.url}: {what}: refusing to follow a symlink", kind="refused")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return RemoteError(f"{self.url}: {what}: permission denied ({exc.strerror})", kind="access_denied")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return RemoteError(f"{self.url}: {what}: remote file system full ({exc.strerror})", kind="no_space")
        if exc.errno == errno.ENAMETOOLONG:
            return RemoteError(f"{self.url}: {what}: name too long for the remote file system", kind="bad_key")
        return RemoteError(f"{self.url}: {what}: {exc}", kind="io_error")

    async def _run(self, what: str, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn`` in a thread, translating OS errors."""
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise self._translate(exc, what) from exc

    def _scan(self, parts: Sequence[str], key: str) -> list[tuple[str, os.stat_result]]:
        """Names and lstat results in the directory ``parts``; empty if it is missing or not a directory."""
        try:
            fd = self._open_dir(parts, create=False, key=key)
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

    # -- Remote ------------------------------------------------------------------

    async def check(self) -> None:
        def probe() -> None:
            if not self.root.exists():
                raise RemoteError(f"remote directory {self.root} does not exist", kind="no_directory")
            if not self.root.is_dir():
                raise RemoteError(f"remote path {self.root} is not a directory", kind="not_a_directory")
            try:
                with self._temp():
                    pass
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                raise RemoteError(
                    f"remote directory {self.root} is not writable: {exc.strerror}", kind="access_denied"
                ) from exc

        await self._run("check", probe)

    async def put_object(self, key: str, data: bytes) -> None:
        parts = self._parts(key)

        def put() -> None:
            with self._temp() as (tmp_dir, name, fd):
                pwrite_full(fd, data, 0)
                os.fsync(fd)
                self._install(tmp_dir, name, parts, key)
            self._after_put(key, data)

        await self._run(f"put {key}", put)

    async def create_object(self, key: str, data: bytes) -> bool:
        parts = self._parts(key)

        def create() -> bool:
            with self._temp() as (tmp_dir, name, fd):
                pwrite_full(fd, data, 0)
                os.fsync(fd)
                return self._install_new(tmp_dir, name, parts, key)

        return await self._run(f"create {key}", create)

    def _install_new(self, src_dir: int, src_name: str, parts: Sequence[str], key: str) -> bool:
        """Link a complete, fsynced file at ``key`` unless something is there (O_EXCL's link(2) form)."""
        try:
            parent = self._open_dir(parts[:-1], create=True, key=key)
        except NotADirectoryError:
            raise self._conflict(key) from None
        try:
            os.link(src_name, parts[-1], src_dir_fd=src_dir, dst_dir_fd=parent, follow_symlinks=False)
            os.fsync(parent)
        except FileExistsError:
            return False
        finally:
            os.close(parent)
        return True

    def _after_put(self, key: str, data: bytes) -> None:
        """A manifest just written records its object's mode: apply it (the object was made 0600)."""
        if not (key.startswith(_MANIFEST_PREFIX) and key.endswith(".json")):
            return
        target = key[len(_MANIFEST_PREFIX) : -len(".json")]
        try:
            doc = json.loads(data)
            mode = doc["mode"] if isinstance(doc, dict) and doc.get("key") == target else None
        except (ValueError, RecursionError):
            return
        if type(mode) is not int or not 0 <= mode < 1 << 32:
            return
        try:
            self._set_mode(self._parts(target), target, mode)
        except (OSError, RemoteError) as exc:  # the object stays 0600: safe, only less readable
            log.warning("event=remote_mode_failed key=%s mode=%o error=%r", target, stat.S_IMODE(mode), str(exc))

    def _set_mode(self, parts: Sequence[str], key: str, mode: int) -> None:
        fd = self._open_object(parts, key)
        try:
            os.fchmod(fd, stat.S_IMODE(mode) & 0o666)
        finally:
            os.close(fd)

    async def set_mode(self, key: str, mode: int) -> None:
        """Give the object at ``key`` permission bits ``mode & 0o666`` (never through a symlink)."""
        parts = self._parts(key)
        await self._run(f"chmod {key}", self._set_mode, parts, key, mode)

    async def get_object(self, key: str) -> bytes:
        parts = self._parts(key)

        def read() -> bytes:
            fd = self._open_object(parts, key)
            try:
                return pread_full(fd, os.fstat(fd).st_size, 0)
            finally:
                os.close(fd)

        return await self._run(f"get {key}", read)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        parts = self._parts(key)

        def read() -> bytes:
            fd = self._open_object(parts, key)
            try:
                return pread_full(fd, max(0, end - start), start)
            finally:
                os.close(fd)

        return await self._run(f"get {key} bytes {start}-{end}", read)

    async def head(self, key: str) -> ObjectInfo | None:
        parts = self._parts(key)

        def head() -> ObjectInfo | None:
            try:
                with self._parent(parts, create=False, key=key) as parent:
                    st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            return _info(key, st) if stat.S_ISREG(st.st_mode) else None  # a symlink is no object

        return await self._run(f"head {key}", head)

    async def list_dir(self, dir_key: str) -> tuple[list[ObjectInfo], list[str]]:
        parts = self._dir_parts(dir_key)
        key_prefix = "/".join(parts) + "/" if parts else ""

        def scan() -> tuple[list[ObjectInfo], list[str]]:
            files, dirs = [], []
            for name, st in sorted(self._scan(parts, dir_key), key=lambda entry: entry[0]):
                if stat.S_ISDIR(st.st_mode):
                    dirs.append(name)
                elif stat.S_ISREG(st.st_mode):
                    files.append(_info(key_prefix + name, st))
            return files, dirs

        return await self._run(f"list {dir_key or '/'}", scan)

    async def list_all(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        # Walk from the deepest directory the prefix names; the rest is a string match, as on S3.
        async for info in self._walk(prefix.rpartition("/")[0], prefix):
            yield info

    async def _walk(self, dir_key: str, prefix: str, nested: bool = False) -> AsyncIterator[ObjectInfo]:
        try:
            entries = await self._run(f"list {dir_key or '/'}", self._scan, self._dir_parts(dir_key), dir_key)
        except RemoteError as exc:
            if not (nested and exc.kind == "refused"):
                raise
            log.warning("event=list_skipped key=%s error=%r", dir_key, str(exc))  # swapped for a link meanwhile
            return
        # Sorting directories as "name/" makes this depth-first walk yield keys in S3's order.
        entries.sort(key=lambda e: e[0] + "/" if stat.S_ISDIR(e[1].st_mode) else e[0])
        key_prefix = dir_key + "/" if dir_key else ""
        for name, st in entries:
            key = key_prefix + name
            if stat.S_ISDIR(st.st_mode):
                if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                    async for info in self._walk(key, prefix, nested=True):
                        yield info
            elif stat.S_ISREG(st.st_mode) and key.startswith(prefix):
                yield _info(key, st)

    def _uploads(self, create: bool) -> int:
        return self._open_dir((INTERNAL_DIR, "uploads"), create=create, key=f"{INTERNAL_DIR}/uploads")

    async def create_multipart(self, key: str) -> str:
        parts = self._parts(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex

        def create() -> None:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # refuse a link in the way early
                os.close(self._open_dir(parts[:-1], create=False, key=key))
            uploads = self._uploads(create=True)
            try:
                for name, content in ((f"{upload_id}.key", key.encode()), (upload_id, b"")):
                    fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=uploads)
                    try:
                        pwrite_full(fd, content, 0)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            finally:
                os.close(uploads)

        await self._run(f"create upload {key}", create)
        return upload_id

    def _open_upload(self, uploads: int, key: str, upload_id: str) -> int:
        """The temp file of an upload in progress (blocking: called in threads)."""
        _check_upload_id(self.url, upload_id)
        try:
            return os.open(upload_id, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=uploads)
        except (FileNotFoundError, OSError) as exc:
            if isinstance(exc, FileNotFoundError) or exc.errno == errno.ELOOP:
                raise RemoteNotFound(f"{self.url}: no multipart upload {upload_id} for {key}") from None
            raise

    @contextlib.contextmanager
    def _existing_uploads(self, key: str, upload_id: str) -> Iterator[int]:
        try:
            uploads = self._uploads(create=False)
        except (FileNotFoundError, NotADirectoryError):
            raise RemoteNotFound(f"{self.url}: no multipart upload {upload_id} for {key}") from None
        try:
            yield uploads
        finally:
            os.close(uploads)

    async def upload_part(self, key: str, upload_id: str, part_number: int, offset: int, data: bytes) -> UploadedPart:
        _check_upload_id(self.url, upload_id)

        def write() -> None:
            with self._existing_uploads(key, upload_id) as uploads:
                fd = self._open_upload(uploads, key, upload_id)
            try:
                pwrite_full(fd, data, offset)
            finally:
                os.close(fd)

        await self._run(f"upload {key} part {part_number}", write)
        # The etag records where the part went, so completion can check the parts tile the object.
        return UploadedPart(part_number, f"{offset}-{len(data)}")

    async def complete_multipart(self, key: str, upload_id: str, parts: list[UploadedPart]) -> None:
        key_parts = self._parts(key)
        _check_upload_id(self.url, upload_id)
        size = 0
        for part in sorted(parts, key=lambda p: p.part_number):
            offset, length = _part_extent(part)
            if offset != size:
                raise RemoteError(
                    f"{self.url}: upload {upload_id} for {key}: part {part.part_number} starts at {offset}, "
                    f"expected {size} (missing or overlapping part)",
                    kind="invalid_upload",
                )
            size += length

        def complete() -> None:
            with self._existing_uploads(key, upload_id) as uploads:
                fd = self._open_upload(uploads, key, upload_id)
                try:
                    if os.fstat(fd).st_size < size:
                        raise RemoteError(f"{self.url}: upload {upload_id} for {key} is short", kind="invalid_upload")
                    os.ftruncate(fd, size)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self._install(uploads, upload_id, key_parts, key)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{upload_id}.key", dir_fd=uploads)

        await self._run(f"complete upload {key}", complete)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        _check_upload_id(self.url, upload_id)

        def abort() -> None:
            try:
                uploads = self._uploads(create=False)
            except (FileNotFoundError, NotADirectoryError):
                return
            try:
                for name in (upload_id, f"{upload_id}.key"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name, dir_fd=uploads)  # unlink never follows a link
            finally:
                os.close(uploads)

        await self._run(f"abort upload {key}", abort)

    async def list_multipart_uploads(self) -> list[tuple[str, str]]:
        def scan() -> list[tuple[str, str]]:
            uploads = []
            try:
                dir_fd = self._uploads(create=False)
            except (FileNotFoundError, NotADirectoryError):
                return []
            try:
                for name in os.listdir(dir_fd):
                    if not name.endswith(".key"):
                        continue
                    try:
                        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
                    except OSError:  # completed or aborted meanwhile, or not ours to read
                        continue
                    try:
                        key = pread_full(fd, 64 << 10, 0).decode(errors="replace")
                    finally:
                        os.close(fd)
                    uploads.append((key, name.removesuffix(".key")))
            finally:
                os.close(dir_fd)
            return sorted(uploads)

        return await self._run("list uploads", scan)

    async def copy(self, src: str, dst: str) -> None:
        src_parts, dst_parts = self._parts(src), self._parts(dst)

        def copy() -> None:
            try:
                src_fd = self._open_object(src_parts, src)
            except (FileNotFoundError, NotADirectoryError, RemoteNotFound):
                raise RemoteNotFound(f"{self.url}: copy source {src} not found") from None
            try:
                with self._temp() as (tmp_dir, name, fd):
                    copy_fd(src_fd, fd)  # copy_file_range where the kernel can
                    os.fsync(fd)
                    self._install(tmp_dir, name, dst_parts, dst)
            finally:
                os.close(src_fd)

        await self._run(f"copy {src} to {dst}", copy)

    async def delete(self, key: str) -> None:
        parts = self._parts(key)

        def delete() -> None:
            # Keep every directory descriptor: the prune below works on them, never on paths.
            try:
                fds = [self._open_root(create=False)]
            except (FileNotFoundError, NotADirectoryError):
                return
            try:
                for i, name in enumerate(parts[:-1]):
                    try:
                        fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
                    except (FileNotFoundError, NotADirectoryError) as exc:
                        self._check_link(exc, fds[-1], name, key, parts[: i + 1])
                        return
                    except OSError as exc:
                        self._check_link(exc, fds[-1], name, key, parts[: i + 1])
                        raise
                self._refuse_link_at(fds[-1], parts[-1], key, parts)
                try:
                    os.unlink(parts[-1], dir_fd=fds[-1])
                except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                    return
                except PermissionError as exc:  # EISDIR is reported as EPERM by some file systems
                    if exc.errno == errno.EPERM and _is_dir(fds[-1], parts[-1]):
                        return
                    raise
                # Like S3, a "directory" exists only while it holds objects.
                for depth in range(len(parts) - 1, 0, -1):
                    try:
                        os.rmdir(parts[depth - 1], dir_fd=fds[depth - 1])
                    except OSError:  # not empty, or already gone
                        break
            finally:
                for fd in fds:
                    os.close(fd)

        await self._run(f"delete {key}", delete)

    def is_temp_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno in _TEMP_ERRNOS

    async def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""


def _check_upload_id(url: RemoteURL, upload_id: str) -> None:
    if not upload_id or not upload_id.isascii() or not upload_id.isalnum():
        raise RemoteNotFound(f"{url}: no multipart upload {upload_id!r}")


def _part_extent(part: UploadedPart) -> tuple[int, int]:
    """(offset, length) recorded in a part's etag by :meth:`FileRemote.upload_part`."""
    try:
        offset, length = (int(n) for n in part.etag.split("-"))
    except ValueError:
        raise RemoteError(
            f"part {part.part_number}: etag {part.etag!r} is not from this remote", kind="invalid_upload"
        ) from None
    return offset, length


def _info(key: str, st: os.stat_result) -> ObjectInfo:
    return ObjectInfo(key=key, size=st.st_size, etag=None, mtime=st.st_mtime)


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

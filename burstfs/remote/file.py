"""A directory (typically on a parallel file system) as a remote.

Objects are plain files at ``DIR/<key>``, so the remote holds exactly the
user's files.  Every write lands in a temp file under ``DIR/.burstfs/`` and is
published with fsync + ``rename``, so readers never see a partial object.
A multipart upload is one file under ``DIR/.burstfs/uploads/<id>`` that parts
are ``pwrite``-ed into at their final offset (no concatenation copy at the
end); a sidecar ``<id>.key`` names its destination so that uploads left by a
crash can be listed and aborted.  All blocking I/O runs in worker threads.

The directory is shared and the daemon runs as root, so no path below the
root is ever resolved through a symlink (``dirtree.py``): a symlink anywhere
in a key fails that one object with ``RemoteError(kind="refused")``; listings
skip symlinks.

Modes: objects and temp files are created 0600; when the manifest of an object
is written (it records the file's mode), the object gets that mode & 0o666, so a
0600 checkpoint never shows up world-readable.  Directories are created 0755
(their modes are not recorded anywhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import stat
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TypeVar

from ..config import RemoteURL
from ..errors import RemoteError, RemoteNotFound
from ..fileio import copy_fd, pread_full, pwrite_full
from .base import INTERNAL_DIR, LONG_NAMES_DIR, ObjectInfo, Remote, UploadedPart, manifest_key
from .dirtree import NEW_FILE_FLAGS, READ_FLAGS, DirTree

T = TypeVar("T")

log = logging.getLogger("burstfs.remote.file")

#: What check() writes (and removes): a remote that cannot take this much is full.
CHECK_BYTES = 64 * 1024
#: OSError numbers that a network/parallel file system returns transiently.
_TEMP_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.ECONNRESET})

_MANIFEST_PREFIXES = (f"{INTERNAL_DIR}/manifests/", f"{LONG_NAMES_DIR}/")


class FileRemote(Remote):
    """``file:///DIR``: objects are files under an existing directory."""

    def __init__(self, url: RemoteURL) -> None:
        if url.scheme != "file":
            raise ValueError(f"FileRemote needs a file:// URL, not {url}")
        self.url = url
        self.root = Path(url.prefix)
        self.tree = DirTree(url)  # every path below the root, resolved without following symlinks

    # -- errors and threads ------------------------------------------------------------

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

    # -- Remote ------------------------------------------------------------------

    def expect_established(self) -> None:
        self.tree.established = True

    async def check(self) -> None:
        def probe() -> None:
            if not self.root.exists():
                raise RemoteError(f"remote directory {self.root} does not exist", kind="no_directory")
            if not self.root.is_dir():
                raise RemoteError(f"remote path {self.root} is not a directory", kind="not_a_directory")
            try:
                with self.tree.temp() as (_, _, fd):  # makes INTERNAL_DIR in a new remote directory
                    # Bytes, not an empty file: a full file system still makes empty files, and a
                    # drain halted by ENOSPC resumed at every probe, then halted at its next upload.
                    pwrite_full(fd, bytes(CHECK_BYTES), 0)
                    os.fsync(fd)
                self.tree.established = True
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                raise RemoteError(
                    f"remote directory {self.root} is not writable: {exc.strerror}", kind="access_denied"
                ) from exc

        await self._run("check", probe)

    async def put_object(self, key: str, data: bytes) -> None:
        parts = self.tree.parts(key)

        def put() -> None:
            with self.tree.temp() as (tmp_dir, name, fd):
                pwrite_full(fd, data, 0)
                os.fsync(fd)
                self.tree.install(tmp_dir, name, parts, key)
            self._after_put(key, data)

        await self._run(f"put {key}", put)

    async def create_object(self, key: str, data: bytes) -> bool:
        parts = self.tree.parts(key)

        def create() -> bool:
            with self.tree.temp() as (tmp_dir, name, fd):
                pwrite_full(fd, data, 0)
                os.fsync(fd)
                return self.tree.install_new(tmp_dir, name, parts, key)

        return await self._run(f"create {key}", create)

    def _after_put(self, key: str, data: bytes) -> None:
        """A manifest just written records its object's mode: apply it (the object was made 0600)."""
        if not (key.startswith(_MANIFEST_PREFIXES) and key.endswith(".json")):
            return
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return
        target = doc.get("key") if isinstance(doc, dict) else None
        if not isinstance(target, str) or manifest_key(target) != key:  # not the manifest of its object
            return
        mode = doc.get("mode")
        if type(mode) is not int or not 0 <= mode < 1 << 32:
            return
        try:
            self.tree.set_mode(self.tree.parts(target), target, mode)
        except (OSError, RemoteError) as exc:  # the object stays 0600: safe, only less readable
            log.warning("event=remote_mode_failed key=%s mode=%o error=%r", target, stat.S_IMODE(mode), str(exc))

    async def set_mode(self, key: str, mode: int) -> None:
        """Give the object at ``key`` permission bits ``mode & 0o666`` (never through a symlink)."""
        parts = self.tree.parts(key)
        await self._run(f"chmod {key}", self.tree.set_mode, parts, key, mode)

    async def get_object(self, key: str) -> bytes:
        parts = self.tree.parts(key)

        def read() -> bytes:
            fd = self.tree.open_object(parts, key)
            try:
                return pread_full(fd, os.fstat(fd).st_size, 0)
            finally:
                os.close(fd)

        return await self._run(f"get {key}", read)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        parts = self.tree.parts(key)

        def read() -> bytes:
            fd = self.tree.open_object(parts, key)
            try:
                return pread_full(fd, max(0, end - start), start)
            finally:
                os.close(fd)

        return await self._run(f"get {key} bytes {start}-{end}", read)

    async def head(self, key: str) -> ObjectInfo | None:
        parts = self.tree.parts(key)

        def head() -> ObjectInfo | None:
            try:
                with self.tree.parent(parts, create=False, key=key) as parent:
                    st = os.stat(parts[-1], dir_fd=parent, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return None
            return _info(key, st) if stat.S_ISREG(st.st_mode) else None  # a symlink is no object

        return await self._run(f"head {key}", head)

    async def list_dir(self, dir_key: str) -> tuple[list[ObjectInfo], list[str]]:
        parts = self.tree.dir_parts(dir_key)
        key_prefix = "/".join(parts) + "/" if parts else ""

        def scan() -> tuple[list[ObjectInfo], list[str]]:
            files, dirs = [], []
            for name, st in sorted(self.tree.scan(parts, dir_key), key=lambda entry: entry[0]):
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
            entries = await self._run(f"list {dir_key or '/'}", self.tree.scan, self.tree.dir_parts(dir_key), dir_key)
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
        return self.tree.open_dir((INTERNAL_DIR, "uploads"), create=create, key=f"{INTERNAL_DIR}/uploads")

    async def create_multipart(self, key: str) -> str:
        parts = self.tree.parts(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex

        def create() -> None:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # refuse a link in the way early
                os.close(self.tree.open_dir(parts[:-1], create=False, key=key))
            uploads = self._uploads(create=True)
            try:
                for name, content in ((f"{upload_id}.key", key.encode()), (upload_id, b"")):
                    fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=uploads)
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
        key_parts = self.tree.parts(key)
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
                self.tree.install(uploads, upload_id, key_parts, key)
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
                        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
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
        src_parts, dst_parts = self.tree.parts(src), self.tree.parts(dst)

        def copy() -> None:
            try:
                src_fd = self.tree.open_object(src_parts, src)
            except (FileNotFoundError, NotADirectoryError, RemoteNotFound):
                raise RemoteNotFound(f"{self.url}: copy source {src} not found") from None
            try:
                with self.tree.temp() as (tmp_dir, name, fd):
                    copy_fd(src_fd, fd)  # copy_file_range where the kernel can
                    os.fsync(fd)
                    self.tree.install(tmp_dir, name, dst_parts, dst)
            finally:
                os.close(src_fd)

        await self._run(f"copy {src} to {dst}", copy)

    async def delete(self, key: str) -> None:
        parts = self.tree.parts(key)
        await self._run(f"delete {key}", self.tree.remove, parts, key)

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

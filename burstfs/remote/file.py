"""A directory (typically on a parallel file system) as a remote.

Objects are plain files at ``DIR/<key>``, so the remote holds exactly the
user's files.  Every write lands in a temp file under ``DIR/.burstfs/`` and is
published with fsync + ``os.replace``, so readers never see a partial object.
A multipart upload is one file under ``DIR/.burstfs/uploads/<id>`` that parts
are ``pwrite``-ed into at their final offset (no concatenation copy at the
end); a sidecar ``<id>.key`` names its destination so that uploads left by a
crash can be listed and aborted.  All blocking I/O runs in worker threads.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import stat
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

from ..config import RemoteURL
from ..errors import RemoteError, RemoteNotFound
from .base import INTERNAL_DIR, ObjectInfo, Remote, UploadedPart

T = TypeVar("T")

#: OSError numbers that a network/parallel file system returns transiently.
_TEMP_ERRNOS = frozenset({errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ESTALE, errno.ECONNRESET})


class FileRemote(Remote):
    """``file:///DIR``: objects are files under an existing directory."""

    def __init__(self, url: RemoteURL) -> None:
        if url.scheme != "file":
            raise ValueError(f"FileRemote needs a file:// URL, not {url}")
        self.url = url
        self.root = Path(url.prefix)
        self._tmp_dir = self.root / INTERNAL_DIR / "tmp"
        self._uploads_dir = self.root / INTERNAL_DIR / "uploads"

    # -- helpers ---------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """The file for ``key``; refuses keys that could escape the directory."""
        parts = key.split("/")
        if not key or "\0" in key or any(p in ("", ".", "..") for p in parts):
            raise RemoteError(f"invalid object key {key!r}", kind="bad_key")
        return self.root.joinpath(*parts)

    def _dir_path(self, dir_key: str) -> Path:
        dir_key = dir_key.strip("/")
        return self._path(dir_key) if dir_key else self.root

    def _upload_path(self, upload_id: str) -> Path:
        if not upload_id or not upload_id.isalnum():
            raise RemoteNotFound(f"{self.url}: no multipart upload {upload_id!r}")
        return self._uploads_dir / upload_id

    def _ensure_dir(self, path: Path) -> None:
        """Create ``path`` and its parents below the root, never the root itself."""
        if not self.root.is_dir():
            raise RemoteError(f"remote directory {self.root} does not exist", kind="no_directory")
        path.mkdir(parents=True, exist_ok=True)

    def _new_temp(self) -> Path:
        self._ensure_dir(self._tmp_dir)
        return self._tmp_dir / uuid.uuid4().hex

    def _install(self, tmp: Path, dst: Path) -> None:
        """Atomically move a complete, fsynced temp file to ``dst`` and make the rename durable."""
        # A concurrent delete may prune the empty parent between mkdir and rename; retry a little.
        for _ in range(3):
            try:
                os.replace(tmp, dst)
                break
            except FileNotFoundError:
                if not tmp.exists():
                    raise
                try:
                    self._ensure_dir(dst.parent)
                except (FileExistsError, NotADirectoryError):
                    raise self._conflict(dst) from None
            except (IsADirectoryError, NotADirectoryError):
                raise self._conflict(dst) from None
        else:
            raise RemoteError(f"{self.url}: could not create the parent directory of {dst}", kind="io_error")
        _fsync_dir(dst.parent)

    def _conflict(self, dst: Path) -> RemoteError:
        key = dst.relative_to(self.root).as_posix()
        return RemoteError(
            f"{self.url}: {key}: a file and a directory cannot share a path on a file remote", kind="key_conflict"
        )

    def _translate(self, exc: OSError, what: str) -> BaseException:
        """Map a permanent OSError to a RemoteError; temporary ones stay raw for retrying()."""
        if exc.errno in _TEMP_ERRNOS:
            return exc
        if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
            return RemoteNotFound(f"{self.url}: {what}: not found")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return RemoteError(f"{self.url}: {what}: permission denied ({exc.strerror})", kind="access_denied")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return RemoteError(f"{self.url}: {what}: remote file system full ({exc.strerror})", kind="no_space")
        return RemoteError(f"{self.url}: {what}: {exc}", kind="io_error")

    async def _run(self, what: str, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn`` in a thread, translating OS errors."""
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            raise self._translate(exc, what) from exc

    # -- Remote ------------------------------------------------------------------

    async def check(self) -> None:
        def probe() -> None:
            if not self.root.exists():
                raise RemoteError(f"remote directory {self.root} does not exist", kind="no_directory")
            if not self.root.is_dir():
                raise RemoteError(f"remote path {self.root} is not a directory", kind="not_a_directory")
            try:
                tmp = self._new_temp()
                tmp.write_bytes(b"")
                tmp.unlink()
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                raise RemoteError(
                    f"remote directory {self.root} is not writable: {exc.strerror}", kind="access_denied"
                ) from exc

        await self._run("check", probe)

    async def put_object(self, key: str, data: bytes) -> None:
        dst = self._path(key)

        def put() -> None:
            tmp = self._new_temp()
            try:
                _write_file(tmp, data)
                self._install(tmp, dst)
            finally:
                tmp.unlink(missing_ok=True)

        await self._run(f"put {key}", put)

    async def get_object(self, key: str) -> bytes:
        return await self._run(f"get {key}", self._path(key).read_bytes)

    async def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)

        def read() -> bytes:
            fd = os.open(path, os.O_RDONLY)
            try:
                return pread_full(fd, max(0, end - start), start)
            finally:
                os.close(fd)

        return await self._run(f"get {key} bytes {start}-{end}", read)

    async def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)

        def head() -> ObjectInfo | None:
            try:
                st = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                return None
            return _info(key, st) if stat.S_ISREG(st.st_mode) else None

        return await self._run(f"head {key}", head)

    async def list_dir(self, dir_key: str) -> tuple[list[ObjectInfo], list[str]]:
        base = self._dir_path(dir_key)
        key_prefix = dir_key.strip("/") + "/" if dir_key.strip("/") else ""

        def scan() -> tuple[list[ObjectInfo], list[str]]:
            files, dirs = [], []
            for name, st in sorted(_scan(base), key=lambda entry: entry[0]):
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

    async def _walk(self, dir_key: str, prefix: str) -> AsyncIterator[ObjectInfo]:
        entries = await self._run(f"list {dir_key or '/'}", _scan, self._dir_path(dir_key))
        # Sorting directories as "name/" makes this depth-first walk yield keys in S3's order.
        entries.sort(key=lambda e: e[0] + "/" if stat.S_ISDIR(e[1].st_mode) else e[0])
        key_prefix = dir_key + "/" if dir_key else ""
        for name, st in entries:
            key = key_prefix + name
            if stat.S_ISDIR(st.st_mode):
                if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                    async for info in self._walk(key, prefix):
                        yield info
            elif stat.S_ISREG(st.st_mode) and key.startswith(prefix):
                yield _info(key, st)

    async def create_multipart(self, key: str) -> str:
        self._path(key)  # validate now, not at completion
        upload_id = uuid.uuid4().hex

        def create() -> None:
            self._ensure_dir(self._uploads_dir)
            _write_file(self._uploads_dir / f"{upload_id}.key", key.encode())
            _write_file(self._uploads_dir / upload_id, b"")

        await self._run(f"create upload {key}", create)
        return upload_id

    def _open_upload(self, path: Path, key: str, upload_id: str) -> int:
        """The temp file of an upload in progress (blocking: called in threads)."""
        try:
            return os.open(path, os.O_WRONLY)
        except FileNotFoundError:
            raise RemoteNotFound(f"{self.url}: no multipart upload {upload_id} for {key}") from None

    async def upload_part(self, key: str, upload_id: str, part_number: int, offset: int, data: bytes) -> UploadedPart:
        path = self._upload_path(upload_id)

        def write() -> None:
            fd = self._open_upload(path, key, upload_id)
            try:
                _pwrite_full(fd, data, offset)
            finally:
                os.close(fd)

        await self._run(f"upload {key} part {part_number}", write)
        # The etag records where the part went, so completion can check the parts tile the object.
        return UploadedPart(part_number, f"{offset}-{len(data)}")

    async def complete_multipart(self, key: str, upload_id: str, parts: list[UploadedPart]) -> None:
        dst = self._path(key)
        path = self._upload_path(upload_id)
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
            fd = self._open_upload(path, key, upload_id)
            try:
                if os.fstat(fd).st_size < size:
                    raise RemoteError(f"{self.url}: upload {upload_id} for {key} is short", kind="invalid_upload")
                os.ftruncate(fd, size)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._install(path, dst)
            (self._uploads_dir / f"{upload_id}.key").unlink(missing_ok=True)

        await self._run(f"complete upload {key}", complete)

    async def abort_multipart(self, key: str, upload_id: str) -> None:
        path = self._upload_path(upload_id)

        def abort() -> None:
            path.unlink(missing_ok=True)
            (self._uploads_dir / f"{upload_id}.key").unlink(missing_ok=True)

        await self._run(f"abort upload {key}", abort)

    async def list_multipart_uploads(self) -> list[tuple[str, str]]:
        def scan() -> list[tuple[str, str]]:
            uploads = []
            for name, _ in _scan(self._uploads_dir):
                if name.endswith(".key"):
                    try:
                        key = (self._uploads_dir / name).read_text()
                    except FileNotFoundError:  # completed or aborted meanwhile
                        continue
                    uploads.append((key, name.removesuffix(".key")))
            return sorted(uploads)

        return await self._run("list uploads", scan)

    async def copy(self, src: str, dst: str) -> None:
        src_path, dst_path = self._path(src), self._path(dst)

        def copy() -> None:
            tmp = self._new_temp()
            try:
                try:
                    shutil.copyfile(src_path, tmp)  # copy_file_range/sendfile where the kernel can
                except (FileNotFoundError, IsADirectoryError):
                    raise RemoteNotFound(f"{self.url}: copy source {src} not found") from None
                _fsync_file(tmp)
                self._install(tmp, dst_path)
            finally:
                tmp.unlink(missing_ok=True)

        await self._run(f"copy {src} to {dst}", copy)

    async def delete(self, key: str) -> None:
        path = self._path(key)

        def delete() -> None:
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                return
            # Like S3, a "directory" exists only while it holds objects.
            parent = path.parent
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:  # not empty, or already gone
                    break
                parent = parent.parent

        await self._run(f"delete {key}", delete)

    def is_temp_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, OSError) and exc.errno in _TEMP_ERRNOS

    async def close(self) -> None:
        """Nothing to release: every call opens and closes its own files."""


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


def _scan(path: Path) -> list[tuple[str, os.stat_result]]:
    """Names and lstat results in ``path``; empty if it is missing or not a directory."""
    try:
        with os.scandir(path) as it:
            return [(e.name, e.stat(follow_symlinks=False)) for e in it]
    except (FileNotFoundError, NotADirectoryError):
        return []


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_full(fd: int, length: int, offset: int) -> bytes:
    """Read ``length`` bytes at ``offset`` (fewer only at end of file)."""
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def _pwrite_full(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written

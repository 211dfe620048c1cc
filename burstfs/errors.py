"""Error types and the one table that maps them to errno values.

Every failure inside burstfs is one of these (or an ``OSError`` from the local
tier).  The FUSE front calls :func:`to_errno` in exactly one place, so a POSIX
caller always sees a meaningful errno and the mount never dies of an exception.
"""

from __future__ import annotations

import errno
import sqlite3


class BurstfsError(Exception):
    """Base class: something burstfs detected and can explain."""

    errno: int = errno.EIO


class ConfigError(BurstfsError):
    """Bad configuration or command-line input (bad URL, missing mount point...)."""

    errno = errno.EINVAL


class RemoteError(BurstfsError):
    """A permanent failure talking to the remote (missing bucket, access denied...).

    ``kind`` is a short machine-readable word used in status output and metrics.
    """

    def __init__(self, message: str, kind: str = "remote") -> None:
        super().__init__(message)
        self.kind = kind


class RemoteNotFound(RemoteError):
    """The object (or upload) does not exist on the remote."""

    errno = errno.ENOENT

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="not_found")


class CorruptDataError(BurstfsError):
    """Bytes did not match the checksum recorded when they were staged."""

    errno = errno.EIO


class UploadCancelled(BurstfsError):
    """An upload stopped because its caller said so (the file changed or went away).

    Nothing was published and the multipart upload was aborted; not a failure.
    """

    errno = errno.ECANCELED


class NoSpaceError(BurstfsError):
    """The local tier is full of data that is not yet durable."""

    errno = errno.ENOSPC


class FsError(BurstfsError):
    """A POSIX-level refusal raised by the core with an explicit errno."""

    def __init__(self, err: int, message: str = "") -> None:
        super().__init__(message or errno.errorcode.get(err, str(err)))
        self.errno = err


def to_errno(exc: BaseException) -> int:
    """The errno a POSIX caller should see for ``exc`` (EIO when unknown)."""
    if isinstance(exc, BurstfsError):
        return exc.errno
    if isinstance(exc, OSError) and exc.errno:
        return exc.errno
    if isinstance(exc, (TimeoutError,)):
        return errno.ETIMEDOUT
    if isinstance(exc, sqlite3.Error):  # the journal: a full cache file system is ENOSPC
        return errno.ENOSPC if "full" in str(exc) else errno.EIO
    return errno.EIO

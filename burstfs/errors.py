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
    """Bad configuration or command-line input (bad URL, missing mount point...).

    ``option``: the mount option at fault, as its long option is spelled
    (``"full-timeout"``), so a config file's error can name the key and its line.
    """

    errno = errno.EINVAL

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class RemoteError(BurstfsError):
    """A permanent failure talking to the remote (missing bucket, access denied...).

    ``kind`` is a short machine-readable word used in status output and metrics.
    """

    def __init__(self, message: str, kind: str = "remote") -> None:
        super().__init__(message)
        self.kind = kind


#: The RemoteError kind of requests the store kept refusing for their rate (503 SlowDown):
#: temporary like "unavailable", but the remote answers.
THROTTLED = "throttled"
#: The RemoteError kind of an object this node uploaded that is gone from the remote (removed
#: behind burstfs' back): moving it to a new name has nothing to copy, for that file alone.
OBJECT_GONE = "object_gone"
#: RemoteError kinds that belong to one object (its key or its size): that file fails,
#: the drain goes on.  Everything else permanent (no bucket, access denied, full)
#: halts the drain until the remote answers again.
OBJECT_ERROR_KINDS = frozenset(
    {
        "bad_key",
        "key_too_long",
        "key_conflict",
        "refused",
        "invalid_argument",
        "too_large",
        "invalid_upload",
        "checksum",
        OBJECT_GONE,
    }
)
#: OSError numbers (the cause of a file remote's error) that only concern one path.
_OBJECT_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.EINVAL, errno.EISDIR, errno.ENOTDIR, errno.EFBIG})

#: What to do about an error: retry the file later, fail that object, or halt the drain.
RETRY, OBJECT, HALT = "retry", "object", "halt"


def error_scope(exc: BaseException) -> str:
    """Decide, in one place, whether ``exc`` concerns one object or the whole remote.

    RETRY: temporary (unavailable after retries), the upload vanished (aborted
    elsewhere), or a full remote file system (which may still take smaller files, and
    takes this one once room is made): the file is requeued with backoff.  OBJECT: the
    key or the object itself is unacceptable (name too long, invalid argument, a
    file/directory clash): only that file fails.  HALT: the remote as a whole refuses
    (missing bucket, access denied): the drain stops until a probe succeeds.
    """
    if not isinstance(exc, RemoteError):
        return OBJECT
    if exc.kind in ("unavailable", THROTTLED, "not_found", "no_space"):
        return RETRY
    if exc.kind in OBJECT_ERROR_KINDS:
        return OBJECT
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno in _OBJECT_ERRNOS:
        return OBJECT
    return HALT


class RemoteNotFound(RemoteError):
    """The object (or upload) does not exist on the remote."""

    errno = errno.ENOENT

    def __init__(self, message: str) -> None:
        super().__init__(message, kind="not_found")


class CorruptDataError(BurstfsError):
    """Bytes did not match the checksum recorded when they were staged."""

    errno = errno.EIO


class ManifestError(CorruptDataError):
    """A manifest on the remote is unreadable, too large or inconsistent: that file is corrupt."""


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

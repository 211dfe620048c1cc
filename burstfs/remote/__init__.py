"""Where drained files go: the remote interface and its S3 and directory implementations."""

from __future__ import annotations

from ..config import RemoteURL, S3Options
from .base import INTERNAL_DIR, ObjectInfo, Remote, UploadedPart
from .file import FileRemote
from .pool import fail_fast_group, run_workers
from .retry import RetryPolicy, retrying

__all__ = [
    "INTERNAL_DIR",
    "FileRemote",
    "ObjectInfo",
    "Remote",
    "RetryPolicy",
    "UploadedPart",
    "fail_fast_group",
    "open_remote",
    "retrying",
    "run_workers",
]


def open_remote(url: RemoteURL, s3: S3Options | None = None, *, max_connections: int = 64) -> Remote:
    """The remote for ``url``; nothing is contacted until the first call (use ``check()``).

    max_connections: HTTP connections to S3; at least max_files x concurrency of the drain.
    """
    if url.scheme == "s3":
        from .s3 import S3Remote  # aiobotocore is slow to import: only when S3 is used

        return S3Remote(url, s3, max_connections=max_connections)
    if url.scheme == "file":
        return FileRemote(url)
    raise ValueError(f"unsupported remote scheme {url.scheme!r}")

"""Validated configuration values: the remote URL and the mount options.

Everything here is a frozen value object built from user input, so a bad value
fails at start-up with a message that names it, never later inside a request.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import urllib.parse
from pathlib import Path

from .errors import ConfigError

# S3 bucket names: 3-63 chars, lowercase letters, digits, dots and hyphens.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")

DEFAULT_COMMIT_MARKERS = (".metadata", "latest", "*.index.json", "latest_checkpointed_iteration.txt")


@dataclasses.dataclass(frozen=True)
class RemoteURL:
    """Where drained files go.

    scheme: ``"s3"`` or ``"file"``.
    bucket: the S3 bucket (empty for ``file``).
    prefix: key prefix without leading or trailing slash ("" for the bucket root);
        for ``file`` the absolute directory path.
    """

    scheme: str
    bucket: str
    prefix: str

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.prefix}"
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_remote_url(url: str) -> RemoteURL:
    """Parse ``s3://bucket[/prefix]`` or ``file:///abs/dir``; raise ConfigError otherwise."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "s3":
        bucket = parsed.netloc
        if not bucket:
            raise ConfigError(f"remote URL {url!r}: missing bucket name (expected s3://BUCKET/PREFIX)")
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ConfigError(f"remote URL {url!r}: {bucket!r} is not a valid S3 bucket name")
        if parsed.query or parsed.fragment or parsed.params:
            raise ConfigError(f"remote URL {url!r}: query strings and fragments are not allowed")
        prefix = parsed.path.strip("/")
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ConfigError(f"remote URL {url!r}: prefix has empty, '.' or '..' components")
        return RemoteURL("s3", bucket, prefix)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"remote URL {url!r}: file URLs take an absolute path (file:///dir)")
        path = urllib.parse.unquote(parsed.path)
        if not path.startswith("/") or path == "/":
            raise ConfigError(f"remote URL {url!r}: expected file:///ABSOLUTE/DIR")
        return RemoteURL("file", "", str(Path(path)))
    raise ConfigError(
        f"remote URL {url!r}: unsupported scheme {parsed.scheme or '(none)'!r}; "
        "use s3://BUCKET/PREFIX or file:///DIR"
    )


def is_commit_marker(name: str, patterns: tuple[str, ...]) -> bool:
    """True if a file named ``name`` (basename) publishes a checkpoint."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclasses.dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store.  Credentials come from the AWS chain."""

    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = True


@dataclasses.dataclass(frozen=True)
class DrainOptions:
    """How files travel to the remote.

    part_size: multipart part size and checksum chunk size, bytes.
    concurrency: parts in flight per file (and the memory bound: part_size x concurrency).
    max_files: files draining at once.
    compress: ``None`` or ``"lz4"``.
    commit_markers: fnmatch patterns of files that publish a checkpoint.
    delay: seconds a closed file waits before draining (0 = at once).
    """

    part_size: int = 8 * 1024 * 1024
    concurrency: int = 8
    max_files: int = 2
    compress: str | None = None
    commit_markers: tuple[str, ...] = DEFAULT_COMMIT_MARKERS
    delay: float = 0.0

    def __post_init__(self) -> None:
        if self.part_size < 5 * 1024 * 1024 or self.part_size > 5 * 1024**3:
            raise ConfigError("part size must be between 5 MiB and 5 GiB (S3 multipart limits)")
        if self.concurrency < 1 or self.max_files < 1:
            raise ConfigError("concurrency and max-files must be at least 1")
        if self.compress not in (None, "lz4"):
            raise ConfigError(f"unknown compression {self.compress!r}; supported: lz4")


@dataclasses.dataclass(frozen=True)
class MountConfig:
    """Everything ``burstfs mount`` was asked to do, validated.

    fsync_remote: fsync(2) waits until the file is durable on the remote.
    writeback_cache: let the kernel buffer writes (large, batched writes to us).
    passthrough: let the kernel read and write local files on the tier itself (FUSE passthrough).
    cache_size: bytes of the local tier burstfs may use (None: the whole file system).
    min_free: bytes the local tier's file system must keep free.
    evict_policy: lru | fifo | none (which durable files leave the tier first).
    full_timeout: seconds a write waits for the drain on a full tier before ENOSPC.
    list_ttl: seconds a directory's remote listing stays fresh.
    read_ahead: kernel readahead of the mount, bytes.
    nonempty: mount over a mount point that holds files (hidden while mounted).
    remote_wait: seconds a request (lookup miss, opendir) waits for a remote listing.
    """

    mountpoint: Path
    cache_dir: Path
    remote: RemoteURL
    s3: S3Options = S3Options()
    drain: DrainOptions = DrainOptions()
    fsync_remote: bool = False
    allow_other: bool = False
    writeback_cache: bool = True
    passthrough: bool = True
    cache_size: int | None = None
    min_free: int = 0
    evict_policy: str = "lru"
    full_timeout: float = 60.0
    list_ttl: float = 30.0
    read_ahead: int = 1 << 20
    log_level: str = "INFO"
    metrics_addr: str | None = None
    nonempty: bool = False
    remote_wait: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.remote_wait <= 60:
            raise ConfigError(f"--remote-wait must be between 0 and 60 seconds, not {self.remote_wait}")
        if self.full_timeout < 0:
            raise ConfigError(f"--full-timeout must not be negative, not {self.full_timeout}")

"""Validated configuration values: the remote URL and the mount options.

One tree: :class:`MountConfig` holds the mount's own options and its
:class:`S3Options`, :class:`DrainOptions` and :class:`TierOptions`; the core,
the mover and the control server take their part of it.  Everything here is a
frozen value object built from user input (the command line, a config file:
``configfile.py``), so a bad value fails at start-up with a message that names
it, never later inside a request.  A mount journals its config
(:meth:`MountConfig.to_json`), and ``burstfs drain`` and ``burstfs-admin`` read
it back (:func:`config_from_meta`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import ipaddress
import json
import math
import os
import re
import socket
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError

# S3 bucket names: 3-63 chars, lowercase letters, digits, dots and hyphens.
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")

# A node id names this mount's records on the remote: key-safe, no '@' (it separates the round id).
_NODE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# An S3 region is a DNS label (botocore.utils.validate_region_name refuses anything else, and
# only at the first request): 1-63 letters, digits and hyphens, no hyphen first or last, not all digits.
_REGION_RE = re.compile(r"(?![0-9]+$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")

#: Bounds of --read-ahead.  The daemon writes it to the mount's bdi ``read_ahead_kb``, which the
#: kernel keeps in whole pages: less than a page, or a part of one, would be rounded silently.
READ_AHEAD_UNIT = 4 << 10
#: Readahead holds that much page cache per file being read; far more no longer fits the kernel's
#: counters (a file's window is 32 bits of pages) or is refused by it, which the daemon only logs.
READ_AHEAD_MAX = 1 << 30

DEFAULT_COMMIT_MARKERS = (".metadata", "latest", "*.index.json", "latest_checkpointed_iteration.txt")

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'8M', '512MiB', '20G' -> bytes."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS and not value[-1:].isdigit() else ""
    number = value[: len(value) - len(unit)]
    try:
        return int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ConfigError(f"not a size: {text!r} (examples: 8M, 512MiB, 20G)") from None


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
    """Parse ``s3://bucket[/prefix]`` or ``file:///abs/dir``; raise ConfigError otherwise.

    A prefix inside burstfs' own bookkeeping (a ``.burstfs`` component) is refused: a mount
    there would list and rewrite the manifests and records of the mount on the prefix above.
    """
    if any(ord(char) < 32 or ord(char) == 127 for char in url):  # urlparse drops tabs and newlines
        raise ConfigError(f"remote URL {url!r}: control characters (tab, newline) are not allowed")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "s3":
        bucket = parsed.netloc
        if not bucket:
            raise ConfigError(f"remote URL {url!r}: missing bucket name (expected s3://BUCKET/PREFIX)")
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ConfigError(f"remote URL {url!r}: {bucket!r} is not a valid S3 bucket name")
        if parsed.query or parsed.fragment or parsed.params:
            raise ConfigError(f"remote URL {url!r}: query strings and fragments are not allowed")
        prefix = parsed.path.removeprefix("/").rstrip("/")  # s3://B//x: an empty component, not "x"
        if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
            raise ConfigError(f"remote URL {url!r}: prefix has empty, '.' or '..' components")
        _check_not_internal(url, prefix.split("/"))
        return RemoteURL("s3", bucket, prefix)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"remote URL {url!r}: file URLs take an absolute path (file:///dir)")
        path = urllib.parse.unquote(parsed.path)
        if not path.startswith("/") or path == "/":
            raise ConfigError(f"remote URL {url!r}: expected file:///ABSOLUTE/DIR")
        _check_not_internal(url, Path(path).parts)
        return RemoteURL("file", "", str(Path(path)))
    raise ConfigError(
        f"remote URL {url!r}: unsupported scheme {parsed.scheme or '(none)'!r}; use s3://BUCKET/PREFIX or file:///DIR"
    )


def _check_not_internal(url: str, parts: Sequence[str]) -> None:
    """ConfigError if a component of the remote's path is burstfs' bookkeeping directory."""
    from .remote.base import INTERNAL_DIR  # not at the top: the remote package imports this module

    if INTERNAL_DIR in parts:
        raise ConfigError(
            f"remote URL {url!r}: {INTERNAL_DIR!r} is where burstfs keeps the bookkeeping of the prefix above it "
            f"(manifests, checkpoint records); a mount there would rewrite another mount's; use a prefix "
            f"without a {INTERNAL_DIR!r} component",
            "remote",
        )


def check_node_id(node_id: str) -> str:
    """``node_id`` if it is safe in a remote key (letters, digits, ``.``, ``_``, ``-``; at most 63).

    Anything else raises ConfigError: the empty string too (the mount's default, the host
    name, is asked for by leaving --node-id out).
    """
    if not node_id:
        raise ConfigError(
            "--node-id is empty: give 1-63 letters, digits, '.', '_' or '-', or leave it out for the host name",
            "node-id",
        )
    if not _NODE_ID_RE.fullmatch(node_id):
        raise ConfigError(
            f"node id {node_id!r}: use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit",
            "node-id",
        )
    return node_id


def check_region(region: str) -> str:
    """``region`` if it can name an S3 region (what botocore accepts); ConfigError otherwise."""
    if not _REGION_RE.fullmatch(region):
        raise ConfigError(
            f"--region {region!r}: not a region name; use 1-63 letters, digits and '-' (e.g. us-east-1)", "region"
        )
    return region


def check_read_ahead(nbytes: int) -> int:
    """``nbytes`` if it is a --read-ahead the kernel takes as it is; ConfigError otherwise."""
    if not READ_AHEAD_UNIT <= nbytes <= READ_AHEAD_MAX or nbytes % READ_AHEAD_UNIT:
        raise ConfigError(
            f"--read-ahead must be a multiple of 4K (the kernel counts it in pages) from 4K to 1G, not {nbytes} bytes",
            "read-ahead",
        )
    return nbytes


def check_seconds(value: float, option: str, maximum: float | None = None) -> float:
    """``value`` if it is a finite number of seconds from 0 to ``maximum``; ConfigError naming
    ``--option`` otherwise.  The one check of every duration option: a NaN compares false
    with everything, so it would pass a plain range check and then never expire."""
    if not math.isfinite(value) or value < 0 or (maximum is not None and value > maximum):
        limit = f"from 0 to {maximum:g}" if maximum is not None else "that is finite and at least 0"
        raise ConfigError(f"--{option} must be a number of seconds {limit}, not {value}", option)
    return value


def redact_url(url: str) -> str:
    """``url`` fit to print: its password, if any, is replaced by ***.  The user part runs to
    the last ``@``, not to the first ``/``, ``?`` or ``#`` as a URL parser takes it: a password
    holding one of those made the rest of it the URL's path, printed in clear."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, host = rest.rpartition("@")
    user, colon, _ = userinfo.partition(":")
    if not (sep and at and colon):
        return url
    return f"{scheme}://{user}:***@{host}"


def check_endpoint_url(url: str, source: str = "--endpoint-url") -> str:
    """``url`` if it is an http(s) URL with a host (and a valid port); ConfigError otherwise.

    botocore only fails at the first request, with a traceback that names neither
    the option nor ``source`` (where the value came from).
    """
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    key = "endpoint-url" if source == "--endpoint-url" else None
    extra = parts.path not in ("", "/") or parts.query or parts.fragment  # the bucket would be taken from it
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok or extra:
        raise ConfigError(
            f"{source} {redact_url(url)!r}: not an S3 endpoint; expected http://HOST[:PORT] or https://HOST[:PORT] "
            "(e.g. http://127.0.0.1:9000)",
            key,
        )
    if parts.username is not None or parts.password is not None:
        # botocore signs every request itself and refuses an URL that carries credentials.
        raise ConfigError(
            f"{source} {redact_url(url)!r}: credentials in the URL are not used for S3; give them as "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile or an instance role instead",
            key,
        )
    return url


def parse_metrics_addr(text: str) -> tuple[str, int]:
    """'127.0.0.1:9100' or '[::1]:9100' -> (host, port); ConfigError naming what is wrong otherwise."""
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    usage = f"--metrics-addr {text!r}: expected HOST:PORT, e.g. 127.0.0.1:9100"
    if not sep:
        raise ConfigError(f"{usage} (the port is missing)", "metrics-addr")
    if not host:
        raise ConfigError(f"{usage} (a host is required)", "metrics-addr")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{usage}; the port must be a number from 1 to 65535", "metrics-addr")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"{usage}; {host!r} is not an IP address", "metrics-addr") from None
    return host, int(port)


def default_node_id() -> str:
    """The host name (its first label), made key-safe: the node id when --node-id is not given."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname().split(".")[0]).lstrip("._-")[:63]
    return name or "node"


def is_commit_marker(name: str, patterns: tuple[str, ...]) -> bool:
    """True if a file named ``name`` (basename) publishes a checkpoint."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


@dataclasses.dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store.  Credentials come from the AWS chain."""

    endpoint_url: str | None = None
    region: str | None = None
    path_style: bool = True

    def __post_init__(self) -> None:
        if self.endpoint_url is not None:
            check_endpoint_url(self.endpoint_url)
        if self.region is not None:
            check_region(self.region)

    def endpoint(self) -> str | None:
        """The endpoint to use: ``endpoint_url``, else the one botocore takes from the environment
        or the AWS config file (:func:`configured_endpoint`; checked, and said to come from there),
        else None (AWS).  Read when a client is made, never journaled; the client is given it, so
        that :meth:`store` is where its requests go."""
        if self.endpoint_url:
            return self.endpoint_url
        configured = configured_endpoint()
        return None if configured is None else check_endpoint_url(*configured)

    def store(self) -> str:
        """Which store :meth:`endpoint` reaches, as a cache dir records it (:func:`endpoint_store`)."""
        return endpoint_store(self.endpoint())


def endpoint_store(url: str | None) -> str:
    """The store an endpoint ``url`` reaches: ``scheme://host:port`` (``aws`` for None, AWS's own).
    The bucket and prefix alone do not say it: the same names on another store hold none of a
    cache's objects or checkpoint rounds."""
    if url is None:
        return "aws"
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.scheme}://{(parts.hostname or '').lower()}:{port}"


def configured_endpoint() -> tuple[str, str] | None:
    """The endpoint botocore gives an S3 client made without one, and where it is set; None for
    AWS's own.  botocore's own lookup, so that none of its sources goes unseen by the store check:
    $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, then the profile's ``services`` section and its
    ``endpoint_url`` in the AWS config file, all ignored under ``ignore_configured_endpoint_urls``
    ($AWS_IGNORE_CONFIGURED_ENDPOINT_URLS).  Reads only the environment and the config file."""
    import botocore.exceptions
    import botocore.session
    from botocore.configprovider import ConfiguredEndpointProvider

    session = botocore.session.Session()
    try:
        if session.get_config_variable("ignore_configured_endpoint_urls"):
            return None
        url = ConfiguredEndpointProvider(session.full_config, session.get_scoped_config(), "s3").provide()
    except botocore.exceptions.BotoCoreError as exc:  # no such profile, a malformed config file
        raise ConfigError(f"AWS configuration: {exc}") from None
    if not url:
        return None
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):  # botocore's order: the first set one won
        if os.environ.get(name) == url:
            return url, name
    where = session.get_config_variable("config_file")
    return url, f"endpoint_url of AWS profile {session.profile or 'default'} in {where}"


#: The most parts per file (--concurrency) and files (--max-files) a drain keeps in flight:
#: each part is held in memory (64 x 64 x 8 MiB is already 32 GiB).
MAX_IN_FLIGHT = 64


@dataclasses.dataclass(frozen=True)
class DrainOptions:
    """How files travel to the remote.

    part_size: multipart part size and checksum chunk size, bytes.
    concurrency: parts in flight per file (and its memory bound: part_size x concurrency,
        see Mover.drain_memory for the drain's).
    max_files: files draining at once.
    compress: ``None`` or ``"lz4"``.
    commit_markers: fnmatch patterns of files that publish a checkpoint.
    delay: seconds a closed file waits before draining (0 = at once).
    node_id: this node's name in the records of cross-node commits ("" = the host name).
    """

    part_size: int = 8 * 1024 * 1024
    concurrency: int = 8
    max_files: int = 2
    compress: str | None = None
    commit_markers: tuple[str, ...] = DEFAULT_COMMIT_MARKERS
    delay: float = 0.0
    node_id: str = ""

    def __post_init__(self) -> None:
        if self.node_id:
            check_node_id(self.node_id)
        if self.part_size < 5 * 1024 * 1024 or self.part_size > 5 * 1024**3:
            raise ConfigError("part size must be between 5 MiB and 5 GiB (S3 multipart limits)", "part-size")
        if not 1 <= self.concurrency <= MAX_IN_FLIGHT:
            raise ConfigError(
                f"--concurrency must be from 1 to {MAX_IN_FLIGHT}, not {self.concurrency} "
                "(each part in flight is held in memory)",
                "concurrency",
            )
        if not 1 <= self.max_files <= MAX_IN_FLIGHT:
            raise ConfigError(
                f"--max-files must be from 1 to {MAX_IN_FLIGHT}, not {self.max_files} "
                "(each file draining holds --concurrency parts in memory)",
                "max-files",
            )
        if "" in self.commit_markers:
            raise ConfigError("a --commit-marker pattern must not be empty (it would match no file)", "commit-marker")
        for pattern in self.commit_markers:
            if "/" in pattern:
                raise ConfigError(
                    f"--commit-marker {pattern!r}: a pattern matches a file's name, not its path "
                    f"(it would match no file): give {pattern.rpartition('/')[2]!r}",
                    "commit-marker",
                )
        if self.compress not in (None, "lz4"):
            raise ConfigError(f"unknown compression {self.compress!r}; supported: lz4", "compress")
        check_seconds(self.delay, "drain-delay")


EVICT_POLICIES = ("lru", "fifo", "none")


@dataclasses.dataclass(frozen=True)
class TierOptions:
    """How the local tier is kept from overflowing (the core's capacity policy).

    cache_size: bytes of file data the tier may hold (None: bounded by the file system only).
    min_free: bytes the tier's file system must keep free.
    evict: "lru" (least recently used durable files first: the newest checkpoint
        stays hot), "fifo" (oldest closed first) or "none".
    full_timeout: seconds a write waits for the drain when the tier is full of
        undrained data before it fails with ENOSPC.
    """

    cache_size: int | None = None
    min_free: int = 0
    evict: str = "lru"
    full_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.cache_size is not None and self.cache_size <= 0:
            raise ConfigError(f"--cache-size must be positive, not {self.cache_size}", "cache-size")
        if self.min_free < 0:
            raise ConfigError(f"--min-free must not be negative, not {self.min_free}", "min-free")
        if self.evict not in EVICT_POLICIES:
            raise ConfigError(f"--evict must be one of {', '.join(EVICT_POLICIES)}, not {self.evict!r}", "evict")
        check_seconds(self.full_timeout, "full-timeout")


@dataclasses.dataclass(frozen=True)
class MountConfig:
    """Everything ``burstfs mount`` was asked to do, validated.

    fsync_remote: fsync(2) waits until the file is durable on the remote.
    writeback_cache: let the kernel buffer writes (large, batched writes to us).
    passthrough: let the kernel read and write local files on the tier itself (FUSE passthrough).
    read_plans: fetch ahead the files a checkpoint's index names once a reader walks them (readplans.py).
    tier: how the local tier is kept from overflowing.
    list_ttl: seconds a directory's remote listing stays fresh.
    read_ahead: kernel readahead of the mount, bytes (whole 4 KiB pages, 4 KiB to 1 GiB).
    nonempty: mount over a mount point that holds files (hidden while mounted).
    remote_wait: seconds a request (lookup miss, opendir) waits for a remote listing.
    """

    mountpoint: Path
    cache_dir: Path
    remote: RemoteURL
    s3: S3Options = S3Options()
    drain: DrainOptions = DrainOptions()
    tier: TierOptions = TierOptions()
    fsync_remote: bool = False
    allow_other: bool = False
    writeback_cache: bool = True
    passthrough: bool = True
    read_plans: bool = True
    list_ttl: float = 30.0
    read_ahead: int = 1 << 20
    log_level: str = "INFO"
    metrics_addr: str | None = None
    nonempty: bool = False
    remote_wait: float = 1.0

    def __post_init__(self) -> None:
        check_seconds(self.remote_wait, "remote-wait", maximum=60)
        check_seconds(self.list_ttl, "list-ttl")
        check_read_ahead(self.read_ahead)
        if self.metrics_addr is not None:
            parse_metrics_addr(self.metrics_addr)

    def to_json(self) -> str:
        """The whole tree as JSON, for the journal (``burstfs drain`` and ``burstfs-admin`` read it back)."""
        doc = dataclasses.asdict(self)
        doc.update(mountpoint=str(self.mountpoint), cache_dir=str(self.cache_dir), remote=str(self.remote))
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> MountConfig:
        """The tree :meth:`to_json` wrote (keys a later burstfs added are ignored, missing ones default)."""
        doc = json.loads(text)
        drain = _known(DrainOptions, doc.get("drain", {}))
        if "commit_markers" in drain:
            drain["commit_markers"] = tuple(drain["commit_markers"])
        options = {k: v for k, v in _known(cls, doc).items() if k not in _TREE_FIELDS}
        if "read_ahead" in options:
            try:
                check_read_ahead(options["read_ahead"])
            except ConfigError:  # an older burstfs took any --read-ahead: only its mount used it
                del options["read_ahead"]
        return cls(
            mountpoint=Path(doc["mountpoint"]),
            cache_dir=Path(doc["cache_dir"]),
            remote=parse_remote_url(doc["remote"]),
            s3=S3Options(**_known(S3Options, doc.get("s3", {}))),
            drain=DrainOptions(**drain),
            tier=TierOptions(**_known(TierOptions, doc.get("tier", {}))),
            **options,
        )


_TREE_FIELDS = frozenset({"mountpoint", "cache_dir", "remote", "s3", "drain", "tier"})


def _known(cls: type, doc: dict[str, Any]) -> dict[str, Any]:
    names = {field.name for field in dataclasses.fields(cls)}
    return {key: value for key, value in doc.items() if key in names}


def config_from_meta(get_meta: Callable[[str], str | None], cache_dir: Path) -> MountConfig | None:
    """The config the last mount of ``cache_dir`` journaled (``Journal.get_meta``), None if never mounted.

    A cache last mounted by a burstfs before the config was journaled whole has
    its remote, S3 and drain options under separate keys: those are read instead.
    """
    text = get_meta("config")
    if text is not None:
        return dataclasses.replace(MountConfig.from_json(text), cache_dir=cache_dir)
    remote = get_meta("remote")
    if remote is None:
        return None
    drain = json.loads(get_meta("drain") or "{}")
    drain["commit_markers"] = tuple(drain.get("commit_markers", DEFAULT_COMMIT_MARKERS))
    return MountConfig(
        mountpoint=Path(get_meta("mountpoint") or "/"),
        cache_dir=cache_dir,
        remote=parse_remote_url(remote),
        s3=S3Options(**json.loads(get_meta("s3") or "{}")),
        drain=DrainOptions(**drain),
    )


#: Journal meta: the S3 store (``S3Options.store``) the cache's files go to.
STORE_META = "store"


def recorded_store(get_meta: Callable[[str], str | None]) -> str | None:
    """The store a cache's files go to, as its journal (``Journal.get_meta``) says: its ``store``,
    else, for a cache last mounted by a burstfs that did not record one, the store of the
    --endpoint-url its last mount journaled with its options (that mount's requests went there).
    None when nothing tells (that mount reached AWS or an endpoint set in the environment or the
    AWS config file, never journaled): the next mount's store becomes the cache's."""
    store = get_meta(STORE_META)
    if store is not None:
        return store
    text = get_meta("config")
    s3 = json.loads(text).get("s3", {}) if text is not None else json.loads(get_meta("s3") or "{}")
    url = s3.get("endpoint_url")
    return endpoint_store(url) if url else None


def check_cache_store(config: MountConfig, recorded: str | None) -> None:
    """Refuse to drain a cache's files into another S3 store than the one it was mounted on
    (``recorded``, see :func:`recorded_store`): same bucket and prefix, another endpoint (a
    changed --endpoint-url, $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL or AWS config file).
    Its staged files would land there, its evicted ones be missing, and its checkpoint rounds
    stay open on the first store, where the other nodes wait for this node's part."""
    if config.remote.scheme != "s3" or recorded is None or recorded == config.s3.store():
        return
    cache, now, endpoint = config.cache_dir, config.s3.store(), config.s3.endpoint()
    back = (
        "leave out --endpoint-url, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL and the AWS config file's endpoint_url"
        if recorded == "aws"
        else f"use --endpoint-url {recorded}"
    )
    same = (
        f", or, if {now} is the same store under another name, drain this cache with "
        f"`burstfs drain --cache {cache} --endpoint-url {endpoint}` and remove it first"
        if endpoint
        else ""
    )
    raise ConfigError(
        f"cache dir {cache} holds files for {config.remote} on the store at {recorded}, not {now}; {back}{same}"
    )

"""``burstfs.client``: ask a live mount from a training script, without shelling out.

    from burstfs import client
    client.wait_durable("/mnt/ckpt/step_1000", timeout=600)   # raises unless durable
    print(client.status("/mnt/ckpt").undrained.bytes)
    client.prefetch("/mnt/ckpt/step_1000")                    # before a restart reads it
    client.latest("/mnt/ckpt")                                # newest complete checkpoint dir, or None

It talks to the mount's control socket and reads its journal read-only, exactly
as ``burstfs-admin`` does (it reuses burstfs/admin's finding of the mount and its
socket client).  No torch import: safe in any process.  Every failure is a
``ClientError``: ``NotAMountError``, ``DaemonGoneError``, ``DurableTimeoutError``,
``DrainFailedError``, ``PrefetchError``, or ``ClientError`` itself for the rest
(e.g. the daemon refused a request).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .admin.checkpoints import latest_checkpoint
from .admin.common import (
    EXIT_USAGE,
    AccessDenied,
    AdminError,
    DaemonLost,
    Target,
    outage_note,
    remote_left_note,
    resolve,
)
from .admin.common import wait_durable as _wait_durable
from .journal import BROKEN, DONE, MOVING, WRITING, FileState
from .status import wait_state
from .xattrs import LISTED_XATTR, MARKERS_XATTR

STATE_XATTR = "user.burstfs.state"  # every file's drain state, readable by anyone who may read the file
XATTR_POLL_S = 0.1

PathLike = str | os.PathLike[str]


class ClientError(Exception):
    """Anything that went wrong talking to a mount."""


class NotAMountError(ClientError):
    """The path is in no live burstfs mount."""


class DaemonGoneError(ClientError):
    """The mount is there but its daemon does not answer (crashed, or stopped meanwhile)."""


class AccessDeniedError(ClientError):
    """Only the daemon's user and root may use the mount's control socket (a job's user
    under a mount that root made).  ``wait_durable`` and ``is_durable`` then read each
    file's ``user.burstfs.state`` through the mount instead, and ``refresh_listings`` a
    directory's ``user.burstfs.listed``; ``status`` and ``prefetch`` cannot."""


@dataclasses.dataclass(frozen=True)
class PendingFile:
    """A file that is not durable (yet): its path under the mount, state and error."""

    path: str
    state: str
    error: str | None


class DurableTimeoutError(ClientError, TimeoutError):
    """``wait_durable`` ran out of time; ``pending`` says which files were not durable."""

    def __init__(self, message: str, pending: list[PendingFile]) -> None:
        super().__init__(message)
        self.pending = pending


class DrainFailedError(ClientError):
    """A file failed to drain or is incomplete, or the drain is halted: waiting will not help."""

    def __init__(self, message: str, failed: list[PendingFile], halted: str | None) -> None:
        super().__init__(message)
        self.failed = failed
        self.halted = halted


@dataclasses.dataclass(frozen=True)
class FileCount:
    files: int
    bytes: int


@dataclasses.dataclass(frozen=True)
class Status:
    """A live mount's status (docs/ADMIN.md "status"; ``document`` holds all of it)."""

    mountpoint: Path
    cache_dir: Path
    remote: str
    pid: int
    states: dict[str, FileCount]
    undrained: FileCount  # closed but not durable: staged, draining, failed
    oldest_undrained_age_s: float | None
    throughput_bps: float | None
    eta_s: float | None
    halted: str | None
    outage: str | None  # the reason the remote has not taken data lately, if it has not
    document: dict[str, Any]

    @property
    def all_durable(self) -> bool:
        """Every file in the mount is on the remote (none open for writing, staged, failed...)."""
        return all(count.files == 0 for state, count in self.states.items() if state not in DONE)


@dataclasses.dataclass(frozen=True)
class Durable:
    """What ``wait_durable`` waited for: all of it is on the remote now."""

    files: int
    bytes: int
    waited_s: float


@dataclasses.dataclass(frozen=True)
class FetchedFile:
    path: str
    ok: bool
    bytes: int
    error: str | None


@dataclasses.dataclass(frozen=True)
class Prefetched:
    files: list[FetchedFile]
    bytes: int


@dataclasses.dataclass(frozen=True)
class PrefetchProgress:
    done_files: int
    total_files: int
    done_bytes: int
    total_bytes: int
    file: FetchedFile


class PrefetchError(ClientError):
    """Some files could not be fetched; ``result`` has every file's outcome."""

    def __init__(self, message: str, result: Prefetched) -> None:
        super().__init__(message)
        self.result = result


def _live(paths: Sequence[PathLike]) -> Target:
    """The live mount the paths are in (all in one), with an answering daemon."""
    if not paths:
        raise ClientError("no path given (an empty list): name the files or directories to ask about")
    try:
        target = resolve([Path(p) for p in paths], None)
    except AccessDenied as exc:
        raise AccessDeniedError(exc.message) from None
    except AdminError as exc:
        raise (NotAMountError if exc.exit_code == EXIT_USAGE else ClientError)(exc.message) from None
    if target.mountpoint is None:
        raise NotAMountError(f"{paths[0]} is not in a mounted burstfs (its cache {target.cache_dir} is not mounted)")
    if target.daemon is None:
        raise DaemonGoneError(
            f"{target.mountpoint} is mounted but its daemon does not answer; "
            f"clean up with: burstfs unmount {target.mountpoint}"
        )
    return target


def _call(target: Target, op: str, **args: Any) -> dict[str, Any]:
    """One control-socket request; the daemon's refusal or loss as a ClientError."""
    assert target.daemon is not None
    try:
        return target.daemon.call(op, **args)
    except DaemonLost as exc:
        raise DaemonGoneError(exc.message) from None
    except AdminError as exc:
        raise ClientError(exc.message) from None


def _paths(path: PathLike | Sequence[PathLike]) -> list[PathLike]:
    return [path] if isinstance(path, (str, os.PathLike)) else list(path)


def status(mountpoint: PathLike) -> Status:
    """The status of the live mount that ``mountpoint`` (or any path in it) is in."""
    target = _live([mountpoint])
    doc = _call(target, "status")
    drain = doc["drain"]
    outage = drain.get("outage")
    return Status(
        mountpoint=Path(doc["mountpoint"]),
        cache_dir=Path(doc["cache_dir"]),
        remote=doc["remote"],
        pid=doc["pid"],
        states={state: FileCount(c["files"], c["bytes"]) for state, c in doc["states"].items()},
        undrained=FileCount(doc["undrained"]["files"], doc["undrained"]["bytes"]),
        oldest_undrained_age_s=doc["undrained"]["oldest_age_s"],
        throughput_bps=drain["throughput_bps"],
        eta_s=drain["eta_s"],
        halted=drain["halted"],
        outage=outage["reason"] if outage else None,
        document=doc,
    )


def wait_durable(path: PathLike | Sequence[PathLike], timeout: float | None = None) -> Durable:
    """Block until the file at ``path``, or everything under the directory, is on the remote.

    Raises DurableTimeoutError after ``timeout`` seconds, DrainFailedError at once
    when a file failed or is incomplete or the drain is halted, DaemonGoneError
    if the daemon goes away.  Files created under a directory while this waits
    are waited for too, and so are this node's records for them (a round's done,
    a marker's commit record: ``latest`` finds a checkpoint by it).
    """
    started = time.monotonic()
    try:
        target = _live(_paths(path))
    except AccessDeniedError:
        return _wait_by_xattrs(_paths(path), timeout, started)
    try:
        outcome = _wait_durable(target, timeout)
    except DaemonLost as exc:
        raise DaemonGoneError(exc.message) from None
    except AdminError as exc:
        raise ClientError(exc.message) from None
    if outcome.result == "durable":
        return Durable(len(outcome.files), sum(r.size for _, r in outcome.files), time.monotonic() - started)
    if outcome.result == "failed":
        failed = [PendingFile(p, wait_state(p, r), r.error) for p, r in outcome.broken]
        reasons = [f"{f.path}: {f.state}" + (f" ({f.error})" if f.error else "") for f in failed]
        if outcome.halted:
            reasons.append(f"the drain is halted: {outcome.halted}")
        raise DrainFailedError("not durable: " + "; ".join(reasons), failed, outcome.halted)
    pending = [PendingFile(p, wait_state(p, r), r.error) for p, r in outcome.pending]
    raise DurableTimeoutError(
        (f"{len(pending)} of {len(outcome.files)} files not durable" if pending else "files durable")
        + f" after {timeout:g}s{remote_left_note(outcome)}{outage_note(outcome)}",
        pending,
    )


def prefetch(
    path: PathLike | Sequence[PathLike], on_progress: Callable[[PrefetchProgress], None] | None = None
) -> Prefetched:
    """Fetch files only on the remote to the local tier (a restart's checkpoint, before
    it is read); ``on_progress`` is called after each file.  Raises PrefetchError if any
    file could not be fetched."""
    target = _live(_paths(path))

    def fetched(file: dict[str, Any]) -> FetchedFile:
        return FetchedFile(file["path"], file["ok"], file["bytes"], file.get("error"))

    def progress(message: dict[str, Any]) -> None:
        if on_progress is not None and message["file"] is not None:  # not the ticks between files
            on_progress(
                PrefetchProgress(
                    message["done_files"],
                    message["total_files"],
                    message["done_bytes"],
                    message["total_bytes"],
                    fetched(message["file"]),
                )
            )

    doc = _call(target, "prefetch", paths=target.rels, timeout=None, progress=progress)
    result = Prefetched([fetched(f) for f in doc["files"]], doc["bytes"])
    failed = [f for f in result.files if not f.ok]
    if failed:
        raise PrefetchError(
            f"{len(failed)} of {len(result.files)} files not fetched: "
            + "; ".join(f"{f.path}: {f.error}" for f in failed[:5]),
            result,
        )
    return result


def refresh_listings(path: PathLike | Sequence[PathLike]) -> None:
    """List the directories at or below ``path`` from the remote now, whatever ``--list-ttl``:
    what other nodes drained there since this node last listed them shows up (before a
    checkpoint is deleted, see ``retention.prune_checkpoints``)."""
    paths = _paths(path)
    try:
        target = _live(paths)
        _call(target, "refresh_listings", paths=target.rels, timeout=None)
    except AccessDeniedError:  # a job's user under a mount root made: ask through the mount
        for top in paths:
            try:
                os.getxattr(top, LISTED_XATTR.decode())
            except OSError as exc:  # EIO: the remote could not be listed
                raise ClientError(f"{top}: listing it afresh failed: {exc.strerror}") from None


def commit_markers(directory: PathLike) -> list[str] | None:
    """The commit-marker patterns of the mount ``directory`` is in, read through the mount
    (``user.burstfs.markers``: any user who may read the directory); None where it cannot say."""
    try:
        patterns = json.loads(os.getxattr(directory, MARKERS_XATTR.decode()))
    except (OSError, ValueError):
        return None
    return [str(p) for p in patterns] if isinstance(patterns, list) else None


def is_durable(path: PathLike | Sequence[PathLike]) -> bool:
    """Whether the file at ``path``, or everything under the directory, is on the remote
    now (no waiting).  Raises DrainFailedError when a file failed or is incomplete."""
    try:
        wait_durable(path, timeout=0)
    except DurableTimeoutError:
        return False
    return True


def _files_by_xattr(paths: Sequence[PathLike]) -> list[tuple[str, str, int]]:
    """(path, state, size) of every file at or under ``paths``, from the mount's xattrs (MOVING:
    durable, its object still at an older name)."""
    found = []
    for top in map(Path, paths):
        try:
            is_dir = stat.S_ISDIR(os.stat(top).st_mode)  # a symlink named: its target, as with the socket
        except OSError as exc:
            raise ClientError(f"{top}: {exc.strerror}") from None
        files = [top] if not is_dir else sorted(Path(d) / f for d, _, names in os.walk(top) for f in names)
        for file in files:
            try:
                st = os.stat(file) if file is top else os.lstat(file)
                if not stat.S_ISREG(st.st_mode):
                    continue  # symlinks, FIFOs, sockets in a directory: nothing of them drains
                value = os.getxattr(file, STATE_XATTR).decode()
            except FileNotFoundError:
                continue  # removed since the walk (a tmp file renamed into place): gone, not pending
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise ClientError(f"{file}: {exc.strerror}") from None
                value = WRITING  # not journaled yet: a file just created
            state = value if value == MOVING else FileState(value)
            found.append((str(file), state, st.st_size))
    return found


def _wait_by_xattrs(paths: Sequence[PathLike], timeout: float | None, started: float) -> Durable:
    """wait_durable for a user without the control socket: poll the files' states.  It
    cannot see a halted drain (a halt shows as a timeout), queued remote deletes, nor a move
    that failed for good (a timeout too)."""
    while True:
        files = _files_by_xattr(paths)
        broken = [PendingFile(p, s, None) for p, s, _ in files if s in BROKEN]
        if broken:
            raise DrainFailedError("not durable: " + "; ".join(f"{f.path}: {f.state}" for f in broken), broken, None)
        pending = [PendingFile(p, s, None) for p, s, _ in files if s not in DONE]
        if not pending:
            return Durable(len(files), sum(size for _, _, size in files), time.monotonic() - started)
        if timeout is not None and time.monotonic() - started > timeout:
            raise DurableTimeoutError(f"{len(pending)} of {len(files)} files not durable after {timeout:g}s", pending)
        time.sleep(XATTR_POLL_S)


def latest(path: PathLike | None = None, *, remote: str | None = None, endpoint_url: str | None = None) -> Path | None:
    """The newest complete checkpoint directory under ``path`` (a directory in a mount, mounted
    or not), or under the subdirectory ``path`` of ``remote`` (``s3://B/P``, ``file:///D``: no
    mount needed); None if there is none.  See docs/SEMANTICS.md "Many nodes"."""
    try:
        found = latest_checkpoint(path, remote, endpoint_url)
    except AdminError as exc:
        raise (NotAMountError if exc.exit_code == EXIT_USAGE and remote is None else ClientError)(exc.message) from None
    return None if found.path is None else Path(found.path)

"""What every ``burstfs-admin`` command shares: exit codes and errors, the daemon's
control socket, finding the mount (and its journal) a PATH names, table and JSON
output, and the click group the commands register on."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import logging
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from ..cachelock import CacheLock
from ..config import RemoteURL, S3Options, check_seconds, config_from_meta
from ..control import SOCKET_NAME, socket_address
from ..errors import THROTTLED, BurstfsError, ConfigError
from ..journal import FileState, Journal
from ..log import escape_controls
from ..mountinfo import FSNAME_PREFIX, UnexaminedPath, find_burstfs_mount, mounts
from ..progress import count
from ..status import LOCAL_TIER_KIND, RETRYING_KIND, Durability, lookup
from ..status import wait_durable as wait_in_journal

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_FAILED = 4
EXIT_UNKNOWN = 5  # latest: the remote could not be read, so nothing is known (never "start over")

REQUEST_TIMEOUT_S = 60.0  # quick ops; prefetch and verify wait as long as they take
START_HINT = "start a mount with: burstfs mount MOUNTPOINT --cache DIR --remote URL"


class AdminError(click.ClickException):
    """A failure reported as ``burstfs-admin: message`` with a chosen exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code  # type: ignore[misc]  # click reads it per instance

    def show(self, file: Any = None) -> None:
        click.echo(f"burstfs-admin: {self.message}", err=True)


class AccessDenied(AdminError):
    """This user may not use the mount's control socket (only the daemon's user and root)."""


class DaemonLost(AdminError):
    """The daemon went away (or never answered) in the middle of a request."""


# -- talking to the daemon -------------------------------------------------------------------


class Daemon:
    """The control socket of a live mount: one connection per request."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def find(cls, cache_dir: Path) -> Daemon | None:
        """The daemon serving ``cache_dir``, or None when none answers."""
        daemon = cls(cache_dir / SOCKET_NAME)
        try:
            daemon._connect(5.0).close()
        except (FileNotFoundError, ConnectionRefusedError):
            return None
        return daemon

    def _connect(self, timeout: float | None) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            with socket_address(self.path) as address:
                sock.connect(address)
        except PermissionError:
            sock.close()
            raise AccessDenied(
                f"permission denied on {self.path}: only the user who started the mount (and root) may use it"
            ) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def call(
        self,
        op: str,
        *,
        timeout: float | None = REQUEST_TIMEOUT_S,
        progress: Callable[[dict[str, Any]], None] | None = None,
        **args: Any,
    ) -> dict[str, Any]:
        """Send one request; return the final response (``ok``/``more`` removed)."""
        try:
            with self._connect(timeout) as sock, sock.makefile("rwb") as stream:
                stream.write(json.dumps({"op": op, **args}).encode() + b"\n")
                stream.flush()
                for line in stream:
                    message = json.loads(line)
                    if not message.pop("ok", False):
                        code = message.get("errno")
                        name = errno.errorcode.get(code, "") if isinstance(code, int) else ""
                        text = str(message.get("error"))
                        raise AdminError(
                            f"the daemon refused {op}: {text}" + (f" ({name})" if name and name not in text else "")
                        )
                    if message.pop("more", False):
                        if progress is not None:
                            progress(message)
                        continue
                    return message
        except (ConnectionError, FileNotFoundError, TimeoutError) as exc:
            raise DaemonLost(f"lost the daemon at {self.path}: {exc}") from None
        raise DaemonLost(f"the daemon at {self.path} closed the connection without answering {op}")


# -- finding the mount -----------------------------------------------------------------------


@dataclasses.dataclass
class Target:
    """What the paths on the command line refer to."""

    cache_dir: Path
    mountpoint: Path | None  # live mount point, None when not mounted
    rels: list[str]  # the paths, relative to the file-system root ("" = root)
    daemon: Daemon | None  # None when no daemon answers

    def journal(self) -> contextlib.AbstractContextManager[Journal]:
        return read_journal(self.cache_dir)

    def need_daemon(self, what: str, offline_hint: str = "") -> Daemon:
        if self.daemon is not None:
            return self.daemon
        hint = offline_hint or START_HINT.replace("MOUNTPOINT --cache DIR", f"MOUNTPOINT --cache {self.cache_dir}")
        if self.mountpoint is not None:
            hint = f"{self.mountpoint} is mounted but its daemon is gone: fusermount3 -u {self.mountpoint}, then {hint}"
        raise AdminError(f"{what} needs a running mount, and no daemon answers for cache {self.cache_dir}; {hint}")


@contextlib.contextmanager
def read_journal(cache_dir: Path) -> Iterator[Journal]:
    """The journal, read-only; a journal only a writer can open (a crash left a WAL to
    recover) is an error that says how to recover it, not a traceback."""
    try:
        journal = Journal(cache_dir, readonly=True)
        try:
            yield journal
        finally:
            journal.close()
    except sqlite3.Error as exc:
        raise AdminError(
            f"cannot read the journal of {cache_dir} read-only ({exc}); mount the cache again, "
            f"or run: burstfs drain --cache {cache_dir}"
        ) from None


def _live_mount_of(cache_dir: Path) -> Path | None:
    source = f"{FSNAME_PREFIX}{cache_dir}"
    return next((point for point, fstype, src, _ in mounts() if fstype.startswith("fuse") and src == source), None)


def _is_cache_dir(path: Path) -> bool:
    return (path / "journal.db").is_file()


def resolve(paths: Sequence[Path], cache: Path | None, must_exist: bool = True) -> Target:
    """Map PATHs (and ``--cache``) to a cache dir, a live mount if any, and file-system paths.
    ``must_exist=False``: PATHs name places on the remote (``latest``), not files here: a
    directory another node made since this mount listed its parent is not known here yet."""
    if cache is not None:
        cache_dir = Path(os.path.realpath(cache))
        if not _is_cache_dir(cache_dir):
            raise AdminError(f"{cache} is not a burstfs cache dir (no journal.db)", EXIT_USAGE)
    else:
        found = find_burstfs_mount(paths[0])
        if found is not None:
            cache_dir = found[1]
        elif _is_cache_dir(Path(os.path.realpath(paths[0]))):
            cache_dir = Path(os.path.realpath(paths[0]))
        else:
            raise AdminError(
                f"{paths[0]} is not inside a burstfs mount and is not a burstfs cache dir; "
                f"{START_HINT} (or give --cache DIR to read a stopped mount's journal)",
                EXIT_USAGE,
            )
    mountpoint = _live_mount_of(cache_dir)
    root = mountpoint
    if root is None:
        with read_journal(cache_dir) as journal:
            last = journal.get_meta("mountpoint")
        root = Path(last) if last else None
    rels = []
    for path in paths:
        if root is not None and Path(os.path.abspath(path)) == root:  # no look at a live root (find_burstfs_mount)
            rels.append("")
            continue
        real = Path(os.path.realpath(path))
        if real == cache_dir:
            rels.append("")
        elif root is not None and (real == root or root in real.parents):
            rels.append(str(real.relative_to(root)).removeprefix("."))
        else:
            where = f"mounted at {root}" if mountpoint else f"last mounted at {root}" if root else "never mounted"
            raise AdminError(f"{path} is not in the file system of cache {cache_dir} ({where})", EXIT_USAGE)
    daemon = Daemon.find(cache_dir) if mountpoint is not None else None
    if must_exist:
        _check_paths_exist(paths, rels, cache_dir, mountpoint if daemon is not None else None)
    return Target(cache_dir, mountpoint, rels, daemon)


def seconds_option(value: float | None, option: str) -> float | None:
    """``value`` of ``--option`` checked as config.check_seconds does (a NaN timeout never
    expires); a bad one is bad usage, said in one line."""
    try:
        return None if value is None else check_seconds(value, option)
    except ConfigError as exc:
        raise AdminError(str(exc), EXIT_USAGE) from None


def _check_paths_exist(paths: Sequence[Path], rels: list[str], cache_dir: Path, live: Path | None) -> None:
    """Refuse (exit 1) a path that does not exist, so that no command reports on or steers
    nothing as if it succeeded.  A live mount answers for its paths (it also knows files only
    on the remote); a stopped one, or one whose daemon is gone, by its journal."""
    if live is not None:
        missing = [path for path, rel in zip(paths, rels, strict=True) if rel and not os.path.lexists(path)]
        where = f"in the burstfs mount {live}"
    else:
        with read_journal(cache_dir) as journal:
            missing = [path for path, rel in zip(paths, rels, strict=True) if lookup(journal, rel) is None]
        where = f"in the journal of cache {cache_dir}"
    if missing:
        raise AdminError(f"{missing[0]}: {os.strerror(errno.ENOENT)} ({where})")


def journal_call(target: Target, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    with target.journal() as journal:
        try:
            return fn(journal, *args)
        except BurstfsError as exc:
            raise AdminError(str(exc)) from None


def wait_durable(
    target: Target,
    timeout: float | None,
    on_poll: Callable[[Durability], None] | None = None,
    ignore: frozenset[FileState] = frozenset(),
    skip_abandoned: bool = False,
) -> Durability:
    """status.wait_durable on the target's journal (read-only), asking its daemon, if one runs,
    whether the drain is halted; the last poll's outcome (``result`` "waiting": timed out)."""
    daemon = target.daemon
    deadline = None if timeout is None else time.monotonic() + timeout

    def ask(op: str) -> dict[str, Any] | None:
        """The daemon's answer to ``op``, or None once the wait's own time ran out first (a daemon
        that stopped answering: the wait times out, as it would for files not durable)."""
        assert daemon is not None
        left = REQUEST_TIMEOUT_S if deadline is None else deadline - time.monotonic()
        try:
            return daemon.call(op, timeout=max(0.5, min(REQUEST_TIMEOUT_S, left)))
        except DaemonLost:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            raise

    outage: list[dict[str, Any] | None] = [None]  # the last status answer's
    probed = [False]

    def halted() -> str | None:
        answer = ask("status")
        if answer is None:
            return None
        outage[0] = answer["drain"].get("outage")  # absent from an older daemon's document
        reason: str | None = answer["drain"]["halted"]
        if reason is not None and not probed[0]:
            # Halted when the wait began: the remote may have been fixed since (its next look
            # is up to 15 s away).  It looks now; the next poll says what it found.
            probed[0] = True
            with contextlib.suppress(AdminError):  # an older daemon without the op
                ask("probe")
            return None
        return reason

    def with_outage(state: Durability) -> Durability:
        return dataclasses.replace(state, outage=outage[0])

    def polled(state: Durability) -> None:
        if on_poll is not None:
            on_poll(with_outage(state))

    def nobody_drains() -> str | None:
        """A stopped mount's files drain only once a daemon (or ``burstfs drain``) runs for the
        cache: waiting for them with none would wait for good (``unmount --wait`` of a dead mount)."""
        if CacheLock(target.cache_dir).owner_pid() is not None:
            return None
        return (
            f"no burstfs daemon runs for cache {target.cache_dir}, so nothing drains it: mount it again, "
            f"or run `burstfs drain --cache {target.cache_dir}`"
        )

    if daemon is not None:
        ask("settle")  # a file created just now is journaled before we look
    with target.journal() as journal:
        try:
            return with_outage(
                wait_in_journal(
                    journal,
                    target.rels,
                    timeout=None if deadline is None else max(0.0, deadline - time.monotonic()),
                    on_poll=polled,
                    ignore=ignore,
                    skip_abandoned=skip_abandoned,
                    halted=nobody_drains if daemon is None else halted,
                )
            )
        except BurstfsError as exc:
            raise AdminError(str(exc)) from None


# -- formatting ------------------------------------------------------------------------------


def fmt_time(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).isoformat(sep=" ", timespec="milliseconds")


def remote_left_note(outcome: Durability) -> str:
    """The remote work a wait still waits for besides files: queued deletes, and this node's
    records not out yet (the dones other nodes' markers wait for, the commits ``latest`` reads)."""
    note = f"; {outcome.deletes} remote deletes queued" if outcome.deletes else ""
    if outcome.records:
        note += f"; {count(outcome.records, 'record')} of this node not on the remote yet (dones, commits)"
    return note


def outage_note(outcome: Durability) -> str:
    """What a wait that has not ended adds to its message: the drain's outage, if it has one
    (a wait on an unreachable remote said only which files it waited for, "draining")."""
    return f"; {outage_line(outcome.outage)}" if outcome.outage else ""


def outage_line(outage: dict[str, Any]) -> str:
    """The drain's outage (``status.outage_of``) as status shows it: what fails, since when, why."""
    errors = f"{outage['errors']} errors"
    if outage.get("kind") == LOCAL_TIER_KIND:
        headline = "LOCAL TIER FAILING"  # the journal on the tier (full, damaged): not the remote
    elif outage.get("kind") == RETRYING_KIND:
        headline, errors = "REMOTE RETRYING", f"{outage['errors']} retries, no request succeeded since"
    elif outage.get("kind") == THROTTLED:
        headline = "REMOTE THROTTLING"  # it answers "slow down": the drain backs off
    else:
        headline = f"REMOTE {'UNREACHABLE' if outage['unreachable'] else 'FAILING'}"
    return f"{headline} since {fmt_time(outage['since'])}: {outage['reason']}  (nothing drained since; {errors})"


def shown(text: str) -> str:
    """A file name (or a message that may hold one) for a line of text output: control characters
    escaped as in the log, so that a name with a newline cannot make a line of its own."""
    return escape_controls(text)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Left-aligned columns (``right``: indexes of right-aligned ones), two spaces apart; cells
    :func:`shown`, one row per line."""
    rows = [[shown(cell) for cell in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def emit_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, sort_keys=True))


# -- commands --------------------------------------------------------------------------------


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON document (docs/ADMIN.md).")(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="burstfs")
def main() -> None:
    """See and steer the drain of a burstfs mount.

    Exit codes: 0 ok, 1 error (latest: no complete checkpoint), 2 bad usage or
    no mount found, 3 timeout, 4 a file failed to drain (or is incomplete, or
    the drain is halted) or did not verify, 5 latest could not read the remote.
    """
    # What a command has to say it says itself, in one line: the remote's retries (latest
    # --remote against a sick store) are the daemon's log lines, not this tool's output.
    logging.getLogger("burstfs").addHandler(logging.NullHandler())
    logging.getLogger("burstfs").propagate = False


def cache_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--cache DIR``: every command takes it (docs/ADMIN.md), to name a stopped mount by its cache."""
    return click.option(
        "--cache",
        type=click.Path(path_type=Path, file_okay=False),
        help="Cache dir of the mount (to read a stopped mount's journal).",
    )(fn)


def path_command(name: str | None = None, *, many: bool = False) -> Callable[[Callable[..., Any]], click.Command]:
    """Register a command on PATH (``many``: PATHS...) with ``--cache`` and ``--json``: the
    shape of every command that reads or steers one mount.  Its own options go below it."""

    def register(fn: Callable[..., Any]) -> click.Command:
        fn = cache_option(json_option(fn))
        if many:
            fn = click.argument("paths", nargs=-1, required=True, type=UnexaminedPath())(fn)
        else:
            fn = click.argument("path", type=UnexaminedPath())(fn)
        return main.command(name)(fn)

    return register


def remote_of(journal: Journal, cache_dir: Path) -> tuple[RemoteURL, S3Options]:
    config = config_from_meta(journal.get_meta, cache_dir)
    if config is None:
        raise AdminError("the journal records no remote: this cache was never mounted")
    return config.remote, config.s3

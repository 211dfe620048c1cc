"""``burstfs-admin``: see and steer the drain of a burstfs mount.

PATH is a mount point or anything inside it.  A live mount is asked through its
control socket (``CACHE/control.sock``); a stopped one is read from its journal,
read-only, when PATH or ``--cache DIR`` names its cache dir.  Human tables by
default, ``--json`` documents (docs/ADMIN.md) for scripts.

Exit codes: 0 ok, 1 error, 2 bad usage (or nothing to talk to), 3 timeout,
4 a file failed to drain or did not verify.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import json
import os
import re
import socket
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import click

from .cachelock import CacheLock
from .config import RemoteURL, S3Options, config_from_meta, parse_remote_url
from .control import SOCKET_NAME, socket_address
from .errors import BurstfsError
from .journal import FILE_STATES, FileState, Journal
from .mountinfo import FSNAME_PREFIX, find_burstfs_mount, mounts
from .progress import Progress, fmt_bytes, fmt_duration
from .status import SCHEMA, Durability, journal_events, journal_status, list_files, short_reason
from .status import wait_durable as wait_in_journal
from .verify import verify_stopped

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_FAILED = 4

WATCH_INTERVAL_S = 1.0
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


def resolve(paths: Sequence[Path], cache: Path | None) -> Target:
    """Map PATHs (and ``--cache``) to a cache dir, a live mount if any, and file-system paths."""
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
        real = Path(os.path.realpath(path))
        if real == cache_dir:
            rels.append("")
        elif root is not None and (real == root or root in real.parents):
            rels.append(str(real.relative_to(root)).removeprefix("."))
        else:
            where = f"mounted at {root}" if mountpoint else f"last mounted at {root}" if root else "never mounted"
            raise AdminError(f"{path} is not in the file system of cache {cache_dir} ({where})", EXIT_USAGE)
    daemon = Daemon.find(cache_dir) if mountpoint is not None else None
    return Target(cache_dir, mountpoint, rels, daemon)


def _journal_call(target: Target, fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    with target.journal() as journal:
        try:
            return fn(journal, *args)
        except BurstfsError as exc:
            raise AdminError(str(exc)) from None


# -- formatting ------------------------------------------------------------------------------


def fmt_time(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).isoformat(sep=" ", timespec="milliseconds")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Left-aligned columns (``right``: indexes of right-aligned ones), two spaces apart."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False))
        ).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


def emit_json(doc: dict[str, Any]) -> None:
    click.echo(json.dumps(doc, sort_keys=True))


# -- commands --------------------------------------------------------------------------------


def cache_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--cache",
        type=click.Path(path_type=Path, file_okay=False),
        help="Cache dir of the mount (to read a stopped mount's journal).",
    )(fn)


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print a JSON document (docs/ADMIN.md).")(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="burstfs")
def main() -> None:
    """See and steer the drain of a burstfs mount.

    Exit codes: 0 ok, 1 error, 2 bad usage or no mount found, 3 timeout,
    4 a file failed to drain (or is incomplete, or the drain is halted) or did
    not verify.
    """


def _status_doc(target: Target) -> dict[str, Any]:
    if target.daemon is not None:
        return target.daemon.call("status")
    doc = _journal_call(target, journal_status, target.cache_dir)
    doc["pid"] = CacheLock(target.cache_dir).owner_pid()
    return doc


def _print_status(doc: dict[str, Any]) -> None:
    if doc["live"]:
        click.echo(f"burstfs at {doc['mountpoint']} (running, pid {doc['pid']})")
    else:
        owner = f"; pid {doc['pid']} holds the cache (burstfs drain?)" if doc["pid"] else ""
        click.echo(f"burstfs cache {doc['cache_dir']}: not mounted (last at {doc['mountpoint'] or '-'}){owner}")
    click.echo(f"  cache {doc['cache_dir']}   remote {doc['remote']}")
    if doc["data_path"] == "passthrough":
        click.echo("  data path: FUSE passthrough (the kernel reads and writes local files on the tier)")
    elif doc["data_path"]:
        click.echo("  data path: through the daemon (see burstfs.log for why passthrough is off)")
    states = doc["states"]
    rows = [[s, str(states[s]["files"]), fmt_bytes(states[s]["bytes"])] for s in FILE_STATES]
    click.echo(table(["STATE", "FILES", "BYTES"], rows, right=(1, 2)))
    undrained = doc["undrained"]
    oldest = f"; oldest closed {fmt_duration(undrained['oldest_age_s'])} ago" if undrained["files"] else ""
    click.echo(f"undrained: {undrained['files']} files, {fmt_bytes(undrained['bytes'])}{oldest}")
    drain = doc["drain"]
    outage = drain.get("outage")  # absent from an older daemon's document
    if outage:
        click.echo(
            f"REMOTE {'UNREACHABLE' if outage['unreachable'] else 'FAILING'} since "
            f"{fmt_time(outage['since'])}: {outage['reason']}  (nothing drained since; "
            f"{outage['errors']} errors)"
        )
    if doc["live"]:
        eta = "nothing to drain" if drain["eta_s"] == 0 else f"ETA {fmt_duration(drain['eta_s'])}"
        click.echo(
            f"drain: {fmt_bytes(drain['throughput_bps'])}/s, {eta}; "
            f"{drain['files_drained']} files ({fmt_bytes(drain['bytes_drained'])}) drained since mount"
        )
    if doc.get("node_id"):
        click.echo(f"node id: {doc['node_id']}")
    for held in doc.get("checkpoints_waiting", ()):
        click.echo(_held_line(held))
    if drain["halted"]:
        click.echo(f"HALTED: {drain['halted']}  (fix the remote; then: burstfs-admin retry PATH)")
    if drain["mover_crashed"]:
        click.echo(f"MOVER CRASHED: {drain['mover_crashed']}  (see {doc['cache_dir']}/burstfs.log)")
    if drain["errors_by_kind"]:
        click.echo("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(drain["errors_by_kind"].items())))
        for error in drain["recent_errors"][-5:]:
            click.echo(f"  {fmt_time(error['time'])}  {short_reason(error['message'])}")
    tier = doc["local_tier"]
    line = f"local tier {tier['path']}: burstfs holds {fmt_bytes(tier['used_bytes'])}"
    if tier["fs_total_bytes"] is not None:
        line += f"; file system {fmt_bytes(tier['fs_total_bytes'])}, {fmt_bytes(tier['fs_free_bytes'])} free"
    if tier["mount_total_bytes"] is not None:
        line += f"; mount reports {fmt_bytes(tier['mount_free_bytes'])} free of {fmt_bytes(tier['mount_total_bytes'])}"
    if tier["limit_bytes"] is not None:
        line += f"; limit {fmt_bytes(tier['limit_bytes'])}"
    click.echo(line)


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@cache_option
@json_option
@click.option("--watch", is_flag=True, help="Refresh every second until Ctrl-C.")
def status(path: Path, cache: Path | None, as_json: bool, watch: bool) -> None:
    """Files and bytes per state, drain rate and ETA, errors, local tier use."""
    target = resolve([path], cache)
    if target.mountpoint is not None and target.daemon is None:
        click.echo(
            f"warning: {target.mountpoint} is mounted but its daemon does not answer (crashed?); "
            f"showing the journal; clean up with: fusermount3 -u {target.mountpoint}",
            err=True,
        )
    try:
        while True:
            doc = _status_doc(target)
            if watch and not as_json and sys.stdout.isatty():
                click.clear()
            emit_json(doc) if as_json else _print_status(doc)
            if not watch:
                return
            time.sleep(WATCH_INTERVAL_S)
            if watch and not as_json and not sys.stdout.isatty():
                click.echo("")
    except KeyboardInterrupt:
        return


def _held_line(held: dict[str, Any]) -> str:
    """One checkpoint whose marker waits, and for whom (docs/SEMANTICS.md "Many nodes")."""
    where = held["dir"] or "/"
    if held["abandoned"]:
        return f"checkpoint {where} abandoned (its marker is never published)"
    others = [
        f"node {w['node']} (intent {datetime.datetime.fromtimestamp(w['intent_time']):%H:%M}, no done)"
        + ("" if w["dir"] == held["dir"] else f" in {w['dir']}")
        for w in held["waiting"]
    ]
    if held["own_pending"]:
        others.append("this node's own files")
    return f"checkpoint {where} waiting for " + ", ".join(others)


@main.command(name="ls")
@click.argument("path", type=click.Path(path_type=Path))
@cache_option
@json_option
def ls_command(path: Path, cache: Path | None, as_json: bool) -> None:
    """Per-file state, size, generation, digest and remote key."""
    target = resolve([path], cache)
    rel = target.rels[0]
    doc = target.daemon.call("ls", path=rel) if target.daemon else _journal_call(target, list_files, rel)
    if as_json:
        emit_json(doc)
        return
    rows = [
        [f["state"], fmt_bytes(f["size"]), str(f["generation"]), f["digest"] or "-", f["path"], f["remote_key"] or "-"]
        for f in doc["files"]
    ]
    click.echo(table(["STATE", "SIZE", "GEN", "DIGEST", "PATH", "REMOTE KEY"], rows, right=(1, 2)))
    for f in doc["files"]:
        if f["error"]:
            click.echo(f"{f['path']}: {f['error']}")


def wait_durable(
    target: Target,
    timeout: float | None,
    on_poll: Callable[[Durability], None] | None = None,
    ignore: frozenset[FileState] = frozenset(),
) -> Durability:
    """status.wait_durable on the target's journal (read-only), asking its daemon, if one runs,
    whether the drain is halted; the last poll's outcome (``result`` "waiting": timed out)."""
    daemon = target.daemon
    with target.journal() as journal:
        try:
            return wait_in_journal(
                journal,
                target.rels,
                timeout=timeout,
                on_poll=on_poll,
                ignore=ignore,
                halted=None if daemon is None else lambda: daemon.call("status")["drain"]["halted"],
            )
        except BurstfsError as exc:
            raise AdminError(str(exc)) from None


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@cache_option
@json_option
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds (exit 3).")
def wait(paths: tuple[Path, ...], cache: Path | None, as_json: bool, timeout: float | None) -> None:
    """Block until the files (or everything under the directories) are durable.

    Exit 0 when all are durable, 3 on timeout, 4 when one failed, is incomplete,
    or the drain is halted.  Polls the journal read-only.
    """
    target = resolve(paths, cache)
    bar = None if as_json else Progress("durable")

    def progress(outcome: Durability) -> None:
        if bar is not None:
            bar.update(
                len(outcome.done),
                len(outcome.files),
                sum(r.size for _, r in outcome.done),
                sum(r.size for _, r in outcome.files),
            )

    try:
        outcome = wait_durable(target, timeout, progress)
    finally:
        if bar is not None:
            bar.close()
    files, done, broken, halted = outcome.files, outcome.done, outcome.broken, outcome.halted
    pending = outcome.pending
    result = "timeout" if outcome.result == "waiting" else outcome.result
    if as_json:
        emit_json(
            {
                "schema": SCHEMA,
                "result": result,
                "files": len(files),
                "durable": len(done),
                "halted": halted,
                "pending": [{"path": p, "state": r.state, "error": r.error} for p, r in pending],
            }
        )
    if result == "failed":
        reasons = [f"{p}: {r.state}" + (f" ({r.error})" if r.error else "") for p, r in broken]
        if halted:
            reasons.append(f"the drain is halted: {halted}")
        raise AdminError("not durable: " + "; ".join(reasons), EXIT_FAILED)
    if result == "timeout":
        sample = ", ".join(f"{p} ({r.state})" for p, r in pending[:5]) + (" ..." if len(pending) > 5 else "")
        raise AdminError(
            f"timeout after {timeout:g}s: {len(pending)} of {len(files)} files not durable: {sample}", EXIT_TIMEOUT
        )


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@cache_option
@json_option
@click.option("--now", is_flag=True, help="Skip the configured drain delay and any retry backoff.")
def drain(path: Path, cache: Path | None, as_json: bool, now: bool) -> None:
    """Start draining at once (--now)."""
    if not now:
        raise click.UsageError(
            "say --now to drain at once; to block until files are durable, use: burstfs-admin wait PATH"
        )
    target = resolve([path], cache)
    daemon = target.need_daemon(
        "drain --now", f"drain a stopped mount's cache with: burstfs drain --cache {target.cache_dir}"
    )
    doc = daemon.call("drain_now")
    emit_json(doc) if as_json else click.echo("draining now (delays and retry backoff skipped)")


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@cache_option
@json_option
def retry(path: Path, cache: Path | None, as_json: bool) -> None:
    """Requeue failed files and lift a halted drain."""
    target = resolve([path], cache)
    doc = target.need_daemon("retry").call("retry")
    emit_json(doc) if as_json else click.echo(f"requeued {doc['requeued']} failed files")


def _per_file_failures(doc: dict[str, Any], verb: str) -> None:
    failed = [f for f in doc["files"] if not f["ok"]]
    if failed:
        raise AdminError(f"{len(failed)} of {len(doc['files'])} files not {verb}")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@cache_option
@json_option
def evict(paths: tuple[Path, ...], cache: Path | None, as_json: bool) -> None:
    """Drop the local copies of durable files (they are fetched again when read)."""
    target = resolve(paths, cache)
    doc = target.need_daemon("evict").call("evict", paths=target.rels)
    if as_json:
        emit_json(doc)
    else:
        for f in doc["files"]:
            click.echo(
                f"evicted {f['path']} ({fmt_bytes(f['bytes_freed'])})"
                if f["ok"]
                else f"not evicted {f['path']}: {f['error']}"
            )
        click.echo(f"freed {fmt_bytes(doc['bytes_freed'])}")
    _per_file_failures(doc, "evicted")


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@cache_option
@json_option
def prefetch(paths: tuple[Path, ...], cache: Path | None, as_json: bool) -> None:
    """Fetch files that are only on the remote to the local tier, with progress."""
    target = resolve(paths, cache)
    daemon = target.need_daemon("prefetch")
    bar = None if as_json else Progress("fetched", baseline=0)

    def progress(message: dict[str, Any]) -> None:
        file = message["file"]
        what = f"fetched {file['path']}" if file["ok"] else f"failed {file['path']}: {file['error']}"
        if bar is not None:
            bar.update(
                message["done_files"], message["total_files"], message["done_bytes"], message["total_bytes"], what
            )

    try:
        doc = daemon.call("prefetch", paths=target.rels, timeout=None, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        emit_json(doc)
    else:
        failed = sum(not f["ok"] for f in doc["files"])
        click.echo(
            f"fetched {fmt_bytes(doc['bytes'])} in {len(doc['files']) - failed} files"
            + (f"; {failed} failed" if failed else "")
        )
    _per_file_failures(doc, "fetched")


def _remote_of(journal: Journal, cache_dir: Path) -> tuple[RemoteURL, S3Options]:
    config = config_from_meta(journal.get_meta, cache_dir)
    if config is None:
        raise AdminError("the journal records no remote: this cache was never mounted")
    return config.remote, config.s3


@main.command(name="verify")
@click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))
@cache_option
@json_option
@click.option("--remote", "check_remote", is_flag=True, help="Also read each object back from the remote.")
def verify_command(paths: tuple[Path, ...], cache: Path | None, as_json: bool, check_remote: bool) -> None:
    """Re-hash files against the digests journaled at close (exit 4 on a mismatch)."""
    target = resolve(paths, cache)
    if target.daemon is not None:
        doc = target.daemon.call("verify", paths=target.rels, remote=check_remote, timeout=None)
    else:
        with target.journal() as journal:
            remote, s3 = _remote_of(journal, target.cache_dir) if check_remote else (None, None)
            try:
                doc = verify_stopped(target.cache_dir, journal, target.rels, remote, s3)
            except BurstfsError as exc:
                raise AdminError(str(exc)) from None
    if as_json:
        emit_json(doc)
    else:
        for f in doc["files"]:
            checks = "; ".join(f"{name}: {f[name]['detail']}" for name in ("local", "remote") if name in f)
            click.echo(f"{f['result']:<8}  {f['path']}  ({checks})")
    if doc["mismatches"]:
        raise AdminError(f"{doc['mismatches']} of {len(doc['files'])} files do not match their checksums", EXIT_FAILED)
    skipped = sum(f["result"] == "SKIPPED" for f in doc["files"])  # an older daemon's document has no "skipped"
    if skipped:  # nothing was checked for them: never a success
        raise AdminError(
            f"{skipped} of {len(doc['files'])} files could not be checked (SKIPPED); "
            "verify them once they are closed, hashed or drained",
            EXIT_ERROR,
        )


class Since(click.ParamType):
    """'10m', '2h', '90s', '1d' (that long ago) or an ISO time -> epoch seconds."""

    name = "AGE|TIME"
    _ago = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float):
            return value
        text = str(value).strip()
        match = self._ago.match(text)
        if match:
            return time.time() - float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        try:
            return datetime.datetime.fromisoformat(text).timestamp()
        except ValueError:
            self.fail(f"{text!r}: give an age (30s, 10m, 2h, 1d) or an ISO time (2024-05-01T12:00)", param, ctx)


@main.command(name="journal")
@click.argument("path", type=click.Path(path_type=Path))
@cache_option
@json_option
@click.option(
    "--since", type=Since(), default=0.0, help="Only events newer than this: 10m, 2h, 1d ago, or an ISO time."
)
@click.option("--limit", default=200, show_default=True, help="At most this many (the newest).")
def journal_command(path: Path, cache: Path | None, as_json: bool, since: float, limit: int) -> None:
    """Recent journal events (closes, durable, renames, failures...) of files under PATH."""
    target = resolve([path], cache)
    rel = target.rels[0]
    if target.daemon is not None:
        doc = target.daemon.call("journal", since=since, path=rel, limit=limit)
    else:
        doc = _journal_call(target, journal_events, since, rel, limit)
    if as_json:
        emit_json(doc)
        return
    for event in doc["events"]:
        name = event["path"] if event["path"] is not None else f"(ino {event['ino']})" if event["ino"] else ""
        click.echo(f"{fmt_time(event['time'])}  {event['event']:<10}  {name}  {event['detail']}".rstrip())


@main.command()
@click.argument("path", required=False, default=None)
@click.option(
    "--remote",
    "remote_url",
    default=None,
    help="Look at s3://BUCKET/PREFIX or file:///DIR directly (no mount); PATH is then a subdirectory.",
)
@click.option("--endpoint-url", default=None, help="S3 endpoint (with --remote); default $AWS_ENDPOINT_URL or AWS.")
@click.option("--region", default=None, help="S3 region (with --remote).")
@json_option
def latest(
    path: str | None, remote_url: str | None, endpoint_url: str | None, region: str | None, as_json: bool
) -> None:
    """The newest complete checkpoint directory under PATH (exit 1 if there is none).

    Complete: its commit marker was published by the cross-node commit, and every
    file its nodes' done records list is on the remote with the recorded size and
    digest.  Works from any node, and with --remote without a mount (a restart script).
    """
    found = latest_checkpoint(path, remote_url, endpoint_url, region)
    if as_json:
        emit_json({"schema": SCHEMA, **dataclasses.asdict(found)})
    else:
        for skipped in found.skipped:
            click.echo(f"skipped {skipped['dir'] or '/'}: {skipped['reason']}", err=True)
        if found.dir is not None:
            click.echo(found.path or "/")
        else:
            click.echo(f"no complete checkpoint under {found.subdir or '/'} in {found.remote}", err=True)
    if found.dir is None:
        sys.exit(EXIT_ERROR)


@dataclasses.dataclass
class Latest:
    """What ``latest`` found (``dir`` None: no complete checkpoint)."""

    remote: str
    subdir: str
    dir: str | None  # relative to the remote prefix
    path: str | None  # in the mount (the remote-relative dir with --remote)
    marker: str | None
    committed_at: float | None
    files: int
    skipped: list[dict[str, str]]  # newer checkpoints passed over: {"dir", "reason"}


def latest_checkpoint(
    path: str | os.PathLike[str] | None,
    remote_url: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
) -> Latest:
    """The newest complete checkpoint under ``path`` (in a mount), or under the subdirectory
    ``path`` of ``remote_url`` (no mount); see commitgroups.find_latest."""
    import asyncio

    from .commitgroups import find_latest
    from .remote import open_remote

    if remote_url is not None:
        try:
            url, s3 = parse_remote_url(remote_url), S3Options(endpoint_url=endpoint_url, region=region)
        except BurstfsError as exc:
            raise AdminError(str(exc), EXIT_USAGE) from None
        subdir, root = str(path or "").strip("/"), None
    else:
        if path is None:
            raise AdminError("give a PATH inside a mount, or --remote URL", EXIT_USAGE)
        target = resolve([Path(path)], None)
        with target.journal() as journal:
            url, s3 = _remote_of(journal, target.cache_dir)
        s3 = dataclasses.replace(s3, endpoint_url=endpoint_url or s3.endpoint_url, region=region or s3.region)
        subdir, root = target.rels[0], target.mountpoint

    async def look() -> Any:
        remote = open_remote(url, s3)
        try:
            return await find_latest(remote, subdir)
        finally:
            await remote.close()

    try:
        found, skipped = asyncio.run(look())
    except BurstfsError as exc:
        raise AdminError(f"{url}: {exc}") from None
    shown = None if found is None else str(root / found.dir) if root is not None else found.dir
    return Latest(
        remote=str(url),
        subdir=subdir,
        dir=found.dir if found else None,
        path=shown,
        marker=found.marker if found else None,
        committed_at=found.committed_at if found else None,
        files=found.files if found else 0,
        skipped=[{"dir": d, "reason": r} for d, r in skipped],
    )


@main.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--yes", is_flag=True, help="Confirm: the checkpoint in PATH is given up for good.")
@json_option
def abandon(path: Path, yes: bool, as_json: bool) -> None:
    """Give up the checkpoint in directory PATH whose marker waits for a lost node.

    Its marker (held on this node) is never published; the lost nodes' intents no
    longer hold later checkpoints written into PATH.  Run it on the node that
    holds the marker (burstfs-admin status shows "waiting for node ...").
    """
    if not yes:
        raise AdminError(f"abandon gives up the checkpoint in {path} for good: add --yes", EXIT_USAGE)
    target = resolve([path], None)
    doc = target.need_daemon("abandon").call("abandon", paths=target.rels)
    if as_json:
        emit_json(doc)
        return
    nodes = ", ".join(sorted({w["node"] for w in doc["gave_up"]})) or "none"
    click.echo(f"abandoned the checkpoint in {doc['dir'] or '/'} (gave up on nodes: {nodes})")

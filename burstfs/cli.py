"""``burstfs``: mount, unmount and drain from the command line.

Exit codes: 0 success, 1 runtime failure, 2 bad input (click's usage errors too).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from . import configfile
from .cachelock import CacheLock
from .config import DEFAULT_COMMIT_MARKERS, check_seconds, config_from_meta
from .errors import BurstfsError, ConfigError
from .mountinfo import UnexaminedPath, find_burstfs_mount
from .progress import be, count, they

log = logging.getLogger("burstfs.cli")

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3  # as burstfs-admin wait


def _fail(exc: BurstfsError) -> None:
    click.echo(f"burstfs: {exc}", err=True)
    sys.exit(EXIT_USAGE if isinstance(exc, ConfigError) else EXIT_FAILURE)


@click.group()
@click.version_option(package_name="burstfs")
def main() -> None:
    """A burst buffer for training checkpoints: local-speed writes, drained to object storage."""


def _mountpoint_command(config_help: str) -> Callable[[Callable[..., Any]], click.Command]:
    """Register a command on an optional MOUNTPOINT and ``--config FILE`` (mount and unmount
    take both: a config file names the mount point).  Its own options go below it."""

    def register(fn: Callable[..., Any]) -> click.Command:
        config = click.option(
            "--config", "config_file", type=click.Path(path_type=Path, dir_okay=False), help=config_help
        )
        fn = click.argument("mountpoint", required=False, type=UnexaminedPath())(config(fn))
        return main.command()(fn)

    return register


@_mountpoint_command("TOML file of these options (docs/CONFIGURATION.md); the command line overrides it.")
@click.option(
    "--cache",
    "cache_dir",
    type=click.Path(path_type=Path),
    help="Local tier directory (tmpfs or NVMe); holds staged data and the journal. Required.",
)
@click.option("--remote", help="s3://BUCKET/PREFIX or file:///DIR. Required.")
@click.option("--foreground", "-f", is_flag=True, help="Do not daemonize (systemd, Kubernetes).")
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.option(
    "--fsync",
    "fsync_mode",
    default="local",
    show_default=True,
    type=click.Choice(["local", "remote"]),
    help="local: fsync returns once the local tier and journal hold the data; remote: once durable remotely.",
)
@click.option("--allow-other", is_flag=True, help="Let other users access the mount (kernel checks permissions).")
@click.option("--no-writeback-cache", is_flag=True, help="Send every write to the daemon at once (slower).")
@click.option(
    "--no-passthrough",
    is_flag=True,
    help="Serve file data through the daemon even where FUSE passthrough is available (slower).",
)
@click.option(
    "--no-read-plans",
    is_flag=True,
    help="Do not fetch ahead the shards of a checkpoint (DCP, Hugging Face index) when a reader walks them.",
)
@click.option("--cache-size", default=None, help="Bytes of the local tier to use (e.g. 20G); default: all of it.")
@click.option(
    "--min-free", default="0", show_default=True, help="Free space the local tier's file system keeps (e.g. 2G)."
)
@click.option(
    "--evict",
    "evict_policy",
    type=click.Choice(["lru", "fifo", "none"]),
    default="lru",
    show_default=True,
    help="Which durable files leave a full local tier first (lru keeps the newest checkpoint hot).",
)
@click.option(
    "--full-timeout",
    default=60.0,
    show_default=True,
    help="Seconds a write waits for the drain when the tier is full of undrained data, then ENOSPC.",
)
@click.option("--list-ttl", default=30.0, show_default=True, help="Seconds a directory's remote listing stays fresh.")
@click.option(
    "--endpoint-url",
    default=None,
    help="S3 endpoint (MinIO, Ceph RGW...); default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, "
    "the AWS config file's endpoint_url, or AWS.",
)
@click.option("--region", default=None, help="S3 region.")
@click.option("--part-size", default="8M", show_default=True, help="Multipart part and checksum chunk size.")
@click.option("--concurrency", default=8, show_default=True, help="Parts in flight per file.")
@click.option(
    "--max-files",
    default=2,
    show_default=True,
    help="Files draining at once (drain memory: max-files x concurrency x part size + 32 MiB of small files).",
)
@click.option("--read-ahead", default="1M", show_default=True, help="Kernel readahead of the mount.")
@click.option("--compress", type=click.Choice(["none", "lz4"]), default="none", show_default=True)
@click.option(
    "--drain-delay",
    default=0.0,
    show_default=True,
    help="Seconds a closed file waits before it drains (coalesces quick rewrites).",
)
@click.option(
    "--commit-marker",
    "commit_markers",
    multiple=True,
    default=DEFAULT_COMMIT_MARKERS,
    show_default=True,
    help="Pattern of files that publish a checkpoint (repeatable; replaces the defaults).",
)
@click.option("--metrics-addr", default=None, help="Serve Prometheus metrics on HOST:PORT.")
@click.option(
    "--nonempty", is_flag=True, help="Mount over a mount point that holds files (they are hidden while mounted)."
)
@click.option(
    "--remote-wait",
    default=1.0,
    show_default=True,
    help="Seconds a lookup or a directory listing waits for the remote; then it is answered from local entries.",
)
@click.option(
    "--node-id",
    default=None,
    help="This node's name in cross-node checkpoint records on the remote (default: the host name).",
)
@click.pass_context
def mount(ctx: click.Context, config_file: Path | None, **options: Any) -> None:
    """Mount burstfs at MOUNTPOINT; returns once the mount is live.

    MOUNTPOINT, --cache and --remote are required, on the command line or in
    the --config file.
    """
    from .daemon import mount as run
    from .daemon import refusal_in

    try:
        file = configfile.load(config_file, ctx.command) if config_file is not None else None
        given = {name for name in ctx.params if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE}
        values = configfile.merge(options, file, given)
        config = configfile.build_with_file(values, file, ctx.command)
        sys.exit(run(config, foreground=values["foreground"]))
    except BurstfsError as exc:
        _fail(exc)
    except BaseExceptionGroup as group:  # --foreground: a start-up step failed in a nursery
        refusal = refusal_in(group)
        if refusal is None:
            raise
        _fail(refusal)


@main.group(name="config")
def config_group() -> None:
    """Config files of burstfs mount (docs/CONFIGURATION.md)."""


@config_group.command(name="check")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=False))
def config_check(file: Path) -> None:
    """Validate FILE and print the settings a mount with it would use (exit 2 if it is wrong).

    Secrets (a password in an endpoint URL) are never printed.
    """
    try:
        loaded = configfile.load(file, mount)
        values = configfile.merge(configfile.defaults(mount), loaded, set())
        config = configfile.build_with_file(values, loaded, mount)
    except BurstfsError as exc:
        _fail(exc)
    from .latest import missing_root

    if (problem := missing_root(config.remote)) is not None:  # it may be mounted later: a note, not an error
        click.echo(f"burstfs: note: {problem} (yet): `burstfs mount` fails until it does", err=True)
    click.echo(f"# {file}: valid; the settings of `burstfs mount --config {file}`")
    # The paths as the mount takes them (a file's relative paths are its directory's: conf/../mnt)
    values = {**values, "mountpoint": config.mountpoint, "cache_dir": config.cache_dir}
    for line in configfile.format_settings(values, mount):
        click.echo(line)


def _flag_incomplete_after_crash(cache_dir: Path) -> None:
    """Flag the files a dead daemon had open for writing ``incomplete`` in its journal, as the
    next start would (recovery.flag_incomplete): ``burstfs-admin`` reading the stopped cache
    then says so, rather than "writing" for a file nobody writes.  Skipped if a new daemon
    took the cache meanwhile (it recovers the cache itself)."""
    from .journal import Journal
    from .localtier import LocalTier
    from .recovery import flag_incomplete

    lock = CacheLock(cache_dir)
    try:
        lock.acquire()
    except (BurstfsError, OSError):
        return
    try:
        journal = Journal(cache_dir)
        try:
            flag_incomplete(journal, LocalTier(cache_dir))
        finally:
            journal.close()
    except (OSError, sqlite3.Error) as exc:  # said; the next start does it
        click.echo(f"burstfs: note: could not update the journal in {cache_dir} after the crash: {exc}", err=True)
    finally:
        lock.release()


def _left_behind(cache_dir: Path) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """What a stopped mount leaves undrained, by fate (status.left_behind), and its remote
    work beyond uploads (status.remote_work)."""
    from .journal import Journal
    from .localtier import LocalTier
    from .status import left_behind, remote_work

    journal = Journal(cache_dir, readonly=True)
    try:
        return left_behind(journal, LocalTier(cache_dir)), remote_work(journal)
    finally:
        journal.close()


def _fail_on_left_behind(cache_dir: Path) -> None:
    """After ``burstfs drain``: exit 1 while a closed file is not on the remote at its path (a
    failed drain, a move that failed for good), so that ``drain --cache DIR && rm -rf DIR`` (the
    Slurm epilog) keeps the only copy.  Files left ``incomplete`` by a crash never drain: said,
    not an error (``unmount --wait`` leaves them out too)."""
    from .journal import Journal
    from .localtier import LocalTier
    from .status import left_behind, stuck_moves

    journal = Journal(cache_dir, readonly=True)
    try:
        left, stuck = left_behind(journal, LocalTier(cache_dir)), stuck_moves(journal)
    finally:
        journal.close()
    files, nbytes = left.get("incomplete", (0, 0))
    if files:
        click.echo(
            f"burstfs: {count(files, 'file')} ({nbytes} bytes) {be(files)} incomplete (open for writing at a crash): "
            f"{they(files, 'it never drains', 'they never drain')} (see: burstfs-admin ls {cache_dir})",
            err=True,
        )
    problems = []
    files, nbytes = left.get("failed", (0, 0))
    if files:
        problems.append(f"{count(files, 'file')} ({nbytes} bytes) failed to drain")
    if stuck:
        problems.append(f"{stuck} renamed files' objects could not be moved to their new names")
    if problems:
        stay = they(files + stuck, "it stays", "they stay")
        raise BurstfsError(
            "; ".join(problems) + f": {stay} in {cache_dir} (see: burstfs-admin ls {cache_dir}; "
            "`burstfs-admin retry` on the next mount drains failed files again)"
        )


#: How often ``unmount --wait`` says what it still waits for.
WAIT_NOTE_S = 30.0


def _wait_durable(point: Path, timeout: float | None) -> None:
    """Block until every file of the mount is durable, as ``burstfs-admin wait`` does;
    incomplete files never drain, and markers of abandoned checkpoints are never published,
    so they are left out (unmount reports them).  So are other nodes' files known here from
    listings: none of their bytes is lost with this mount, and a move of one renamed here is
    its owner's to make (it may never come: an epilog waited for it for good)."""
    from .admin.common import AdminError, outage_note, remote_left_note, resolve, wait_durable
    from .journal import INCOMPLETE, REMOTE
    from .status import Durability

    said = [time.monotonic()]

    def say_what_it_waits_for(outcome: Durability) -> None:
        """Every WAIT_NOTE_S, one line on stderr: a wait never runs silent (a lost node's marker)."""
        if time.monotonic() - said[0] < WAIT_NOTE_S or outcome.result != "waiting":
            return
        said[0] = time.monotonic()
        if outcome.pending:
            path, row = outcome.pending[0]
            what = f"{count(len(outcome.pending), 'file')} to be durable (first: {path}, {outcome.state_of(path, row)})"
        elif outcome.deletes:
            what = f"{outcome.deletes} remote deletes"
        else:
            what = f"{count(outcome.records, 'record')} of this node to go out (dones, commits)"
        click.echo(
            f"burstfs: waiting for {what}{outage_note(outcome)}; burstfs-admin status {point} says why", err=True
        )

    target = resolve([point], None)
    try:
        outcome = wait_durable(
            target, timeout, say_what_it_waits_for, ignore=frozenset({INCOMPLETE, REMOTE}), skip_abandoned=True
        )
    except AdminError as exc:  # the daemon went away while it waited (killed, crashed)
        _fail(
            BurstfsError(
                f"{exc.message}; not unmounting (`burstfs unmount {point}` without --wait clears a dead mount)"
            )
        )
    if outcome.result == "failed":
        why = (
            f"the drain is halted ({outcome.halted})"
            if outcome.halted
            else f"{count(len(outcome.broken), 'file')} failed to drain"
        )
        if target.daemon is None:  # a dead mount: retry has nobody to ask; a plain unmount clears it
            hint = f"`burstfs unmount {point}` without --wait clears the dead mount, then mount it again"
        else:
            hint = f"see: burstfs-admin status {point}; burstfs-admin retry {point}"
        _fail(BurstfsError(f"{why}; not unmounting ({hint})"))
    if outcome.result == "waiting":
        _fail(
            BurstfsError(
                (f"{count(len(outcome.pending), 'file')} still not durable" if outcome.pending else "still waiting")
                + f" after {timeout:.0f}s{remote_left_note(outcome)}{outage_note(outcome)}; "
                f"not unmounting (see: burstfs-admin status {point})"
            )
        )


@_mountpoint_command("Unmount the mountpoint of this `burstfs mount --config` file (systemd, Kubernetes).")
@click.option("--wait", "wait_drain", is_flag=True, help="First wait until every closed file is durable.")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for the daemon to exit.")
@click.option("--wait-timeout", default=None, type=float, help="With --wait: give up after this many seconds.")
def unmount(
    mountpoint: Path | None, config_file: Path | None, wait_drain: bool, timeout: float, wait_timeout: float | None
) -> None:
    """Unmount MOUNTPOINT (or the --config file's) and wait for its daemon to stop.

    Files not yet durable stay staged and journaled in the cache dir; the next
    mount (or `burstfs drain --cache DIR`) drains them.  With --wait, unmount
    only once everything closed is durable (exit 1 if that times out).
    """
    try:
        check_seconds(timeout, "timeout")
        if wait_timeout is not None:
            check_seconds(wait_timeout, "wait-timeout")
            if not wait_drain:  # it unmounted at once, not durable files left staged
                raise ConfigError("--wait-timeout is a bound of --wait: give both", "wait-timeout")
    except ConfigError as exc:
        _fail(exc)
    if mountpoint is None:
        try:
            mountpoint = configfile.load(config_file, mount).values.get("mountpoint") if config_file else None
        except BurstfsError as exc:
            _fail(exc)
        if mountpoint is None:
            _fail(ConfigError("give MOUNTPOINT, or --config FILE with a mountpoint"))
            return
    found = find_burstfs_mount(mountpoint)
    named = Path(os.path.abspath(mountpoint))  # before resolving links: see find_burstfs_mount
    if found is None or (found[0] != named and found[0] != Path(os.path.realpath(mountpoint))):
        _fail(ConfigError(f"{mountpoint} is not a burstfs mount point"))
        return
    point, cache_dir = found
    if wait_drain:
        _wait_durable(point, wait_timeout)
    lock = CacheLock(cache_dir)
    pid = lock.owner_pid()
    result = subprocess.run(["fusermount3", "-u", str(point)], capture_output=True, text=True)
    if result.returncode != 0:
        _fail(
            BurstfsError(
                f"unmounting {point} failed: {result.stderr.strip()} (files still open? try: fuser -m {point})"
            )
        )
    deadline = time.monotonic() + timeout
    while pid is not None and lock.owner_pid() is not None:
        if time.monotonic() > deadline:
            _fail(BurstfsError(f"daemon pid {pid} did not exit within {timeout:.0f}s after unmount"))
        time.sleep(0.05)
    click.echo(f"unmounted {point} (cache {cache_dir})")
    if pid is None:  # a dead mount: its crash is recovered as the next start would
        _flag_incomplete_after_crash(cache_dir)
    try:
        left, work = _left_behind(cache_dir)
    except (OSError, sqlite3.Error) as exc:  # the cache dir was removed or damaged under the mount
        _fail(BurstfsError(f"cannot read the journal in {cache_dir} to say what is left undrained: {exc}"))
    files, nbytes = left.get("drains", (0, 0))
    if files:
        click.echo(
            f"{count(files, 'file')} ({nbytes} bytes) {be(files)} not durable yet: "
            f"{they(files, 'it stays', 'they stay')} staged in {cache_dir}; "
            f"the next mount or `burstfs drain --cache {cache_dir}` drains {they(files, 'it', 'them')}"
        )
    if work["moving"] or work["deletes"]:
        click.echo(
            f"{work['moving']} objects still to move after renames and {work['deletes']} remote deletes queued: "
            f"the next mount or `burstfs drain --cache {cache_dir}` does them"
        )
    files, nbytes = left.get("failed", (0, 0))
    if files:
        click.echo(
            f"{count(files, 'file')} ({nbytes} bytes) failed to drain: "
            f"{they(files, 'it drains', 'they drain')} after `burstfs-admin retry` "
            f"on the next mount (see: burstfs-admin ls {cache_dir})"
        )
    files, nbytes = left.get("incomplete", (0, 0))
    if files:
        click.echo(
            f"{count(files, 'file')} ({nbytes} bytes) {be(files)} incomplete (open for writing at a crash, or a write "
            f"failed): {they(files, 'it will not drain', 'they will not drain')}; "
            f"rewrite or delete {they(files, 'it', 'them')}"
        )
    files, _ = left.get("abandoned", (0, 0))
    if files:
        click.echo(
            f"{count(files, 'marker')} of abandoned checkpoints (burstfs-admin abandon) stay in {cache_dir}: "
            f"{they(files, 'it is', 'they are')} never published"
        )


@main.command()
@click.option(
    "--cache",
    "cache_dir",
    required=True,
    type=click.Path(path_type=Path, exists=True, file_okay=False),
    help="Cache dir of a stopped (or crashed) mount.",
)
@click.option("--endpoint-url", default=None, help="Override the S3 endpoint recorded by the last mount.")
@click.option("--now", is_flag=True, help="Drain at once: skip the --drain-delay the last mount was started with.")
@click.option(
    "--timeout",
    type=float,
    default=None,
    help="Give up after this many seconds (exit 3); what is not durable stays in the cache. Default: no limit.",
)
def drain(cache_dir: Path, endpoint_url: str | None, now: bool, timeout: float | None) -> None:
    """Drain a cache dir without a mount (after unmount or a crash), then exit.

    Files drain with the options of the last mount, --drain-delay included
    (said on stderr); --now skips the delay.  Exit 0 when everything closed is
    durable, 1 if the drain stopped on an error, 3 when --timeout ran out first
    (a remote that is down: without it the drain waits for the remote).
    """
    import asyncio

    from .cachelock import PRIVATE_UMASK, CacheLock, check_cache_dir, secure_cache_dir
    from .config import check_cache_store, recorded_store
    from .heap import keep_freed_buffers
    from .journal import Journal
    from .localtier import LocalTier
    from .log import setup_logging
    from .mover import Mover
    from .recovery import flag_incomplete

    os.umask(PRIVATE_UMASK)  # the journal's WAL, the log, temp files: private to this user
    keep_freed_buffers()
    try:
        if timeout is not None:
            check_seconds(timeout, "timeout")
        # Refused before anything is changed: a typo (--cache /tmp) must not chmod it or leave a log in it.
        check_cache_dir(cache_dir)
        if not (cache_dir / "journal.db").exists():
            raise ConfigError(f"{cache_dir} is not a burstfs cache dir (no journal.db)")
        secure_cache_dir(cache_dir, create=False)
        if not os.access(cache_dir, os.W_OK | os.X_OK):  # a file system gone read-only after I/O errors
            raise ConfigError(f"cache dir {cache_dir} is not writable: copy it elsewhere to drain it")
        setup_logging("INFO", log_file=cache_dir / "burstfs.log", stderr=True)
    except BurstfsError as exc:
        _fail(exc)
    except OSError as exc:
        _fail(BurstfsError(f"cannot write to cache dir {cache_dir}: {exc.strerror}"))
    lock = CacheLock(cache_dir)
    try:
        lock.acquire()
        journal = Journal(cache_dir)
        try:
            config = config_from_meta(journal.get_meta, cache_dir)
            store = recorded_store(journal.get_meta)
            if config is not None:  # a crash's files open for writing never drain as closed versions
                for row, _, why in flag_incomplete(journal, LocalTier(cache_dir)):
                    log.warning("event=recover_incomplete ino=%d name=%s reason=%r", row.ino, row.name, why)
        finally:
            journal.close()
        if config is None:
            raise ConfigError(f"{cache_dir} is not a burstfs cache dir (no journal)")
        if not endpoint_url:  # an explicit one is the operator's word that it reaches the same store
            check_cache_store(config, store)
        s3 = dataclasses.replace(config.s3, endpoint_url=endpoint_url) if endpoint_url else config.s3
        options = config.drain
        if now:
            options = dataclasses.replace(options, delay=0.0)
        elif options.delay > 0:
            click.echo(
                f"burstfs: files drain {options.delay:.0f}s after their close, the --drain-delay of the last mount "
                "(a crash or an unmount does not shorten it); pass --now to drain at once",
                err=True,
            )
        mover = Mover(cache_dir, config.remote, s3, options)
        try:
            asyncio.run(asyncio.wait_for(mover.run(until_idle=True), timeout))
        except TimeoutError:
            left, _ = _left_behind(cache_dir)
            files = sum(n for fate, (n, _) in left.items() if fate not in ("incomplete", "abandoned"))
            click.echo(
                f"burstfs: drain stopped after {timeout:g}s: {count(files, 'file')} {be(files)} not durable yet; "
                f"{they(files, 'it stays', 'they stay')} in {cache_dir} (burstfs-admin status {cache_dir} says why)",
                err=True,
            )
            sys.exit(EXIT_TIMEOUT)
        click.echo(
            f"drained {count(mover.stats.files_drained, 'file')} ({mover.stats.bytes_drained} bytes) to {config.remote}"
        )
        _fail_on_left_behind(cache_dir)
    except BurstfsError as exc:
        _fail(exc)
    finally:
        lock.release()

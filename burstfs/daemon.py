"""Mount lifecycle: checks before mounting, daemonizing, the trio main loop, shutdown.

``burstfs mount`` returns only when the mount is live: the daemon reports
``ready`` (or the reason it failed) through a pipe to the waiting parent.  All
checks run before anything is mounted, so a failed start leaves nothing mounted
and changes nothing in an existing cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import socket
import sqlite3
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from . import passthrough  # before pyfuse3: the shim interposes fuse_session_mount

# isort: split

import pyfuse3
import trio

from .cachelock import PRIVATE_UMASK, CacheLock, check_cache_dir, secure_cache_dir
from .commitgroups import unfinished_rounds
from .config import STORE_META, MountConfig, check_cache_store, default_node_id, parse_metrics_addr, recorded_store
from .control import serve_control
from .core import BurstCore
from .drainservice import DrainService
from .errors import THROTTLED, BurstfsError, ConfigError, RemoteError
from .fuse_ops import BurstOperations
from .headroom import drop_reserve_if_full
from .heap import keep_freed_buffers
from .journal import ROOT_INO, Journal
from .localtier import holds_data
from .log import reopen_log_file, setup_logging
from .metrics import start_metrics
from .mountinfo import FSNAME_PREFIX, device_of, find_burstfs_mount, mounts
from .mover import Mover
from .progress import fmt_bytes
from .recovery import stamp_alive
from .remote import open_remote
from .sdnotify import SystemdNotifier

log = logging.getLogger("burstfs.daemon")


def preflight(config: MountConfig) -> None:
    """Refuse bad input before touching anything (tenet 5)."""
    mnt = config.mountpoint
    # Asked of /proc first: stat() of a dead FUSE mount fails.  Other mounts there (a bind
    # mount, a Kubernetes volume, a tmpfs) are mounted over, as any FUSE file system does.
    if any(point == mnt and fstype.startswith("fuse") for point, fstype, *_ in mounts()):
        try:
            os.stat(mnt)
        except OSError as exc:
            raise ConfigError(
                f"{mnt} is a mount whose daemon is gone ({exc.strerror}); clean it up first: burstfs unmount {mnt}"
            ) from None
        raise ConfigError(f"{mnt} is already a mount point (unmount it first: burstfs unmount {mnt})")
    if not mnt.exists():
        raise ConfigError(f"mount point {mnt} does not exist (create it with: mkdir -p {mnt})")
    if not mnt.is_dir():
        raise ConfigError(f"mount point {mnt} is not a directory")
    check_overlaps(config)
    if not config.nonempty and any(os.scandir(mnt)):
        raise ConfigError(
            f"mount point {mnt} is not empty: its files would be hidden under the mount "
            "(use an empty directory, or pass --nonempty to mount over them)"
        )
    if not os.path.exists("/dev/fuse"):
        raise ConfigError(
            "/dev/fuse is missing: load the fuse module (modprobe fuse) or pass --device /dev/fuse to the container"
        )
    if shutil.which("fusermount3") is None:
        raise ConfigError("fusermount3 not found: install fuse3 (apt-get install fuse3)")
    if config.metrics_addr is not None:
        _check_port_free(*parse_metrics_addr(config.metrics_addr))
    cache = config.cache_dir
    if cache.exists() and not cache.is_dir():
        raise ConfigError(f"cache dir {cache} is not a directory")
    if not cache.exists():
        if not cache.parent.is_dir():
            problem = "is not a directory" if cache.parent.exists() else "does not exist"
            raise ConfigError(f"cannot create cache dir {cache}: {cache.parent} {problem}")
        if not os.access(cache.parent, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot create cache dir {cache}: {cache.parent} is not writable")
    elif not os.access(cache, os.W_OK | os.X_OK):
        raise ConfigError(f"cache dir {cache} is not writable")
    else:
        check_cache_dir(cache)  # another user's, or no cache (--cache /tmp): secure_cache_dir() refuses it too
        _check_cache_owner(config)
    _check_min_free(config)


def _check_min_free(config: MountConfig) -> None:
    """Refuse a --min-free that the tier's file system cannot keep: every write would wait
    --full-timeout and fail with ENOSPC, however empty the tier."""
    if not config.tier.min_free:
        return
    where = config.cache_dir if config.cache_dir.exists() else config.cache_dir.parent
    st = os.statvfs(where)
    total = st.f_blocks * st.f_frsize
    if config.tier.min_free >= total:
        raise ConfigError(
            f"--min-free {fmt_bytes(config.tier.min_free)} is not less than the size of the file system "
            f"of the cache dir ({fmt_bytes(total)} at {where}): nothing could ever be written",
            "min-free",
        )


def _check_port_free(host: str, port: int) -> None:
    """Refuse a metrics port in use before the cache dir is made (the server binds it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {host}:{port}: {exc.strerror}", "metrics-addr") from None


def _mounted_here(config: MountConfig) -> bool:
    """Whether this cache's mount is still at the mount point (not just another mount under it)."""
    source = f"{FSNAME_PREFIX}{os.path.realpath(config.cache_dir)}"
    return any(point == config.mountpoint and src == source for point, _, src, _ in mounts())


def _nested(a: Path, b: Path) -> bool:
    """Whether one of two resolved paths is, or is inside, the other."""
    return a == b or a in b.parents or b in a.parents


def check_overlaps(config: MountConfig) -> None:
    """Refuse a mount point, cache dir and file:// remote that nest (either way, after
    resolving links), and a cache dir inside another burstfs mount.

    Each of these wedges or corrupts the mount: a remote in the mount point asks
    the daemon itself for every listing (a deadlock on the first lookup miss),
    a remote over the cache shows and deletes the live journal, a mount point
    in the cache or a cache in a burstfs mount has the daemon serve its own
    files or drain them to someone else's remote.  Read-only: checked before
    anything is created.
    """
    places = {
        "mount point": Path(os.path.realpath(config.mountpoint)),
        "cache dir": Path(os.path.realpath(config.cache_dir)),
    }
    if config.remote.scheme == "file":
        places["file:// remote"] = Path(os.path.realpath(config.remote.prefix))
    named = list(places.items())
    for i, (name_a, a) in enumerate(named):
        for name_b, b in named[i + 1 :]:
            if _nested(a, b):
                how = "is" if a == b else ("is inside" if b in a.parents else "contains")
                raise ConfigError(f"the {name_a} {a} {how} the {name_b} {b}: they must not overlap")
    for name, path in places.items():
        if name == "mount point":
            continue
        inside = find_burstfs_mount(path)
        if inside is not None:
            raise ConfigError(
                f"the {name} {path} is inside the burstfs mount {inside[0]}: "
                "use a directory outside every burstfs mount"
            )


def _check_cache_owner(config: MountConfig) -> None:
    """Refuse a cache dir in use, or holding another remote's files, before touching it.

    Read-only, so that a refused mount changes nothing in the cache; the daemon
    checks again under the lock (``open_cache``) in case of a race.
    """
    cache = config.cache_dir
    owner = CacheLock(cache).owner_pid()
    if owner is not None:
        raise ConfigError(f"cache dir {cache} is in use by another burstfs process (pid {owner})")
    if not _journal_present(cache):
        _refuse_data_without_journal(cache)
        return
    try:
        journal = Journal(cache, readonly=True)
        try:
            recorded, store = journal.get_meta("remote"), recorded_store(journal.get_meta)
        finally:
            journal.close()
    except sqlite3.Error:  # e.g. a crash left a WAL that needs a writer: the daemon checks
        return
    if recorded is not None and recorded != str(config.remote):
        raise _other_remote(config, recorded)
    check_cache_store(config, store)


def _journal_present(cache: Path) -> bool:
    """Whether the cache has a journal: an empty ``journal.db`` is none (SQLite would make a fresh one)."""
    try:
        return (cache / "journal.db").stat().st_size > 0
    except FileNotFoundError:
        return False


def _refuse_data_without_journal(cache: Path) -> None:
    """A tier with data but no journal lost its journal: a mount would start a fresh journal and
    remove every data file it does not know as a crash's leftover, closed files not yet durable
    among them.  Refuse, and say what the files are."""
    if holds_data(cache):
        raise ConfigError(
            f"cache dir {cache} holds file data ({cache / 'data'}) but no journal (journal.db is missing "
            "or empty): burstfs cannot tell which files they are, and a mount would remove them; copy "
            "what you need out of data/ (each file there is one file's bytes) and move the cache dir aside"
        )


#: The mount's probe of the remote tries again after a temporary failure, after these pauses.
CHECK_RETRY_PAUSES_S = (0.5, 2.0)
#: Failures that say nothing about the configuration: the remote may answer in a moment.
TEMPORARY_KINDS = frozenset({"unavailable", "unreachable", THROTTLED})
#: A cache mounted on its remote before mounts anyway when the remote fails so: the
#: drain waits for it as it would have without the restart.
OUTAGE_KINDS = TEMPORARY_KINDS | {"no_space"}


def _other_remote(config: MountConfig, recorded: str) -> ConfigError:
    return ConfigError(
        f"cache dir {config.cache_dir} holds files for remote {recorded}, not {config.remote}; "
        "use another --cache, or drain and remove this one first"
    )


def check_remote(config: MountConfig, timeout: float = 20.0) -> str | None:
    """Fail the mount early when the remote is misconfigured (no bucket, access denied, not S3
    at that address) or, for a cache never mounted on it, unreachable.

    A temporary failure (a 503, a reset) is tried again, within ``timeout``.  A cache that
    was mounted on this remote before mounts anyway, with a warning: a daemon restarted
    during an outage (a crash, the watchdog, an upgrade) must go on taking checkpoints, and
    its drain waits for the remote as it would have without the restart.  Returns the
    failure then (the daemon warns of it once), else None.
    """

    async def probe() -> None:
        remote = open_remote(config.remote, config.s3)
        if _drained_to(config):
            remote.expect_established()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            for pause in (*CHECK_RETRY_PAUSES_S, None):
                try:
                    await asyncio.wait_for(remote.check(), max(0.1, deadline - loop.time()))
                    return
                except TimeoutError:
                    raise RemoteError(
                        f"remote {config.remote} did not answer within {timeout:.0f}s", kind="unreachable"
                    ) from None
                except RemoteError as exc:
                    if exc.kind not in TEMPORARY_KINDS or pause is None or loop.time() + pause >= deadline:
                        raise
                await asyncio.sleep(pause)
        finally:
            await remote.close()

    try:
        asyncio.run(probe())
    except RemoteError as exc:
        if exc.kind not in OUTAGE_KINDS or not _mounted_on(config):
            raise
        return str(exc)
    return None


def _mounted_on(config: MountConfig) -> bool:
    """Whether the cache dir's journal says it was mounted on ``config.remote`` before."""
    return _recorded(config, lambda journal: journal.get_meta("remote") == str(config.remote))


def _drained_to(config: MountConfig) -> bool:
    """Whether the cache dir's journal says a file of it became durable on ``config.remote``."""
    return _recorded(config, lambda journal: journal.drained_to(str(config.remote)))


def _recorded(config: MountConfig, ask: Callable[[Journal], bool]) -> bool:
    if not _journal_present(config.cache_dir):
        return False
    try:
        journal = Journal(config.cache_dir, readonly=True)
    except (BurstfsError, sqlite3.Error):
        return False
    try:
        return ask(journal)
    finally:
        journal.close()


def open_cache(config: MountConfig) -> tuple[CacheLock, Journal, MountConfig]:
    """Lock the cache dir and open its journal; refuse a cache that belongs to another remote
    or (with rounds open) to another node id.  Returns the config with the cache's node id.
    A file system that fails it (full, read-only) is said in one line."""
    try:
        return _open_cache(config)
    except (OSError, sqlite3.Error) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise BurstfsError(f"cannot set up cache dir {config.cache_dir}: {why}") from exc


def _open_cache(config: MountConfig) -> tuple[CacheLock, Journal, MountConfig]:
    os.umask(PRIVATE_UMASK)  # journal.db, its WAL and everything else: 0600
    secure_cache_dir(config.cache_dir)
    lock = CacheLock(config.cache_dir)
    lock.acquire()
    try:
        if not _journal_present(config.cache_dir):
            _refuse_data_without_journal(config.cache_dir)
        drop_reserve_if_full(config.cache_dir)
        journal = Journal(config.cache_dir)
        recorded = journal.get_meta("remote")
        if recorded is not None and recorded != str(config.remote):
            journal.close()
            raise _other_remote(config, recorded)
        try:
            check_cache_store(config, recorded_store(journal.get_meta))
        except ConfigError:
            journal.close()
            raise
        journal.set_meta("remote", str(config.remote))
        if config.remote.scheme == "s3":
            journal.set_meta(STORE_META, config.s3.store())
        config = _keep_node_id(config, journal)
        # The latest mount's options are the ones `burstfs drain` and `burstfs-admin` reuse.
        journal.set_meta("config", config.to_json())
    except BaseException:
        lock.release()
        raise
    return lock, journal, config


def _keep_node_id(config: MountConfig, journal: Journal) -> MountConfig:
    """A cache keeps the node id it was first mounted with: its rounds' intents are on the
    remote under that id, and other nodes' markers wait for dones by it (a cache remounted
    as another node published its done under the new name and wedged the checkpoint).
    Without --node-id (the host name by default: a cache moved to another host) the
    recorded id is kept; another explicit id is refused while a round is open."""
    wanted = config.drain.node_id or default_node_id()
    recorded = journal.get_meta("node_id")
    if recorded is not None and recorded != wanted and not config.drain.node_id:
        log.info("event=node_id_kept node_id=%s host_name=%s", recorded, wanted)
        wanted = recorded
    elif recorded is not None and recorded != wanted and (open_rounds := unfinished_rounds(journal)):
        journal.close()
        raise ConfigError(
            f"cache dir {config.cache_dir} has checkpoint rounds open as node {recorded!r} in "
            f"{', '.join(d or '/' for d in open_rounds[:3])}: other nodes wait for this node's part "
            f"under that name; mount it with --node-id {recorded} (or drain it first: "
            f"burstfs drain --cache {config.cache_dir} --now)"
        )
    journal.set_meta("node_id", wanted)
    # Saved with the config: `burstfs drain` of this cache (on any host) drains as this node.
    return dataclasses.replace(config, drain=dataclasses.replace(config.drain, node_id=wanted))


class StartupWatch:
    """Names the step a slow start-up is in, every ``warn_every`` seconds, until the mount is
    ready: ``burstfs mount`` waits for the daemon, and a silent wait says nothing about why.
    A thread of its own, so a step that blocks the trio loop (or runs before it) is named too."""

    #: After this many warnings, each thread's stack goes into the log once: the step's name
    #: says where the start-up waits, the stacks say on what (a hang seen twice in CI left
    #: nothing else to go on).
    STACKS_AFTER_WARNINGS = 2

    def __init__(self, warn_every: float = 10.0) -> None:
        self.started = time.monotonic()
        self.step = "opening the cache"
        self._ready = threading.Event()
        self._warn_every = warn_every
        threading.Thread(target=self._watch, name="startup-watch", daemon=True).start()

    def enter(self, step: str) -> None:
        self.step = step

    def ready(self) -> float:
        """Stop watching; returns the seconds the start-up took."""
        self._ready.set()
        return time.monotonic() - self.started

    def _watch(self) -> None:
        warnings = 0
        while not self._ready.wait(self._warn_every):
            log.warning("event=start_slow step=%r seconds=%.0f", self.step, time.monotonic() - self.started)
            warnings += 1
            if warnings == self.STACKS_AFTER_WARNINGS:
                log.warning("event=start_slow_stacks step=%r", self.step, extra={"detail": thread_stacks()})


def thread_stacks() -> str:
    """Every thread's current stack, innermost call last, for a log line about a hang."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"thread {names.get(ident, ident)}:\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


async def set_read_ahead(mountpoint: Path, nbytes: int, initialized: trio.Event) -> None:
    """Kernel readahead of the mount.  The default 128 KiB turns a 1 GiB sequential
    read into 8192 requests; 1 MiB requests cut the per-request cost 8x.

    The kernel sets readahead when it gets the INIT reply, so this waits for INIT
    to be answered.  Never by touching the mount itself: a thread of this daemon
    blocked in a request it was sent, when the daemon is killed, waits for an
    answer that cannot come and keeps the dead daemon from exiting.
    """
    await initialized.wait()
    device = device_of(mountpoint)
    knob = Path(f"/sys/class/bdi/{device}/read_ahead_kb")
    try:
        await trio.to_thread.run_sync(knob.write_text, f"{max(nbytes // 1024, 4)}\n")
    except OSError as exc:  # not root, or /sys read-only: slower reads, nothing worse
        log.warning("event=read_ahead_unchanged device=%s error=%s", device, exc)


def fuse_options(config: MountConfig) -> set[str]:
    options = set(pyfuse3.default_options)  # default_permissions: the kernel checks modes
    options |= {f"fsname={FSNAME_PREFIX}{os.path.realpath(config.cache_dir)}", "subtype=burstfs"}
    if config.allow_other:
        options.add("allow_other")
    return options


async def serve(config: MountConfig, ops: BurstOperations, on_ready: Callable[[], None], watch: StartupWatch) -> None:
    """Run the mount until it is unmounted or the daemon is told to stop."""
    core = ops.core
    drain = core.links.drain if isinstance(core.links.drain, DrainService) else None
    metrics = start_metrics(config, core, drain)  # outside the nursery: a busy port fails with a plain message
    systemd = SystemdNotifier.from_environment()  # a no-op outside a Type=notify unit
    async with trio.open_nursery() as nursery:
        if drain is not None:  # the mover's thread lives as long as this nursery
            watch.enter("starting the mover")
            await nursery.start(drain.run)
        if metrics is not None:
            nursery.start_soon(metrics.run)
        watch.enter("starting the committer, reaper and headroom tasks")
        await nursery.start(core.committer.run)
        await nursery.start(core.reaper.run)
        await nursery.start(core.headroom.run)
        if config.read_plans and core.links.fetcher is not None:
            await nursery.start(core.plans.run)
        if core.links.fetcher is not None:
            await nursery.start(core.orphans.run)
        watch.enter("opening the control socket")
        await nursery.start(serve_control, config, core, drain)
        nursery.start_soon(_stop_on_signals, core.capacity.stop_waiting)
        nursery.start_soon(stamp_alive, config.cache_dir)
        nursery.start_soon(set_read_ahead, config.mountpoint, config.read_ahead, ops.initialized)
        if core.links.fetcher is not None:  # a fresh cache sees the remote's root from the start
            watch.enter("listing the remote's root")
            await core.listings.refresh_bounded(core.namespace.dir(ROOT_INO))
        on_ready()
        startup_s = watch.ready()
        systemd.ready(f"mounted at {config.mountpoint}")
        nursery.start_soon(systemd.keep_alive)
        log.info(
            "event=mounted mountpoint=%s cache=%s remote=%s startup_s=%.2f",
            config.mountpoint,
            config.cache_dir,
            config.remote,
            startup_s,
        )
        await pyfuse3.main(min_tasks=4, max_tasks=64)
        systemd.stopping(f"unmounted {config.mountpoint}; files not yet durable stay staged in {config.cache_dir}")
        nursery.cancel_scope.cancel()


async def _stop_on_signals(stop_waiting: Callable[[], None]) -> None:
    """SIGTERM and SIGINT unmount; SIGHUP (logrotate's, a closed terminal) reopens the log.

    ``stop_waiting()`` fails the writes waiting for room on a full tier (ENOSPC): the FUSE
    loop returns only once every request is answered, and they would hold the stop for up to
    ``--full-timeout``."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            if signum == signal.SIGHUP:
                reopen_log_file()
                log.info("event=signal signal=SIGHUP action=reopen_log")
                continue
            log.info("event=signal signal=%s action=unmount", signal.Signals(signum).name)
            stop_waiting()
            pyfuse3.terminate()
            return


def passthrough_backing(config: MountConfig) -> passthrough.BackingFiles | None:
    """FUSE passthrough when this daemon can have it, else None (the writeback-cache path)."""
    if not config.passthrough:
        reason = "--no-passthrough"
    elif config.tier.cache_size is not None or config.tier.min_free:
        reason = "--cache-size/--min-free are enforced on writes, which passthrough hides from the daemon"
    else:
        reason = passthrough.unavailable_reason()
    passthrough.request(not reason)
    if reason:
        log.info("event=passthrough state=off reason=%s", reason)
        return None
    return passthrough.BackingFiles()


def run_mount(config: MountConfig, on_ready: Callable[[], None]) -> None:
    """Mount, serve until unmounted, then leave the cache consistent for the next start."""
    keep_freed_buffers()
    watch = StartupWatch()
    lock, journal, config = open_cache(config)
    try:
        watch.enter("recovering the cache")
        backing = passthrough_backing(config)
        drain = DrainService(
            Mover(config.cache_dir, config.remote, config.s3, config.drain), journal, intent_wait=config.remote_wait
        )
        core = BurstCore(
            config.cache_dir,
            journal,
            fsync_remote=config.fsync_remote,
            capacity=config.tier,
            list_ttl=config.list_ttl,
            listing_wait=config.remote_wait,
            digest_chunk_size=config.drain.part_size,
            backing=backing,
            drain=drain,
            fetcher=drain,
        )
        ops = BurstOperations(core, writeback_cache=config.writeback_cache, backing=backing)
        watch.enter("mounting (fusermount3)")
        try:
            pyfuse3.init(ops, str(config.mountpoint), fuse_options(config))
        except RuntimeError as exc:
            raise BurstfsError(f"mounting {config.mountpoint} failed: {exc}") from exc
        unmounted = False
        try:
            trio.run(serve, config, ops, on_ready, watch)
            unmounted = True
        finally:
            pyfuse3.close(unmount=not unmounted or _mounted_here(config))
            core.close()
        pending = journal.undrained().values()
        log.info(
            "event=unmounted mountpoint=%s undrained_files=%d undrained_bytes=%d",
            config.mountpoint,
            sum(f for f, _ in pending),
            sum(b for _, b in pending),
        )
    finally:
        watch.ready()  # a start-up that failed is not slow: the failure is logged
        journal.close()
        lock.release()


def mount(config: MountConfig, *, foreground: bool) -> int:
    """``burstfs mount``: returns the process exit code once the mount is live (or failed)."""
    os.umask(PRIVATE_UMASK)  # before the first file in the cache (or a temp file on the remote) exists
    preflight(config)
    log_file = config.cache_dir / "burstfs.log"

    def log_unavailable(unavailable: str | None) -> None:
        if unavailable is not None:
            log.warning(
                "event=remote_unavailable_at_mount remote=%s action=mount_anyway error=%s", config.remote, unavailable
            )

    if foreground:
        unavailable = check_remote(config)
        secure_cache_dir(config.cache_dir)
        setup_logging(config.log_level, log_file=log_file, stderr=True)
        log_unavailable(unavailable)
        run_mount(config, on_ready=lambda: None)
        return 0
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid:  # the parent waits for the daemon's verdict
        os.close(write_fd)
        with os.fdopen(read_fd) as pipe:
            verdict = pipe.read()
        if verdict.startswith("ready"):
            return 0
        # "error N: message": N is 2 for refused input (e.g. a cache dir taken meanwhile), else 1.
        kind, _, message = verdict.partition(": ")
        sys.stderr.write(message or "burstfs: the daemon died during start-up\n")
        os.waitpid(pid, 0)
        return 2 if kind == "error 2" else 1
    os.close(read_fd)
    status = os.fdopen(write_fd, "w")

    def ready() -> None:
        try:
            status.write("ready\n")
            status.close()
        except BrokenPipeError:  # nobody waits for the mount: it goes (``burstfs mount`` said it failed)
            raise BurstfsError("the burstfs mount command went away before the mount was ready") from None

    def tell_parent(exc: BaseException) -> None:
        # A refusal says all in its message; anything else (a nursery's sub-exceptions) needs its traceback.
        refusal = refusal_in(exc)
        if not status.closed:
            message = str(refusal) if refusal is not None else "".join(traceback.format_exception(exc))
            with contextlib.suppress(OSError):  # the parent is gone
                status.write(f"error {2 if isinstance(refusal, ConfigError) else 1}: burstfs: {message}\n")
                status.close()

    # The remote is probed here in the child, not before the fork: a daemon forked after its
    # parent's S3 client ran (OpenSSL 3's state, the resolver's threads) was seen to sit 60 s
    # in its own first SSL context.  Its warning still reaches the user's terminal.
    try:
        unavailable = check_remote(config)
    except BaseException as exc:
        tell_parent(exc)
        os._exit(1)
    if unavailable is not None:  # on the user's terminal (in the foreground, the log line says it there)
        sys.stderr.write(
            f"burstfs: warning: {unavailable}; cache {config.cache_dir} was mounted on this remote before, so "
            "it mounts anyway: closes are journaled as ever and drain once the remote answers\n"
        )
    if os.getppid() != parent:  # the mount command went away during the probe (killed, Ctrl-C)
        os._exit(1)
    _become_daemon()
    code = 0
    try:
        secure_cache_dir(config.cache_dir)
        setup_logging(config.log_level, log_file=log_file, stderr=False)
        log_unavailable(unavailable)
        run_mount(config, on_ready=ready)
    except BaseException as exc:  # the parent prints it; the log keeps the details
        code = 1
        log.error("event=daemon_failed error=%s", exc, exc_info=None if refusal_in(exc) is not None else exc)
        tell_parent(exc)
    os._exit(code)


def refusal_in(exc: BaseException) -> BurstfsError | None:
    """The BurstfsError that ``exc`` is, or is alone inside (nested) exception groups of: a
    start-up step run in a nursery (the mover's) fails that way, and says all in its message."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, BurstfsError) else None


def _become_daemon() -> None:
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    os.chdir("/")

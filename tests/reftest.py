"""The harness of the reference-model suite: an in-process node and the faults it suffers.

A :class:`Node` is what one ``burstfs mount`` runs, wired as the daemon wires it
(``BurstCore`` on a trio loop, the ``Mover`` on its asyncio thread through
``DrainService``) but without FUSE, so thousands of operation sequences run in
minutes.  Its remote is a real :class:`~burstfs.remote.FileRemote` behind a
:class:`FaultyRemote`, the failure-injecting client of mountpoint-s3's reftests:

- a *gate* holds every call that changes the remote while the model is not in a
  drain step, so the test decides when the mover may make progress and which
  operations happen while an upload is in flight;
- *faults*: the next N changing calls fail temporarily (retried) or permanently;
- a *crash switch*: after N more events (changing calls and journal writes of
  a drain step), every later journal write and remote change raises
  :class:`Crash`, as if the process had died at that commit point.  SQLite
  commits are atomic, so the journal on disk is exactly what a ``kill -9``
  there would leave.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

from burstfs.config import DrainOptions, RemoteURL, S3Options
from burstfs.core import BurstCore
from burstfs.drainservice import DrainService
from burstfs.errors import RemoteError
from burstfs.journal import ROOT_INO, Journal
from burstfs.mover import Mover
from burstfs.mover import scheduler as mover_scheduler
from burstfs.mover import timing as mover_timing
from burstfs.remote import FileRemote, RetryPolicy

# Calls that only read the remote pass the gate: restores and listings are the
# request path, which must work whatever the drain is doing.
READ_CALLS = frozenset(
    {
        "check",
        "get_object",
        "get_range",
        "open_range",
        "head",
        "list_dir",
        "list_all",
        "list_multipart_uploads",
        "is_temp_failure",
    }
)
# The mover's waits, shortened so that a sequence of drains takes milliseconds.
FAST_MOVER_TIMING = {
    "IDLE_RESCAN_S": 0.02,
    "REQUEUE_BACKOFF_S": 0.005,
    "REQUEUE_BACKOFF_MAX_S": 0.02,
    "HALT_PROBE_S": 0.02,
    "COALESCE_S": 0.001,
    "STALE_UPLOAD_RETRY_S": 0.02,
    "BURST_GAP_S": 0.005,
    "BURST_MAX_S": 0.05,
}
# Retries short enough that a few injected failures cost milliseconds.
FAST_RETRY = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.005)


class Crash(BaseException):
    """The simulated death of the daemon: nothing after it may reach the journal or the remote."""


class InjectedTempFailure(ConnectionResetError):
    """A temporary remote failure (a reset connection, a 503): retried by the object layer."""


class Faults:
    """What goes wrong, shared by one node's remote and journals."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gate_open = False
        self.temp_failures = 0
        self.permanent_failures = 0
        self.crash_after: int | None = None  # events left before the crash (drain steps only)
        self.crashed = False
        self.events = 0  # changing calls and journal writes seen: "progress" for the idle check
        self.in_flight = 0  # changing calls past the gate and not yet returned: the drain is not idle
        self.hold_at: int | None = None  # the n-th changing call of this drain step is held...
        self.on_hold: Callable[[], None] | None = None  # ...after running this (the interleaving)
        self.held = threading.Event()  # set while a call is held
        self.release = threading.Event()
        self.connections: list[sqlite3.Connection] = []  # closed at a crash: their locks die with them

    def tick(self, *, countable: bool) -> None:
        """One event; raises Crash once the crash switch has fired."""
        with self.lock:
            if self.crashed:
                raise Crash()
            self.events += 1
            if countable and self.gate_open and self.crash_after is not None:
                self.crash_after -= 1
                if self.crash_after <= 0:
                    self.crashed = True
                    raise Crash()

    def journal_write(self) -> None:
        self.tick(countable=True)


class FaultyRemote:
    """Wraps a remote: the gate, injected failures and the crash switch, by method name."""

    def __init__(self, inner: Any, faults: Faults) -> None:
        self._inner = inner
        self._faults = faults
        self.url = inner.url
        self.min_part_size = inner.min_part_size
        self.max_parts = inner.max_parts
        self.changing_calls = 0

    def is_temp_failure(self, exc: BaseException) -> bool:
        return isinstance(exc, InjectedTempFailure) or self._inner.is_temp_failure(exc)

    def is_throttling(self, exc: BaseException) -> bool:
        return self._inner.is_throttling(exc)

    def list_all(self, prefix: str = "") -> Any:
        return self._inner.list_all(prefix)

    async def close(self) -> None:
        await self._inner.close()  # even after a crash: the test process lives on

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name in READ_CALLS or not asyncio.iscoroutinefunction(attr):
            if asyncio.iscoroutinefunction(attr):
                return self._read_call(attr)
            return attr
        return self._changing_call(name, attr)

    def _read_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        async def call(*args: Any, **kw: Any) -> Any:
            if self._faults.crashed:
                raise Crash()
            return await fn(*args, **kw)

        return call

    def _changing_call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        faults = self._faults

        @functools.wraps(fn)
        async def call(*args: Any, **kw: Any) -> Any:
            while not faults.gate_open and not faults.crashed:
                await asyncio.sleep(0.002)
            with faults.lock:
                faults.in_flight += 1
            try:
                return await _past_the_gate(*args, **kw)
            finally:
                with faults.lock:
                    faults.in_flight -= 1

        async def _past_the_gate(*args: Any, **kw: Any) -> Any:
            self.changing_calls += 1
            if faults.hold_at is not None and self.changing_calls >= faults.hold_at:
                faults.hold_at = None
                if faults.on_hold is not None:  # the model's operations, while this call is in flight
                    await asyncio.to_thread(faults.on_hold)
                faults.held.set()
                while not faults.release.is_set() and not faults.crashed:
                    await asyncio.sleep(0.001)
            faults.tick(countable=True)
            with faults.lock:
                if faults.temp_failures > 0:
                    faults.temp_failures -= 1
                    raise InjectedTempFailure(f"injected: connection reset during {name}")
                if faults.permanent_failures > 0:
                    faults.permanent_failures -= 1
                    raise RemoteError(f"injected: access denied during {name}", kind="access_denied")
            return await fn(*args, **kw)

        return call


class _CrashableConnection:
    """A sqlite3 connection whose writes stop at the crash switch."""

    _WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE", "BEGIN", "COMMIT", "CREATE", "ALTER", "DROP")

    def __init__(self, db: sqlite3.Connection, faults: Faults) -> None:
        self._db = db
        self._faults = faults

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.lstrip().upper().startswith(self._WRITES):
            self._faults.journal_write()
        elif self._faults.crashed and not sql.lstrip().upper().startswith("ROLLBACK"):
            raise Crash()
        return self._db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._faults.journal_write()
        return self._db.executemany(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._db, name)


_FAULTS_BY_CACHE: dict[Path, Faults] = {}


def _mover_journal(cache_dir: Path, **kw: Any) -> Journal:
    faults = _FAULTS_BY_CACHE.get(Path(cache_dir))
    return crashable_journal(Path(cache_dir), faults) if faults is not None else Journal(cache_dir, **kw)


def crashable_journal(cache: Path, faults: Faults) -> Journal:
    journal = Journal(cache)
    database = journal.database
    faults.connections.append(database.connection)
    database.connection = _CrashableConnection(database.connection, faults)  # type: ignore[assignment]
    return journal


@dataclasses.dataclass
class NodeOptions:
    """A node as the model mounts it: small parts so that multipart uploads happen."""

    part_size: int = 64 << 10
    max_files: int = 2
    list_ttl: float = 0.0
    node_id: str = "node-a"  # each node of a shared prefix has its own (as --node-id makes sure)


def drain_options(part_size: int, max_files: int, node_id: str) -> DrainOptions:
    options = DrainOptions(max_files=max_files, concurrency=2, node_id=node_id)
    # The 5 MiB floor is S3's; the file remote takes any part size, and small
    # parts put multipart uploads within reach of small test files.
    object.__setattr__(options, "part_size", part_size)
    return options


class Node:
    """One daemon's core, journal and mover, in this process."""

    def __init__(self, cache: Path, remote: RemoteSide, options: NodeOptions, faults: Faults | None = None) -> None:
        self.cache = cache
        self.side = remote
        self.options = options
        self.faults = faults or Faults()
        cache.mkdir(mode=0o700, exist_ok=True)
        self.journal = crashable_journal(cache, self.faults)
        self.core = BurstCore(cache, self.journal, digest_chunk_size=options.part_size, list_ttl=options.list_ttl)
        url = remote.url
        self.remote = FaultyRemote(remote.open(), self.faults)
        _FAULTS_BY_CACHE[cache] = self.faults  # the mover opens its journal (again, after a restart) by path
        self.mover = Mover(
            cache,
            url,
            remote.s3_options,
            drain_options(options.part_size, options.max_files, options.node_id),
            remote=self.remote,
        )  # type: ignore[arg-type]
        # A close does not wait for its directory's intent record: the gate holds every remote
        # change outside drain steps, so each close would wait the whole bound.
        self.drain = DrainService(self.mover, self.journal, intent_wait=0.0)
        self.core.links.drain = self.drain
        self.core.links.fetcher = self.drain
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._started = threading.Event()
        self.trio_error: BaseException | None = None
        self._trio_thread = threading.Thread(target=self._trio_main, name="model-trio", daemon=True)
        self._trio_thread.start()
        self._started.wait(10)
        self.drain.start()
        self.drain.wait_ready(10)
        assert self.mover.store is not None
        self.mover.store.retry = FAST_RETRY
        self.mover.restore.store.retry = FAST_RETRY  # reads have a store (and retry budget) of their own
        self._reader = sqlite3.connect(f"file:{cache / 'journal.db'}?mode=ro", uri=True, check_same_thread=False)

    def _trio_main(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                await nursery.start(self.core.committer.run)
                await nursery.start(self.core.reaper.run)
                await nursery.start(self.core.plans.run)  # a cold node's read-back walks DCP read plans
                await nursery.start(self.core.orphans.run)
                self._started.set()
                await self._stop.wait()
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        except BaseException as exc:  # a Crash in the committer: the node is dead
            self.trio_error = exc
            self._started.set()

    # -- calling the core ------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run core method ``fn`` on the node's trio loop (async or not) and return its result."""
        if self.trio_error is not None or not self._trio_thread.is_alive():
            raise Crash()

        async def run() -> Any:
            result = fn(*args, **kw)
            if hasattr(result, "__await__"):
                result = await result
            return result

        try:
            return trio.from_thread.run(run, trio_token=self._token)
        except trio.RunFinishedError:  # the loop died (a Crash in the committer) after the check above
            self._trio_thread.join(10)
            if self.trio_error is None:
                raise
            raise Crash() from self.trio_error

    def resolve(self, path: str) -> int:
        """The inode of ``path`` (no remote lookup); KeyError if absent."""
        ino = ROOT_INO
        for part in filter(None, path.split("/")):
            children = self.core.inodes[ino].children
            if children is None or os.fsencode(part) not in children:
                raise KeyError(path)
            ino = children[os.fsencode(part)]
        return ino

    def parent_and_name(self, path: str) -> tuple[int, bytes]:
        head, _, name = path.rpartition("/")
        return self.resolve(head), os.fsencode(name)

    def name_row(self, path: str) -> int:
        """The journal row of the name ``path``: its inode's own, or a hard link's (``link_of``)."""
        parent, name = self.parent_and_name(path)
        ((row,),) = self.rows("SELECT ino FROM inodes WHERE parent=? AND name=?", (parent, name))
        return int(row)

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self._reader.execute(sql, params).fetchall()

    # -- draining ------------------------------------------------------------------

    def pending(self, tolerated: frozenset[str] = frozenset()) -> list[str]:
        """What the mover still has to do (empty: idle), named for the failure message.

        tolerated: paths of staged files that may legitimately wait for good (a
        commit marker behind a file left incomplete by a crash, or behind a file still
        open for writing).  A file closed while another of its handles stays open for
        writing waits for that handle's release (the mover holds it): not pending.
        """
        reasons = []
        for ino, data_ino, state, seq, error, generation in self.rows(
            "SELECT ino, COALESCE(link_of, ino), state, close_seq, error, generation FROM inodes "
            "WHERE kind='file' AND parent!=0 AND state IN ('staged','draining')"
        ):
            path = self.journal_path(ino)
            if state == "staged" and self.mover.held_open.get(data_ino) == generation:
                continue
            if not (state == "staged" and path in tolerated):
                reasons.append(f"{state} {path} (ino {ino}, close_seq {seq}, error {error})")
        reasons += [f"delete {key} ({reason})" for key, reason in self.rows("SELECT key, reason FROM remote_deletes")]
        if self.commit_records_due():
            reasons.append("commit records (intent, done or commit) not published yet")
        reasons += [
            f"upload {key} ({upload_id}) not finished or aborted"
            for key, upload_id in self.rows("SELECT key, upload_id FROM uploads")
        ]
        for ino, key in self.rows(
            "SELECT ino, remote_key FROM inodes WHERE kind='file' AND parent!=0 AND remote_key IS NOT NULL "
            "AND state IN ('durable','evicted')"
        ):
            path = self.journal_path(ino)
            if path is not None and path != key:
                reasons.append(f"relocation {key} -> {path}")
        return reasons

    def commit_records_due(self) -> bool:
        """Whether this node has intent, done or commit records it can publish now: outside its
        drain steps the gate holds them, and another node's marker may wait for them."""
        loop = self.mover.loop
        if loop is None or self.faults.crashed:
            return False
        try:
            return asyncio.run_coroutine_threadsafe(self.mover.groups.has_work(), loop).result(10)
        except (Exception, Crash):  # the mover stopped or crashed meanwhile: nothing it can publish now
            return False

    def gate_state(self) -> str:
        """What the commit gate knows, for a wedge's failure message: this node's rounds, the
        verdicts of the directories markers wait on, and the records backing off."""
        groups = self.mover.groups
        rounds = [
            f"{g.dir_key}:{g.round} intent={g.intent} sealed={g.sealed} done={g.done} members={sorted(g.members)}"
            for g in list(groups.groups.values())
        ]
        verdicts = {
            d: f"listed_at={v.listed_at:.3f} waiting={v.waiting} own_pending={v.own_pending}"
            for d, v in list(groups.verdicts.items())
        }
        markers = self.rows("SELECT ino, name, updated, generation FROM inodes WHERE state='staged' AND parent!=0")
        return (
            f"rounds={rounds} verdicts={verdicts} retry_at={dict(groups._retry_at)} "
            f"failures={dict(groups._failures)} staged={markers} now={time.time():.3f}"
        )

    def journal_path(self, ino: int) -> str | None:
        parts = []
        while ino != ROOT_INO:
            row = self.rows("SELECT parent, name FROM inodes WHERE ino=?", (ino,))
            if not row or row[0][0] == 0:
                return None
            parts.append(os.fsdecode(row[0][1]))
            ino = row[0][0]
        return "/".join(reversed(parts))

    def drain_until_idle(self, timeout: float = 60.0, tolerated: Callable[[], frozenset[str]] = frozenset) -> str:
        """Open the gate until the mover has nothing left it can do.

        Returns "idle", "halted" (a permanent fault stopped the drain) or "crashed".
        Raises AssertionError if the drain makes no progress within ``timeout``.
        """
        faults = self.faults
        faults.gate_open = True
        try:
            outcome = self._drain_with_gate_open(timeout, tolerated)
        finally:
            with faults.lock:  # a countable event after the last look may have crashed the node
                faults.gate_open = False
        return "crashed" if faults.crashed else outcome

    def _drain_with_gate_open(self, timeout: float, tolerated: Callable[[], frozenset[str]]) -> str:
        faults = self.faults
        deadline = time.monotonic() + timeout
        self.mover.drain_now()
        quiet, last = 0, None
        while time.monotonic() < deadline:
            if faults.crashed:
                return "crashed"
            if self.drain.last_crash is not None:
                raise AssertionError(f"the mover died: {self.drain.last_crash!r}")
            if faults.held.is_set():
                return "held"
            if self.mover.stats.halted is not None:
                return "halted"
            # A call past the gate (one held back while the model's interleaving runs, an
            # intent record) is work in progress even when the journal shows none.
            signature = (faults.events, faults.in_flight, self.pending(tolerated()))
            quiet = quiet + 1 if signature == last and not signature[1] and not signature[2] else 0
            last = signature
            if quiet >= 3:
                return "idle"
            time.sleep(0.003)
            self.mover.wake()
        raise AssertionError(f"the drain is wedged: {self.pending(tolerated())}; {self.gate_state()}")

    def drain_until_idle_while_held(self, quiet_polls: int = 10) -> None:
        """With one call held, let everything else the mover can do happen."""
        self.faults.gate_open = True
        try:
            self.mover.drain_now()
            quiet, last = 0, -1
            deadline = time.monotonic() + 10
            while quiet < quiet_polls and time.monotonic() < deadline and not self.faults.crashed:
                quiet = quiet + 1 if self.faults.events == last else 0
                last = self.faults.events
                time.sleep(0.003)
                self.mover.wake()
        finally:
            self.faults.gate_open = False

    # -- stopping ------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the node: cleanly, or after a crash (nothing more reaches the journal)."""
        self.faults.release.set()
        self.drain.stop(10)
        if self._trio_thread.is_alive() and self._stop is not None and self._token is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._trio_thread.join(10)
        self.core.close()
        self._reader.close()
        for db in self.faults.connections:  # what a dead process leaves: no open transaction
            db.close()


@contextlib.contextmanager
def fast_mover() -> Iterator[None]:
    """Shorten the mover's waits, and give its journals the crash switch, for the duration of a test."""
    patched = [(mover_timing, name, value) for name, value in FAST_MOVER_TIMING.items()]
    patched.append((mover_scheduler, "Journal", _mover_journal))
    saved = [(module, name, getattr(module, name)) for module, name, _ in patched]
    for module, name, value in patched:
        setattr(module, name, value)
    # Upload tasks a simulated crash ends hold a Crash nobody retrieves: not worth a log line each.
    asyncio_log = logging.getLogger("asyncio")
    level = asyncio_log.level
    asyncio_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        asyncio_log.setLevel(level)
        for module, name, value in saved:
            setattr(module, name, value)


class RemoteSide:
    """The remote as the test sees it, around burstfs: what it holds, and damage done behind its back."""

    url: RemoteURL
    s3_options: S3Options = S3Options()

    def open(self) -> Any:
        """A new client of this remote for a node."""
        raise NotImplementedError

    def objects(self) -> dict[str, bytes]:
        """Every object outside ``.burstfs``, by key."""
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    def manifest_keys(self) -> set[str]:
        """The keys that have a manifest under ``.burstfs/manifests``."""
        raise NotImplementedError

    def uploads_left(self) -> bool:
        """True if a multipart upload was started and never completed or aborted."""
        raise NotImplementedError


class FileSide(RemoteSide):
    """A ``file://`` remote: a directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = RemoteURL("file", "", str(root))

    def open(self) -> Any:
        return FileRemote(self.url)

    def objects(self) -> dict[str, bytes]:
        return remote_files(self.root)

    def get(self, key: str) -> bytes | None:
        path = self.root / key
        return path.read_bytes() if path.is_file() else None

    def put(self, key: str, data: bytes) -> None:
        (self.root / key).write_bytes(data)

    def manifest_keys(self) -> set[str]:
        manifests = self.root / ".burstfs" / "manifests"
        found = manifests.rglob("*.json") if manifests.exists() else ()
        return {f.relative_to(manifests).as_posix()[: -len(".json")] for f in found}

    def uploads_left(self) -> bool:
        uploads = self.root / ".burstfs" / "uploads"
        return uploads.exists() and any(uploads.iterdir())


class S3Side(RemoteSide):
    """An S3 prefix on the tests' moto server, read and damaged with plain boto3."""

    def __init__(self, endpoint: str, bucket: str, prefix: str) -> None:
        import boto3

        self.url = RemoteURL("s3", bucket, prefix)
        self.s3_options = S3Options(endpoint_url=endpoint)
        self.bucket, self.prefix = bucket, prefix
        self.client = boto3.client("s3", endpoint_url=endpoint)

    def open(self) -> Any:
        from burstfs.remote.s3 import S3Remote

        return S3Remote(self.url, self.s3_options, max_connections=16)

    def _keys(self, under: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=f"{self.prefix}/{under}"
        )
        return [obj["Key"][len(self.prefix) + 1 :] for page in pages for obj in page.get("Contents", [])]

    def objects(self) -> dict[str, bytes]:
        return {key: self.get(key) or b"" for key in self._keys() if not key.startswith(".burstfs/")}

    def get(self, key: str) -> bytes | None:
        try:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}")["Body"].read())
        except self.client.exceptions.NoSuchKey:
            return None

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{key}", Body=data)

    def manifest_keys(self) -> set[str]:
        prefix = ".burstfs/manifests/"
        return {k[len(prefix) : -len(".json")] for k in self._keys(prefix) if k.endswith(".json")}

    def uploads_left(self) -> bool:
        listing = self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=f"{self.prefix}/")
        return bool(listing.get("Uploads"))


def remote_files(remote_dir: Path) -> dict[str, bytes]:
    """Every object of the file remote outside ``.burstfs``, by key."""
    found: dict[str, bytes] = {}
    for dirpath, _dirnames, filenames in os.walk(remote_dir):
        rel = os.path.relpath(dirpath, remote_dir)
        if rel == ".burstfs" or rel.startswith(".burstfs/"):
            continue
        for name in filenames:
            key = name if rel == "." else f"{rel}/{name}"
            if stat.S_ISREG(os.lstat(os.path.join(dirpath, name)).st_mode):
                found[key] = Path(dirpath, name).read_bytes()
    return found

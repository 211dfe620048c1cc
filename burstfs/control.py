"""The control socket of a live mount, and the journal queries behind ``burstfs-admin``.

``CACHE/control.sock`` speaks one JSON object per line: a request
``{"op": ..., ...}`` gets one response line ``{"ok": true, ...}`` or
``{"ok": false, "error": "...", "errno": N}``.  A long operation (``prefetch``)
first sends progress lines marked ``"more": true``.  docs/ADMIN.md documents
every op and field.

Access: the socket is made owner-only before it accepts connections, and the
server also checks the peer's uid (``SO_PEERCRED``), so only the daemon's own
user and root can read the namespace or steer the drain, even if someone loosens
the file's mode.

The server runs in the daemon's trio nursery.  Anything that touches SQLite or
the local tier's files runs in a worker thread on a read-only journal
connection of its own, so a slow query never stalls a FUSE request.  The query
functions at module level are shared with ``burstfs-admin``, which runs them
against the journal of a stopped mount.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
import xxhash

from .config import MountConfig, RemoteURL, S3Options
from .errors import BurstfsError, CorruptDataError, FsError, RemoteNotFound
from .journal import (
    CLOSED_UNDRAINED,
    FILE_STATES,
    NOT_LOCAL,
    QUEUED,
    REMOTE,
    ROOT_INO,
    WRITING,
    InodeRow,
    Journal,
    set_meta_op,
)
from .localtier import LocalTier

if TYPE_CHECKING:  # burstfs-admin imports this module: keep the mover (aiobotocore) out of its start-up
    from .core import BurstCore, Inode
    from .drainservice import DrainService

log = logging.getLogger("burstfs.control")

SOCKET_NAME = "control.sock"
SCHEMA = 1  # version of the JSON documents (docs/ADMIN.md); bump on incompatible change
MAX_LINE = 1 << 20  # longest request accepted: a path list of a few thousand files
PREFETCH_FILES_AT_ONCE = 4  # each core.prefetch is parallel inside; a few files hide per-file latency
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL


# -- journal queries (live daemon and stopped mount alike) -----------------------------------


def lookup(journal: Journal, rel: str) -> InodeRow | None:
    """The inode at ``rel`` (relative to the file-system root, "" = root), or None."""
    row = journal.inode(ROOT_INO)
    for part in filter(None, rel.split("/")):
        if row is None:
            return None
        row = journal.child(row.ino, os.fsencode(part))
    return row


def files_under(journal: Journal, rel: str) -> list[tuple[str, InodeRow]]:
    """(path, row) of the file at ``rel``, or of every file below the directory ``rel``.

    Raises FsError(ENOENT) when nothing is there, so a typo is an error, not an empty result.
    """
    top = lookup(journal, rel)
    if top is None:
        raise FsError(errno.ENOENT, f"/{rel}: {os.strerror(errno.ENOENT)}")
    if top.kind != "dir":
        return [(rel, top)] if top.kind == "file" else []
    rows = journal.subtree(top.ino)
    by_ino = {row.ino: row for row in rows}
    paths: dict[int, str] = {top.ino: rel}

    def path(row: InodeRow) -> str:
        if row.ino not in paths:
            parent = path(by_ino[row.parent])
            paths[row.ino] = f"{parent}/{os.fsdecode(row.name)}" if parent else os.fsdecode(row.name)
        return paths[row.ino]

    found = [(path(row), row) for row in rows if row.kind == "file"]
    return sorted(found, key=lambda item: item[0])


def files_at(journal: Journal, rels: list[str]) -> list[tuple[str, InodeRow]]:
    """files_under for several paths, each file once."""
    seen: dict[int, tuple[str, InodeRow]] = {}
    for rel in rels:
        for path, row in files_under(journal, rel):
            seen.setdefault(row.ino, (path, row))
    return list(seen.values())


def file_info(path: str, row: InodeRow) -> dict[str, Any]:
    """One file of ``ls`` (docs/ADMIN.md: ls)."""
    return {
        "path": path,
        "ino": row.ino,
        "state": row.state,
        "size": row.size,
        "generation": row.generation,
        "durable_generation": row.durable_generation,
        "digest": row.digest,
        "remote_key": row.remote_key,
        "local_bytes": row.local_bytes,
        "mtime": row.mtime_ns / 1e9,
        "error": row.error,
    }


def list_files(journal: Journal, rel: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "files": [file_info(path, row) for path, row in files_under(journal, rel)]}


def _closed_at(journal: Journal, ino: int, fallback: float) -> float:
    # Newest 'closed' event of the file, scanning back from the end of the log: the
    # oldest undrained file is usually recent, so the scan stays short.
    closed = journal.last_closed_at(ino)
    return fallback if closed is None else closed


#: Error kinds that say the remote cannot be reached or is not answering (vs. a refusal
#: or a per-file problem): temporary failures after retries, a failed start-up probe.
UNREACHABLE_KINDS = frozenset({"unavailable", "unreachable"})
#: An outage is reported while its latest error is at most this old.
OUTAGE_FRESH_S = 300.0


def short_reason(message: str) -> str:
    """An error message for a headline: URLs cut to their host (no upload ids, no keys), bounded."""
    text = re.sub(r"https?://([^/\s'\"]+)[^\s'\"]*", r"\1", " ".join(message.split()))
    return text if len(text) <= 200 else text[:197] + "..."


def outage_of(stats: Any, now: float | None = None) -> dict[str, Any] | None:
    """The drain's trouble since its last progress: ``{"since", "reason", "kind", "errors",
    "unreachable"}``, or None while files drain (or nothing failed).

    Errors recorded after the newest durable file, the latest within
    OUTAGE_FRESH_S, make an outage.  It started at the first failed attempt the
    mover noted for them (``MoverStats.trouble_since``), else at the first of them.
    ``unreachable`` comes from the error's kind, never from its message text.
    """
    now = time.time() if now is None else now
    last_progress = max((t for t, _ in list(stats.bytes_drained_recent)), default=0.0)
    errors = [(t, k, m) for t, k, m in list(stats.recent_errors) if t > last_progress]
    if not errors or now - errors[-1][0] > OUTAGE_FRESH_S:
        return None
    _, kind, reason = errors[-1]
    since = getattr(stats, "trouble_since", None)
    if since is None or since <= last_progress or since > errors[0][0]:
        since = errors[0][0]
    return {"since": since, "reason": short_reason(reason), "kind": kind, "errors": len(errors),
            "unreachable": kind in UNREACHABLE_KINDS}  # fmt: skip


def _held_bytes(journal: Journal, data_dir: Path) -> int:
    """Bytes the local tier holds for files: each file's journaled local bytes, but no
    more than its data file has allocated (``st_blocks * 512``), so a sparse file
    (an ``incomplete`` one a write failed in, a hole-punched one) counts what it
    takes, not its logical size."""
    total = 0
    for ino, local in journal.local_bytes_by_file():
        try:
            allocated = os.stat(data_dir / f"{int(ino):016x}").st_blocks * 512  # LocalTier.path; no LocalTier: it mkdirs
        except OSError:  # removed meanwhile (evicted, unlinked): holds nothing
            continue
        total += min(int(local), allocated)
    return total


def journal_status(journal: Journal, cache_dir: Path) -> dict[str, Any]:
    """Everything status can tell from the journal and the cache dir alone (no daemon)."""
    states = {state: {"files": 0, "bytes": 0} for state in FILE_STATES}
    for state, (files, nbytes) in journal.state_counts().items():
        states.setdefault(state, {"files": 0, "bytes": 0}).update(files=files, bytes=nbytes)
    local_bytes = _held_bytes(journal, cache_dir / "data")
    oldest = journal.oldest_closed_undrained()
    oldest_closed = _closed_at(journal, *oldest) if oldest else None
    tier = os.statvfs(LocalTier(cache_dir).data_dir) if (cache_dir / "data").is_dir() else None
    return {
        "schema": SCHEMA,
        "live": False,
        "mountpoint": journal.get_meta("mountpoint"),
        "cache_dir": str(cache_dir),
        "remote": journal.get_meta("remote"),
        "pid": None,
        "data_path": None,
        "daemon_written_bytes": None,
        "states": states,
        "undrained": {
            "files": sum(states[s]["files"] for s in CLOSED_UNDRAINED),
            "bytes": sum(states[s]["bytes"] for s in CLOSED_UNDRAINED),
            "oldest_closed_at": oldest_closed,
            "oldest_age_s": None if oldest_closed is None else max(0.0, time.time() - oldest_closed),
        },
        "drain": {
            "throughput_bps": None,
            "eta_s": 0.0 if not sum(states[s]["bytes"] for s in QUEUED) else None,
            "files_drained": None,
            "bytes_drained": None,
            "outage": None,
            "halted": None,
            "mover_crashed": None,
            "errors_by_kind": {},
            "recent_errors": [],
        },
        "local_tier": {
            "path": str(cache_dir / "data"),
            "used_bytes": local_bytes,
            "fs_total_bytes": tier.f_blocks * tier.f_frsize if tier else None,
            "fs_free_bytes": tier.f_bavail * tier.f_frsize if tier else None,
            "limit_bytes": None,
            "mount_total_bytes": None,
            "mount_free_bytes": None,
        },
    }


def journal_events(journal: Journal, since: float, rel: str = "", limit: int = 1000) -> dict[str, Any]:
    """Events since ``since`` (epoch seconds), only those of files under ``rel`` when given."""
    wanted = None if not rel else {row.ino for _, row in files_under(journal, rel)}
    events = []
    for when, ino, event, detail in journal.events(since, limit):
        if wanted is not None and ino not in wanted:
            continue
        path = journal.path_of(ino) if ino is not None else None
        events.append({"time": when, "ino": ino, "path": path, "event": event, "detail": detail})
    return {"schema": SCHEMA, "events": events}


# -- verify -----------------------------------------------------------------------------------


def _verify_local(cache_dir: Path, journal: Journal, row: InodeRow) -> tuple[str, str]:
    """('ok' | 'mismatch' | 'skipped', detail): the staged bytes against the journaled digest."""
    from .objects import compute_digests

    if row.state in NOT_LOCAL:
        return "skipped", "not on the local tier"
    if row.state == WRITING:
        return "skipped", "open for writing"
    if not row.digest or not row.chunk_size:
        return "skipped", f"no digest recorded yet (state {row.state})"
    digests = compute_digests(LocalTier(cache_dir).path(row.ino), row.chunk_size)
    current = journal.inode(row.ino)
    if current is None or current.generation != row.generation:
        return "skipped", "changed while it was being verified"
    if digests.digest == row.digest and digests.size == row.size:
        return "ok", f"generation {row.generation}"
    if digests.size != row.size:
        return "mismatch", f"local data is {digests.size} bytes, journal says {row.size}"
    expected = row.chunk_digests()
    bad = next((i for i, (a, b) in enumerate(zip(digests.chunks, expected)) if a != b), None)
    where = f"bytes {bad * row.chunk_size}-{min((bad + 1) * row.chunk_size, row.size)}" if bad is not None else "data"
    return "mismatch", f"{where} differ from the checksum taken at close (generation {row.generation})"


async def _verify_remote(store: Any, row: InodeRow) -> tuple[str, str]:
    """('ok' | 'mismatch' | 'skipped', detail): the remote object against its manifest and the journal.

    A ``remote`` file (listed, another node drained it) has no journaled digest
    here: its object is checked against its manifest alone, chunk by chunk.
    """
    listed = row.state == REMOTE
    if not row.remote_key or (row.durable_generation is None and not listed):
        return "skipped", "not on the remote yet"
    key = row.remote_key
    try:
        manifest = await store.fetch_manifest(key)
        if manifest is None:
            return "mismatch", f"no burstfs manifest for {key}: the object cannot be verified"
        if not listed and manifest.generation == row.generation and row.digest and manifest.digest != row.digest:
            return "mismatch", f"manifest of {key} has digest {manifest.digest}, journal {row.digest}"
        whole = xxhash.xxh3_128()
        for start in range(0, manifest.size, manifest.chunk_size):
            whole.update(await store.read_range(key, manifest, start, start + manifest.chunk_size))
    except CorruptDataError as exc:
        return "mismatch", str(exc)
    except RemoteNotFound:
        return "mismatch", f"object {key} is missing on the remote"
    if whole.hexdigest() != manifest.digest:
        return "mismatch", f"object {key} hashes to {whole.hexdigest()}, manifest says {manifest.digest}"
    if listed:
        return "ok", f"generation {manifest.generation} (against its manifest)"
    older = "" if manifest.generation == row.generation else f" (local has generation {row.generation})"
    return "ok", f"generation {manifest.generation}{older}"


async def _verify_remote_all(remote: RemoteURL, s3: S3Options | None, rows: list[InodeRow]) -> list[tuple[str, str]]:
    from .objects import ObjectStore
    from .remote import open_remote

    store = ObjectStore(open_remote(remote, s3, max_connections=8))
    try:
        return [await _verify_remote(store, row) for row in rows]
    finally:
        await store.remote.close()


def verify(
    cache_dir: Path, journal: Journal, rels: list[str], remote: RemoteURL | None = None, s3: S3Options | None = None
) -> dict[str, Any]:
    """Re-hash files (blocking; run in a thread).  With ``remote`` also read their objects back."""
    files = sorted(files_at(journal, rels), key=lambda item: item[0])
    local = [_verify_local(cache_dir, journal, row) for _, row in files]
    checked_remote = asyncio.run(_verify_remote_all(remote, s3, [row for _, row in files])) if remote else None
    results = []
    for index, (path, _) in enumerate(files):
        checks = {"local": local[index]}
        if checked_remote is not None:
            checks["remote"] = checked_remote[index]
        verdicts = [verdict for verdict, _ in checks.values()]
        result = "MISMATCH" if "mismatch" in verdicts else "OK" if "ok" in verdicts else "SKIPPED"
        entry: dict[str, Any] = {"path": path, "result": result}
        for name, (verdict, detail) in checks.items():
            entry[name] = {"result": verdict, "detail": detail}
        results.append(entry)
    mismatches = sum(r["result"] == "MISMATCH" for r in results)
    if mismatches:
        log.error("event=verify_mismatch files=%d", mismatches)
    skipped = sum(r["result"] == "SKIPPED" for r in results)
    return {"schema": SCHEMA, "files": results, "mismatches": mismatches, "skipped": skipped}


# -- the socket ------------------------------------------------------------------------------


def error_response(exc: BaseException) -> dict[str, Any]:
    code = getattr(exc, "errno", None) or errno.EIO
    return {"ok": False, "error": str(exc) or errno.errorcode.get(code, "error"), "errno": code}


@contextlib.contextmanager
def socket_address(path: Path) -> Iterator[str]:
    """An address for ``path`` that fits sun_path, via /proc/self/fd when the path is long."""
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def peer_uid(sock: Any) -> int:
    _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return int(uid)


class ControlServer:
    """Answers ``burstfs-admin`` for one mount."""

    def __init__(self, config: MountConfig, core: BurstCore, drain: DrainService | None) -> None:
        self.config = config
        self.core = core
        self.drain = drain
        self.path = config.cache_dir / SOCKET_NAME
        self.journal = Journal(config.cache_dir, readonly=True)
        self._ops: dict[str, Callable[[dict[str, Any], Callable[[dict[str, Any]], Awaitable[None]]],
                                      Awaitable[dict[str, Any]]]] = {
            "status": self._status,
            "ls": self._ls,
            "drain_now": self._drain_now,
            "retry": self._retry,
            "evict": self._evict,
            "prefetch": self._prefetch,
            "verify": self._verify,
            "journal": self._journal,
        }  # fmt: skip

    async def listen(self) -> trio.SocketListener:
        """Bind ``CACHE/control.sock`` owner-only, then listen.

        The mode is set between bind and listen: before listen() every connect is
        refused, so there is no moment where a wider mode lets anyone in (a umask
        would do the same, but it is process-wide and the mover thread creates files).
        """
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # left by a crashed daemon; the cache lock says it is ours
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with socket_address(self.path) as address:
                await sock.bind(address)
            os.chmod(self.path, stat.S_IRUSR | stat.S_IWUSR)
            sock.listen(16)
        except BaseException:
            sock.close()
            raise
        return trio.SocketListener(sock)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled (the mount ends); removes the socket on the way out."""
        listener = await self.listen()
        try:
            # Lets burstfs-admin map paths under the mount point while the mount is down.
            await self.core.committer.commit(
                [set_meta_op("mountpoint", str(self.config.mountpoint))]
            )
            log.info("event=control_listening socket=%s", self.path)
            task_status.started()
            await trio.serve_listeners(self._serve_connection, [listener])
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self.journal.close()

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            uid = peer_uid(stream.socket)
            if uid not in (0, os.geteuid()):
                log.warning("event=control_refused uid=%d", uid)
                refusal = FsError(errno.EACCES, f"uid {uid} may not use this mount's control socket "
                                                f"(only uid {os.geteuid()} and root)")  # fmt: skip
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    with trio.move_on_after(5):  # answer the request, as clients expect, if one comes
                        await stream.receive_some(MAX_LINE)
                    await self._send(stream, error_response(refusal))
                return
            buffer = b""
            try:
                while True:
                    while b"\n" not in buffer:
                        data = await stream.receive_some(65536)
                        if not data:
                            return
                        buffer += data
                        if len(buffer) > MAX_LINE and b"\n" not in buffer:
                            await self._send(stream, error_response(FsError(errno.E2BIG, "request too long")))
                            return
                    line, _, buffer = buffer.partition(b"\n")
                    await self._send(stream, await self._answer(line, stream))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client went away; nothing to answer

    @staticmethod
    async def _send(stream: trio.SocketStream, message: dict[str, Any]) -> None:
        await stream.send_all(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def _answer(self, line: bytes, stream: trio.SocketStream) -> dict[str, Any]:
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise TypeError("a request is a JSON object")
            handler = self._ops.get(request.get("op"))  # type: ignore[arg-type]
            if handler is None:
                raise FsError(errno.EINVAL, f"unknown op {request.get('op')!r}; known: {', '.join(self._ops)}")

            sending = trio.Lock()  # progress may come from several tasks of one op

            async def progress(message: dict[str, Any]) -> None:
                async with sending:
                    await self._send(stream, {"ok": True, "more": True, **message})

            return {"ok": True, **await handler(request, progress)}
        except (ValueError, TypeError, KeyError) as exc:
            return error_response(FsError(errno.EINVAL, f"bad request: {exc}"))
        except (BurstfsError, OSError) as exc:
            return error_response(exc)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise
        except Exception as exc:
            log.exception("event=control_bug")
            return error_response(exc)

    # -- helpers -----------------------------------------------------------------------

    @staticmethod
    def _rels(request: dict[str, Any]) -> list[str]:
        paths = request.get("paths")
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            raise ValueError("'paths' must be a non-empty list of paths relative to the mount root")
        return [p.strip("/") for p in paths]

    async def _inodes_under(self, rel: str) -> list[tuple[str, Inode]]:
        """Files at or below ``rel`` in the live namespace, remote listings merged first
        (a restore on a fresh node prefetches directories nobody has listed yet)."""
        inode = self.core.inode(ROOT_INO)
        for part in filter(None, rel.split("/")):
            await self.core.refresh_listing(inode)
            try:
                inode = self.core.child(inode.ino, os.fsencode(part))
            except FsError as exc:
                raise FsError(exc.errno, f"/{rel}: {os.strerror(exc.errno)}") from None
        found: list[tuple[str, Inode]] = []
        stack = [(rel, inode)]
        while stack:
            path, node = stack.pop()
            if node.kind == "file":
                found.append((path, node))
                continue
            if node.kind == "dir":
                await self.core.refresh_listing(node)
            for name, ino in (node.children or {}).items():
                child = self.core.inodes.get(ino)
                if child is not None:
                    stack.append((f"{path}/{os.fsdecode(name)}" if path else os.fsdecode(name), child))
        return found

    async def _files(self, request: dict[str, Any]) -> list[tuple[str, Inode]]:
        seen: dict[int, tuple[str, Inode]] = {}
        for rel in self._rels(request):
            for path, inode in await self._inodes_under(rel):
                seen.setdefault(inode.ino, (path, inode))
        return sorted(seen.values(), key=lambda item: item[0])

    def _mover(self) -> Any:
        if self.drain is None:
            raise FsError(errno.ENOTSUP, "this mount has no mover")
        return self.drain.mover

    # -- ops ---------------------------------------------------------------------------

    async def _status(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        doc = await trio.to_thread.run_sync(journal_status, self.journal, self.config.cache_dir)
        doc.update(live=True, pid=os.getpid(), mountpoint=str(self.config.mountpoint), remote=str(self.config.remote),
                   data_path="passthrough" if self.core.backing is not None else "daemon",
                   daemon_written_bytes=self.core.daemon_written_bytes)  # fmt: skip
        fs = self.core.statfs(await self.core.evictable_bytes())
        doc["local_tier"].update(
            limit_bytes=self.config.cache_size,
            mount_total_bytes=fs.blocks * fs.block_size,
            mount_free_bytes=fs.blocks_free * fs.block_size,
        )
        if self.drain is not None:
            stats = self.drain.mover.stats
            outage = outage_of(stats)
            throughput = 0.0 if outage else stats.throughput()  # an outage stops the drain now, not in 30 s
            pending = sum(doc["states"][s]["bytes"] for s in QUEUED)
            doc["drain"].update(
                outage=outage,
                throughput_bps=throughput,
                eta_s=0.0 if not pending else (pending / throughput if throughput > 0 else None),
                files_drained=stats.files_drained,
                bytes_drained=stats.bytes_drained,
                halted=stats.halted,
                mover_crashed=None if self.drain.crashed is None else repr(self.drain.crashed),
                errors_by_kind=dict(stats.errors_by_kind),
                recent_errors=[{"time": t, "kind": k, "message": m} for t, k, m in list(stats.recent_errors)],
            )
        return doc

    async def _ls(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        return await trio.to_thread.run_sync(list_files, self.journal, str(request.get("path", "")).strip("/"))

    async def _journal(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        since = float(request.get("since", 0.0))
        limit = int(request.get("limit", 1000))
        rel = str(request.get("path", "")).strip("/")
        return await trio.to_thread.run_sync(journal_events, self.journal, since, rel, limit)

    async def _drain_now(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        self._mover().drain_now()
        log.info("event=control_drain_now")
        return {"schema": SCHEMA}

    async def _retry(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        requeued = await trio.to_thread.run_sync(self._mover().retry_failed)
        log.info("event=control_retry requeued=%d", requeued)
        return {"schema": SCHEMA, "requeued": requeued}

    async def _evict(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        for path, inode in await self._files(request):
            try:
                freed = await self.core.evict(inode.ino)
                results.append({"path": path, "ok": True, "bytes_freed": freed})
            except (BurstfsError, OSError) as exc:
                results.append({"path": path, "ok": False, **_error_fields(exc)})
        freed_total = sum(r.get("bytes_freed", 0) for r in results)
        log.info("event=control_evict files=%d bytes_freed=%d", len(results), freed_total)
        return {"schema": SCHEMA, "files": results, "bytes_freed": freed_total}

    async def _prefetch(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        files = await self._files(request)
        total = sum(inode.size for _, inode in files)
        results: list[dict[str, Any]] = []
        limiter = trio.CapacityLimiter(PREFETCH_FILES_AT_ONCE)
        client_gone = False

        async def fetch(path: str, inode: Inode) -> None:
            nonlocal client_gone
            async with limiter:
                if client_gone:  # Ctrl-C on the admin side: start nothing new, let running fetches end
                    return
                try:
                    await self.core.prefetch(inode.ino)
                    result = {"path": path, "ok": True, "bytes": inode.size}
                except (BurstfsError, OSError) as exc:
                    result = {"path": path, "ok": False, "bytes": 0, **_error_fields(exc)}
            results.append(result)
            done = sum(r["bytes"] for r in results)
            try:
                await progress({"file": result, "done_files": len(results), "total_files": len(files),
                                "done_bytes": done, "total_bytes": total})  # fmt: skip
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                client_gone = True

        async with trio.open_nursery() as nursery:
            for path, inode in files:
                nursery.start_soon(fetch, path, inode)
        if client_gone:
            raise trio.BrokenResourceError("the client went away during prefetch")
        fetched = sum(r["bytes"] for r in results)
        log.info("event=control_prefetch files=%d bytes=%d failed=%d", len(files), fetched,
                 sum(1 for r in results if not r["ok"]))  # fmt: skip
        return {"schema": SCHEMA, "files": sorted(results, key=lambda r: r["path"]), "bytes": fetched}

    async def _verify(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        rels = self._rels(request)
        remote = self.config.remote if request.get("remote") else None
        return await trio.to_thread.run_sync(
            verify, self.config.cache_dir, self.journal, rels, remote, self.config.s3
        )


def _error_fields(exc: BaseException) -> dict[str, Any]:
    fields = error_response(exc)
    return {"error": fields["error"], "errno": fields["errno"]}


async def serve_control(
    config: MountConfig, core: BurstCore, drain: DrainService | None,
    *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """The daemon's entry point: ``await nursery.start(serve_control, ...)``."""
    await ControlServer(config, core, drain).run(task_status=task_status)


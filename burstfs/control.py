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
connection of its own, so a slow query never stalls a FUSE request; the
queries themselves are :mod:`burstfs.status` (shared with ``burstfs-admin``,
which runs them against the journal of a stopped mount) and
:mod:`burstfs.verify`, whose remote check runs on the mover's loop with the
mover's client.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .config import MountConfig
from .errors import BurstfsError, FsError
from .journal import ROOT_INO, Journal
from .status import SCHEMA, drain_eta, drain_rate, journal_events, journal_status, list_files, outage_of
from .verify import check_local_all, check_remote_all, files_to_verify, report

if TYPE_CHECKING:  # burstfs-admin imports this module: keep the mover (aiobotocore) out of its start-up
    from .core import BurstCore, Inode
    from .drainservice import DrainService

log = logging.getLogger("burstfs.control")

SOCKET_NAME = "control.sock"
MAX_LINE = 1 << 20  # longest request accepted: a path list of a few thousand files
PREFETCH_FILES_AT_ONCE = 4  # each core.prefetch is parallel inside; a few files hide per-file latency
PREFETCH_TICK_S = 1.0  # how often a prefetch reports the bytes landed so far
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes with the NUL


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
        self._ops: dict[
            str, Callable[[dict[str, Any], Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[dict[str, Any]]]
        ] = {
            "status": self._status,
            "ls": self._ls,
            "drain_now": self._drain_now,
            "probe": self._probe,
            "retry": self._retry,
            "evict": self._evict,
            "refresh_listings": self._refresh_listings,
            "prefetch": self._prefetch,
            "verify": self._verify,
            "journal": self._journal,
            "abandon": self._abandon,
            "settle": self._settle,
        }

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
            await self.core.set_meta("mountpoint", str(self.config.mountpoint))
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
                refusal = FsError(
                    errno.EACCES,
                    f"uid {uid} may not use this mount's control socket (only uid {os.geteuid()} and root)",
                )
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

            await self.core.committer.settle()  # every answer reads the journal
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

    async def _list(self, directory: Inode, path: str, *, fresh: bool) -> None:
        """Merge the remote listing of ``directory`` (at ``path``): if older than the TTL, a
        failure logged and passed over (none tried while the remote is down: it would wait
        again for each directory) unless nothing of it is known here (a directory never
        listed: prefetch said "fetched 0 B in 0 files", exit 0, for a checkpoint it could not
        list); ``fresh``: now, and a failure raised, since what the directory holds on the
        remote is then not known (EIO either way)."""
        listings = self.core.listings
        if not fresh:
            await listings.refresh_unless_down(directory)
            listed = not listings.unseen(directory)
        else:
            listed = listings.links.fetcher is None or await listings.refresh(directory, force=True)
        if not listed:
            raise FsError(
                errno.EIO,
                f"/{path}: could not list this directory on the remote (the daemon's log says why); "
                "what it holds there is not known",
            )

    async def _inode_at(self, rel: str, *, listed: bool = True, fresh: bool = False) -> Inode:
        """The inode at ``rel``, each directory on the way listed first if ``listed``
        (``fresh``: see :meth:`_list`)."""
        inode = self.core.namespace.inode(ROOT_INO)
        walked = ""
        for part in filter(None, rel.split("/")):
            if listed:
                await self._list(inode, walked, fresh=fresh)
            walked = f"{walked}/{part}" if walked else part
            try:
                inode = self.core.namespace.child(inode.ino, os.fsencode(part))
            except FsError as exc:
                raise FsError(exc.errno, f"/{rel}: {os.strerror(exc.errno)}") from None
        return inode

    async def _inodes_under(self, rel: str, *, listed: bool = True, fresh: bool = False) -> list[tuple[str, Inode]]:
        """Files at or below ``rel`` in the live namespace, remote listings merged first
        (a restore on a fresh node prefetches directories nobody has listed yet).
        ``listed=False``: no listing is waited for (evict acts on local copies only, and
        is what frees a full tier during an outage).  ``fresh``: every directory is listed
        now, and one that cannot be raises (verify --remote: see :meth:`_list`)."""
        found: list[tuple[str, Inode]] = []
        stack = [(rel, await self._inode_at(rel, listed=listed, fresh=fresh))]
        while stack:
            path, node = stack.pop()
            if node.kind == "file":
                found.append((path, node))
                continue
            if node.kind == "dir" and listed:
                await self._list(node, path, fresh=fresh)
            for name, child in self.core.namespace.entries(node):
                stack.append((f"{path}/{os.fsdecode(name)}" if path else os.fsdecode(name), child))
        return found

    async def _files(
        self, request: dict[str, Any], *, listed: bool = True, fresh: bool = False
    ) -> list[tuple[str, Inode]]:
        seen: dict[int, tuple[str, Inode]] = {}
        for rel in self._rels(request):
            for path, inode in await self._inodes_under(rel, listed=listed, fresh=fresh):
                seen.setdefault(inode.ino, (path, inode))
        return sorted(seen.values(), key=lambda item: item[0])

    def _drain(self) -> DrainService:
        if self.drain is None:
            raise FsError(errno.ENOTSUP, "this mount has no mover")
        return self.drain

    # -- ops ---------------------------------------------------------------------------

    async def _status(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        doc = await trio.to_thread.run_sync(journal_status, self.journal, self.config.cache_dir)
        doc.update(
            live=True,
            pid=os.getpid(),
            mountpoint=str(self.config.mountpoint),
            remote=str(self.config.remote),
            data_path="passthrough" if self.core.passthrough else "daemon",
            daemon_written_bytes=self.core.data.daemon_written_bytes,
        )
        fs = await self.core.statfs()
        doc["local_tier"].update(
            used_bytes=doc["local_tier"]["used_bytes"] + self.core.capacity.partial_bytes(),
            limit_bytes=self.config.tier.cache_size,
            mount_total_bytes=fs.blocks * fs.block_size,
            mount_free_bytes=fs.blocks_free * fs.block_size,
        )
        if self.drain is not None:
            stats = self.drain.mover.stats
            outage = outage_of(stats)
            throughput = drain_rate(stats, outage)
            waiting = self.drain.mover.groups.waiting_markers()
            # A marker held for another node's part drains when that node is done: not at a rate.
            held = any(entry["waiting"] and not entry["abandoned"] for entry in waiting)
            doc["drain"].update(
                outage=outage,
                throughput_bps=throughput,
                eta_s=None if held else drain_eta(doc["states"], throughput, stats.landed_in_flight()),
                files_drained=stats.files_drained,
                bytes_drained=stats.bytes_drained,
                halted=stats.halted,
                mover_crashed=None if self.drain.crashed is None else repr(self.drain.crashed),
                errors_by_kind=dict(stats.errors_by_kind),
                recent_errors=[{"time": t, "kind": k, "message": m} for t, k, m in list(stats.recent_errors)],
            )
            doc.update(
                node_id=self.drain.mover.node_id,
                checkpoints_waiting=waiting,
                commit_markers=list(self.drain.mover.options.commit_markers),
            )
        return doc

    async def _abandon(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        if self.drain is None:
            raise FsError(errno.ENOTSUP, "this mount has no mover")
        rel = self._rels(request)[0]
        given_up, waiting = await self.drain.abandon(rel)
        log.warning("event=control_abandon dir=%s intents=%d", given_up, len(waiting))
        return {"schema": SCHEMA, "dir": given_up, "gave_up": waiting}

    async def _settle(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        """Nothing but what every answer does first: the deferred records are committed, so a
        reader of the journal (``burstfs-admin wait``) sees a file just created."""
        return {}

    async def _ls(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        return await trio.to_thread.run_sync(list_files, self.journal, str(request.get("path", "")).strip("/"))

    async def _journal(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        since = float(request.get("since", 0.0))
        limit = int(request.get("limit", 1000))
        rel = str(request.get("path", "")).strip("/")
        return await trio.to_thread.run_sync(journal_events, self.journal, since, rel, limit)

    async def _drain_now(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        self._drain().drain_now()
        log.info("event=control_drain_now")
        return {"schema": SCHEMA}

    async def _probe(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        self._drain().probe_now()
        return {"schema": SCHEMA}

    async def _retry(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        requeued = await self._drain().retry_failed()
        log.info("event=control_retry requeued=%d", requeued)
        return {"schema": SCHEMA, "requeued": requeued}

    async def _refresh_listings(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        """List every directory at or below the paths from the remote now, whatever the TTL
        (``RemoteListings.refresh_path``): ``retention.prune_checkpoints`` deletes what other
        nodes drained since this node last listed a checkpoint (they would be left on the
        remote, and the step come back); ``burstfs-admin latest`` shows the step it names."""
        listed = 0
        for rel in self._rels(request):
            listed += (await self.core.listings.refresh_path(rel))[1]
        return {"schema": SCHEMA, "listed": listed}

    async def _evict(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        results: list[dict[str, Any]] = []
        for path, inode in await self._files(request, listed=False):
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
        drain = self.drain
        fetched_before = drain.fetched_bytes if drain is not None else 0

        def landed() -> int:
            """The files done, or the bytes fetched since the start if more (files in flight)."""
            done = sum(r["bytes"] for r in results)
            return done if drain is None else min(total, max(done, drain.fetched_bytes - fetched_before))

        async def tick() -> None:
            """Bytes as they land, between files (``"file": null``): counted only once each file
            was done, a few large files after many small ones showed a rate (and an ETA) far off."""
            nonlocal client_gone
            while drain is not None and not client_gone:
                await trio.sleep(PREFETCH_TICK_S)
                message = {"file": None, "done_files": len(results), "total_files": len(files)}
                try:
                    await progress({**message, "done_bytes": landed(), "total_bytes": total})
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    client_gone = True

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
            try:
                await progress(
                    {
                        "file": result,
                        "done_files": len(results),
                        "total_files": len(files),
                        "done_bytes": landed(),
                        "total_bytes": total,
                    }
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                client_gone = True

        async with trio.open_nursery() as fetches:
            async with trio.open_nursery() as nursery:
                for path, inode in files:
                    nursery.start_soon(fetch, path, inode)
                fetches.start_soon(tick)
            fetches.cancel_scope.cancel()  # every file is done: no tick after the last answer
        if client_gone:
            raise trio.BrokenResourceError("the client went away during prefetch")
        fetched = sum(r["bytes"] for r in results)
        # A prefetch larger than the tier evicts its own earlier files to fetch the later ones.
        inodes = {path: inode for path, inode in files}
        evicted = sorted(r["path"] for r in results if r["ok"] and not inodes[r["path"]].local)
        log.info(
            "event=control_prefetch files=%d bytes=%d failed=%d evicted_again=%d",
            len(files),
            fetched,
            sum(1 for r in results if not r["ok"]),
            len(evicted),
        )
        return {
            "schema": SCHEMA,
            "files": sorted(results, key=lambda r: r["path"]),
            "bytes": fetched,
            "evicted_again": evicted,
        }

    async def _verify(self, request: dict[str, Any], progress: Any) -> dict[str, Any]:
        rels = self._rels(request)
        drain = self._drain() if request.get("remote") else None  # refuse before hashing anything
        if drain is not None:
            # The remote holds what the node may never have listed (a restore node): every
            # directory walked is listed now, as for prefetch, and merged before the journal
            # is read; one that cannot be listed fails the verify, never an empty "all OK".
            await self._files(request, fresh=True)
        files = await trio.to_thread.run_sync(files_to_verify, self.journal, rels)
        local = await trio.to_thread.run_sync(check_local_all, self.config.cache_dir, self.journal, files)
        remote = None
        if drain is not None:
            mover = drain.mover

            async def check_on_mover_loop() -> list[tuple[str, str]]:
                if mover.store is None:
                    raise FsError(errno.EIO, "the mover is not running")
                return await check_remote_all(mover.store, [row for _, row in files])

            remote = await drain.on_mover_loop(check_on_mover_loop())
        return report(files, local, remote)


def _error_fields(exc: BaseException) -> dict[str, Any]:
    fields = error_response(exc)
    return {"error": fields["error"], "errno": fields["errno"]}


async def serve_control(
    config: MountConfig,
    core: BurstCore,
    drain: DrainService | None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The daemon's entry point: ``await nursery.start(serve_control, ...)``."""
    await ControlServer(config, core, drain).run(task_status=task_status)

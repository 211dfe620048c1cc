"""Prefetch planned from a checkpoint's index: a reader walking the shards finds them fetched.

A framework restoring a sharded checkpoint reads its index first (PyTorch DCP's
``.metadata``, a Hugging Face ``*.index.json`` with its ``weight_map``), then
the shards it names, one after another.  Each shard then streams at one GET's
speed while the others wait.  Here the core notes which files a checkpoint has
(its directory's *plan*: a DCP directory's ``*.distcp`` files, the files a
``weight_map`` names), and once this node walks the plan, that is opens a
named file after it closed another one, the next few named files that are
only on the remote are fetched whole in the background, with the one it opened
(a loader that seeks inside a file would otherwise fetch it by ranges).  A DCP
data file is a rank's own part, read whole: any open of one fetches it whole.

Why not fetch every named file as soon as the index is read: on a cluster every
rank reads the index and then only its own shards, so each node would fetch the
whole checkpoint.  Ranks of one node open their shards side by side, without
closing one first, so they fetch nothing ahead; a walker costs at most
``AHEAD_FILES`` files it may not read.  A plan never makes room on the tier (it
fetches only what fits without evicting or waiting) and never delays another
request: opens and closes only note names; planning (reading a ``weight_map``
index) and the fetches run in :meth:`ReadPlans.run`, a task of the daemon's
nursery.  The open of a file a plan fetches whole waits for that file
(:meth:`ReadPlans.reads_whole`): its reads then go through passthrough.
"""

from __future__ import annotations

import collections
import logging
import os
import re
from collections.abc import Iterable

import trio

from .checkpointindex import MAX_INDEX_BYTES, index_kind, weight_map_files
from .datapath import DataPath
from .errors import BurstfsError
from .namespace import Namespace
from .nodes import Inode

log = logging.getLogger("burstfs.readplans")

AHEAD_FILES = 4  # files fetched ahead of the one a walker opened, and files fetched at once
MAX_PLANS = 64  # directories whose plans are remembered (least recently planned dropped)
QUEUED = 256  # notes waiting for the planner; more are dropped, never waited for


def dcp_files(names: Iterable[bytes]) -> list[bytes]:
    """A DCP checkpoint's data files among its directory's names, in the order a one-process
    ``dcp.load`` reads them (``__RANK_N.distcp``: by rank, then N).

    Taken from the directory, not from ``.metadata``: every ``.distcp`` file there
    belongs to it, and the metadata of a checkpoint of thousands of ranks (tens of
    MiB of pickle) would cost seconds of pure-Python parsing to say the same.
    """
    return sorted((name for name in names if name.endswith(b".distcp")), key=_natural_order)


def _natural_order(name: bytes) -> list[int | bytes]:
    """``__2_0`` before ``__10_0``: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(rb"(\d+)", name)]


class Plan:
    """The files one directory's index names, and which of them this node has closed."""

    def __init__(self, index: Inode, kind: str, names: list[bytes]) -> None:
        self.kind = kind
        self.index_ino = index.ino
        self.index_version = (index.size, index.mtime_ns)
        self.names = names
        self.position = {name: i for i, name in enumerate(names)}
        self.closed: set[bytes] = set()

    def walked_to(self, name: bytes) -> bool:
        """An open of ``name`` is a walk step: it is planned, and another planned file was closed."""
        return name in self.position and (len(self.closed) > 1 or bool(self.closed and name not in self.closed))


class ReadPlans:
    """Plans of the directories whose index was opened, and the task that fetches ahead."""

    def __init__(self, namespace: Namespace, data: DataPath) -> None:
        self.namespace = namespace
        self.data = data
        self.plans: collections.OrderedDict[int, Plan] = collections.OrderedDict()  # directory ino -> plan
        self._fetching: set[int] = set()  # inos a plan is fetching now
        self._planning: set[int] = set()  # index inos noted and not planned yet (every rank opens the index)
        self._send, self._receive = trio.open_memory_channel[tuple[str, Inode]](QUEUED)
        self.running = False  # run() is serving notes (a remote is configured, plans are on)

    # -- notes from the request path (never wait) ----------------------------------------

    def opened(self, inode: Inode, writable: bool) -> None:
        """A file was opened: an index is read and planned, a walker's next files fetched."""
        if writable or not self.running or not inode.parent:
            return
        kind = index_kind(inode.name)
        if kind is not None:
            plan = self.plans.get(inode.parent)
            stale = plan is None or plan.index_ino != inode.ino or plan.index_version != (inode.size, inode.mtime_ns)
            if stale and inode.ino not in self._planning:
                self._planning.add(inode.ino)
                self._note("index", inode)
            return
        plan = self.plans.get(inode.parent)
        if plan is None or inode.name not in plan.position:
            return
        if plan.walked_to(inode.name):
            self._note("walk", inode)
        elif plan.kind == "dcp":  # a rank's own data file: it reads all of it
            self._note("open", inode)

    def reads_whole(self, inode: Inode, writable: bool) -> bool:
        """Whether this open is of a file a plan fetches whole anyway: a planned DCP data file (a
        rank reads all of its own) or a walker's next one.  Such an open waits for the whole
        file, and its reads then go through passthrough, the kernel reading the local tier
        (a cold read through the daemon costs two more copies and a request per MiB)."""
        if writable or not self.running or not inode.parent or inode.local or inode.kind != "file":
            return False
        plan = self.plans.get(inode.parent)
        if plan is None or inode.name not in plan.position:
            return False
        return plan.kind == "dcp" or plan.walked_to(inode.name)

    def closed(self, inode: Inode) -> None:
        """A handle of a file was released: a named file closed is a step of a walk."""
        plan = self.plans.get(inode.parent) if inode.parent else None
        if plan is not None and inode.name in plan.position:
            plan.closed.add(inode.name)

    def _note(self, what: str, inode: Inode) -> None:
        try:
            self._send.send_nowait((what, inode))
        except trio.WouldBlock:
            self._planning.discard(inode.ino)
            log.debug("event=read_plan_note_dropped what=%s ino=%d", what, inode.ino)

    # -- the planner's task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Plan indexes and fetch ahead of walkers until cancelled (a daemon nursery task)."""
        limiter = trio.CapacityLimiter(AHEAD_FILES)
        try:
            async with trio.open_nursery() as fetches:
                self.running = True
                task_status.started()
                async for what, inode in self._receive:
                    if what == "index":  # in a task: a slow remote holds up only this index
                        fetches.start_soon(self._plan, inode)
                        continue
                    try:
                        ahead = self._ahead_of(inode, AHEAD_FILES if what == "walk" else 0)
                    except Exception:  # a bug here must not end the mount: plans only save time
                        log.exception("event=read_plan_bug ino=%d", inode.ino)
                        continue
                    for candidate in ahead:
                        self._fetching.add(candidate.ino)
                        fetches.start_soon(self._fetch, candidate, limiter)
        finally:
            self.running = False

    async def _plan(self, index: Inode) -> None:
        """Remember the files of ``index``'s checkpoint: a DCP directory's data files, or what a
        ``weight_map`` names (read from the index, fetched: its reader needs it anyway)."""
        try:
            await self._plan_from(index)
        except (BurstfsError, OSError) as exc:
            log.info("event=read_plan_skipped ino=%d error=%s", index.ino, exc)
        except Exception:  # a bug here must not end the mount: plans only save time
            log.exception("event=read_plan_bug ino=%d", index.ino)
        finally:
            self._planning.discard(index.ino)

    async def _plan_from(self, index: Inode) -> None:
        kind = index_kind(index.name)
        if kind is None or not index.parent:
            return
        if kind == "dcp":
            names = dcp_files(self._children(index.parent))
        else:
            if index.size > MAX_INDEX_BYTES:
                return
            await self.data.ensure_local(index)
            data = await trio.to_thread.run_sync(_read_head, self.data.tier.path(index.ino), index.size)
            names = await trio.to_thread.run_sync(weight_map_files, data)
        children = self._children(index.parent)
        files = [name for name in names if name in children and self._is_file(children[name])]
        if not files:
            return
        self.plans[index.parent] = Plan(index, kind, files)
        self.plans.move_to_end(index.parent)
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        log.info("event=read_plan dir_ino=%d index=%s kind=%s files=%d", index.parent, index.name, kind, len(files))

    def _children(self, dir_ino: int) -> dict[bytes, int]:
        directory = self.namespace.inodes.get(dir_ino)
        return directory.children if directory is not None and directory.children is not None else {}

    def _is_file(self, ino: int) -> bool:
        inode = self.namespace.inodes.get(ino)
        return inode is not None and inode.kind == "file"

    def _ahead_of(self, inode: Inode, count: int) -> list[Inode]:
        """``inode`` and the next ``count`` files of the plan after it that are only on the
        remote, in that order: a walker reads whole files, so the one it opened comes whole too
        (one GET from its start rather than ranged reads where the loader seeks)."""
        plan = self.plans.get(inode.parent)
        directory = self.namespace.inodes.get(inode.parent)
        if plan is None or directory is None or directory.children is None or inode.name not in plan.position:
            return []
        ahead: list[Inode] = []
        for name in plan.names[plan.position[inode.name] : plan.position[inode.name] + 1 + count]:
            ino = directory.children.get(name)
            candidate = self.namespace.inodes.get(ino) if ino is not None else None
            if candidate is None or candidate.kind != "file" or candidate.local or candidate.ino in self._fetching:
                continue
            ahead.append(candidate)
        return ahead

    async def _fetch(self, inode: Inode, limiter: trio.CapacityLimiter) -> None:
        try:
            async with limiter:
                if not inode.local and inode.named:
                    await self.data.fetch_whole_if_it_fits(inode, "read_plan")
        except (BurstfsError, OSError) as exc:  # its reader meets the error itself, if it reads
            log.warning(
                "event=read_plan_fetch_failed ino=%d path=%s error=%s", inode.ino, self.namespace.path_of(inode), exc
            )
        except Exception:  # a bug here must not end the mount: plans only save time
            log.exception("event=read_plan_bug ino=%d", inode.ino)
        finally:
            self._fetching.discard(inode.ino)


def _read_head(path: os.PathLike[str], size: int) -> bytes:
    """The first ``size`` bytes of a data file, through a descriptor of its own (the
    tier's may be closed by a release while this worker thread reads)."""
    with open(path, "rb") as f:
        return f.read(size)

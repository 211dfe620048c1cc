"""``burstfs-admin latest``: the newest checkpoint that is complete on the remote.

Complete: its commit record (``commitgroups.py``) was published, the marker
and every file the record names are on the remote with the recorded size and
digest, and so are the files of any part announced too late for its gate
(:func:`late_parts`).  Reads only the remote, so it works from any node and
without a mount.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from .commitgroups import (
    ABANDONED,
    COMMITS_PREFIX,
    DONE_RECORD,
    INTENT,
    POINTER_MARKERS,
    commit_written_ms,
    dir_of,
    group_prefix,
    parse_record,
    parse_record_key,
    record_files,
    record_key,
    round_started_ms,
)
from .config import RemoteURL
from .errors import CorruptDataError, RemoteNotFound
from .objects import Manifest, manifest_key
from .remote import Remote, RetryPolicy

# This many files of a checkpoint are checked at once, each request retried like the drain's.
VERIFY_CONCURRENCY = 16
#: A round another node began this long before a marker was written (their two clocks) is of
#: that checkpoint even if its gate did not see it (:func:`late_parts`).
LATE_ROUND_SLACK_MS = 500
LATEST_RETRY = RetryPolicy()
#: Listings of the commit records one answer takes at most (a record replaced while read).
LISTINGS_MAX = 3


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    dir: str
    marker: str
    committed_at: float  # the commit record's time on the remote
    files: int
    commit_key: str
    step: str  # the directory holding its files: for a pointer beside steps (``latest``), the step it names


async def _check_file(remote: Remote, entry: dict[str, Any], rewritable: bool = False) -> str | None:
    """Why ``entry`` (path, size, digest) does not match the remote, or None if it does.
    ``rewritable``: a pointer marker (``latest``), rewritten in place at every checkpoint: its
    object only has to be there (its new bytes land before its new commit record does, and
    the files of the step this record names are what is checked)."""
    path = entry["path"]
    info = await LATEST_RETRY.call(remote, remote.head, path, what=f"head {path}")
    if info is None:
        return f"{path}: missing"
    try:
        data = await LATEST_RETRY.call(remote, remote.get_object, manifest_key(path), what=f"get manifest {path}")
        manifest = Manifest.from_json(data)
    except RemoteNotFound as exc:
        return f"{path}: no manifest ({exc})"
    except CorruptDataError as exc:
        return f"{path}: bad manifest ({exc})"
    if rewritable:
        return None
    stored = sum(chunk.stored_size for chunk in manifest.chunks)
    if manifest.size != entry.get("size") or (entry.get("digest") and manifest.digest != entry["digest"]):
        return f"{path}: not the bytes this checkpoint recorded"
    if info.size != stored:
        return f"{path}: object and manifest disagree (being rewritten)"
    return None


async def verify_commit(remote: Remote, doc: dict[str, Any]) -> str | None:
    """None if every file a commit record names (and its marker) matches the remote, else why not."""
    marker = doc.get("marker")
    if not isinstance(marker, dict) or not isinstance(marker.get("path"), str):
        return "the commit record names no marker"
    pointer = marker["path"].rpartition("/")[2] in POINTER_MARKERS and bool(record_files(doc))
    return await _check_file(remote, marker, rewritable=pointer) or await _check_files(remote, record_files(doc))


async def late_parts(remote: Remote, doc: dict[str, Any], written_ms: int | None) -> tuple[str | None, int]:
    """Parts of a checkpoint its gate could not see: why it is not complete (None if it is), and
    how many files those parts add.

    A node whose intent reached the remote only after the marker's gate looked (the remote was
    down or slow for it longer than ``--remote-wait``) was not waited for, and the marker went
    out without its shards.  Its round began before the marker was written, so, once its
    intent is there, the checkpoint counts as complete only when that round's done is out and
    its files match.  Rounds an operator abandoned are no part of any checkpoint.  Only for
    commit records that say which directory their gate looked at."""
    gate = doc.get("gate")
    if not isinstance(gate, str) or written_ms is None:
        return None, 0
    seen = {tuple(r) for r in doc.get("rounds", []) if isinstance(r, list)}
    kinds: dict[tuple[str, str, str], set[str]] = {}
    async for info in remote.list_all(group_prefix(gate)):
        parsed = parse_record_key(info.key)
        if parsed is None:
            continue
        group_dir, node, round_id, kind = parsed
        started = round_started_ms(round_id)
        ident = (group_dir, node, round_id)
        if ident not in seen and started is not None and started < written_ms - LATE_ROUND_SLACK_MS:
            kinds.setdefault(ident, set()).add(kind)
    files: list[dict[str, Any]] = []
    for (group_dir, node, round_id), found in sorted(kinds.items()):
        if ABANDONED in found or INTENT not in found:  # (a done alone: an older round its node is removing)
            continue
        if DONE_RECORD not in found:
            return f"node {node}'s part in {group_dir} (announced after the marker) is not durable yet", 0
        key = record_key(group_dir, node, round_id, DONE_RECORD)
        files += record_files(parse_record(await LATEST_RETRY.call(remote, remote.get_object, key, what=f"get {key}")))
    return await _check_files(remote, files), len(files)


async def _check_files(remote: Remote, entries: list[dict[str, Any]]) -> str | None:
    semaphore = asyncio.Semaphore(VERIFY_CONCURRENCY)

    async def check(entry: dict[str, Any]) -> str | None:
        async with semaphore:
            return await _check_file(remote, entry)

    for problem in await asyncio.gather(*(check(e) for e in entries)):
        if problem is not None:
            return problem
    return None


def _points_to_steps(dir_key: str, commit_key: str, committed: dict[str, tuple[float, float, str]]) -> bool:
    """A commit of a pointer marker in a directory whose subdirectories hold committed
    checkpoints: the restart point is one of those, not the directory with the pointer.
    (Megatron's tracker beside step directories without markers of their own: the directory
    with the tracker is what it loads, and stays a checkpoint.)"""
    marker = commit_key.rpartition("/")[2].rsplit("@", 2)[0]  # <marker>@<node>@<id>.commit
    below = f"{dir_key}/" if dir_key else ""
    return marker in POINTER_MARKERS and any(d != dir_key and d.startswith(below) for d in committed)


def pointed_dir(dir_key: str, doc: dict[str, Any]) -> str:
    """The step directory of a pointer's commit record (``latest``, Megatron's tracker): the
    subdirectory of ``dir_key`` holding every file it names (it names the step it points at
    only: ``CommitGroups.gate_dir``); ``dir_key`` for any other marker's record."""
    marker = doc.get("marker", {}).get("path", "")
    below = f"{dir_key}/" if dir_key else ""
    paths = [entry["path"] for entry in record_files(doc)]
    if marker.rpartition("/")[2] not in POINTER_MARKERS or not all(p.startswith(below) for p in paths):
        return dir_key
    rels = [p[len(below) :] for p in paths]
    steps = {rel.partition("/")[0] for rel in rels}
    if len(steps) == 1 and all("/" in rel for rel in rels):
        return f"{below}{steps.pop()}"
    return dir_key


def missing_root(url: RemoteURL) -> str | None:
    """Why a file remote's directory cannot be read (None: it is there, or not a file remote):
    else it lists as empty, and "no checkpoint" would be the wrong answer."""
    if url.scheme != "file" or os.path.isdir(url.prefix):
        return None
    problem = "is not a directory" if os.path.exists(url.prefix) else "does not exist"
    return f"{url}: remote directory {url.prefix} {problem}"


async def find_latest(remote: Remote, subdir: str = "") -> tuple[Checkpoint | None, list[tuple[str, str]]]:
    """The newest checkpoint under ``subdir`` whose commit record matches the remote, and the
    newer ones skipped (dir, why).  One listing of the commit records, then newest first:
    only the checkpoints it must look at are read.  A record replaced between the listing and
    its read (a marker committed again meanwhile) means a newer one is there: listed again
    (a few times at most) rather than answered "none"."""
    for _ in range(LISTINGS_MAX):
        found, skipped, replaced = await _find_once(remote, subdir)
        if found is not None or not replaced:
            break
    return found, skipped


async def _find_once(remote: Remote, subdir: str) -> tuple[Checkpoint | None, list[tuple[str, str]], bool]:
    """:func:`find_latest` from one listing; also whether a record listed was gone when read."""
    prefix = f"{COMMITS_PREFIX}{subdir}/" if subdir else COMMITS_PREFIX
    newest: dict[str, tuple[float, float, str]] = {}  # dir -> (marker written, record's mtime, key)
    async for info in remote.list_all(prefix):
        if not info.key.endswith(".commit"):
            continue
        dir_key = dir_of(info.key)[len(COMMITS_PREFIX) :]
        written = commit_written_ms(info.key.removesuffix(".commit"))
        order = (info.mtime if written is None else written / 1000, info.mtime, info.key)
        if dir_key not in newest or order > newest[dir_key]:
            newest[dir_key] = order
    for pointer in [d for d, (_, _, key) in newest.items() if _points_to_steps(d, key, newest)]:
        del newest[pointer]
    skipped: list[tuple[str, str]] = []
    replaced = False
    for dir_key, (_, mtime, key) in sorted(newest.items(), key=lambda item: item[1], reverse=True):
        late = 0
        try:
            doc = parse_record(await LATEST_RETRY.call(remote, remote.get_object, key, what=f"get {key}"))
            problem = await verify_commit(remote, doc)
            if problem is None:
                problem, late = await late_parts(remote, doc, commit_written_ms(key.removesuffix(".commit")))
        except RemoteNotFound as exc:  # a record gone since the listing: a newer one replaced it
            problem, replaced = str(exc), True
        except CorruptDataError as exc:
            problem = str(exc)
        # Any other RemoteError (denied, unavailable) goes up: whether this checkpoint is
        # complete is not known, and skipping it could answer "none" over a good one.
        if problem is None:
            marker = doc["marker"]["path"]
            files = len(doc.get("files", [])) + 1 + late
            return Checkpoint(dir_key, marker, mtime, files, key, pointed_dir(dir_key, doc)), skipped, replaced
        skipped.append((dir_key, problem))
    return None, skipped, replaced

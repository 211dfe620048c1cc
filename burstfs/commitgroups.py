"""Cross-node commits: one checkpoint written by many nodes, published only when all of it is durable.

Every node that writes into a directory D (a writable open of a file that is not a
commit marker) starts a *round* there and publishes, on the remote, an intent
record; once every file it opened for writing in D in that round is durable it
publishes a done record listing them.  A commit marker under D drains only when
every intent under ``.burstfs/groups/D/`` (D's whole subtree) has its done; after
the marker is durable its node writes a commit record (the marker and every file
of the dones it saw), which is what ``burstfs-admin latest`` verifies (``latest.py``).  The object
store is the only coordination point; nodes never write or delete each other's keys.

Remote layout (all keys are created once, with ``If-None-Match: *`` / ``O_EXCL``)::

    .burstfs/groups/<dir>/<node>@<round>.intent     {"node", "round", "dir", "time"}
    .burstfs/groups/<dir>/<node>@<round>.done       ... + "files": [{path, size, digest, generation}]
    .burstfs/groups/<dir>/<node>@<round>.abandoned  an operator gave that intent up
    .burstfs/commits/<dir>/<marker>@<node>@<id>.commit  {"dir", "marker": {file}, "gate", "files", "rounds"}

Round ids start with the time in milliseconds and end with random hex, so a
node's records never collide with another's, even with a duplicate node id; a
commit record's id starts with the time its marker was closed (``latest``
orders checkpoints by it).
Everything remote runs on the mover's loop; the FUSE thread only calls
:meth:`CommitGroups.writing_in` (a dict update) and waits for an intent at most
the short remote bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import functools
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from .checkpointindex import index_kind, named_files, read_index
from .errors import OBJECT, CorruptDataError, FsError, RemoteError, RemoteNotFound, error_scope
from .journal import DONE, FAILED, INCOMPLETE, QUEUED, REMOTE, WRITING, InodeRow, Journal
from .journal.states import state_marks
from .journal.thread import JournalCall
from .objects import RequestHealth, reported_call
from .remote import INTERNAL_DIR, Remote, RetryPolicy
from .remote.base import manifest_key
from .status import lookup

log = logging.getLogger("burstfs.groups")

GROUPS_PREFIX = f"{INTERNAL_DIR}/groups/"
COMMITS_PREFIX = f"{INTERNAL_DIR}/commits/"
INTENT, DONE_RECORD, ABANDONED = "intent", "done", "abandoned"
# The journal's meta keys of this node's open groups and of abandoned directories.
_META_GROUP = "group:"
_META_ABANDONED = "abandoned:"
_META_CARRIED = "carried:"  # a marker moved here from another directory: the nodes it still waits for
_META_COMMIT = "commit:"  # a commit record due (its key -> its document): a stop or a crash keeps it
#: Markers that name a step directory beside them rather than close a checkpoint of their own
#: directory: DeepSpeed's ``latest`` (the tag of the newest step) and Megatron's tracker file.
POINTER_MARKERS = frozenset({"latest", "latest_checkpointed_iteration.txt"})
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
# A pointer's content is a step's name or number: more than this is no pointer.
POINTER_MAX_BYTES = 4096
# A waiting marker's directory is listed again after this, doubling up to the cap: the
# last done of another node is seen at most GATE_POLL_MAX_S later.
GATE_POLL_MIN_S = 0.05
GATE_POLL_MAX_S = 0.4
# A directory no marker asked about for this long is no longer polled.
GATE_FORGET_S = 5.0
# A marker held back by other nodes says so in the log this often (a drain of a stopped
# cache waiting for a lost node has no status to show it).
GATE_WAIT_LOG_S = 60.0
# A failed record publication is retried after this (doubling, capped).
PUBLISH_BACKOFF_S = 0.5
PUBLISH_BACKOFF_MAX_S = 30.0
#: A file an index waits for and no done lists is looked for on the remote (object and
#: manifest) at most this often per directory, the first this many of them.
UNRECORDED_CHECK_S = 1.0
UNRECORDED_CHECK_MAX = 16
#: How often the rounds of directories removed here are looked for (``_forget_removed``); a
#: directory is forgotten once two looks in a row found it gone.
FORGET_REMOVED_S = 60.0
# Records read from the (shared) remote are bounded before they are parsed.
MAX_RECORD_BYTES = 64 << 20
#: A done lists at most this many files of the node's earlier rounds in its directory (the
#: newest): a directory written a file per round (samples, logs) would otherwise carry every
#: file ever written there into every done.  A checkpoint's files per node are far fewer.
CARRIED_FILES_MAX = 1000
# A round's full check (every member read) waits this many times its last duration before
# it runs again: a quarter of the journal thread at most while small files keep coming in.
FULL_CHECK_SPACING = 3.0


def group_prefix(dir_key: str) -> str:
    """Where the records of ``dir_key`` and its subdirectories live."""
    return f"{GROUPS_PREFIX}{dir_key}/" if dir_key else GROUPS_PREFIX


def record_key(dir_key: str, node: str, round_id: str, kind: str) -> str:
    return f"{group_prefix(dir_key)}{node}@{round_id}.{kind}"


def parse_record_key(key: str) -> tuple[str, str, str, str] | None:
    """``(dir, node, round, kind)`` of a group record key, None for anything else."""
    if not key.startswith(GROUPS_PREFIX):
        return None
    dir_key, _, name = key[len(GROUPS_PREFIX) :].rpartition("/")
    stem, _, kind = name.rpartition(".")
    node, at, round_id = stem.partition("@")
    if not (at and node and round_id) or kind not in (INTENT, DONE_RECORD, ABANDONED):
        return None
    return dir_key, node, round_id, kind


#: Seconds one attempt at a commit-group record (a few hundred bytes) may take.
RECORD_ATTEMPT_TIMEOUT_S = 10.0


def new_round_id() -> str:
    return record_id(time.time_ns())


def round_started_ms(round_id: str) -> int | None:
    """When the round ``round_id`` began, in ms of its node's clock (see :func:`record_id`)."""
    stamp = round_id.partition("-")[0]
    return int(stamp) if stamp.isdigit() else None


def record_id(time_ns: int) -> str:
    """An id that sorts by ``time_ns`` (in ms) and never collides: ``<ms>-<random hex>``."""
    return f"{time_ns // 1_000_000:013d}-{secrets.token_hex(4)}"


def commit_written_ms(key: str) -> int | None:
    """When the marker of the commit record at ``key`` was written (ms; see ``_publish_commit``),
    or None for a key of another form."""
    stamp = key.rpartition("@")[2].partition("-")[0]
    return int(stamp) if len(stamp) == 13 and stamp.isdigit() else None


def dir_of(key: str) -> str:
    return key.rpartition("/")[0]


def _under(dir_key: str, top: str) -> bool:
    return not top or dir_key == top or dir_key.startswith(top + "/")


def pointed_step(marker_name: str, content: bytes) -> str | None:
    """The name of the step directory a pointer marker's ``content`` names, beside the
    pointer: DeepSpeed's ``latest`` holds the tag (``global_step100``), Megatron's tracker
    the iteration (``iter_0000100``) or ``release``.  None for anything else."""
    try:
        text = content.decode().strip()
    except UnicodeDecodeError:
        return None
    if marker_name == MEGATRON_TRACKER and text != "release":
        if not text.isdigit():
            return None
        text = f"iter_{int(text):07d}"
    if not text or text in (".", "..") or "/" in text or "\0" in text or len(text.encode()) > 255:
        return None
    return text


def _read_pointer(path: os.PathLike[str] | str) -> bytes | None:
    """A pointer marker's content from its local copy, None if it is too long to be one."""
    with open(path, "rb") as f:
        data = f.read(POINTER_MAX_BYTES + 1)
    return data if len(data) <= POINTER_MAX_BYTES else None


def parse_record(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_RECORD_BYTES:
        raise CorruptDataError(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptDataError(f"unreadable record: {exc}") from None
    if not isinstance(doc, dict):
        raise CorruptDataError("a record is not a JSON object")
    return doc


def record_files(doc: dict[str, Any]) -> list[dict[str, Any]]:
    files = doc.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        raise CorruptDataError("a record's 'files' is not a list of files")
    return files


@dataclasses.dataclass
class OwnGroup:
    """This node's round in one directory: what it opened for writing there, and what is published."""

    dir_key: str
    round: str
    started: float
    members: set[int] = dataclasses.field(default_factory=set)
    touches: int = 0  # writable opens and closes seen: a done is written only if none came while it was decided
    intent: bool = False  # published
    sealed: bool = False  # its done is written (or being written): a later open starts a new round
    done: bool = False  # published
    # Its records cannot exist on the remote (their keys too long, say): not announced, and
    # nothing waits for them (a drain until idle ends); tried again after a restart.
    unrecordable: bool = False
    # This node's earlier rounds here: their records go once this round's done is out, and this
    # done lists their files still here as they were (a marker written after a done of the
    # node's shards, in a round of its own, kept no record of them).
    previous: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        # Field by field: dataclasses.asdict deep-copies every member first (a pass journals
        # a directory of 10,000 small files' round while they drain).
        doc = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        doc["members"] = sorted(self.members)
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> OwnGroup:
        doc = json.loads(text)
        doc["members"] = set(doc.get("members", ()))
        previous = doc.get("previous")  # one round id or none, as journaled before it was a list
        doc["previous"] = [previous] if isinstance(previous, str) else list(previous or ())
        return cls(**doc)


def unfinished_rounds(journal: Journal) -> list[str]:
    """The directories where this cache's node has a round with files whose done is not out
    (blocking: the journal's meta).  Other nodes' markers wait for those dones by this
    node's id: the cache must keep it."""
    unfinished = []
    for _, value in journal.meta_items(_META_GROUP):
        with contextlib.suppress(ValueError, TypeError):
            group = OwnGroup.from_json(value)
            if group.members and not group.done and not group.unrecordable:
                unfinished.append(group.dir_key)
    return sorted(unfinished)


def records_due(journal: Journal, rels: list[str]) -> int:
    """How many of this node's records for directories at or under ``rels`` still have to go
    out (blocking: the journal's meta): the done of each round with files (other nodes'
    markers wait for it) and the commit record of each marker durable here (``latest`` reads
    it).  ``unmount --wait`` waits for them: a cache removed after it would lose them."""
    places = unfinished_rounds(journal)  # a round's directory; a commit's marker (a wait on it counts it)
    for key, _ in journal.meta_items(_META_COMMIT):
        places.append(key[len(_META_COMMIT) :].removeprefix(COMMITS_PREFIX).rsplit("@", 2)[0])
    return sum(1 for place in places if any(_under(place, rel.strip("/")) for rel in rels))


@dataclasses.dataclass(frozen=True)
class Waiting:
    """An intent without its done: who holds a marker back."""

    dir_key: str
    node: str
    round: str
    since: float  # when the intent was published (the remote's clock)


@dataclasses.dataclass
class Verdict:
    """What one listing of a marker directory's records said."""

    listed_at: float  # this node's clock, taken before the listing
    waiting: list[Waiting]
    own_pending: list[tuple[str, float]]  # (dir, round start) of own rounds whose intent or done is not out yet
    rounds: list[tuple[str, str, str]]  # (dir, node, round) complete
    files: list[dict[str, Any]]
    abandoned: list[float]  # when each intent without its done that an operator gave up was (the remote's clock)
    intent_times: dict[tuple[str, str, str], float]  # (dir, node, round) -> its intent's time (the remote's clock)
    # Files an index waiting here names that no done lists, found whole on the remote (object
    # and manifest): their node's records may never come (it stopped before it sent them).
    on_remote: frozenset[str] = frozenset()

    @functools.cached_property
    def recorded(self) -> frozenset[str]:
        """The paths the done records of the complete rounds list, and ``on_remote``."""
        return frozenset(entry["path"] for entry in self.files) | self.on_remote

    def open_for(self, closed_at: float) -> bool:
        """True if a marker closed at ``closed_at`` (this node's clock) may go: no other node's
        intent without its done, none of this node's rounds begun before it unfinished, and
        the listing taken after it closed.  Own rounds begun after it (the next checkpoint
        already being written here) do not hold it."""
        return (
            self.listed_at >= closed_at
            and not self.waiting
            and not any(started <= closed_at for _, started in self.own_pending)
        )

    def given_up_for(self, node_id: str, closed_at: float) -> bool:
        """True if a marker of ``node_id`` closed at ``closed_at`` (its clock) is of a checkpoint
        an operator gave up elsewhere: the gate is open only because of abandoned intents, and
        the checkpoint is older than the abandon.  An abandon frees *later* checkpoints only:
        a marker written before it (an earlier run's, staged on a cache drained later) waited
        for the same lost node, and freed by it went out over a newer run's shards.

        The marker's checkpoint is the node's own last round begun before it closed (round
        ids carry the node's clock); its age against an abandon is that round's intent time
        against the abandon's (both the remote's clock).  A node that wrote only the marker
        has no round: any round done in the directory after the abandon makes it later."""
        if not self.abandoned or not self.open_for(closed_at):
            return False
        own = [
            (round_id, at)
            for (_, node, round_id), at in self.intent_times.items()
            if node == node_id and (started := round_started_ms(round_id)) is not None and started <= closed_at * 1000
        ]
        if own:
            checkpoint_at = max(own)[1]
        else:
            checkpoint_at = max((self.intent_times[ident] for ident in self.rounds), default=-math.inf)
        return any(abandoned_at > checkpoint_at for abandoned_at in self.abandoned)


class CommitGroups:
    """This node's side of cross-node commits; lives with the mover, on its loop.

    ``writing_in`` is called from the FUSE thread (thread-safe, no I/O); everything
    else runs on the mover's asyncio loop, its journal reads and writes through
    ``journal_call`` (the mover's journal thread).
    """

    def __init__(
        self,
        node_id: str,
        journal: Journal,
        is_marker: Callable[[str], bool],
        wake: Callable[[], None],
        journal_call: JournalCall,
        health: RequestHealth | None = None,
    ) -> None:
        """``health`` hears how the remote answers the intent and done records (a silent
        remote shows in the status from the first retry of a record, as of a drain request)."""
        self.health = health
        self.node_id = node_id
        self.journal = journal
        self._db = journal_call
        self.is_marker = is_marker
        self._wake = wake
        self._lock = threading.Lock()
        self.groups: dict[str, OwnGroup] = {}
        self._dirty: set[str] = set()  # groups whose journaled copy is behind
        self._published = False  # an intent or a done went out in this pass (journaled at its end)
        # dir -> (round, members seen closed and durable, or out of the round): a pass reads
        # only the others, so a directory of 10,000 small files costs a read per file
        # drained, not a scan per pass (the done itself is still decided on a full check).
        self._settled: dict[str, tuple[str, set[int]]] = {}
        self._retouched: dict[str, set[int]] = {}  # dir -> members opened or closed since (not settled)
        # dir -> the round's touch count at the last pass: the full check runs only once it stood
        # still for a pass (files still coming in would void it, and it reads every member: done
        # on each pass it made a directory of small files written while draining cost O(n^2)).
        self._touches_seen: dict[str, int] = {}
        # dir -> not before then (monotonic) the next full check: its cost bounds how often it
        # runs while files keep coming in (a quarter of the time at most).
        self._full_check_after: dict[str, float] = {}
        self._retry_at: dict[str, float] = {}  # what -> earliest retry of its record
        self._failures: dict[str, int] = {}
        self._intent_events: dict[str, asyncio.Event] = {}
        self._wanted: dict[str, float] = {}  # marker dir -> last asked
        self._given_up: dict[str, float] = {}  # marker dir abandoned -> last asked (for status)
        self._wait_logged: dict[str, float] = {}  # marker dir -> when its wait was last logged (monotonic)
        self._failure_logged: dict[str, float] = {}  # marker dir -> when a failed look there was last logged
        self._waiting_since: dict[str, float] = {}  # marker dir -> when the poller first found it held
        self.verdicts: dict[str, Verdict] = {}
        self._done_files: dict[str, list[dict[str, Any]]] = {}  # done key -> its files (keys are write-once)
        self.abandoned: dict[str, float] = {}  # dir -> when an operator gave up its checkpoint
        # (pointer ino, generation) -> the directory its gate looks at (``gate_dir``)
        self._pointed: dict[tuple[int, int], str] = {}
        # pointer path -> the (ino, generation) of its newest version seen: an older one, rewritten
        # in place or replaced by a rename (a new inode), never drains
        self._pointer_at: dict[str, tuple[int, int]] = {}
        # gate dir -> how many older versions of the pointer now waiting there were rewritten
        # while they waited (status: the drain is slower than the checkpoint interval)
        self._rewritten: dict[str, int] = {}
        # dir -> {node: since}: a marker renamed into dir from a checkpoint these other nodes had
        # parts of; it waits for each of them to have a round there too (their renames).
        self.carried: dict[str, dict[str, float]] = {}
        # (marker ino, generation) -> the directory its gate looked at, and what it found there
        self._approved: dict[tuple[int, int], tuple[str, Verdict]] = {}
        # (index marker ino, generation) -> the names (relative to its directory) of the files it names
        self._named: dict[tuple[int, int], list[str]] = {}
        # gate dir -> the files the index waiting there names that no done lists yet (status)
        self._unrecorded: dict[str, list[str]] = {}
        self._unrecorded_logged: dict[str, float] = {}  # gate dir -> when that wait was last logged
        self._whole_checked: dict[str, tuple[float, frozenset[str]]] = {}  # gate dir -> (when, found whole)
        self._commits: dict[str, dict[str, Any]] = {}  # commit record key -> its document (journaled, due)
        self._poke: asyncio.Event | None = None
        self._next_forget = time.monotonic() + FORGET_REMOVED_S
        self._gone: set[str] = set()  # directories of complete rounds the last look found removed
        self.remote: Remote | None = None
        # Records are small: an attempt not answered within RECORD_ATTEMPT_TIMEOUT_S is on a
        # connection gone silent (a black-holed remote that healed), not a slow transfer.
        self.retry = RetryPolicy(attempts=3, base_delay=0.05, max_delay=0.5, attempt_timeout=RECORD_ATTEMPT_TIMEOUT_S)

    # -- the FUSE thread -------------------------------------------------------------

    def writing_in(self, ino: int, dir_key: str, name: bytes) -> None:
        """A file is opened for writing, or closed, in ``dir_key``: join this node's round there,
        or start one (if the round's done is already decided, the file was not in it)."""
        if self.is_marker(os.fsdecode(name)):
            return  # a marker is what the round waits for, never part of it
        with self._lock:
            group = self.groups.get(dir_key)
            if group is None or group.sealed:
                earlier = group
                group = OwnGroup(dir_key, new_round_id(), time.time())
                if earlier is not None:
                    # After its done, what is left of its earlier rounds are records a failed
                    # delete kept: this round's done tries again.
                    group.previous = [*earlier.previous, earlier.round]
                    if not earlier.done:  # its done is not out (yet): its files are waited for here too
                        group.members |= earlier.members
                self.groups[dir_key] = group
                log.info("event=round_started dir=%s round=%s node=%s", dir_key, group.round, self.node_id)
            self._touch_locked(group, ino)
        self._wake()

    def joined_announced(self, ino: int, dir_key: str, name: bytes) -> bool:
        """``writing_in`` for a close, done at once from any thread when this node's open round
        in ``dir_key`` already has its intent out: True if ``ino`` is now in that round (the
        close has nothing to wait for), False to go the long way (no such round yet, its done
        decided, or a marker).  Counting the touch under the lock is what keeps a done that
        is being decided from sealing the round without this close."""
        if self.is_marker(os.fsdecode(name)):
            return False
        with self._lock:
            group = self.groups.get(dir_key)
            if group is None or group.sealed or not group.intent:
                return False
            joined = self._touch_locked(group, ino)
        if joined:
            self._wake()
        return True

    def _touch_locked(self, group: OwnGroup, ino: int) -> bool:
        """Count an open or close of ``ino`` in ``group`` (held: ``_lock``); True if it joined."""
        group.touches += 1
        self._retouched.setdefault(group.dir_key, set()).add(ino)
        if ino in group.members:
            return False
        group.members.add(ino)
        self._dirty.add(group.dir_key)
        return True

    def announced_in(self, dir_key: str) -> bool:
        """Whether this node announced a round in ``dir_key`` on the remote (an intent is out):
        its files there reached (or are reaching) the remote, beside other nodes' (any thread)."""
        with self._lock:
            group = self.groups.get(dir_key)
            return group is not None and (group.intent or bool(group.previous))

    def intent_out(self, dir_key: str) -> bool:
        """True unless this node's intent for ``dir_key`` is still to be published."""
        group = self.groups.get(dir_key)
        return group is None or group.intent

    # -- the mover's loop ------------------------------------------------------------

    async def load(self) -> None:
        """This node's groups and abandons as journaled (a restart continues their rounds)."""
        own = await self._db(self.journal.meta_items, _META_GROUP)
        abandoned = await self._db(self.journal.meta_items, _META_ABANDONED)
        carried = await self._db(self.journal.meta_items, _META_CARRIED)
        commits = await self._db(self.journal.meta_items, _META_COMMIT)
        with self._lock:
            for key, value in own:
                try:
                    group = OwnGroup.from_json(value)
                except (ValueError, TypeError) as exc:
                    log.error("event=group_unreadable key=%s error=%r", key, exc)
                    continue
                group.unrecordable = False  # tried again
                self.groups.setdefault(group.dir_key, group)
            for key, value in abandoned:
                self.abandoned[key[len(_META_ABANDONED) :]] = float(value)
        for key, value in carried:
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                nodes = {str(node): float(since) for node, since in json.loads(value).items()}
                if nodes:
                    self.carried[key[len(_META_CARRIED) :]] = nodes
        for key, value in commits:
            try:
                self._commits[key[len(_META_COMMIT) :]] = json.loads(value)
            except ValueError as exc:
                log.error("event=commit_unreadable key=%s error=%r", key, exc)
        # Rounds are journaled by the mover's passes: closes since the last one (a pass stuck on
        # a silent remote, then an unmount or a crash) were in no journaled round.  Every file
        # closed here and not drained yet is in one: its directory's open round, or a new one.
        for ino, dir_key, name in await self._db(self._undrained_files):
            known = self.groups.get(dir_key)
            if known is None or known.sealed or ino not in known.members:
                self.writing_in(ino, dir_key, name)

    def _undrained_files(self) -> list[tuple[int, str, bytes]]:
        """(ino, directory, name) of every named file closed here and not durable (journal reads)."""
        marks, states = state_marks(QUEUED | {FAILED})
        rows = self.journal.inodes(
            f"WHERE kind='file' AND parent!=0 AND link_of IS NULL AND state IN ({marks})", states
        )
        found = []
        for row, path in zip(rows, self.journal.paths_of([r.ino for r in rows]), strict=True):
            if path is not None:
                found.append((row.ino, dir_of(path), row.name))
        return found

    async def wait_intent(self, dir_key: str, timeout: float) -> bool:  # noqa: ASYNC109 (a bound asked from the trio side)
        """Wait (at most ``timeout``) until this node's intent for ``dir_key`` is out."""
        if self.intent_out(dir_key):
            return True
        event = self._intent_events.setdefault(dir_key, asyncio.Event())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout)
        return self.intent_out(dir_key)

    async def has_work(self) -> bool:
        """Records that can be published now (a drain that runs until idle waits for them;
        a round with a file that never becomes durable is not one)."""
        with self._lock:
            groups = [(g.intent, g.done, set(g.members), g.dir_key) for g in self.groups.values() if not g.unrecordable]
        if self._commits:
            return True
        for intent, done, members, dir_key in groups:
            if not intent or (not done and await self._db(self._members, members, dir_key) is not None):
                return True
        return False

    async def step(self, remote: Remote) -> None:
        """Publish due intents and dones (and their journaled state); never raises for the remote."""
        self.remote = remote
        now = time.time()
        with self._lock:  # the FUSE thread adds members under it (joined_announced)
            pending = [g for g in self.groups.values() if not (g.intent and g.done)]
        await self._journal_dirty()
        for group in pending:
            if self._retry_at.get(group.dir_key, 0.0) > now or group.unrecordable:
                continue
            try:
                if not group.intent:
                    await self._publish_intent(remote, group)
                if group.intent and not group.done:
                    await self._maybe_done(remote, group)
            except RemoteError as exc:
                if error_scope(exc) == OBJECT:  # never, whatever the retries: the directory's files fail alike
                    with self._lock:
                        group.unrecordable = True
                        self._dirty.add(group.dir_key)
                    log.error("event=group_record_impossible dir=%s error=%s", group.dir_key, exc)
                else:
                    self._publish_failed(group.dir_key, exc)
        for commit_key, doc in list(self._commits.items()):
            if self._retry_at.get(commit_key, 0.0) > now:
                continue
            try:
                await self._publish_commit(remote, commit_key, doc)
            except RemoteError as exc:
                if error_scope(exc) != OBJECT:
                    self._publish_failed(commit_key, exc)
                    break
                log.error("event=commit_record_impossible key=%s error=%s", commit_key, exc)
            del self._commits[commit_key]
            self._retry_at.pop(commit_key, None)
            self._failures.pop(commit_key, None)
            await self._db(self.journal.drop_metas, [f"{_META_COMMIT}{commit_key}"])
        if self._published:  # what this pass published (an intent, a done) is journaled before it ends
            self._published = False
            await self._journal_dirty()
        if time.monotonic() >= self._next_forget:
            self._next_forget = time.monotonic() + FORGET_REMOVED_S
            await self._forget_removed(remote)

    async def _journal_dirty(self) -> None:
        """Journal the groups changed since they were last journaled."""
        with self._lock:
            dirty = [(f"{_META_GROUP}{key}", self.groups[key].to_json()) for key in self._dirty if key in self.groups]
            self._dirty.clear()
        if dirty:
            await self._db(self.journal.set_metas, dirty)

    async def _forget_removed(self, remote: Remote) -> None:
        """Rounds of directories removed here (keep-last-N, ``rm -r``) go: their records on the
        remote, their journal rows and their place here.  A run of thousands of steps kept two
        records per step directory ever written on the remote, a row in the journal, and an
        entry every look of a gate went through.  Only complete rounds (their done out) of a
        directory gone at two looks in a row (a rename in progress is not caught midway)."""
        with self._lock:
            complete = {g.dir_key: g for g in self.groups.values() if g.intent and g.done}
        present = await self._db(self._dirs_present, list(complete))
        gone = {dir_key for dir_key in complete if dir_key not in present}
        due, self._gone = gone & self._gone, gone
        for dir_key in sorted(due):
            group = complete[dir_key]
            with self._lock:
                if self.groups.get(dir_key) is not group:  # a new round began there meanwhile
                    continue
                del self.groups[dir_key]
            try:
                for round_id in [*group.previous, group.round]:
                    for kind in (INTENT, DONE_RECORD):  # the intent first: a done left alone is no round
                        key = record_key(dir_key, self.node_id, round_id, kind)
                        await self.retry.call(remote, remote.delete, key, what=f"delete {key}")
                        self._done_files.pop(key, None)
            except RemoteError as exc:  # its journal row stays: the next start's looks try again
                log.warning("event=group_forget_failed dir=%s error=%s", dir_key, exc)
                continue
            await self._db(self.journal.drop_metas, [f"{_META_GROUP}{dir_key}"])
            for per_dir in (self._settled, self._retouched, self._touches_seen, self._full_check_after):
                per_dir.pop(dir_key, None)
            log.info("event=group_forgotten dir=%s rounds=%d", dir_key, len(group.previous) + 1)

    def _dirs_present(self, dir_keys: list[str]) -> set[str]:
        """Of ``dir_keys``, the directories this node has (journal reads)."""
        return {dir_key for dir_key in dir_keys if self._is_dir(dir_key)}

    def retry_now(self) -> None:
        """``drain --now``: records backing off after failures are due at once (any thread)."""
        self._retry_at.clear()

    def _publish_failed(self, what: str, exc: RemoteError) -> None:
        failures = self._failures.get(what, 0) + 1
        self._failures[what] = failures
        delay = min(PUBLISH_BACKOFF_MAX_S, PUBLISH_BACKOFF_S * 2 ** (failures - 1))
        self._retry_at[what] = time.time() + delay
        log.warning("event=group_record_retry what=%s delay=%.1f error=%s", what, delay, exc)

    async def _create(self, remote: Remote, key: str, doc: dict[str, Any]) -> None:
        data = json.dumps(doc, separators=(",", ":")).encode()
        if not await reported_call(
            self.retry, remote, self.health, remote.create_object, key, data, what=f"create {key}"
        ):
            log.info("event=group_record_exists key=%s", key)  # an earlier attempt of ours landed

    async def _publish_intent(self, remote: Remote, group: OwnGroup) -> None:
        key = record_key(group.dir_key, self.node_id, group.round, INTENT)
        doc = {"node": self.node_id, "round": group.round, "dir": group.dir_key, "time": group.started}
        await self._create(remote, key, doc)
        with self._lock:
            group.intent = True
            self._dirty.add(group.dir_key)
        self._published = True
        self._retry_at.pop(group.dir_key, None)
        self._failures.pop(group.dir_key, None)
        event = self._intent_events.pop(group.dir_key, None)
        if event is not None:
            event.set()
        log.info("event=intent_published key=%s", key)

    def _all_settled(self, group: OwnGroup, members: set[int], retouched: set[int]) -> bool:
        """Whether every member looks closed and durable (or out of the round), reading only
        those not seen so once already in this round (and the ones opened or closed since).
        Journal reads: runs on the journal thread (the mover's loop awaits it)."""
        round_id, settled = self._settled.get(group.dir_key, (group.round, set()))
        if round_id != group.round:
            settled = set()
        settled -= retouched
        self._settled[group.dir_key] = (group.round, settled)
        for ino in sorted(members - settled):
            if self._members({ino}, group.dir_key) is None:
                return False
            settled.add(ino)
        return True

    def _members(self, members: set[int], dir_key: str) -> list[InodeRow] | None:
        """The closed member files still in ``dir_key``, or None while one is not durable.

        Files unlinked or renamed away are no longer part of the round (a file renamed into
        the directory joins it, and waits for its object to move), nor are
        files renamed to a marker's name (DCP writes ``.metadata`` as a temp file).
        A file still open for writing (or left open by a crash: ``incomplete``) is
        not waited for: a checkpoint's files are closed before its marker is
        written, and a later close joins the next round (a log file kept open in
        a checkpoint directory holds nothing back).  Journal reads only: runs on the journal thread."""
        rows = []
        for ino in sorted(members):
            row = self.journal.inode(ino)
            path = self.journal.path_of(ino) if row is not None and row.parent else None
            if row is None or path is None or dir_of(path) != dir_key or self.is_marker(os.fsdecode(row.name)):
                continue
            if row.state in (WRITING, INCOMPLETE):
                continue
            if row.state not in DONE or row.durable_generation != row.generation:
                return None
            if row.remote_key is not None and row.remote_key != path:
                return None  # renamed: settled once its object is moved to its new key
            rows.append(row)
        return rows

    async def _maybe_done(self, remote: Remote, group: OwnGroup) -> None:
        with self._lock:
            members, touches = set(group.members), group.touches
            retouched = self._retouched.pop(group.dir_key, set())
        quiet = self._touches_seen.get(group.dir_key) == touches
        self._touches_seen[group.dir_key] = touches
        if not await self._db(self._all_settled, group, members, retouched) or not quiet:
            return  # a member not durable yet (its upload's end wakes a pass), or files still coming in
        began = time.monotonic()
        if began < self._full_check_after.get(group.dir_key, 0.0):
            return  # the idle rescan (or the next wake) comes back
        rows = await self._db(self._members, members, group.dir_key)
        ended = time.monotonic()
        self._full_check_after[group.dir_key] = ended + FULL_CHECK_SPACING * (ended - began)
        if rows is None:  # changed without an open (a truncate by path): read each one again
            self._settled.pop(group.dir_key, None)
            return
        with self._lock:
            if group.touches != touches or self.groups.get(group.dir_key) is not group:
                return  # a file was opened or closed meanwhile: look again on the next pass
            group.sealed = True  # from here on, an open in this directory starts the next round
            self._dirty.add(group.dir_key)
        self._settled.pop(group.dir_key, None)
        self._touches_seen.pop(group.dir_key, None)
        self._full_check_after.pop(group.dir_key, None)
        paths = await self._db(self.journal.paths_of, [r.ino for r in rows])
        files = [
            {"path": path, "size": r.size, "digest": r.digest, "generation": r.generation}
            for r, path in zip(rows, paths, strict=True)
        ]
        earlier = (await self._earlier_files(remote, group))[-CARRIED_FILES_MAX:]
        files = [*await self._db(self._still_here, group.dir_key, earlier, {str(p) for p in paths}), *files]
        key = record_key(group.dir_key, self.node_id, group.round, DONE_RECORD)
        doc = {"node": self.node_id, "round": group.round, "dir": group.dir_key, "time": time.time(), "files": files}
        await self._create(remote, key, doc)
        with self._lock:
            group.done = True
            self._dirty.add(group.dir_key)
        self._published = True
        self._done_files[key] = files
        log.info("event=done_published key=%s files=%d", key, len(files))
        await self._drop_earlier(remote, group)

    async def _earlier_files(self, remote: Remote, group: OwnGroup) -> list[dict[str, Any]]:
        """The files the dones of this node's earlier rounds in ``group``'s directory listed,
        oldest first (a later round's entry for a path wins)."""
        files: dict[str, dict[str, Any]] = {}
        for round_id in group.previous:
            key = record_key(group.dir_key, self.node_id, round_id, DONE_RECORD)
            if key not in self._done_files:
                try:
                    data = await self.retry.call(remote, remote.get_object, key, what=f"get {key}")
                    self._done_files[key] = record_files(parse_record(data))
                except RemoteNotFound:
                    continue  # that round's done never went out: its files are this round's members
                except CorruptDataError as exc:  # not ours as written: nothing to carry from it
                    log.error("event=group_record_unreadable key=%s error=%s", key, exc)
                    continue
            for entry in self._done_files[key]:
                files.pop(entry["path"], None)  # the newest last: what a cap keeps
                files[entry["path"]] = entry
        return list(files.values())

    def _still_here(self, dir_key: str, entries: list[dict[str, Any]], skip: set[str]) -> list[dict[str, Any]]:
        """Of earlier dones' ``entries``, those whose file is still in ``dir_key`` as recorded
        (same generation, durable at its path), but not the paths in ``skip`` (this round
        has them).  Journal reads: runs on the journal thread."""
        directory = lookup(self.journal, dir_key)
        if directory is None or directory.kind != "dir":
            return []
        kept = []
        for entry in entries:
            path = entry["path"]
            if path in skip or dir_of(path) != dir_key:
                continue
            name = path.rpartition("/")[2]
            row = self.journal.child(directory.ino, os.fsencode(name))
            if (
                row is not None
                and row.kind == "file"
                and not self.is_marker(name)
                and row.generation == entry.get("generation")
                and row.state in DONE
                and row.durable_generation == row.generation
                and row.remote_key == path
            ):
                kept.append(entry)
        return kept

    async def _drop_earlier(self, remote: Remote, group: OwnGroup) -> None:
        """This node's earlier rounds in the directory are over once this done is out: their
        records go (only ours, ever), the intent first.  A round whose intent could not be
        deleted keeps its done too (an intent without its done is an unfinished round that
        would hold every later marker above it for good; the pair left is one more complete
        round) and stays earlier, so the next done tries again.  A done left without its
        intent is no round at all."""
        dropped = set()
        for round_id in list(group.previous):
            intent = record_key(group.dir_key, self.node_id, round_id, INTENT)
            try:
                await self.retry.call(remote, remote.delete, intent, what=f"delete {intent}")
            except RemoteError as exc:
                log.warning("event=group_record_kept key=%s reason=%r", intent, str(exc))
                continue
            done = record_key(group.dir_key, self.node_id, round_id, DONE_RECORD)
            with contextlib.suppress(RemoteError):
                await self.retry.call(remote, remote.delete, done, what=f"delete {done}")
            self._done_files.pop(done, None)
            dropped.add(round_id)
        with self._lock:
            group.previous = [round_id for round_id in group.previous if round_id not in dropped]
            self._dirty.add(group.dir_key)

    # -- the marker gate ---------------------------------------------------------------

    async def carry(self, remote: Remote, old_dir: str, new_dir: str) -> None:
        """A marker of ``old_dir``'s checkpoint moved to ``new_dir``: if ``old_dir`` itself was
        renamed (a temp directory renamed to the step's name, so no directory is at its path
        any more), the other nodes with parts in it rename theirs too, and the marker waits in
        ``new_dir`` until each has a round there.  Else the first node's rename published the
        step with its own part only (``latest`` named it).  A marker moved on its own (its old
        directory still there) takes no other node's part along: the gate there decides."""
        if not old_dir or await self._db(self._is_dir, old_dir):
            return
        nodes: set[str] = set()
        given_up: set[tuple[str, str]] = set()
        async for info in remote.list_all(group_prefix(old_dir)):
            parsed = parse_record_key(info.key)
            if parsed is None:
                continue
            _, node, round_id, kind = parsed
            if kind == ABANDONED:
                given_up.add((node, round_id))
            elif node != self.node_id:
                nodes.add(node)
        nodes -= {node for node, _ in given_up}
        if not nodes:
            return
        now = time.time()
        carried = self.carried.setdefault(new_dir, {})
        for node in nodes:
            carried.setdefault(node, now)
        await self._db(self.journal.set_meta, f"{_META_CARRIED}{new_dir}", json.dumps(carried))
        self.verdicts.pop(new_dir, None)
        log.info("event=marker_carries_nodes from=%s to=%s nodes=%s", old_dir, new_dir, ",".join(sorted(nodes)))

    def _is_dir(self, dir_key: str) -> bool:
        """Whether a directory is at ``dir_key`` in this node's namespace (journal reads)."""
        row = lookup(self.journal, dir_key)
        return row is not None and row.kind == "dir"

    async def _drop_carried(self, dir_key: str) -> None:
        if self.carried.pop(dir_key, None) is not None:
            await self._db(self.journal.set_meta, f"{_META_CARRIED}{dir_key}", "{}")

    async def gate_dir(self, marker: InodeRow, marker_key: str, local: os.PathLike[str] | str) -> str:
        """The directory whose records ``marker`` waits for: its own (with its subtree), or,
        for a pointer (``latest``, Megatron's tracker) whose content names a step directory
        beside it, that step only.  Gated on its whole directory a pointer also waited for
        every node's next steps: at a cadence faster than the drain the remote pointer lagged
        tens of steps.  ``local`` is the marker's copy in the tier."""
        dir_key, name = dir_of(marker_key), marker_key.rpartition("/")[2]
        if name not in POINTER_MARKERS or dir_key in self.carried:
            return dir_key
        ident = (marker.ino, marker.generation)
        if ident not in self._pointed:
            try:
                content = await asyncio.to_thread(_read_pointer, local)
            except OSError:
                content = None
            step = None if content is None else pointed_step(name, content)
            gate = dir_key
            if step is not None:
                named = f"{dir_key}/{step}" if dir_key else step
                if await self._db(self._is_dir, named):
                    gate = named
            if len(self._pointed) >= 1024:  # generations never published (rewritten, removed)
                self._pointed.clear()
                self._pointer_at.clear()
            rewritten = 0
            replaced = self._pointer_at.get(marker_key)
            if replaced is not None and replaced in self._pointed:
                # A rewritten pointer's older version never drains: the step it waited for is not
                # asked about any more (status showed it waiting until GATE_FORGET_S went by).
                old_gate = self._pointed.pop(replaced)
                rewritten += 1 + self._rewritten.pop(old_gate, 0)
                if old_gate != gate:
                    self._wanted.pop(old_gate, None)
                    self.verdicts.pop(old_gate, None)
            if rewritten:
                self._rewritten[gate] = rewritten
            self._pointed[ident] = gate
            self._pointer_at[marker_key] = ident
        return self._pointed[ident]

    def is_abandoned(self, marker: InodeRow, marker_key: str, gate: str) -> bool:
        """True if an operator gave up ``marker``'s checkpoint after it was written (here, or
        on another node: :meth:`Verdict.given_up_for`); ``gate`` as :meth:`gate_dir` said."""
        dir_key = gate
        verdict = self.verdicts.get(dir_key)
        given_up = max(self.abandoned.get(dir_key, -1.0), self.abandoned.get(dir_of(marker_key), -1.0))
        if given_up >= marker.updated or (verdict is not None and verdict.given_up_for(self.node_id, marker.updated)):
            self._given_up[dir_key] = time.monotonic()
            return True
        return False

    def holds(self, marker: InodeRow, gate: str) -> bool:
        """True while ``marker`` must wait for other nodes (an abandoned one is the caller's:
        :meth:`is_abandoned`).  Only reads what the poller found; asks it to look at the
        marker's ``gate`` (:meth:`gate_dir`)."""
        dir_key = gate
        self._wanted[dir_key] = time.monotonic()
        if self._poke is not None and dir_key not in self.verdicts:
            self._poke.set()
        verdict = self.verdicts.get(dir_key)
        return verdict is None or not verdict.open_for(marker.updated)

    async def index_holds(self, marker: InodeRow, marker_key: str, local: os.PathLike[str] | str, gate: str) -> bool:
        """True while a file ``marker`` names (a checkpoint index: DCP's ``.metadata``, a
        ``weight_map``) is in no done record of the rounds under ``gate`` (and not durable
        here at its path), once :meth:`holds` let it go.  Without this a node whose intent
        never reached the remote (its remote down for it) was invisible to the gate, and
        the index went out naming that node's missing shard.  ``local``: its tier copy."""
        ident = (marker.ino, marker.generation)
        if ident not in self._named:
            name = os.fsencode(marker_key.rpartition("/")[2])
            names: list[bytes] = []
            try:
                if index_kind(name) is not None:
                    names = await asyncio.to_thread(lambda: named_files(name, read_index(local, name)))
            except OSError as exc:  # the tier lost it: the drain of the marker itself fails
                log.warning("event=index_unreadable key=%s error=%s", marker_key, exc)
            if len(self._named) >= 1024:  # generations never published (rewritten, removed)
                self._named.clear()
            self._named[ident] = [os.fsdecode(n) for n in names]
        # Paths under the marker's directory as it is named now: a directory renamed while its
        # index waited (tmp-checkpoint-N -> checkpoint-N) has its files there.
        dir_key = dir_of(marker_key)
        named = [f"{dir_key}/{n}" if dir_key else n for n in self._named[ident]]
        verdict = self.verdicts.get(gate)
        unrecorded = [path for path in named if verdict is None or path not in verdict.recorded]
        if unrecorded:
            durable_here = await self._db(self._durable_here, unrecorded)
            unrecorded = [path for path in unrecorded if path not in durable_here]
        if not unrecorded:
            self._unrecorded.pop(gate, None)
            self._unrecorded_logged.pop(gate, None)
            return False
        self._unrecorded[gate] = unrecorded
        now = time.monotonic()
        if now - self._unrecorded_logged.get(gate, -math.inf) >= GATE_WAIT_LOG_S:
            self._unrecorded_logged[gate] = now
            log.warning(
                "event=marker_waiting dir=%s unrecorded=%d first=%s hint=%s",
                gate or "/",
                len(unrecorded),
                unrecorded[0],
                "the index names files no node has recorded durable: a node whose intent has not reached "
                "the remote yet, or a file never written (burstfs-admin abandon on this node gives it up)",
            )
        return True

    def _durable_here(self, paths: list[str]) -> set[str]:
        """Of ``paths``, the files durable at that path as this node knows them: its own, or
        another node's it listed (journal reads: runs on the journal thread)."""
        found = set()
        for path in paths:
            row = lookup(self.journal, path)
            if (
                row is not None
                and row.kind == "file"
                and row.state in DONE
                and row.remote_key == path
                and (row.state == REMOTE or row.durable_generation == row.generation)
            ):
                found.add(path)
        return found

    def approve(self, marker: InodeRow, gate: str) -> None:
        """``marker`` drains now (no :meth:`holds` or :meth:`index_holds`): what its gate found is
        its commit record's, once it is durable."""
        self._approved[(marker.ino, marker.generation)] = (gate, self.verdicts[gate])

    async def poll(self, remote: Remote) -> None:
        """Keep the verdicts of the directories waiting markers ask about fresh (runs forever)."""
        self._poke = asyncio.Event()
        delay = GATE_POLL_MIN_S
        while True:
            now = time.monotonic()
            for dir_key, asked in list(self._wanted.items()):
                if now - asked > GATE_FORGET_S:
                    del self._wanted[dir_key]
                    self.verdicts.pop(dir_key, None)
                    self._unrecorded.pop(dir_key, None)
                    self._whole_checked.pop(dir_key, None)
                    self._failure_logged.pop(dir_key, None)
            opened = False
            for dir_key in list(self._wanted):
                try:
                    verdict = await self.look(remote, dir_key)
                except (RemoteError, CorruptDataError) as exc:
                    self._log_failure(dir_key, exc)
                    continue
                except Exception:  # a bug must not stop every later marker: log, look again later
                    log.exception("event=gate_bug dir=%s", dir_key)
                    continue
                self._failure_logged.pop(dir_key, None)
                before = self.verdicts.get(dir_key)
                self.verdicts[dir_key] = verdict
                self._log_waiting(dir_key, verdict)
                if not verdict.waiting:
                    if before is None or before.waiting:
                        opened = True
                        log.info("event=gate_open dir=%s rounds=%d", dir_key, len(verdict.rounds))
                    elif dir_key in self._unrecorded and (
                        verdict.rounds != before.rounds or verdict.on_remote != before.on_remote
                    ):
                        opened = True  # a new done (or a drained file) may be what an index here waits for
            if opened:
                self._wake()
            delay = GATE_POLL_MIN_S if opened else min(GATE_POLL_MAX_S, delay * 2)
            self._poke.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), delay if self._wanted else 3600)
            if self._poke.is_set():
                delay = GATE_POLL_MIN_S

    def _log_failure(self, dir_key: str, exc: BaseException) -> None:
        """One line per GATE_WAIT_LOG_S for a marker directory the remote cannot be asked about
        (looked at every 0.4 s: an outage of an hour wrote 9,000 lines per directory)."""
        now = time.monotonic()
        if now - self._failure_logged.get(dir_key, -math.inf) >= GATE_WAIT_LOG_S:
            self._failure_logged[dir_key] = now
            log.warning("event=gate_list_failed dir=%s error=%s", dir_key, exc)

    def _log_waiting(self, dir_key: str, verdict: Verdict) -> None:
        """One line per GATE_WAIT_LOG_S for a marker directory held by other nodes' intents."""
        if not verdict.waiting:
            self._wait_logged.pop(dir_key, None)
            self._waiting_since.pop(dir_key, None)
            return
        now = time.monotonic()
        if now - self._wait_logged.get(dir_key, -math.inf) < GATE_WAIT_LOG_S:
            return
        self._wait_logged[dir_key] = now
        waited = now - self._waiting_since.setdefault(dir_key, now)
        nodes = ",".join(sorted({w.node for w in verdict.waiting}))
        oldest = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(min(w.since for w in verdict.waiting)))
        log.warning(
            "event=marker_waiting dir=%s nodes=%s intent_since=%s waited=%.0fs hint=%s",
            dir_key or "/",
            nodes,
            oldest,
            waited,
            "their files are not durable yet"
            if waited < GATE_WAIT_LOG_S
            else "if a node is lost, it holds this for good: bring it back with its cache, "
            "or burstfs-admin abandon on this node",
        )

    async def look(self, remote: Remote, dir_key: str) -> Verdict:
        """One listing of ``dir_key``'s records (its subtree): who is still writing, what is done."""
        listed_at = time.time()
        intents: dict[tuple[str, str, str], float] = {}
        dones: dict[tuple[str, str, str], str] = {}
        given_up: dict[tuple[str, str, str], float] = {}  # -> when it was abandoned (the remote's clock)
        async for info in remote.list_all(group_prefix(dir_key)):
            parsed = parse_record_key(info.key)
            if parsed is None:
                continue
            group_dir, node, round_id, kind = parsed
            ident = (group_dir, node, round_id)
            if kind == INTENT:
                intents[ident] = info.mtime
            elif kind == DONE_RECORD:
                dones[ident] = info.key
            else:
                given_up[ident] = info.mtime
        with self._lock:
            own = [g for g in self.groups.values() if _under(g.dir_key, dir_key)]
            own_rounds = {(g.dir_key, self.node_id, g.round) for g in own}
            # A round whose done went out after the listing above was taken is pending too: its
            # files are not in this verdict (a pointer's commit record went out naming none).
            own_pending = [
                (g.dir_key, g.started)
                for g in own
                if g.members
                and not g.unrecordable
                and not (g.intent and g.done and (g.dir_key, self.node_id, g.round) in dones)
            ]
        rounds = sorted(ident for ident in intents if ident in dones)
        # This node's current rounds are judged from what it knows (own_pending), not from the remote.
        unfinished = [
            (ident, t) for ident, t in sorted(intents.items()) if ident not in dones and ident not in own_rounds
        ]
        waiting = [Waiting(*ident, t) for ident, t in unfinished if ident not in given_up]
        present = {node for _, node, _ in intents}
        waiting += [  # a moved marker's nodes that have not renamed their part here yet
            Waiting(dir_key, node, "", since)
            for node, since in sorted(self.carried.get(dir_key, {}).items())
            if node not in present
        ]
        abandoned = [given_up[ident] for ident, _ in unfinished if ident in given_up]
        files: list[dict[str, Any]] = []
        on_remote: frozenset[str] = frozenset()
        if not waiting:
            for ident in rounds:
                files.extend(await self._read_done(remote, dones[ident]))
            listed = {entry["path"] for entry in files}
            on_remote = await self._whole_on_remote(
                remote, dir_key, [p for p in self._unrecorded.get(dir_key, ()) if p not in listed]
            )
        return Verdict(listed_at, waiting, own_pending, rounds, files, abandoned, intents, on_remote)

    async def _whole_on_remote(self, remote: Remote, dir_key: str, paths: list[str]) -> frozenset[str]:
        """Of ``paths`` (files an index waiting in ``dir_key`` names and no done lists), those
        whose object and manifest are both on the remote: drained, though their node's records
        are not out (its remote refused them, then it unmounted: the index waited for good).
        Asked at most every UNRECORDED_CHECK_S per directory, for the first few."""
        if not paths:
            return frozenset()
        checked_at, found = self._whole_checked.get(dir_key, (-math.inf, frozenset()))
        if time.monotonic() - checked_at < UNRECORDED_CHECK_S:
            return found
        present = set()
        for path in paths[:UNRECORDED_CHECK_MAX]:
            try:
                for key in (path, manifest_key(path)):
                    if await self.retry.call(remote, remote.head, key, what=f"head {key}") is None:
                        break
                else:
                    present.add(path)
            except RemoteError as exc:
                log.info("event=gate_head_failed path=%s error=%s", path, exc)
                break
        found = frozenset(present)
        self._whole_checked[dir_key] = (time.monotonic(), found)
        return found

    async def _read_done(self, remote: Remote, key: str) -> list[dict[str, Any]]:
        if key not in self._done_files:
            data = await self.retry.call(remote, remote.get_object, key, what=f"get {key}")
            self._done_files[key] = record_files(parse_record(data))
        return self._done_files[key]

    def commit_due(self, marker: InodeRow, key: str, size: int, digest: str) -> tuple[str, dict[str, Any]] | None:
        """The commit record (its key and document: what ``latest`` checks) that the marker's
        upload makes due, if its gate approved it.  The upload journals it with the marker's
        durable state (``journal_commit``), then queues it (``commit_recorded``): a stop or a
        crash before it is out keeps it, and the marker is not uploaded again to redo it."""
        gate = self._pointed.pop((marker.ino, marker.generation), None)
        if gate is not None:
            self._rewritten.pop(gate, None)
        self._named.pop((marker.ino, marker.generation), None)
        approved = self._approved.pop((marker.ino, marker.generation), None)
        if approved is None:
            return None
        gate, verdict = approved
        files: dict[str, dict[str, Any]] = {}
        for entry in verdict.files:  # a path two nodes wrote: the later done's entry (the last drain won)
            files[entry["path"]] = entry
        doc = {
            "dir": dir_of(key),
            "node": self.node_id,
            "time": time.time(),
            "marker": {"path": key, "size": size, "digest": digest, "generation": marker.generation},
            "gate": gate,  # whose rounds it waited for: ``latest`` looks there for parts announced late
            "rounds": [list(r) for r in verdict.rounds],
            "files": list(files.values()),
        }
        # Named by when the marker was closed here (the journal's time, as the gate judges it),
        # not when it got out: ``latest`` orders checkpoints by it (an older step whose node came
        # back late is not the newest; the remote's modification times have one-second
        # resolution).  Not by the marker's mtime: ``cp -a``, ``rsync -a``, ``tar`` or ``touch``
        # set that to any time, and an older one made a newer step look older.
        return f"{self._commits_of(key)}{record_id(int(marker.updated * 1e9))}.commit", doc

    def journal_commit(self, commit: tuple[str, dict[str, Any]]) -> None:
        """Journal a commit record due (blocking: on the journal thread)."""
        commit_key, doc = commit
        self.journal.set_meta(f"{_META_COMMIT}{commit_key}", json.dumps(doc, separators=(",", ":")))

    def commit_recorded(self, commit: tuple[str, dict[str, Any]]) -> None:
        """A journaled commit record is due: the next pass publishes it."""
        commit_key, doc = commit
        self._commits[commit_key] = doc
        self._wake()

    def _commits_of(self, key: str) -> str:
        """The key prefix of this node's commit records of the marker at ``key``."""
        dir_key, name = dir_of(key), key.rpartition("/")[2]
        return f"{COMMITS_PREFIX}{dir_key + '/' if dir_key else ''}{name}@{self.node_id}@"

    async def _publish_commit(self, remote: Remote, commit_key: str, doc: dict[str, Any]) -> None:
        prefix = commit_key.rpartition("@")[0] + "@"  # _commits_of its marker, by the node id it was made by
        await self._create(remote, commit_key, doc)
        log.info("event=commit_published key=%s files=%d", commit_key, len(doc["files"]))
        await self._drop_carried(doc["dir"])
        await self._delete_commits(remote, prefix, keep=commit_key)  # our older commits of this marker

    async def marker_deleted(self, remote: Remote, key: str) -> None:
        """The marker object at ``key`` was deleted (no file of this node has that name any
        more): this node's commit records of it name a checkpoint that is gone.  Without this a
        long run's records pile up under ``.burstfs/commits/`` and ``latest`` lists them all."""
        prefix = self._commits_of(key)
        due = [commit_key for commit_key in self._commits if commit_key.startswith(prefix)]
        for commit_key in due:  # not published yet: never, now
            del self._commits[commit_key]
        if due:
            await self._db(self.journal.drop_metas, [f"{_META_COMMIT}{k}" for k in due])
        await self._delete_commits(remote, prefix, keep=None)

    async def _delete_commits(self, remote: Remote, prefix: str, keep: str | None) -> None:
        """Delete the commit records under ``prefix`` but ``keep`` (best effort: a failure leaves
        a record that ``latest`` checks and skips)."""
        with contextlib.suppress(RemoteError):
            async for info in remote.list_all(prefix):
                if info.key != keep and info.key.endswith(".commit") and "/" not in info.key[len(prefix) :]:
                    with contextlib.suppress(RemoteError):
                        await self.retry.call(remote, remote.delete, info.key, what=f"delete {info.key}")
                        log.info("event=commit_deleted key=%s", info.key)

    # -- operators -------------------------------------------------------------------------

    async def abandon(self, remote: Remote, dir_key: str) -> tuple[str, list[Waiting]]:
        """Give up the checkpoint in ``dir_key``: its held marker is never published, and the
        intents it waited for no longer hold later rounds there.  Returns the directory given
        up (for a pointer's directory, the step its pointer names) and those intents.
        Only a marker of this node that waits there can be given up: abandoning a directory
        whose nodes are still writing would let its marker out without their shards."""
        if dir_key not in self._wanted:  # a pointer's directory: its gate is the step it names
            pointed = set(self._pointed.values())
            dir_key = next((gate for gate in self._wanted if gate in pointed and dir_of(gate) == dir_key), dir_key)
        if dir_key not in self._wanted:
            raise FsError(
                errno.ENOENT,
                f"no marker of this node waits in {dir_key or '/'}: nothing to abandon (run it on the node "
                "whose marker waits, once it does: burstfs-admin status shows 'checkpoint ... waiting for node')",
            )
        verdict = await self.look(remote, dir_key)
        for waiting in verdict.waiting:
            if not waiting.round:  # a moved marker's node with no round here: nothing to mark
                continue
            key = record_key(waiting.dir_key, waiting.node, waiting.round, ABANDONED)
            await self._create(remote, key, {"by": self.node_id, "time": time.time()})
        await self._drop_carried(dir_key)
        now = time.time()
        self.abandoned[dir_key] = now
        await self._db(self.journal.set_meta, f"{_META_ABANDONED}{dir_key}", repr(now))
        self.verdicts.pop(dir_key, None)
        self._wanted.pop(dir_key, None)  # its marker is given up (a second abandon finds nothing to give up)
        log.warning("event=checkpoint_abandoned dir=%s intents=%d", dir_key, len(verdict.waiting))
        return dir_key, verdict.waiting

    def waiting_markers(self) -> list[dict[str, Any]]:
        """For status: each marker directory still held, and by whom."""
        out = []
        now = time.monotonic()
        wanted, given_up = dict(self._wanted), {d for d, t in dict(self._given_up).items() if now - t < GATE_FORGET_S}
        for dir_key, verdict in sorted(dict(self.verdicts).items()):
            unrecorded = list(self._unrecorded.get(dir_key, ()))
            if (
                dir_key not in wanted
                or dir_key in given_up
                or (not verdict.waiting and not verdict.own_pending and not unrecorded)
            ):
                continue
            out.append(
                {
                    "dir": dir_key,
                    "waiting": [
                        {"node": w.node, "dir": w.dir_key, "round": w.round, "intent_time": w.since}
                        for w in verdict.waiting
                    ],
                    "own_pending": [d for d, _ in verdict.own_pending],
                    # files its index names that no done lists yet (the first 10)
                    "unrecorded": unrecorded[:10],
                    "unrecorded_count": len(unrecorded),
                    # a pointer rewritten this often while it waited: each step drains slower
                    # than the next is written, so the remote pointer does not advance
                    "pointer_rewrites": self._rewritten.get(dir_key, 0),
                    # A marker waiting here now is a later one than any given up here (those are
                    # failed, not asked about): an abandon here long ago says nothing of it.
                    "abandoned": False,
                }
            )
        for dir_key in sorted(given_up):
            out.append(
                {
                    "dir": dir_key,
                    "waiting": [],
                    "own_pending": [],
                    "unrecorded": [],
                    "unrecorded_count": 0,
                    "pointer_rewrites": 0,
                    "abandoned": True,
                }
            )
        return out

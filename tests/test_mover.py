"""The mover in-process: the journal as the front writes it, a real file remote, no FUSE.

``Front`` writes the journal records core.py writes (create+close, rename, unlink)
so that a test can interleave them with the mover at exact points: ``HookedRemote``
parks chosen remote calls until the test lets them go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from journaltree import JournalTree

from burstfs import drainservice as drainservice_module
from burstfs.config import DrainOptions, S3Options, parse_remote_url
from burstfs.errors import FsError, RemoteError
from burstfs.journal import DURABLE, FAILED, MOVING, REMOTE, ROOT_INO, STAGED, Journal
from burstfs.journal.drain import Candidate, DrainQueue
from burstfs.journal.thread import JournalThread
from burstfs.mover import Mover
from burstfs.mover import timing as mover_timing
from burstfs.mover.bursts import WriterBursts
from burstfs.objects import manifest_key
from burstfs.remote import FileRemote
from burstfs.remote.base import UploadedPart
from burstfs.status import durability, wait_state

PART = 5 << 20

Hook = Callable[[str, str], Awaitable[None]]


class HookedRemote(FileRemote):
    """A file remote whose calls can be held (``hold``) or observed (``calls``)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(parse_remote_url(f"file://{directory}"))
        self.calls: list[tuple[str, str]] = []
        self._holds: dict[tuple[str, str], tuple[asyncio.Event, asyncio.Event]] = {}

    def hold(self, op: str, key: str) -> tuple[asyncio.Event, asyncio.Event]:
        """The next ``op`` on ``key`` waits: returns (entered, release) events."""
        events = (asyncio.Event(), asyncio.Event())
        self._holds[(op, key)] = events
        return events

    async def _gate(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        events = self._holds.pop((op, key), None)
        if events is not None:
            events[0].set()
            await events[1].wait()

    async def put_object(self, key: str, data: bytes) -> None:
        await self._gate("put", key)
        await super().put_object(key, data)

    async def complete_multipart(self, key: str, upload_id: str, parts: list[UploadedPart]) -> None:
        await self._gate("complete", key)
        await super().complete_multipart(key, upload_id, parts)

    async def upload_part(self, key: str, upload_id: str, part_number: int, offset: int, data: bytes) -> UploadedPart:
        await self._gate("part", key)
        return await super().upload_part(key, upload_id, part_number, offset, data)

    async def copy(self, src: str, dst: str) -> None:
        await self._gate("copy", src)
        await super().copy(src, dst)


class Front(JournalTree):
    """The journal records of the FUSE front (core.py), without a mount, on a journal of its own;
    like the front's DrainService hooks it stamps the mover's writer bursts when told to
    (``make_mover`` does)."""

    def __init__(self, cache: Path) -> None:
        super().__init__(Journal(cache), cache, chunk_size=PART)
        self.bursts: WriterBursts | None = None

    def create(self, name: str, parent: int = ROOT_INO) -> int:
        ino = super().create(name, parent)
        if self.bursts is not None:
            self.bursts.opened(ino)
        return ino

    def close(self, ino: int, size: int = 10, *, digests: bool = True) -> int:
        generation = super().close(ino, size, digests=digests)
        if self.bursts is not None:
            self.bursts.released(ino)
        return generation


def make_mover(tmp_path: Path, remote: FileRemote | None = None) -> tuple[Mover, Front, HookedRemote]:
    cache, directory = tmp_path / "cache", tmp_path / "remote"
    cache.mkdir(exist_ok=True)
    directory.mkdir(exist_ok=True)
    front = Front(cache)
    hooked = remote if isinstance(remote, HookedRemote) else HookedRemote(directory)
    mover = Mover(
        cache,
        parse_remote_url(f"file://{directory}"),
        S3Options(),
        DrainOptions(part_size=PART, concurrency=2),
        remote=hooked,
    )
    front.bursts = mover.bursts
    return mover, front, hooked


def remote_bytes(tmp_path: Path, key: str) -> bytes | None:
    path = tmp_path / "remote" / key
    return path.read_bytes() if path.is_file() else None


def user_keys(tmp_path: Path) -> set[str]:
    """Objects under the remote directory, burstfs' own .burstfs/ left out."""
    root = tmp_path / "remote"
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()} - {
        p.relative_to(root).as_posix() for p in (root / ".burstfs").rglob("*")
    }


async def until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def settled(front: Front) -> bool:
    """Every linked file durable at its own path, and no remote delete pending."""
    rows = front.journal.query("SELECT ino, state, remote_key FROM inodes WHERE kind='file' AND parent!=0")
    for ino, state, key in rows:
        if state != DURABLE or key != front.journal.path_of(ino):
            return False
    return not front.journal.query("SELECT 1 FROM remote_deletes")


async def settle(mover: Mover, front: Front) -> None:
    mover.drain_now()
    await until(lambda: settled(front) and not mover.in_flight, "the drain to settle")


def run_mover(mover: Mover, scenario: Callable[[], Awaitable[None]]) -> None:
    """Run ``mover`` (until stopped) alongside ``scenario``."""

    async def main() -> None:
        task = asyncio.create_task(mover.run())
        try:
            await asyncio.wait_for(scenario(), 60)
        finally:
            mover.stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


# -- bookkeeping --------------------------------------------------------------------------


def test_event_log_is_pruned_to_the_most_recent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = Journal(tmp_path)
    journal.apply([journal.log_event(None, "closed", f"n={i}") for i in range(50)])
    monkeypatch.setattr(mover_timing, "EVENTS_KEPT", 10)
    mover = Mover(tmp_path, parse_remote_url(f"file://{tmp_path}"), S3Options(), DrainOptions())
    mover._journal_thread = JournalThread()
    asyncio.run(mover._prune_events())
    details = [detail for _, _, _, detail in journal.events()]
    assert details == [f"n={i}" for i in range(40, 50)]
    journal.apply([journal.log_event(None, "closed", "n=50")])
    asyncio.run(mover._prune_events())  # not due again yet: nothing more is dropped
    assert len(journal.events()) == 11
    mover._journal_thread.close()


# -- issue 10 #1: a key another inode owns or is uploading to is never overwritten ----------


def test_small_files_drain_beside_large_uploads_in_flight(tmp_path: Path) -> None:
    """Every --max-files slot holds a large upload: small files still drain (a pool of their own)."""
    mover, front, remote = make_mover(tmp_path)
    large = mover_timing.SMALL_FILE_BYTES + 1
    held = [remote.hold("put", f"large{i}") for i in range(mover.options.max_files)]

    async def scenario() -> None:
        big = [front.write(f"large{i}", b"L" * large) for i in range(mover.options.max_files)]
        mover.wake()
        await until(lambda: all(entered.is_set() for entered, _ in held), "every large slot busy")
        small = [front.write(f"small{i}", b"s" * 4096) for i in range(40)]
        mover.wake()
        await until(lambda: all(front.row(ino).state == DURABLE for ino in small), "the small files durable")
        assert all(front.row(ino).state != DURABLE for ino in big)
        for _, release in held:
            release.set()
        await settle(mover, front)

    run_mover(mover, scenario)
    assert len(user_keys(tmp_path)) == 40 + mover.options.max_files


def test_with_a_drain_delay_a_pass_does_not_read_the_queue_after_every_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --drain-delay no staged file stops the queue's scan early, and a pass follows
    every close: each close read every staged file (19% of the daemon's CPU over 8,000 small
    files). A pass that found none due reads the queue again at most once a second."""
    mover, front, _ = make_mover(tmp_path)
    mover.options = dataclasses.replace(mover.options, delay=30.0)
    front.bursts = None  # no writer burst holds the passes back: every close gets its pass
    empty_reads: list[float] = []
    read_queue = DrainQueue.candidates

    def counting(self: DrainQueue, *args: Any, **kwargs: Any) -> list[Candidate]:
        found = read_queue(self, *args, **kwargs)
        if not found:
            empty_reads.append(time.monotonic())
        return found

    monkeypatch.setattr(DrainQueue, "candidates", counting)

    async def scenario() -> None:
        await until(lambda: empty_reads, "the first pass")
        started = time.monotonic()
        inos = []
        for i in range(40):
            inos.append(front.write(f"f{i}", b"s" * 4096))
            mover.wake()
            await asyncio.sleep(0.02)  # several passes' worth (COALESCE_S) between closes
        seconds = time.monotonic() - started
        reads = [t for t in empty_reads if t >= started]
        assert len(reads) <= 2 + seconds / mover_timing.IDLE_RESCAN_S, (len(reads), seconds)
        await settle(mover, front)  # drain --now skips the delay: no wait for the memo
        assert all(front.row(ino).state == DURABLE for ino in inos)

    run_mover(mover, scenario)


def test_small_uploads_that_end_wake_the_loop_by_the_batch_and_every_file_still_drains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass per small upload that ended was a fifth of the daemon's CPU over thousands of
    small files: an ending small upload wakes the loop only once SMALL_REFILL slots are free.
    With the idle rescan off, a batch that never woke it would leave files undrained."""
    monkeypatch.setattr(mover_timing, "IDLE_RESCAN_S", 3600.0)
    mover, front, remote = make_mover(tmp_path)
    front.bursts = None
    wakes: list[int] = []
    wake = mover.wake
    monkeypatch.setattr(mover, "wake", lambda: (wakes.append(1), wake())[1])
    pool = mover_timing.SMALL_FILES_IN_FLIGHT

    async def scenario() -> None:
        await until(lambda: mover.loop is not None, "the mover's loop")
        real_pool = mover._small_uploads
        mover._small_uploads = {asyncio.create_task(asyncio.sleep(0)) for _ in range(pool)}
        mover.upload_ended(4096)  # the pool still full but for this one: no pass yet
        assert wakes == []
        mover.upload_ended(mover_timing.SMALL_FILE_BYTES + 1)  # a large slot is free at once
        assert len(wakes) == 1
        mover._small_uploads = set(list(mover._small_uploads)[: pool - mover_timing.SMALL_REFILL + 1])
        mover.upload_ended(4096)  # SMALL_REFILL slots free once this one leaves
        assert len(wakes) == 2
        mover._small_uploads = real_pool
        inos = [front.write(f"f{i}", b"s" * 4096) for i in range(3 * pool)]
        mover.wake()
        await until(lambda: all(front.row(ino).state == DURABLE for ino in inos), "every small file durable")

    run_mover(mover, scenario)
    assert len([op for op, _ in remote.calls if op == "put"]) >= 3 * pool


def test_large_uploads_yield_to_a_new_writer_and_small_files_do_not(tmp_path: Path) -> None:
    """While a file opened for writing moments ago is open, no large upload starts and one in
    flight sends no further part (small files still drain); the writer's close lets them go
    on, and everything drains."""
    mover, front, remote = make_mover(tmp_path)
    entered, release = remote.hold("part", "early.bin")

    async def scenario() -> None:
        front.write("early.bin", os.urandom(4 * PART))
        mover.wake()
        await until(entered.is_set, "early.bin's upload under way")
        writer = front.create("next_rank.bin")  # opened, not yet closed
        big = front.write("big.bin", os.urandom(2 * PART + 1))
        small = front.write("small.bin", b"s" * 100)
        mover.wake()
        await until(lambda: front.row(small).state == DURABLE, "the small file durable")
        parts_sent = remote.calls.count(("part", "early.bin"))
        release.set()
        await asyncio.sleep(0.5)
        assert front.row(big).state == STAGED  # not even started
        assert not [call for call in remote.calls if call == ("part", "big.bin")]
        assert remote.calls.count(("part", "early.bin")) == parts_sent  # none since the writer opened
        front.rewrite(writer, b"w" * 100)  # the writer closes
        await settle(mover, front)

    run_mover(mover, scenario)
    assert user_keys(tmp_path) == {"early.bin", "big.bin", "small.bin", "next_rank.bin"}


async def keep_bursting(mover: Mover, seconds: float) -> None:
    """Writers open and close files without a pause (as the FUSE thread stamps them)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        mover.bursts.touch()
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("ends", ["pause", "bound", "drain --now"])
def test_no_upload_starts_during_a_burst_of_writers_until_it_pauses_or_is_too_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    """A burst buffer absorbs the burst first; a burst that never pauses is absorbed only
    for BURST_MAX_S, and `drain --now` does not wait for it."""
    monkeypatch.setattr(mover_timing, "BURST_GAP_S", 1.0)  # a stalled test loop is no pause
    monkeypatch.setattr(mover_timing, "BURST_MAX_S", 1.5 if ends == "bound" else 60.0)
    monkeypatch.setattr(mover_timing, "BURST_MIN_FREE", 0.0)  # whatever the test machine's disk holds
    mover, front, remote = make_mover(tmp_path)

    async def scenario() -> None:
        await until(lambda: mover.running, "the mover running")
        burst = asyncio.create_task(keep_bursting(mover, 60.0))
        try:
            await asyncio.sleep(0.1)
            small = [front.write(f"step/shard{i}", b"s" * 4096) for i in range(5)]
            large = front.write("step/big.bin", os.urandom(2 * PART + 1))
            mover.wake()
            await asyncio.sleep(1.0)  # well inside the burst (and its bound)
            assert not remote.calls, remote.calls
            if ends == "pause":
                burst.cancel()
            elif ends == "drain --now":
                mover.drain_now()
            await until(lambda: all(front.row(ino).state == DURABLE for ino in [*small, large]), "the files durable")
        finally:
            burst.cancel()
        await settle(mover, front)

    run_mover(mover, scenario)
    assert len(user_keys(tmp_path)) == 6


def test_rename_during_upload_keeps_the_new_file_at_the_old_name(tmp_path: Path) -> None:
    """model.pt uploads; renamed to model_100.pt; a new model.pt is saved: both survive."""
    mover, front, remote = make_mover(tmp_path)
    old, new = b"old" * 1000, b"new" * 2000

    async def scenario() -> None:
        entered, release = remote.hold("put", "model.pt")
        a = front.write("model.pt", old)
        mover.wake()
        await until(entered.is_set, "the first upload in flight")
        front.rename(a, "model_100.pt")
        b = front.write("model.pt", new)
        mover.namespace_changed()
        # The new file either raced the old upload (the bug) or waits for the key.
        await until(
            lambda: ("put", "model.pt") in remote.calls[1:] or b in mover.not_before, "the new file's drain attempt"
        )
        release.set()
        await settle(mover, front)
        assert front.row(b).remote_key == "model.pt" and front.row(a).remote_key == "model_100.pt"

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "model.pt") == new
    assert remote_bytes(tmp_path, "model_100.pt") == old
    assert user_keys(tmp_path) == {"model.pt", "model_100.pt"}


def test_rename_onto_a_key_being_uploaded_waits_for_the_upload(tmp_path: Path) -> None:
    """A durable file renamed onto the path another file is uploading to does not move there first."""
    mover, front, remote = make_mover(tmp_path)

    async def scenario() -> None:
        c = front.write("c.bin", b"c" * 100)
        await settle(mover, front)
        entered, release = remote.hold("put", "x.bin")
        x = front.write("x.bin", b"x" * 300)
        mover.wake()
        await until(entered.is_set, "x.bin uploading")
        front.rename(x, "y.bin")  # x's upload still goes to x.bin
        front.rename(c, "x.bin")  # c's object must not move onto x.bin under that upload
        mover.namespace_changed()
        await until(
            lambda: c in mover.key_moves._retry or ("copy", "c.bin") in remote.calls,
            "c's move attempted",
        )
        release.set()
        await settle(mover, front)

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "x.bin") == b"c" * 100
    assert remote_bytes(tmp_path, "y.bin") == b"x" * 300
    assert user_keys(tmp_path) == {"x.bin", "y.bin"}


def test_swapped_names_swap_objects(tmp_path: Path) -> None:
    """a→tmp, b→a, tmp→b: the moves form a cycle; neither object overwrites the other."""
    mover, front, _ = make_mover(tmp_path)

    async def scenario() -> None:
        a = front.write("a", b"A" * 10)
        b = front.write("b", b"B" * 20)
        await settle(mover, front)
        front.rename(a, "tmp")
        front.rename(b, "a")
        front.rename(a, "b")
        mover.namespace_changed()
        await settle(mover, front)

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "a") == b"B" * 20
    assert remote_bytes(tmp_path, "b") == b"A" * 10
    assert user_keys(tmp_path) == {"a", "b"}


# -- #6: unlink during the final PUT/complete ---------------------------------------------


@pytest.mark.parametrize("size", [300, PART + 100], ids=["put", "multipart"])
def test_unlink_during_final_put_deletes_the_object(tmp_path: Path, size: int) -> None:
    mover, front, remote = make_mover(tmp_path)

    async def scenario() -> None:
        entered, release = remote.hold("put" if size < PART else "complete", "gone.bin")
        ino = front.write("gone.bin", os.urandom(size))
        mover.wake()
        await until(entered.is_set, "the final request in flight")
        front.unlink(ino)  # still open: the row stays with parent 0
        release.set()
        await until(
            lambda: not mover.in_flight and not front.journal.query("SELECT 1 FROM remote_deletes"), "the delete pass"
        )
        assert front.row(ino).state != DURABLE

    run_mover(mover, scenario)
    assert user_keys(tmp_path) == set()
    assert not (tmp_path / "remote/.burstfs/manifests/gone.bin.json").exists()


# -- #21: unlink while a renamed directory's objects move ---------------------------------


def test_unlink_during_relocation_deletes_the_copy(tmp_path: Path) -> None:
    mover, front, remote = make_mover(tmp_path)

    async def scenario() -> None:
        d1 = front.mkdir("d1")
        big = front.write("big", os.urandom(1000), parent=d1)
        await settle(mover, front)
        entered, release = remote.hold("copy", "d1/big")
        front.rename(d1, "d2")
        mover.namespace_changed()
        await until(entered.is_set, "the server-side copy in flight")
        front.unlink(big)
        release.set()
        await until(
            lambda: not front.journal.query("SELECT 1 FROM remote_deletes") and ("copy", "d1/big") in remote.calls,
            "the deletes",
        )

    run_mover(mover, scenario)
    assert user_keys(tmp_path) == set()


# -- #2: a per-file problem never kills the mover ------------------------------------------


@pytest.mark.parametrize(
    "manifest", [b"[" * 100_000, b'{"version": 1, "size": Infinity}', b"\xff"], ids=["deep", "infinity", "binary"]
)
def test_corrupt_manifest_during_relocation_fails_that_file_only(tmp_path: Path, manifest: bytes) -> None:
    mover, front, _ = make_mover(tmp_path)
    a = front.write("a.bin", b"a" * 500)
    other = front.write("other.bin", b"o" * 10)
    asyncio.run(mover.run(until_idle=True))
    (tmp_path / "remote/.burstfs/manifests/a.bin.json").write_bytes(manifest)
    front.rename(a, "b.bin")
    front.rename(other, "other2.bin")
    mover, _, _ = make_mover(tmp_path)
    asyncio.run(mover.run(until_idle=True))  # returns: the mover survived
    assert mover.stats.errors_by_kind["relocate"] == 1
    assert remote_bytes(tmp_path, "other2.bin") == b"o" * 10
    # Still local: it was uploaded again at its new path, the old object went.
    assert remote_bytes(tmp_path, "b.bin") == b"a" * 500
    assert front.row(a).state == DURABLE and front.row(a).remote_key == "b.bin"
    assert user_keys(tmp_path) == {"b.bin", "other2.bin"}


def test_wake_after_the_mover_stopped_does_not_raise(tmp_path: Path) -> None:
    mover, front, _ = make_mover(tmp_path)
    front.write("f", b"f")
    asyncio.run(mover.run(until_idle=True))
    mover.wake()  # a close or rename after the loop is gone must not become EIO
    mover.namespace_changed()
    mover.drain_now()


def test_a_burst_of_wakes_hops_to_the_mover_once_and_no_wake_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each close woke the mover's loop with a hop of its own (three or four per small file),
    and on 2 cores the FUSE thread then waited for the GIL.  Wakes now coalesce until the next
    pass -- which must never lose one: with the idle rescan off, a lost wake leaves a closed
    file undrained and this test times out."""
    monkeypatch.setattr(mover_timing, "IDLE_RESCAN_S", 3600.0)
    mover, front, _ = make_mover(tmp_path)
    service = drainservice_module.DrainService(mover, front.journal)
    service.start()
    try:
        service.wait_ready()
        loop = mover.loop
        assert loop is not None
        hops: list[object] = []
        hop = loop.call_soon_threadsafe

        def counted(callback: Callable[..., object], *args: object) -> asyncio.Handle:
            if getattr(callback, "__self__", None) is mover._wakeup:  # not the journal thread's results
                hops.append(callback)
            return hop(callback, *args)

        monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
        for _ in range(1000):
            service.file_closed()
        # One per pass that began meanwhile (a few on a loaded machine), not one per close.
        assert 1 <= len(hops) <= 10, len(hops)
        for i in range(40):  # closes racing with the passes they start: each one still drains
            ino = front.write(f"f{i}.bin", b"x" * (i + 1))
            service.file_closed()
            deadline = time.monotonic() + 10
            while front.row(ino).state != DURABLE:
                assert time.monotonic() < deadline, f"f{i}.bin never drained: its wake was lost"
                time.sleep(0.001)
    finally:
        service.stop()


def test_a_dead_mover_is_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mover, front, _ = make_mover(tmp_path)
    monkeypatch.setattr(drainservice_module, "RESTART_BACKOFF_S", 0.01)
    crashes: list[int] = []
    original = Mover._recover

    async def crash_once(self: Mover) -> None:
        if not crashes:
            crashes.append(1)
            raise RuntimeError("injected mover crash")
        await original(self)

    monkeypatch.setattr(Mover, "_recover", crash_once)
    service = drainservice_module.DrainService(mover, front.journal)
    service.start()
    try:
        deadline = time.monotonic() + 30
        while not (service.restarts >= 1 and mover.running) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.restarts == 1 and mover.running and service.crashed is None
        front.write("after.bin", b"drained by the restarted mover")
        service.file_closed()
        while front.row(2).state != DURABLE and time.monotonic() < deadline:
            time.sleep(0.02)
        assert remote_bytes(tmp_path, "after.bin") == b"drained by the restarted mover"
    finally:
        service.stop()
    service.file_closed()  # a stopped mover: waking it is harmless
    assert not service._thread.is_alive()


# -- #5: an error that belongs to one object fails that object only ----------------------


def test_a_name_of_255_bytes_drains_with_its_manifest_by_digest(tmp_path: Path) -> None:
    """Its ``<name>.json`` would pass NAME_MAX: the manifest goes by a digest of the name."""
    mover, front, _ = make_mover(tmp_path)
    name = "n" * 255
    ino = front.write(name, b"long")
    asyncio.run(mover.run(until_idle=True))
    assert front.row(ino).state == DURABLE and remote_bytes(tmp_path, name) == b"long"
    assert remote_bytes(tmp_path, manifest_key(name)) is not None


def test_s3_key_too_long_fails_only_that_file(tmp_path: Path, s3_env: str) -> None:
    from s3server import fresh_bucket

    from burstfs.remote.s3 import S3Remote

    bucket = fresh_bucket(s3_env)
    cache = tmp_path / "cache"
    cache.mkdir()
    front = Front(cache)
    url = parse_remote_url(f"s3://{bucket}/p")
    options = S3Options(endpoint_url=s3_env, path_style=True)
    mover = Mover(cache, url, options, DrainOptions(part_size=PART), remote=S3Remote(url, options))
    parent = ROOT_INO
    for level in range(5):
        parent = front.mkdir(f"{level}" + "d" * 240, parent)
    bad = front.write("deep.bin", b"deep", parent=parent)  # key > 1024 bytes
    good = front.write("ok.bin", b"ok")
    asyncio.run(mover.run(until_idle=True))
    assert mover.stats.halted is None
    assert front.row(good).state == DURABLE
    assert front.row(bad).state == FAILED and "1024" in (front.row(bad).error or "")


# -- #22: a file rewritten during its drain is superseded, not corrupt ---------------------


def test_file_changed_under_the_drain_is_requeued_not_failed(tmp_path: Path) -> None:
    """Bytes written through a handle still open after a close (the journal has not seen
    them yet) make the staged digests mismatch: the file waits for its next close."""
    mover, front, _ = make_mover(tmp_path)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("burstfs.mover")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)

    async def scenario() -> None:
        ino = front.write("grow.bin", b"")  # closed empty: digests of 0 bytes
        time.sleep(0.01)
        front.tier.path(ino).write_bytes(b"x" * 2048)  # the writer's next bytes, not closed yet
        mover.wake()
        await until(lambda: any("drain_superseded" in r or "drain_failed" in r for r in records), "an attempt")
        front.close(ino)  # the writer closes: generation 2, 2048 bytes
        await settle(mover, front)
        assert front.row(ino).generation == 2

    try:
        run_mover(mover, scenario)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert not [r for r in records if "drain_failed" in r]
    assert mover.stats.errors_by_kind["corrupt"] == 0
    assert remote_bytes(tmp_path, "grow.bin") == b"x" * 2048


def test_bit_rot_is_still_reported_corrupt(tmp_path: Path) -> None:
    mover, front, _ = make_mover(tmp_path)
    ino = front.write("rot.bin", b"a" * 4096)
    path = front.tier.path(ino)
    st = path.stat()
    with open(path, "r+b") as f:  # same size, mtime kept: no writer did this
        f.write(b"b")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    asyncio.run(mover.run(until_idle=True))
    assert front.row(ino).state == FAILED and mover.stats.errors_by_kind["corrupt"] == 1


# -- #8: startup aborts only the uploads this cache started --------------------------------


def test_startup_aborts_only_uploads_this_cache_started(tmp_path: Path) -> None:
    mover, front, remote = make_mover(tmp_path)
    ours: list[str] = []

    async def scenario() -> None:
        foreign = await remote.create_multipart("other-node/shard.bin")  # another node, in flight
        entered, release = remote.hold("part", "big.bin")
        front.write("big.bin", os.urandom(PART + 10))
        mover.wake()
        await until(entered.is_set, "the first part about to go up")
        # Journaled before the first part goes up: a crash now leaves it for the next start.
        ours.extend(u for _, u in front.journal.query("SELECT key, upload_id FROM uploads"))
        assert len(ours) == 1
        release.set()
        await settle(mover, front)
        assert not front.journal.query("SELECT 1 FROM uploads")  # completed: forgotten
        ours.append(foreign)

    run_mover(mover, scenario)
    foreign = ours.pop()

    async def restart() -> None:
        left = await remote.create_multipart("big.bin")  # as if a crash had cut this one short
        front.journal.drain.upload_started("big.bin", left)
        # A crash between the create and its record: only the placeholder was journaled.
        unnamed = await remote.create_multipart("c.bin")
        front.journal.drain.upload_started("c.bin", "pending-0123")
        mover2, _, _ = make_mover(tmp_path, remote)
        await mover2.run(until_idle=True)
        uploads = {u for _, u in await remote.list_multipart_uploads()}
        assert left not in uploads and unnamed not in uploads and foreign in uploads
        assert not front.journal.query("SELECT 1 FROM uploads")

    asyncio.run(restart())


# -- #15: subtree relocation ---------------------------------------------------------------


def test_relocation_walks_only_the_renamed_subtree(tmp_path: Path) -> None:
    mover, front, _ = make_mover(tmp_path)
    walked: list[object] = []

    async def scenario() -> None:
        d = front.mkdir("run")
        for i in range(3):
            front.write(f"f{i}", b"%d" % i, parent=d)
        for i in range(20):
            front.write(f"other{i}", b"o")
        await settle(mover, front)
        original = mover.journal.keys.relocation_candidates

        def spy(roots: object = None) -> list[tuple[int, str, str]]:
            walked.append(roots)
            return original(roots)  # type: ignore[arg-type]

        mover.journal.keys.relocation_candidates = spy  # type: ignore[method-assign]
        front.rename(d, "run2")
        mover.namespace_changed()
        await settle(mover, front)

    run_mover(mover, scenario)
    assert walked and all(roots is not None and len(roots) <= 1 for roots in walked)  # type: ignore[arg-type]
    assert user_keys(tmp_path) == {f"run2/f{i}" for i in range(3)} | {f"other{i}" for i in range(20)}


# -- #17: S3 uploads are verified against what the store says it stored ---------------------


@pytest.mark.parametrize("tamper", ["wrong_checksum", "no_checksum_wrong_etag"])
@pytest.mark.parametrize("op", ["put_object", "upload_part"])
def test_s3_upload_the_store_did_not_keep_intact_is_refused(s3_env: str, tamper: str, op: str) -> None:
    from s3server import fresh_bucket

    from burstfs.remote.s3 import S3Remote

    bucket = fresh_bucket(s3_env)
    url = parse_remote_url(f"s3://{bucket}/p")
    remote = S3Remote(url, S3Options(endpoint_url=s3_env, path_style=True))
    original = remote.session.call

    async def lying_store(name: str, what: str, **params: object) -> object:
        response = await original(name, what, **params)
        if name == op:  # a store that ignored the checksum header and kept other bytes
            response = dict(response)
            if tamper == "wrong_checksum":
                response["ChecksumCRC32C"] = "AAAAAA=="
            else:
                response.pop("ChecksumCRC32C", None)
                response["ETag"] = '"0123456789abcdef0123456789abcdef"'
        return response

    remote.session.call = lying_store  # type: ignore[method-assign,assignment]

    async def main() -> None:
        try:
            if op == "put_object":
                await remote.put_object("k", b"payload")
            else:
                upload_id = await remote.create_multipart("k")
                await remote.upload_part("k", upload_id, 1, 0, b"payload")
        finally:
            await remote.close()

    with pytest.raises(Exception) as err:
        asyncio.run(main())
    assert remote.is_temp_failure(err.value)  # sent again, never recorded as stored


def test_s3_upload_verified_by_md5_etag_when_no_checksum_comes_back(s3_env: str) -> None:
    from s3server import fresh_bucket

    from burstfs.remote.s3 import S3Remote

    bucket = fresh_bucket(s3_env)
    url = parse_remote_url(f"s3://{bucket}/p")
    remote = S3Remote(url, S3Options(endpoint_url=s3_env, path_style=True))
    original = remote.session.call

    async def no_checksums(name: str, what: str, **params: object) -> object:
        response = dict(await original(name, what, **params))
        response.pop("ChecksumCRC32C", None)
        return response

    remote.session.call = no_checksums  # type: ignore[method-assign,assignment]

    async def main() -> bytes:
        try:
            await remote.put_object("k", b"payload")
            return await remote.get_object("k")
        finally:
            await remote.close()

    assert asyncio.run(main()) == b"payload"


def test_a_listed_file_renamed_away_frees_its_name(tmp_path: Path) -> None:
    """Another node's `latest`, listed here and renamed, moves along; a new local `latest` drains."""
    mover, front, _ = make_mover(tmp_path)
    (tmp_path / "remote/latest").write_bytes(b"theirs")

    async def scenario() -> None:
        listed = front.new(ROOT_INO, "latest", "file", REMOTE)
        front.journal.execute("UPDATE inodes SET remote_key='latest', size=6 WHERE ino=?", (listed,))
        d = front.mkdir("a")
        front.rename(listed, "latest", new_parent=d)
        mine = front.write("latest", b"ours")
        mover.namespace_changed()
        await until(
            lambda: (
                front.row(mine).state == DURABLE
                and front.row(listed).remote_key == "a/latest"
                and not front.journal.query("SELECT 1 FROM remote_deletes")
            ),
            "both names settled",
        )

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "latest") == b"ours"
    assert remote_bytes(tmp_path, "a/latest") == b"theirs"


# -- drain rules in-process: commit markers, requeue and backoff, failures, delete safety ----


class FlakyCopyRemote(HookedRemote):
    """Its first server-side copy fails as a remote that stopped answering would."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.copy_failures = 1

    async def copy(self, src: str, dst: str) -> None:
        if self.copy_failures:
            self.copy_failures -= 1
            raise RemoteError("injected: remote unavailable after retries", kind="unavailable")
        await super().copy(src, dst)


def test_draining_a_cache_ends_only_once_renamed_objects_moved(tmp_path: Path) -> None:
    """``burstfs drain --cache`` (run until idle; the Slurm epilog then removes the cache) used
    to stop with a durable file's move pending when the copy failed once: the remote kept the
    object at the old name only.  It goes on until the move and the old key's delete are done."""
    mover, front, _ = make_mover(tmp_path)
    a = front.write("tmp-step.pt", b"a" * 500)
    asyncio.run(mover.run(until_idle=True))
    front.rename(a, "step.pt")
    (tmp_path / "remote").mkdir(exist_ok=True)
    flaky = FlakyCopyRemote(tmp_path / "remote")
    mover, _, _ = make_mover(tmp_path, flaky)
    asyncio.run(mover.run(until_idle=True))
    assert flaky.copy_failures == 0
    assert remote_bytes(tmp_path, "step.pt") == b"a" * 500
    assert user_keys(tmp_path) == {"step.pt"}
    assert settled(front)


class FailingRemote(HookedRemote):
    """Fails the next ``put`` of chosen keys once, with a chosen error (``fail_next``)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.failures: dict[str, Exception] = {}

    def fail_next(self, key: str, error: Exception) -> None:
        self.failures[key] = error

    async def put_object(self, key: str, data: bytes) -> None:
        error = self.failures.pop(key, None)
        if error is not None:
            raise error
        await super().put_object(key, data)


def failing_mover(tmp_path: Path, key: str, error: Exception) -> tuple[Mover, Front, FailingRemote]:
    """make_mover whose remote fails the first put of ``key`` with ``error``."""
    (tmp_path / "remote").mkdir()
    remote = FailingRemote(tmp_path / "remote")
    remote.fail_next(key, error)
    mover, front, _ = make_mover(tmp_path, remote)
    return mover, front, remote


def test_a_commit_marker_waits_for_the_files_closed_before_it(tmp_path: Path) -> None:
    """Invariant 5: the marker is not uploaded while a shard closed before it in its directory drains,
    though a file closed after it elsewhere goes ahead."""
    mover, front, remote = make_mover(tmp_path)

    async def scenario() -> None:
        ck = front.mkdir("ck")
        entered, release = remote.hold("put", "ck/shard")
        front.write("shard", b"s" * 100, ck)
        mover.wake()
        await until(entered.is_set, "the shard uploading")
        marker = front.write("latest", b"100", ck)
        later = front.write("elsewhere", b"e" * 10)  # closed after the marker, not under ck/
        mover.drain_now()
        await until(lambda: front.row(later).state == DURABLE, "the later file elsewhere drained")
        assert front.row(marker).state == STAGED and ("put", "ck/latest") not in remote.calls
        release.set()
        await settle(mover, front)

    run_mover(mover, scenario)
    assert remote.calls.index(("put", "ck/latest")) > remote.calls.index(("put", "ck/shard"))
    assert remote_bytes(tmp_path, "ck/latest") == b"100"


def test_a_temporary_failure_requeues_with_backoff_while_other_files_drain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mover_timing, "REQUEUE_BACKOFF_S", 600.0)  # the backoff outlasts the test unless skipped
    error = RemoteError("remote unavailable after 8 attempts", kind="unavailable")
    mover, front, remote = failing_mover(tmp_path, "flaky", error)

    async def scenario() -> None:
        flaky = front.write("flaky", b"f" * 100)
        mover.wake()
        await until(lambda: front.row(flaky).attempts == 1, "the failed attempt recorded")
        row = front.row(flaky)
        assert row.state == STAGED and "unavailable" in (row.error or "")  # requeued, not failed
        assert mover.stats.errors_by_kind.get("unavailable") == 1
        steady = front.write("steady", b"s" * 100)
        mover.wake()
        await until(lambda: front.row(steady).state == DURABLE, "another file drained during the backoff")
        assert front.row(flaky).state == STAGED and remote.calls.count(("put", "flaky")) == 0
        mover.drain_now()  # skips the backoff
        await settle(mover, front)

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "flaky") == b"f" * 100


def test_an_object_error_fails_only_that_file_and_retry_requeues_it(tmp_path: Path) -> None:
    mover, front, _ = failing_mover(tmp_path, "bad", RemoteError("the store refused this object", kind="refused"))

    async def scenario() -> None:
        bad = front.write("bad", b"b" * 10)
        good = front.write("good", b"g" * 10)
        mover.wake()
        await until(
            lambda: front.row(bad).state == FAILED and front.row(good).state == DURABLE,
            "one file failed, the other durable",
        )
        assert mover.stats.halted is None  # an object's error does not stop the drain
        assert await mover.retry_failed() == 1
        await settle(mover, front)

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "bad") == b"b" * 10


def test_a_delete_request_for_a_key_a_live_file_owns_is_dropped_not_run(tmp_path: Path) -> None:
    """Invariant 6: the delete pass never removes an object another inode owns (a request left
    from before the key changed hands)."""
    mover, front, _ = make_mover(tmp_path)

    async def scenario() -> None:
        front.write("ck", b"new owner")
        await settle(mover, front)
        front.journal.execute("INSERT INTO remote_deletes (key, reason) VALUES (?, ?)", ("ck", "unlink"))
        mover.wake()
        await until(lambda: not front.journal.query("SELECT 1 FROM remote_deletes"), "the delete pass")

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "ck") == b"new owner"
    assert (tmp_path / "remote/.burstfs/manifests/ck.json").exists()


def test_the_mover_thread_lives_as_long_as_the_nursery_and_calls_cross_on_its_loop(tmp_path: Path) -> None:
    """DrainService.run: the mover is ready before start() returns and its thread is joined when the
    nursery ends; drain --now and retry run on the mover's loop, and EIO once it is gone."""
    mover, front, _ = make_mover(tmp_path)
    service = drainservice_module.DrainService(mover, front.journal)
    on_loop: list[bool] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(service.run)
            assert mover.running and service._thread.is_alive()
            ino = front.write("f", b"through the nursery's mover")
            service.file_closed()
            while front.row(ino).state != DURABLE:
                await trio.sleep(0.02)
            service.call_soon(lambda: on_loop.append(threading.current_thread() is service._thread))
            assert await service.retry_failed() == 0  # on the mover's loop, with its journal connection
            assert on_loop == [True]
            nursery.cancel_scope.cancel()
        assert not service._thread.is_alive() and not mover.running
        service.drain_now()  # the mover is gone: runs here, harmlessly
        with pytest.raises(FsError) as info:
            await service.list_dir("")
        assert info.value.errno == errno.EIO

    trio.run(main)
    assert remote_bytes(tmp_path, "f") == b"through the nursery's mover"


def test_an_object_gone_from_the_remote_does_not_hold_back_other_moves(tmp_path: Path) -> None:
    """A durable file's object removed behind burstfs' back (a lifecycle rule, an operator)
    and the file renamed: its copy finds no source.  That was taken for a passing fault: the
    pass ended there, at every retry, and the renamed files after it never moved.  The
    local file uploads again at its new name, and the others move."""
    mover, front, _ = make_mover(tmp_path)
    a = front.write("tmp/a.pt", b"a" * 500)
    b = front.write("tmp/b.pt", b"b" * 500)
    asyncio.run(mover.run(until_idle=True))
    (tmp_path / "remote" / "tmp" / "a.pt").unlink()
    front.rename(a, "a.pt")
    front.rename(b, "b.pt")

    async def scenario() -> None:
        await settle(mover, front)

    run_mover(mover, scenario)
    assert remote_bytes(tmp_path, "a.pt") == b"a" * 500
    assert remote_bytes(tmp_path, "b.pt") == b"b" * 500


def test_a_wait_on_an_evicted_file_whose_object_is_gone_fails_instead_of_timing_out(tmp_path: Path) -> None:
    """The same with the local copy evicted: nothing can be uploaded again.  The drain of the
    cache ends (the move is retried with backoff, but waiting on it is pointless) and a wait on
    the file fails at once, saying why, rather than run to its timeout as ``moving``."""
    mover, front, _ = make_mover(tmp_path)
    c = front.write("tmp/c.pt", b"c" * 500)
    asyncio.run(mover.run(until_idle=True))
    assert front.journal.evict(c, 1)
    (tmp_path / "remote" / "tmp" / "c.pt").unlink()
    front.rename(c, "c.pt")
    asyncio.run(mover.run(until_idle=True))
    assert mover.key_moves.failed(c)
    outcome = durability(front.journal, ["c.pt"])
    assert outcome.result == "failed"
    [(path, row)] = outcome.broken
    assert wait_state(path, row) == MOVING
    assert "tmp/c.pt is no longer on the remote" in (row.error or "")

"""The journal's state machine against SQLite alone (no mount): DESIGN-NOTES invariants 1, 2, 3, 5, 6, 7."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from journaltree import JournalTree

from burstfs import namespace
from burstfs.errors import ConfigError
from burstfs.journal import (
    BROKEN,
    CLOSED_UNDRAINED,
    DONE,
    DRAINING,
    DURABLE,
    EVICTED,
    FAILED,
    FILE_STATES,
    INCOMPLETE,
    META,
    NOT_YET_DURABLE,
    REMOTE,
    ROOT_INO,
    SCHEMA_VERSION,
    STAGED,
    UNDRAINED,
    WRITING,
    FileState,
    InodeRow,
    Journal,
    close_ops,
    connection,
    drop_unlinked_ops,
    held_close_op,
    link_ops,
    mark_writing_op,
    recovered_incomplete_ops,
    released_op,
    schema,
    set_meta_op,
    unchanged_close_op,
    unlink_keeping_object_ops,
    unlink_name_ops,
    unlink_ops,
    update_inode_op,
)
from burstfs.journal.thread import JournalThread


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path)
    yield j
    j.close()


@pytest.fixture
def tree(journal: Journal, tmp_path: Path) -> JournalTree:
    return JournalTree(journal, tmp_path)


def _markers(row: InodeRow) -> bool:
    return row.name == b"COMMIT"


# -- the named state sets ---------------------------------------------------------------


def test_state_sets_partition_the_file_states() -> None:
    assert frozenset(FILE_STATES) == DONE | NOT_YET_DURABLE and not DONE & NOT_YET_DURABLE
    assert META not in FILE_STATES
    assert BROKEN <= NOT_YET_DURABLE and INCOMPLETE not in UNDRAINED and WRITING not in CLOSED_UNDRAINED
    assert CLOSED_UNDRAINED < UNDRAINED < NOT_YET_DURABLE
    assert STAGED == "staged" and f"{DURABLE}" == "durable"  # stored values unchanged


def test_rows_read_back_as_file_states(journal: Journal, tree: JournalTree) -> None:
    ino, _ = tree.write_file("a")
    row = journal.inode(ino)
    assert row is not None and row.state is STAGED
    assert journal.state_counts() == {STAGED: (1, 10)}
    assert journal.undrained() == {"staged": (1, 10)}


def test_inode_row_is_keyword_only() -> None:
    with pytest.raises(TypeError):
        InodeRow(1, 1, b"", "dir", 0, 0, 0, 0, 0, 0, 0, None, META)  # type: ignore[call-arg]


# -- invariant 3: the mover only moves forward the generation it read -----------------------


def test_finish_upload_never_overwrites_a_newer_close(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("ckpt.bin")
    claimed = journal.drain.claim(ino, generation)
    assert isinstance(claimed, tuple)
    key, intent = claimed
    newer = tree.close(ino)  # a close races the upload
    assert newer == generation + 1
    assert journal.drain.superseded(ino, generation)
    assert not journal.drain.finish_upload(ino, generation, key, intent, "late")
    row = journal.inode(ino)
    assert row is not None
    assert (row.state, row.generation, row.durable_generation) == (STAGED, newer, None)
    # The object at the key is still this file's (no delete queued for it).
    assert all(k != key for _, k, _ in journal.keys.pending_deletes(10))


@pytest.mark.parametrize("how", ["requeue", "fail"])
def test_requeue_and_fail_leave_a_newer_close_alone(journal: Journal, tree: JournalTree, how: str) -> None:
    ino, generation = tree.write_file("f")
    assert isinstance(journal.drain.claim(ino, generation), tuple)
    tree.close(ino)
    if how == "requeue":
        journal.drain.requeue(ino, generation, "boom", 3)
    else:
        assert not journal.drain.fail(ino, generation, "boom")
    row = journal.inode(ino)
    assert row is not None and row.state == STAGED and row.attempts == 0 and row.error is None
    assert journal.keys.holder("f") is None  # the upload no longer holds the key


def test_record_digests_is_conditional_on_the_generation(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    tree.close(ino)
    journal.drain.record_digests(ino, generation, "old", ["a"], 4)
    row = journal.inode(ino)
    assert row is not None and row.digest is None


def test_claim_only_from_staged_and_the_right_generation(journal: Journal, tree: JournalTree) -> None:
    ino = tree.create("f")
    assert journal.drain.claim(ino, 0) is None  # writing
    generation = tree.close(ino)
    assert journal.drain.claim(ino, generation - 1) is None
    journal.apply([mark_writing_op(ino)])
    assert journal.drain.claim(ino, generation) is None


def test_unchanged_close_restores_the_previous_state(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    tree.durable(ino, generation)
    journal.apply([mark_writing_op(ino)])
    journal.apply([unchanged_close_op(ino)])
    assert tree.state(ino) == DURABLE
    other, _ = tree.write_file("g")
    journal.apply([mark_writing_op(other)])
    journal.apply([unchanged_close_op(other)])
    assert tree.state(other) == STAGED


def test_recover_stages_draining_files_again(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    assert isinstance(journal.drain.claim(ino, generation), tuple)
    assert journal.drain.recover() == 1
    assert tree.state(ino) == STAGED and journal.keys.holder("f") is None


def test_a_release_record_takes_back_only_the_closes_up_to_its_generation(journal: Journal, tree: JournalTree) -> None:
    """A release record tried again after a failed commit lands after a new writer's close:
    it must leave that close held (a crash then flags the file incomplete, as it should)."""
    ino, _ = tree.write_file("f")
    journal.apply([held_close_op(ino, 3)])
    journal.apply([released_op(ino, 2)])
    assert ino in journal.held_closes()
    journal.apply([released_op(ino, 3)])
    assert ino not in journal.held_closes()


def test_retry_failed(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    assert isinstance(journal.drain.claim(ino, generation), tuple)
    assert journal.drain.fail(ino, generation, "corrupt")
    assert tree.state(ino) == FAILED
    marker, marker_generation = tree.write_file(".metadata")
    assert journal.drain.abandon(marker, marker_generation)
    assert journal.drain.retry_failed() == 1  # not the abandoned checkpoint's marker: never published
    row = journal.inode(ino)
    assert row is not None and (row.state, row.error, row.attempts) == (STAGED, None, 0)
    assert tree.state(marker) == FAILED


# -- invariant 6: a key belongs to one inode ---------------------------------------------


def test_claim_of_a_key_another_inode_owns_returns_the_holder(journal: Journal, tree: JournalTree) -> None:
    old, generation = tree.write_file("a")
    tree.durable(old, generation)
    # Renamed here, not yet moved on the remote: its object still sits at "a".
    journal.apply([update_inode_op(old, name=b"b")])
    new, new_generation = tree.write_file("a")
    assert journal.drain.claim(new, new_generation) == old
    assert tree.state(new) == STAGED


def test_claim_of_a_key_another_upload_writes_returns_the_uploader(journal: Journal, tree: JournalTree) -> None:
    first, generation = tree.write_file("a")
    assert isinstance(journal.drain.claim(first, generation), tuple)
    journal.apply(unlink_ops(first, b"a", time.time_ns()))  # unlinked mid-upload: still uploading to "a"
    second, second_generation = tree.write_file("a")
    assert journal.drain.claim(second, second_generation) == first


def test_unlink_queues_the_object_and_an_unrecorded_upload_leaves_its_intent(
    journal: Journal, tree: JournalTree
) -> None:
    ino, generation = tree.write_file("a")
    key = tree.durable(ino, generation)
    journal.apply(unlink_ops(ino, b"a", time.time_ns()))
    assert [(k, r) for _, k, r in journal.keys.pending_deletes(10)] == [(key, "unlink")]
    other, other_generation = tree.write_file("b")
    claimed = journal.drain.claim(other, other_generation)
    assert isinstance(claimed, tuple)
    assert journal.keys.removals_queued() == 1  # an upload's intent is no delete of a removed file (status)
    assert journal.keys.deletes_queued_under("") == {key}  # nor one that `wait` waits for
    assert journal.keys.deletes_queued_under("b") == set()
    journal.apply(unlink_ops(other, b"b", time.time_ns()))
    assert not journal.drain.finish_upload(other, other_generation, claimed[0], claimed[1], "gone")
    assert ("b", "upload") in [(k, r) for _, k, r in journal.keys.pending_deletes(10)]


def test_a_wait_does_not_count_the_intents_of_failed_attempts_of_a_file_still_there(
    journal: Journal, tree: JournalTree
) -> None:
    """Each failed attempt leaves its intent (the remote may have taken the object after all);
    while the file is still at that path its next upload replaces that object, so a wait
    waits for the file, not for a delete the user never asked for (it said "2 remote deletes
    queued" with the remote down and no file removed)."""
    d = tree.mkdir("ckpt")
    ino, generation = tree.write_file("f1", parent=d)
    for attempt in (1, 2):
        claimed = journal.drain.claim(ino, generation)
        assert isinstance(claimed, tuple) and claimed[0] == "ckpt/f1"
        journal.drain.requeue(ino, generation, "connection refused", attempt)
    assert [r for _, _, r in journal.keys.pending_deletes(10)] == ["upload", "upload"]
    assert journal.keys.deletes_queued_under("") == set()
    assert journal.keys.deletes_queued_under("ckpt") == set()
    journal.apply(unlink_ops(ino, b"f1", time.time_ns()))  # gone: an object left there must go
    assert journal.keys.deletes_queued_under("ckpt") == {"ckpt/f1"}


def test_owned_under_is_a_key_prefix_range(journal: Journal, tree: JournalTree) -> None:
    d = tree.mkdir("ckpt")
    e = tree.mkdir("ckpt-2")
    inside, g1 = tree.write_file("x", d)
    beside, g2 = tree.write_file("y", e)
    tree.durable(inside, g1)
    tree.durable(beside, g2)
    journal.apply(unlink_ops(inside, b"x", time.time_ns()))
    assert journal.keys.owned_under("ckpt") == {"ckpt/x"}  # deleting counts as owned
    assert journal.keys.owned_under("CKPT") == set()  # case matters (LIKE ignored it)
    assert journal.keys.owned_under("ckpt-2") == {"ckpt-2/y"}
    assert journal.keys.owned_under("") == {"ckpt/x", "ckpt-2/y"}
    plan = " ".join(
        str(r)
        for r in journal.query(
            "EXPLAIN QUERY PLAN SELECT remote_key FROM inodes WHERE remote_key >= ? AND remote_key < ?", ("a/", "a0")
        )
    )
    assert "inodes_by_remote_key" in plan


# -- the schema: version checked at open, migrations ------------------------------------


def test_ownership_queries_use_indexes(journal: Journal) -> None:
    for sql in (
        "SELECT ino FROM inodes WHERE remote_key=? AND parent!=0",
        "SELECT ino FROM inodes WHERE upload_key=?",
        "SELECT id FROM remote_deletes WHERE key=?",
    ):
        plan = " ".join(str(row[-1]) for row in journal.query(f"EXPLAIN QUERY PLAN {sql}", ("k",)))
        assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, (sql, plan)


def test_a_version_1_journal_is_upgraded_in_place(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "journal.db")
    db.executescript(schema._BASE_SCHEMA)
    db.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    db.execute(
        "INSERT INTO inodes (ino, parent, name, kind, mode, uid, gid, atime_ns, mtime_ns, ctime_ns, state, "
        "remote_key) VALUES (5, 1, x'61', 'file', 33188, 0, 0, 0, 0, 0, 'durable', 'a')"
    )
    db.commit()
    db.close()
    journal = Journal(tmp_path)
    assert journal.get_meta("schema_version") == str(SCHEMA_VERSION)
    assert {"upload_key", "link_of"} <= {r[1] for r in journal.query("PRAGMA table_info(inodes)")}
    assert journal.keys.holder("a") == 5 and journal.drain.own_uploads() == []
    row = journal.inode(5)
    assert row is not None and row.link_of is None and row.state == DURABLE
    journal.close()
    Journal(tmp_path).close()  # a second open finds nothing to do


def test_a_journal_from_a_newer_burstfs_is_refused(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    journal.set_meta("schema_version", str(SCHEMA_VERSION + 1))
    journal.close()
    with pytest.raises(ConfigError, match=f"schema {SCHEMA_VERSION + 1}") as refused:
        Journal(tmp_path)
    assert "a newer burstfs wrote this cache" in str(refused.value)  # and what to do (an acceptance pass)
    assert "burstfs drain --cache DIR --now" in str(refused.value)
    with pytest.raises(ConfigError, match=f"schema {SCHEMA_VERSION + 1}"):
        Journal(tmp_path, readonly=True)


# -- invariant 5: commit markers wait; close order --------------------------------------


def _unblocked(journal: Journal) -> list[int]:
    """The candidates the mover may claim as far as the journal decides (invariant 5)."""
    candidates = journal.drain.candidates(10, closed_before=time.time() + 1, is_marker=_markers)
    return [c.row.ino for c in candidates if not c.marker_blocked]


def test_candidates_in_close_order(journal: Journal, tree: JournalTree) -> None:
    later = tree.create("later")
    first, _ = tree.write_file("first")
    marker, _ = tree.write_file("COMMIT")
    tree.close(later)
    candidates = journal.drain.candidates(10, closed_before=time.time() + 1, is_marker=_markers)
    assert [c.row.ino for c in candidates] == [first, marker, later]
    # "first" closed before the marker in its directory and is not durable: the marker waits
    assert [(c.marker_key, c.marker_blocked) for c in candidates] == [(None, False), ("COMMIT", True), (None, False)]
    assert [c.row.ino for c in journal.drain.candidates(1, closed_before=time.time() + 1, is_marker=_markers)] == [
        first
    ]
    assert journal.drain.candidates(10, closed_before=0.0, is_marker=_markers) == []  # the delay


@pytest.mark.parametrize("blocker", [STAGED, DRAINING, FAILED, INCOMPLETE, WRITING])
def test_commit_marker_waits_for_earlier_closes_under_its_directory(
    journal: Journal, tree: JournalTree, blocker: FileState
) -> None:
    d = tree.mkdir("step-1")
    sub = tree.mkdir("shard", d)
    data, generation = tree.write_file("part-0", sub)
    marker, _ = tree.write_file("COMMIT", d)
    elsewhere, _ = tree.write_file("other")  # not under the marker's directory
    journal.apply([update_inode_op(data, state=blocker)])
    eligible = _unblocked(journal)
    assert marker not in eligible and elsewhere in eligible
    journal.apply([update_inode_op(data, state=STAGED)])
    tree.durable(data, generation)
    assert marker in _unblocked(journal)


def test_commit_marker_ignores_files_closed_after_it(journal: Journal, tree: JournalTree) -> None:
    d = tree.mkdir("step-1")
    marker, _ = tree.write_file("COMMIT", d)
    tree.write_file("late", d)
    row = journal.inode(marker)
    assert row is not None and not journal.drain.blocks_marker(row)


# -- invariant 7: undrained data is never evicted ------------------------------------------


def test_only_the_durable_generation_is_evictable(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    staged, _ = tree.write_file("g")
    tree.durable(ino, generation)
    assert [i for i, _ in journal.evictable()] == [ino]
    assert not journal.evict(staged, 1)
    assert not journal.evict(ino, generation + 1)
    assert journal.evict(ino, generation)
    row = journal.inode(ino)
    assert row is not None and (row.state, row.local_bytes) == (EVICTED, 0)
    assert journal.evictable() == []
    journal.finish_fetch(ino, 10, digest="d", chunks=["c"], chunk_size=10)
    row = journal.inode(ino)
    assert row is not None and (row.state, row.local_bytes, row.digest, row.chunk_digests()) == (
        DURABLE,
        10,
        "d",
        ("c",),
    )


def test_a_close_after_durable_is_not_evictable(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    tree.durable(ino, generation)
    journal.apply([mark_writing_op(ino)])
    assert journal.evictable() == []
    assert not journal.evict(ino, generation)
    tree.close(ino)
    assert journal.evictable() == []


def test_an_unlinked_file_read_from_the_remote_holds_its_object_until_fetched_or_dropped(
    journal: Journal, tree: JournalTree
) -> None:
    """Invariant 6 for a file unlinked while a process reads it from the remote: its key is
    held (no delete, no upload of a new file at its name) until its copy is whole here, or
    its row goes (the last close, or start-up after a crash): then its delete is queued."""
    for let_go in ("fetched", "dropped"):
        ino, generation = tree.write_file("a")
        key = tree.durable(ino, generation)
        journal.apply([update_inode_op(ino, state=EVICTED)])
        journal.apply(unlink_keeping_object_ops(ino, b"a", time.time_ns()))
        assert journal.keys.pending_deletes(10) == [] and journal.keys.holder(key) == ino
        new, new_generation = tree.write_file("a")
        assert journal.drain.claim(new, new_generation) == ino
        if let_go == "fetched":
            journal.finish_fetch(ino, 10)
        else:
            journal.apply(drop_unlinked_ops(ino))
        assert [(k, r) for _, k, r in journal.keys.pending_deletes(10)] == [(key, "unlink")]
        assert journal.keys.holder(key) is None
        tree.unlink(new)
        for request_id, _, _ in journal.keys.pending_deletes(10):
            journal.keys.drop_delete(request_id)


def test_finish_fetch_only_for_files_not_local(journal: Journal, tree: JournalTree) -> None:
    ino, _ = tree.write_file("f")
    journal.finish_fetch(ino, 10)
    assert tree.state(ino) == STAGED
    listed = tree.create("listed")
    journal.apply([update_inode_op(listed, state=REMOTE)])
    journal.finish_fetch(listed, 5)
    assert tree.state(listed) in DONE and tree.state(listed) == DURABLE


# -- hard links: a row per extra name, its own key (invariant 6), evicted together (7) -------


def test_a_hard_link_drains_its_own_key_and_the_file_evicts_only_when_every_name_is_durable(
    journal: Journal, tree: JournalTree
) -> None:
    d = tree.mkdir("d")
    ino, generation = tree.write_file("a")
    link = 100
    journal.apply(link_ops(link, ino, d, b"b", 1))
    row = journal.inode(link)
    assert row is not None and (row.state, row.generation, row.link_of, row.data_ino) == (STAGED, generation, ino, ino)
    assert tree.durable(ino, generation) == "a"
    assert journal.evictable() == [] and not journal.evict(ino, generation)  # d/b is not on the remote yet
    assert tree.durable(link, generation) == "d/b"
    assert [i for i, _ in journal.evictable()] == [ino]
    # the first name goes: its object is queued, the file lives on under d/b and is fetched from there
    journal.apply(unlink_ops(ino, b"a", 1))
    assert [key for _, key, _ in journal.keys.pending_deletes(10)] == ["a"]
    assert journal.evict(ino, generation)
    assert {r.state for r in journal.inodes("WHERE ino=? OR link_of=?", (ino, ino))} == {EVICTED}
    fetch = journal.fetch_row(ino)
    assert fetch is not None and fetch.remote_key == "d/b"
    journal.finish_fetch(ino, 10)
    assert [(r.ino, r.state, r.local_bytes) for r in journal.inodes("WHERE ino=? OR link_of=?", (ino, ino))] == [
        (ino, DURABLE, 10),
        (link, DURABLE, 0),
    ]
    # a write marks every name writing; the close stages every name with the new generation
    journal.apply([mark_writing_op(ino)])
    assert journal.state_row(ino).state == WRITING  # type: ignore[union-attr]
    assert journal.drain.superseded(link, generation)
    generation = tree.close(ino)
    assert [r.ino for r in journal.names_of(ino)] == [link] and tree.state(link) == STAGED
    assert journal.inode(link).generation == generation  # type: ignore[union-attr]
    # unlink of the link name: its row goes, its object is queued for deletion
    journal.apply(unlink_name_ops(link, b"b"))
    assert journal.inode(link) is None and journal.names_of(ino) == []
    assert [key for _, key, _ in journal.keys.pending_deletes(10)] == ["a", "d/b"]


def test_a_link_of_a_file_being_written_waits_like_its_other_names(journal: Journal, tree: JournalTree) -> None:
    ino, _ = tree.write_file("a")
    journal.apply([mark_writing_op(ino)])
    journal.apply(link_ops(100, ino, ROOT_INO, b"b", 1))
    assert tree.state(100) == WRITING
    journal.apply([unchanged_close_op(ino)])  # closed unchanged: a name never drained is staged
    assert (tree.state(ino), tree.state(100)) == (STAGED, STAGED)


# -- status queries ------------------------------------------------------------------------


def test_status_queries(journal: Journal, tree: JournalTree) -> None:
    d = tree.mkdir("d")
    a, _ = tree.write_file("a", d)
    b, _ = tree.write_file("b", d)
    tree.create("open")
    journal.apply([update_inode_op(a, local_bytes=7)])
    child = journal.child(d, b"a")
    assert child is not None and child.ino == a
    assert journal.child(d, b"nope") is None
    assert {r.ino for r in journal.subtree(d)} == {d, a, b}
    assert sorted(journal.local_bytes_by_file()) == [(a, 7), (b, 10)]  # a close journals its size local
    assert journal.oldest_closed_undrained() is not None
    assert journal.oldest_closed_undrained()[0] == a  # type: ignore[index]
    assert journal.last_closed_at(a) is not None and journal.last_closed_at(d) is None
    assert journal.drain.has_work()
    assert journal.undrained() == {"staged": (2, 20), "writing": (1, 0)}


# -- invariants 1 and 2: closes and the first change after a close --------------------------


def test_a_close_journals_a_new_generation_staged_in_close_order(journal: Journal, tree: JournalTree) -> None:
    a = tree.create("a")
    b = tree.create("b")
    assert tree.close(b) == 1 and tree.close(a) == 1
    rows = {ino: tree.row(ino) for ino in (a, b)}
    assert rows[b].close_seq < rows[a].close_seq  # b closed first, drains first
    assert all(row.state == STAGED and row.local_bytes == row.size == 10 for row in rows.values())
    assert [event for _, ino, event, _ in journal.events() if ino == a] == ["closed"]
    assert journal.last_closed_at(a) is not None


def test_a_close_that_may_lack_bytes_is_incomplete_and_never_claimed(journal: Journal, tree: JournalTree) -> None:
    ino = tree.create("f")
    journal.apply(
        close_ops(
            ino,
            generation=1,
            close_seq=1,
            size=4,
            mtime_ns=0,
            ctime_ns=0,
            digest=None,
            chunks=None,
            chunk_size=None,
            incomplete="a write was lost",
        )
    )
    row = tree.row(ino)
    assert (row.state, row.error) == (INCOMPLETE, "a write was lost")
    assert journal.drain.claim(ino, 1) is None
    assert not journal.drain.has_work()
    ino2, _ = tree.write_file("g")
    journal.apply(recovered_incomplete_ops(ino2, 3, "open for writing at crash"))
    assert (tree.state(ino2), tree.row(ino2).size) == (INCOMPLETE, 3)


def test_a_write_during_an_upload_supersedes_it(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    claimed = journal.drain.claim(ino, generation)
    assert isinstance(claimed, tuple)
    key, intent = claimed
    assert not journal.drain.superseded(ino, generation)
    journal.apply([mark_writing_op(ino)])  # invariant 2: the first change is journaled first
    assert journal.drain.superseded(ino, generation)
    assert not journal.drain.finish_upload(ino, generation, key, intent, "late")
    row = tree.row(ino)
    # Still linked: the object at the key is the file's until its next generation replaces it.
    assert (row.state, row.remote_key, row.durable_generation) == (WRITING, key, None)
    assert journal.keys.holder(key) == ino and journal.keys.pending_deletes(10) == []


def test_a_replaced_generation_queues_the_old_object(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    tree.durable(ino, generation)
    journal.apply([update_inode_op(ino, name=b"g")])  # renamed while staged again: the next upload goes to "g"
    newer = tree.close(ino)
    assert tree.durable(ino, newer) == "g"
    assert [(k, r) for _, k, r in journal.keys.pending_deletes(10)] == [("f", "replaced")]


# -- invariant 6: relocations, stale keys, the delete queue ----------------------------------


def test_a_relocation_takes_the_new_key_and_gives_up_the_old(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("a")
    tree.durable(ino, generation)
    assert journal.keys.relocation(ino) is None  # at its path
    tree.rename(ino, "b")
    assert journal.keys.relocation_candidates() == [(ino, "b", "a")]
    assert journal.keys.relocation_candidates([ino]) == [(ino, "b", "a")]
    assert journal.keys.relocation(ino) == ("b", "a", None)
    intent = journal.keys.intend_move("b")
    assert [(k, r) for _, k, r in journal.keys.pending_deletes(10)] == [("b", "move")]
    assert journal.keys.finish_relocation(ino, "a", "b", intent)
    assert tree.row(ino).remote_key == "b" and journal.keys.relocation_candidates() == []
    assert [(k, r) for _, k, r in journal.keys.pending_deletes(10)] == [("a", "moved")]
    # A wait for the new name waits for the old object's delete too (it returned with the
    # renamed checkpoint still at its old name on the remote, for a fresh node to list).
    assert journal.keys.deletes_queued_under("b") == {"a"} and journal.keys.deletes_queued_under("c") == set()


def test_a_copy_cut_short_by_a_crash_before_its_record_is_deleted_unless_owned(
    journal: Journal, tree: JournalTree
) -> None:
    """The daemon died after copying "a" to "b" and before recording it, and the file was then
    renamed back to "a" (nothing left to move): the copy at "b" was left on the remote for
    good, and a listing brought it back as a file (found by the random model run)."""
    ino, generation = tree.write_file("a")
    tree.durable(ino, generation)
    tree.rename(ino, "b")
    journal.keys.intend_move("b")  # then the copy, then the crash
    tree.rename(ino, "a")
    assert journal.keys.relocation(ino) is None
    assert [(k, r, holder) for _, k, r, _, holder in journal.keys.pending_deletes_held(10)] == [("b", "move", None)]
    tree.rename(ino, "b")  # renamed again before the delete pass: its own move's key is spared
    assert [holder for *_, holder in journal.keys.pending_deletes_held(10)] == [None]
    intent = journal.keys.intend_move("b")
    assert journal.keys.finish_relocation(ino, "a", "b", intent)
    assert [(k, holder) for _, k, _, _, holder in journal.keys.pending_deletes_held(10)] == [("b", ino), ("a", None)]


def test_a_relocation_onto_a_held_key_waits_and_a_copy_nobody_owns_is_deleted(
    journal: Journal, tree: JournalTree
) -> None:
    ino, generation = tree.write_file("a")
    tree.durable(ino, generation)
    other, other_generation = tree.write_file("x")
    assert isinstance(journal.drain.claim(other, other_generation), tuple)  # uploading to "x"
    tree.rename(other, "y")
    tree.rename(ino, "x")
    assert journal.keys.relocation(ino) == ("x", "a", other)  # the upload holds "x": wait
    tree.unlink(ino)  # unlinked during the copy: the copy at "x" is nobody's
    assert not journal.keys.finish_relocation(ino, "a", "x", journal.keys.intend_move("x"))
    assert ("x", "moved") in [(k, r) for _, k, r in journal.keys.pending_deletes(10)]
    assert ("x", "move") not in [(k, r) for _, k, r in journal.keys.pending_deletes(10)]


def test_a_rename_cycle_is_found(journal: Journal, tree: JournalTree) -> None:
    a, ga = tree.write_file("a")
    b, gb = tree.write_file("b")
    tree.durable(a, ga)
    tree.durable(b, gb)
    tree.rename(a, "tmp")
    tree.rename(b, "a")
    tree.rename(a, "b")
    moves = {ino: journal.keys.relocation(ino) for ino in (a, b)}
    assert moves == {a: ("b", "a", b), b: ("a", "b", a)}
    blocked = {ino: move[2] for ino, move in moves.items() if move is not None and move[2] is not None}
    assert journal.keys.rename_cycle(blocked) in (a, b)
    assert journal.keys.rename_cycle({a: 999}) is None  # waits for a file that waits for nobody


def test_stale_keys_of_files_renamed_while_not_durable(journal: Journal, tree: JournalTree) -> None:
    d = tree.mkdir("d")
    ino, generation = tree.write_file("f", d)
    tree.durable(ino, generation)
    tree.close(ino)  # staged again
    tree.rename(ino, "g", d)
    flying, flying_generation = tree.write_file("h", d)
    tree.durable(flying, flying_generation)
    tree.close(flying)
    tree.rename(flying, "i", d)
    assert sorted(journal.keys.stale_keys([d])) == [(ino, "d/f"), (flying, "d/h")]
    dropped = journal.keys.drop_stale_keys([d], frozenset({flying}))  # an upload in flight decides its own key
    assert dropped == [(ino, "d/f")]
    assert tree.row(ino).remote_key is None and tree.row(flying).remote_key == "d/h"
    assert [(k, r) for _, k, r in journal.keys.pending_deletes(10)] == [("d/f", "stale")]


def test_pending_deletes_come_with_the_holder_of_each_key(journal: Journal, tree: JournalTree) -> None:
    old, generation = tree.write_file("a")
    tree.durable(old, generation)
    tree.unlink(old)
    new, new_generation = tree.write_file("a")
    assert [(k, h) for _, k, _, _, h in journal.keys.pending_deletes_held(10)] == [("a", None)]
    tree.durable(new, new_generation)  # a live file owns "a" again: the delete must not run
    pending = journal.keys.pending_deletes_held(10)
    assert [(k, h) for _, k, _, _, h in pending] == [("a", new)]
    assert journal.keys.pending_deletes_held(10, frozenset({"a"})) == []  # an upload in flight to "a"
    journal.keys.drop_deletes([request_id for request_id, *_ in pending])
    assert journal.keys.pending_deletes(10) == [] and journal.keys.owned_under("") == {"a"}


# -- the journal thread ----------------------------------------------------------------------


def test_the_journal_thread_runs_calls_in_order_off_the_loop(journal: Journal, tree: JournalTree) -> None:
    ino, generation = tree.write_file("f")
    thread = JournalThread()
    loop_thread = threading.get_ident()
    ran_on: list[int] = []

    def claim() -> tuple[str, int] | int | None:
        ran_on.append(threading.get_ident())
        return journal.drain.claim(ino, generation)

    async def main() -> None:
        claimed, superseded = await asyncio.gather(
            thread.call(claim), thread.call(journal.drain.superseded, ino, generation)
        )
        assert isinstance(claimed, tuple) and superseded is False  # the claim ran first
        blocker = threading.Event()
        first = asyncio.ensure_future(thread.call(blocker.wait))
        second = asyncio.ensure_future(thread.call(journal.drain.requeue, ino, generation, None, 0))
        await asyncio.sleep(0.01)
        second.cancel()  # cancelled while it waits for the thread: it never runs
        await asyncio.sleep(0.01)  # (the cancellation reaches the thread's queue on the loop's next turns)
        blocker.set()
        await first
        with pytest.raises(asyncio.CancelledError):
            await second

    try:
        asyncio.run(main())
    finally:
        thread.close()
    assert ran_on and ran_on[0] != loop_thread
    assert tree.state(ino) == DRAINING


def test_inode_numbers_are_never_handed_out_twice_across_restarts(
    journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block of numbers is journaled before its first is used: a daemon restarted
    after using some starts past them, even where the rows with those numbers are gone."""
    monkeypatch.setattr(namespace, "INO_BLOCK", 3)
    first = namespace.InodeNumbers(journal, last_row=1)
    taken = [first.take() for _ in range(5)]  # crosses a block
    assert taken == [2, 3, 4, 5, 6]
    again = namespace.InodeNumbers(journal, last_row=1)  # every row but the root removed
    assert again.take() > max(taken)
    assert namespace.InodeNumbers(journal, last_row=100).take() == 101  # rows past the blocks: after them


def test_try_apply_never_waits_for_a_busy_journal(journal: Journal, tmp_path: Path) -> None:
    """False, and nothing applied, while another thread holds the journal or another
    connection a write transaction: the request loop then commits in a thread instead."""
    op = set_meta_op("try", "1")
    results: list[bool] = []
    with journal._db.lock:
        holder = threading.Thread(target=lambda: results.append(journal.try_apply([op])))
        holder.start()
        holder.join()
    assert results == [False]
    other = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        assert journal.try_apply([op]) is False
        assert time.monotonic() - started < 1  # not the 30 s busy timeout
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert journal.get_meta("try") is None
    assert journal.try_apply([op]) is True
    assert journal.get_meta("try") == "1"
    assert journal.query("PRAGMA busy_timeout") == [(connection.BUSY_TIMEOUT_MS,)]

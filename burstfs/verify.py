"""``verify``: re-hash files against the digests journaled at close, and read their objects back.

The local check is blocking (run it in a thread); the remote check is a
coroutine for whatever loop owns the object store: the running mover's loop in
a live daemon (the control server hands it over, so it shares the mover's
client), a loop of its own in ``burstfs-admin verify --remote`` on a stopped
mount.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import xxhash

from .config import RemoteURL, S3Options
from .digests import compute_digests
from .errors import CorruptDataError, RemoteNotFound
from .journal import INCOMPLETE, NOT_LOCAL, REMOTE, WRITING, InodeRow, Journal
from .localtier import LocalTier
from .objects import RANGED_RUN_BYTES, ObjectStore
from .remote import open_remote
from .status import SCHEMA, files_at

# verify --remote hashes an object in windows of this many bytes: a few ranged GETs in
# flight (RANGED_RUN_BYTES each), memory bounded by the window.
VERIFY_WINDOW_BYTES = 4 * RANGED_RUN_BYTES

log = logging.getLogger("burstfs.control")

#: A check's verdict and what it found: ('ok' | 'mismatch' | 'skipped', detail).
Verdict = tuple[str, str]


def check_local(cache_dir: Path, journal: Journal, row: InodeRow) -> Verdict:
    """The staged bytes against the journaled digest (blocking)."""
    if row.state in NOT_LOCAL:
        return "skipped", "not on the local tier"
    if row.state == WRITING:
        return "skipped", "open for writing"
    if row.state == INCOMPLETE:  # its digests are of the last closed version, not of these bytes
        return "skipped", "incomplete (open for writing at a crash, or a write failed): not a closed version"
    if not row.digest or not row.chunk_size:
        return "skipped", f"no digest recorded yet (state {row.state})"
    digests = compute_digests(LocalTier(cache_dir).path(row.data_ino), row.chunk_size)
    current = journal.inode(row.ino)
    if current is None or current.generation != row.generation:
        return "skipped", "changed while it was being verified"
    if digests.digest == row.digest and digests.size == row.size:
        return "ok", f"generation {row.generation}"
    if digests.size != row.size:
        return "mismatch", f"local data is {digests.size} bytes, journal says {row.size}"
    expected = row.chunk_digests()
    bad = next((i for i, (a, b) in enumerate(zip(digests.chunks, expected, strict=False)) if a != b), None)
    where = f"bytes {bad * row.chunk_size}-{min((bad + 1) * row.chunk_size, row.size)}" if bad is not None else "data"
    return "mismatch", f"{where} differ from the checksum journaled for generation {row.generation}"


async def check_remote(store: ObjectStore, row: InodeRow) -> Verdict:
    """The remote object against its manifest and the journal.

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
        # The chunks cover only the bytes the manifest lists: an object with more (bytes
        # appended) or fewer is not the file, however well each chunk checks out.
        info = await store.head(key)
        if info is None:
            return "mismatch", f"object {key} is missing on the remote"
        stored = sum(chunk.stored_size for chunk in manifest.chunks)
        if info.size != stored:
            return "mismatch", f"object {key} is {info.size} bytes, its manifest stores {stored}"
        whole = xxhash.xxh3_128()
        step = manifest.chunk_size * max(1, VERIFY_WINDOW_BYTES // manifest.chunk_size)  # GETs in flight
        for start in range(0, manifest.size, step):
            whole.update(await store.read_range(key, manifest, start, start + step))
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


async def check_remote_all(store: ObjectStore, rows: list[InodeRow]) -> list[Verdict]:
    """check_remote for each row, one after the other (a verify should not starve the drain)."""
    return [await check_remote(store, row) for row in rows]


def files_to_verify(journal: Journal, rels: list[str]) -> list[tuple[str, InodeRow]]:
    """The files at or under ``rels``, in path order (blocking)."""
    return sorted(files_at(journal, rels), key=lambda item: item[0])


def check_local_all(cache_dir: Path, journal: Journal, files: list[tuple[str, InodeRow]]) -> list[Verdict]:
    return [check_local(cache_dir, journal, row) for _, row in files]


def report(files: list[tuple[str, InodeRow]], local: list[Verdict], remote: list[Verdict] | None) -> dict[str, Any]:
    """The ``verify`` document (docs/ADMIN.md): per file OK, MISMATCH or SKIPPED, and the counts."""
    results = []
    for index, (path, _) in enumerate(files):
        checks = {"local": local[index]}
        if remote is not None:
            checks["remote"] = remote[index]
        verdicts = [verdict for verdict, _ in checks.values()]
        # With --remote the question is the remote copy: a file not drained yet is not OK.
        asked = checks["remote" if remote is not None else "local"][0]
        result = "MISMATCH" if "mismatch" in verdicts else "OK" if asked == "ok" else "SKIPPED"
        entry: dict[str, Any] = {"path": path, "result": result}
        for name, (verdict, detail) in checks.items():
            entry[name] = {"result": verdict, "detail": detail}
        results.append(entry)
    mismatches = sum(r["result"] == "MISMATCH" for r in results)
    if mismatches:
        log.error("event=verify_mismatch files=%d", mismatches)
    skipped = sum(r["result"] == "SKIPPED" for r in results)
    return {"schema": SCHEMA, "files": results, "mismatches": mismatches, "skipped": skipped}


def verify_stopped(
    cache_dir: Path, journal: Journal, rels: list[str], remote: RemoteURL | None = None, s3: S3Options | None = None
) -> dict[str, Any]:
    """verify on the journal of a stopped mount (blocking): with ``remote``, objects are read
    back through a client of its own on a loop of its own."""
    files = files_to_verify(journal, rels)
    local = check_local_all(cache_dir, journal, files)
    checked_remote = (
        asyncio.run(_check_remote_with_own_client(remote, s3, [row for _, row in files])) if remote else None
    )
    return report(files, local, checked_remote)


async def _check_remote_with_own_client(remote: RemoteURL, s3: S3Options | None, rows: list[InodeRow]) -> list[Verdict]:
    store = ObjectStore(open_remote(remote, s3, max_connections=8))
    try:
        return await check_remote_all(store, rows)
    finally:
        await store.remote.close()

"""What a fetch is verified against, and the checks themselves.

Strongest first: the manifest's chunk digests (whose whole-file digest must
match the journal's, for files this node drained); without a manifest, the
journal's own chunk digests, or, if it has only the whole-file digest, that
digest over the whole file before a byte is served; only objects nobody
recorded digests for (other tools, other nodes without a manifest) are served
unverified, and the log says so.
"""

from __future__ import annotations

import asyncio
import json
import logging

import xxhash

from ..errors import CorruptDataError
from ..journal import InodeRow
from .datafiles import DataFiles
from .state import UNVERIFIED_CHUNK, FileFetch

log = logging.getLogger("burstfs.restore")


def without_manifest(row: InodeRow) -> FileFetch:
    """Fetch state for an object without a manifest: verified by the journal's digests if it has them."""
    assert row.remote_key is not None
    if not row.digest:
        log.warning("event=unverified_object key=%s note=no burstfs digests, served unverified", row.remote_key)
        return FileFetch(row.ino, row.remote_key, row.size, UNVERIFIED_CHUNK, None)
    chunks = journal_chunks(row)
    if chunks is not None:
        assert row.chunk_size is not None
        log.warning("event=manifest_missing key=%s verify=journal_chunks", row.remote_key)
        return FileFetch(row.ino, row.remote_key, row.size, row.chunk_size, None, expected_chunks=chunks)
    log.warning(
        "event=manifest_missing key=%s verify=journal_digest note=whole file fetched before serving", row.remote_key
    )
    return FileFetch(row.ino, row.remote_key, row.size, UNVERIFIED_CHUNK, None, whole_digest=row.digest)


def check_digest(fetch: FileFetch, index: int, digest: str) -> None:
    """A chunk's xxh3-64 against the recorded one (CorruptDataError, logged, if it differs)."""
    if fetch.manifest is not None:
        expected: str | None = fetch.manifest.chunks[index].xxh3
    elif fetch.expected_chunks is not None:
        expected = fetch.expected_chunks[index]
    else:
        return  # checked over the whole file at the end, or nobody recorded digests
    if digest == expected:
        return
    start, end = fetch.chunk_start(index), fetch.chunk_start(index + 1)
    log.error(
        "event=corrupt_data key=%s ino=%d range=%d-%d chunk=%d problem=%r",
        fetch.key,
        fetch.ino,
        start,
        end,
        index,
        f"xxh3 {digest}, expected {expected} ({fetch.verification})",
    )
    if fetch.manifest is None:
        raise CorruptDataError(
            f"{fetch.key}: bytes {start}-{end} do not match the checksum journaled when it was drained "
            f"(xxh3 {digest}, expected {expected}; the remote object has no manifest)"
        )
    raise CorruptDataError(
        f"{fetch.key}: bytes {start}-{end} do not match their checksum (xxh3 {digest}, expected {expected})"
    )


def note_refetch(fetch: FileFetch, index: int) -> None:
    """A chunk that did not match is fetched once more before it is called corrupt: a bit
    flipped on the way (a plain-HTTP endpoint, a bad NIC) is not the object."""
    log.warning(
        "event=chunk_refetched key=%s ino=%d chunk=%d note=did not match its checksum, fetched once more",
        fetch.key,
        fetch.ino,
        index,
    )


async def check_journal_chunk(fetch: FileFetch, index: int, data: bytes | memoryview) -> None:
    check_digest(fetch, index, await asyncio.to_thread(xxhash.xxh3_64_hexdigest, data))


async def verify_whole(fetch: FileFetch, files: DataFiles) -> None:
    """Check the complete local copy against the journal's whole-file digest (once, shared)."""
    if fetch.verifying is None:
        fetch.verifying = asyncio.ensure_future(_hash_whole(fetch, files))
    verifying = fetch.verifying
    try:
        await asyncio.shield(verifying)
    finally:
        if verifying.done() and fetch.verifying is verifying:
            fetch.verifying = None


async def _hash_whole(fetch: FileFetch, files: DataFiles) -> None:
    digest = await asyncio.to_thread(files.local_digest, fetch.ino, fetch.size)
    if digest == fetch.whole_digest:
        fetch.verified = True
        return
    fetch.present.clear()  # refetch on the next read: the remote may have been repaired
    fetch.contiguous = 0
    log.error(
        "event=corrupt_data key=%s ino=%d range=0-%d problem=%r",
        fetch.key,
        fetch.ino,
        fetch.size,
        f"xxh3-128 {digest}, journal {fetch.whole_digest} (no manifest)",
    )
    raise CorruptDataError(
        f"{fetch.key}: bytes 0-{fetch.size} do not match the checksum journaled when it was drained "
        f"(digest {digest}, expected {fetch.whole_digest}; the remote object has no manifest)"
    )


def journal_chunks(row: InodeRow) -> tuple[str, ...] | None:
    """The journal's per-chunk digests of ``row``, if they are present and cover its size."""
    if not row.chunks or not row.chunk_size or row.chunk_size <= 0:
        return None
    try:
        chunks = json.loads(row.chunks)
    except (ValueError, RecursionError):
        return None
    if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
        return None
    if len(chunks) != -(-row.size // row.chunk_size):
        return None
    return tuple(chunks)

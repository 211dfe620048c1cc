"""Checksummed, optionally compressed objects over both remotes (a directory and S3 via moto)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import xxhash
from faultproxy import FaultProxy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3server import fresh_bucket

import burstfs.digests
import burstfs.objects
from burstfs.config import S3Options, parse_remote_url
from burstfs.errors import CorruptDataError, ManifestError, RemoteError, UploadCancelled
from burstfs.objects import FileDigests, Manifest, ObjectStore, compute_digests, manifest_key
from burstfs.remote import FileRemote, Remote, RetryPolicy
from burstfs.remote.s3 import S3Remote

T = TypeVar("T")

CHUNK = 16 * 1024  # small parts keep moto fast; the launcher lowers its minimum part size
FAST_RETRY = RetryPolicy(attempts=6, base_delay=0.01, max_delay=0.05)


def run(store: ObjectStore, body: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        try:
            return await body()
        finally:
            await store.remote.close()

    return asyncio.run(main())


def make_store(remote: Remote) -> ObjectStore:
    return ObjectStore(remote, FAST_RETRY)


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        root = tmp_path / "remote"
        root.mkdir()
        return make_store(FileRemote(parse_remote_url(f"file://{root}")))
    endpoint = request.getfixturevalue("s3_env")
    return make_store(s3_remote(endpoint, fresh_bucket(endpoint)))


def s3_remote(endpoint: str, bucket: str) -> S3Remote:
    remote = S3Remote(parse_remote_url(f"s3://{bucket}/prefix"), S3Options(endpoint_url=endpoint), retry=FAST_RETRY)
    remote.min_part_size = 1024  # what the test server accepts (real S3: 5 MiB)
    return remote


def staged(tmp_path: Path, data: bytes, name: str = "staged.bin") -> tuple[Path, FileDigests]:
    path = tmp_path / name
    path.write_bytes(data)
    return path, compute_digests(path, CHUNK)


async def upload(store: ObjectStore, key: str, path: Path, digests: FileDigests | None, **kw: Any) -> Manifest:
    options: dict[str, Any] = {"generation": 7, "mtime_ns": 123, "mode": 0o100644, "concurrency": 3, **kw}
    return await store.upload_file(key, path, digests, **options)


def compressible(size: int) -> bytes:
    return (b"tensor-weights-" * (size // 15 + 1))[:size]


# -- digests and manifests ---------------------------------------------------------------------


def test_compute_digests(tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 2 + 5)
    _, digests = staged(tmp_path, data)
    assert digests.size == len(data) and digests.chunk_size == CHUNK
    assert digests.chunks == tuple(xxhash.xxh3_64_hexdigest(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK))
    assert digests.digest == xxhash.xxh3_128_hexdigest(data)
    assert staged(tmp_path, b"", "empty")[1] == FileDigests(0, CHUNK, (), xxhash.xxh3_128_hexdigest(b""))


@pytest.mark.parametrize("compress", [None, "lz4"])
def test_an_upload_tells_the_file_bytes_of_each_part_as_it_lands(
    store: ObjectStore, tmp_path: Path, compress: str | None
) -> None:
    """The drain's rate counts parts as they land: it counted only whole files, so status said
    0 B/s and an ETA of 161867h while a large file's parts went out fine."""
    data = compressible(CHUNK * 5 + 77)
    path, digests = staged(tmp_path, data)
    sent: list[int] = []
    run(store, lambda: upload(store, "big", path, digests, compress=compress, sent=sent.append))
    assert sum(sent) == len(data)  # file bytes, not compressed ones
    assert len(sent) > 1 or compress  # part by part (lz4's small chunks fill one part here)
    small, small_digests = staged(tmp_path, b"x" * 10, "small.bin")
    sent.clear()
    run(store, lambda: upload(store, "small", small, small_digests, sent=sent.append))
    assert sent == [10]


def test_manifest_json_and_ranges() -> None:
    from burstfs.objects import ChunkInfo, StoredChunk

    manifest = Manifest(
        key="a/b",
        size=250,
        chunk_size=100,
        digest="d" * 32,
        generation=3,
        mtime_ns=9,
        mode=0o644,
        chunks=(ChunkInfo("1" * 16, "lz4", 40), ChunkInfo("2" * 16, "raw", 100), ChunkInfo("3" * 16, "lz4", 20)),
    )
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.stored_chunks(0, 10) == [StoredChunk(0, 0, 40)]
    assert manifest.stored_chunks(99, 201) == [StoredChunk(0, 0, 40), StoredChunk(1, 40, 100), StoredChunk(2, 140, 20)]
    assert manifest.stored_chunks(200, 10_000) == [StoredChunk(2, 140, 20)]
    assert manifest.stored_chunks(250, 300) == []
    assert manifest.chunk_range(2) == (200, 250)
    for bad in (b"{", b'{"version": 2}', manifest.to_json().replace(b'"size":250', b'"size":350')):
        with pytest.raises(CorruptDataError):
            Manifest.from_json(bad)


def manifest_doc(**changes: Any) -> dict[str, Any]:
    """A valid manifest document (250 bytes in chunks of 100), with ``changes`` applied."""
    doc: dict[str, Any] = {
        "version": 1,
        "key": "a/b",
        "size": 250,
        "chunk_size": 100,
        "digest": "d" * 32,
        "generation": 3,
        "mtime_ns": 9,
        "mode": 0o100600,
        "chunks": [
            {"xxh3": "1" * 16, "codec": "lz4", "stored_size": 40},
            {"xxh3": "2" * 16, "codec": "raw", "stored_size": 100},
            {"xxh3": "3" * 16, "codec": "raw", "stored_size": 50},
        ],
    }
    doc.update(changes)
    return doc


RAW_CHUNKS = [
    {"xxh3": "1" * 16, "codec": "raw", "stored_size": 100},
    {"xxh3": "2" * 16, "codec": "raw", "stored_size": 100},
    {"xxh3": "3" * 16, "codec": "raw", "stored_size": 50},
]


def doc_bytes(doc: Any) -> bytes:
    import json

    return json.dumps(doc).encode()


HUGE = 5 << 30


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (b"{", "unreadable"),
        (b"\xff\xfe\x00garbage", "unreadable"),
        (b"[" * 100_000 + b"]" * 100_000, "RecursionError"),  # nesting deeper than the parser's stack
        (b'{"version": 1, "size": ' + b"[" * 50_000, "unreadable"),
        (doc_bytes(manifest_doc()).replace(b'"size": 250', b'"size": Infinity'), "non-finite"),
        (doc_bytes(manifest_doc()).replace(b'"size": 250', b'"size": NaN'), "non-finite"),
        (doc_bytes(manifest_doc()).replace(b'"size": 250', b'"size": 1e999'), "'size' is float"),
        (doc_bytes(manifest_doc()).replace(b'"size": 250', b'"size": ' + b"9" * 5000), "unreadable"),
        (doc_bytes([manifest_doc()]), "document is a list"),
        (doc_bytes(manifest_doc(version=2)), "'version' is 2"),
        (doc_bytes(manifest_doc(version="1")), "'version' is str"),
        (doc_bytes(manifest_doc(size="250")), "'size' is str"),
        (doc_bytes(manifest_doc(size=True)), "'size' is bool"),
        (doc_bytes(manifest_doc(size=250.0)), "'size' is float"),
        (doc_bytes(manifest_doc(size=350)), "'chunks' has 3 entries"),
        (doc_bytes(manifest_doc(size=-1)), "'size'"),
        (doc_bytes(manifest_doc(size=10**30)), "'size' is out of range"),
        (doc_bytes(manifest_doc(mode=-1)), "'mode'"),
        (doc_bytes(manifest_doc(generation=-1)), "'generation'"),
        (doc_bytes(manifest_doc(digest=None)), "'digest' is NoneType"),
        (doc_bytes(manifest_doc(digest="zz")), "'digest' is not 32 hex"),
        (doc_bytes(manifest_doc(key="")), "'key' is empty"),
        (doc_bytes({k: v for k, v in manifest_doc().items() if k != "mtime_ns"}), "'mtime_ns' is missing"),
        (doc_bytes(manifest_doc(chunks={"0": 1})), "'chunks' is dict"),
        (doc_bytes(manifest_doc(chunks=[1, 2, 3])), "'chunks[0]' is int"),
        (doc_bytes(manifest_doc(chunk_size=0)), "'chunk_size'"),
        # A hostile manifest must not make 16 fetches of a 5 GiB chunk possible.
        (
            doc_bytes(
                manifest_doc(
                    size=HUGE + 1,
                    chunk_size=HUGE + 1,
                    chunks=[{"xxh3": "1" * 16, "codec": "raw", "stored_size": HUGE + 1}],
                )
            ),
            "'chunk_size' 5368709121 is outside",
        ),
        (
            doc_bytes(
                manifest_doc(
                    chunks=[
                        {"xxh3": "1" * 16, "codec": "lz4", "stored_size": HUGE},
                        {"xxh3": "2" * 16, "codec": "raw", "stored_size": 100},
                        {"xxh3": "3" * 16, "codec": "raw", "stored_size": 50},
                    ]
                )
            ),
            "'chunks[0].stored_size' is 5368709120",
        ),
        (
            doc_bytes(
                manifest_doc(
                    chunks=[
                        {"xxh3": "1" * 16, "codec": "raw", "stored_size": 100},
                        {"xxh3": "2" * 16, "codec": "raw", "stored_size": 99},
                        {"xxh3": "3" * 16, "codec": "raw", "stored_size": 50},
                    ]
                )
            ),
            "'chunks[1].stored_size' is 99",
        ),
        (
            doc_bytes(
                manifest_doc(
                    chunks=[
                        {"xxh3": "1" * 16, "codec": "zstd", "stored_size": 100},
                        {"xxh3": "2" * 16, "codec": "raw", "stored_size": 100},
                        {"xxh3": "3" * 16, "codec": "raw", "stored_size": 50},
                    ]
                )
            ),
            "'chunks[0].codec'",
        ),
        (
            doc_bytes(
                manifest_doc(
                    chunks=[
                        {"xxh3": 1, "codec": "raw", "stored_size": 100},
                        {"xxh3": "2" * 16, "codec": "raw", "stored_size": 100},
                        {"xxh3": "3" * 16, "codec": "raw", "stored_size": 50},
                    ]
                )
            ),
            "'chunks[0].xxh3' is int",
        ),
        (doc_bytes(manifest_doc(block_size=50, blocks=["a" * 16] * 5)), "'blocks' of an object with compressed"),
        (doc_bytes(manifest_doc(chunks=RAW_CHUNKS, block_size=50, blocks=["a" * 16] * 4)), "'blocks' has 4 entries"),
        (doc_bytes(manifest_doc(chunks=RAW_CHUNKS, block_size=30, blocks=["a" * 16] * 9)), "'block_size' 30 does not"),
        (doc_bytes(manifest_doc(chunks=RAW_CHUNKS, block_size=50, blocks=["a" * 16, "A" * 16])), "'blocks[1]' is not"),
        (doc_bytes(manifest_doc(chunks=RAW_CHUNKS, blocks=["a" * 16] * 5)), "'block_size' is missing"),
        (b" " * (80 << 20) + b"{}", "exceeds the limit"),
        (b"[" + b"0," * 5_000_000 + b"0]", "more elements"),
    ],
)
def test_manifest_parsing_is_bounded_and_raises_one_error_type(data: bytes, names: str) -> None:
    """Whatever a (corrupt or hostile) remote holds, parsing fails with ManifestError naming the problem."""
    assert Manifest.from_json(doc_bytes(manifest_doc())).size == 250  # the unmodified document is fine
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(data)
    assert names in str(info.value)
    assert isinstance(info.value, CorruptDataError)  # callers treat it as one corrupt file


def test_manifest_chunk_count_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    from burstfs import manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_CHUNKS", 2)
    with pytest.raises(ManifestError) as info:
        Manifest.from_json(doc_bytes(manifest_doc()))
    assert "'chunks' has more than 2 entries" in str(info.value)


def test_oversized_manifest_object_is_not_read_whole(store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    from burstfs import manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 1000)

    async def body() -> None:
        await store.remote.put_object(manifest_key("k"), doc_bytes(manifest_doc(key="k")) + b" " * 5000)
        with pytest.raises(ManifestError) as info:
            await store.fetch_manifest("k")
        assert "k" in str(info.value) and "exceeds the limit" in str(info.value)

    run(store, body)


JSON_JUNK = (
    b"Infinity",
    b"-Infinity",
    b"NaN",
    b"1e999",
    b"1.5",
    b"[" * 50_000,
    b"{" * 50_000,
    b'"x"',
    b"true",
    b"null",
    b"{}",
    b"[]",
    b"-1",
    b"9" * 5000,
    b"99999999999999999999999",
    b"\xff",
)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([float("inf"), float("-inf"), float("nan"), 10**30, -(10**30)]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)
SPECIAL_VALUES: tuple[Any, ...] = (
    float("inf"),
    float("-inf"),
    float("nan"),
    1.5,
    10**30,
    -1,
    0,
    True,
    "1",
    None,
    [],
    {},
    {"stored_size": float("inf")},
    {"stored_size": 10**12},
    {"codec": "lz4"},
    {"xxh3": 1},
    [[[]]],
)
MANIFEST_FIELDS = ("version", "key", "size", "chunk_size", "digest", "generation", "mtime_ns", "mode", "chunks")


def parses_or_raises_manifest_error(data: bytes) -> None:
    try:
        manifest = Manifest.from_json(data)
    except ManifestError:
        return
    assert manifest._problem() is None
    assert Manifest.from_json(manifest.to_json()) == manifest


@st.composite
def spliced_manifests(draw: st.DrawFn) -> bytes:
    """A valid manifest's JSON with a few bytes (or a hostile token) written over a random place."""
    base = doc_bytes(manifest_doc())
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        pos = draw(st.integers(min_value=0, max_value=len(base)))
        junk = draw(st.sampled_from(JSON_JUNK) | st.binary(min_size=1, max_size=8))
        cut = draw(st.integers(min_value=0, max_value=12))
        base = base[:pos] + junk + base[pos + cut :]
    return base


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | spliced_manifests())
def test_fuzz_manifest_arbitrary_bytes(data: bytes) -> None:
    parses_or_raises_manifest_error(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_fuzz_manifest_arbitrary_json(doc: Any) -> None:
    import json

    parses_or_raises_manifest_error(json.dumps(doc, allow_nan=True).encode())


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(MANIFEST_FIELDS),
    st.sampled_from(SPECIAL_VALUES) | json_values,
    st.integers(min_value=0, max_value=2),
)
def test_fuzz_manifest_one_field_replaced(field: str, value: Any, chunk: int) -> None:
    """Valid manifests with one field (or one chunk's field) replaced by arbitrary JSON."""
    import json

    doc = manifest_doc()
    if field == "chunks" and isinstance(value, dict):
        doc["chunks"][chunk].update(value)
    else:
        doc[field] = value
    parses_or_raises_manifest_error(json.dumps(doc, allow_nan=True).encode())


# -- upload and read back ------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [None, "lz4"])
@pytest.mark.parametrize("size", [0, CHUNK - 1, CHUNK * 5 + 123])
def test_upload_without_digests_takes_them_in_the_same_pass(
    store: ObjectStore, tmp_path: Path, size: int, compress: str | None
) -> None:
    """Files written through passthrough have no digests from close: the upload takes them."""
    data = compressible(size)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "p/ckpt.pt", path, None, chunk_size=CHUNK, compress=compress)
        assert (manifest.size, manifest.chunk_size, manifest.digest) == (size, CHUNK, digests.digest)
        assert tuple(c.xxh3 for c in manifest.chunks) == digests.chunks
        assert await store.read_range("p/ckpt.pt", await store.fetch_manifest("p/ckpt.pt"), 0, size) == data

    run(store, body)
    with pytest.raises(ValueError):
        run(store, lambda: upload(store, "p/x", path, None))  # no chunk size to hash with


def test_a_paused_upload_reads_nothing(store: ObjectStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The drain yields to writers through ``pace``: while it holds, neither the parts nor the
    whole-file digest of a file written through passthrough (no digests) read a byte of it."""
    data = os.urandom(CHUNK * 5 + 123)
    path, digests = staged(tmp_path, data)
    reads: list[int] = []
    for module in (burstfs.digests, burstfs.objects):
        real = module.pread_full

        def counted(fd: int, size: int, offset: int, real: Callable[[int, int, int], bytes] = real) -> bytes:
            reads.append(size)
            return real(fd, size, offset)

        monkeypatch.setattr(module, "pread_full", counted)

    async def body() -> None:
        gate, paused = asyncio.Event(), asyncio.Event()

        async def pace() -> None:
            paused.set()
            await gate.wait()

        task = asyncio.ensure_future(upload(store, "p/ckpt.pt", path, None, chunk_size=CHUNK, pace=pace))
        await paused.wait()
        await asyncio.sleep(0.3)
        assert not reads and not task.done()
        gate.set()
        assert (await task).digest == digests.digest
        assert sum(reads) >= 2 * len(data)  # the parts and the whole-file pass, once each

    run(store, body)


@pytest.mark.parametrize("size", [0, 1, CHUNK, CHUNK + 1, CHUNK * 5 + 123])
def test_plain_upload_is_exactly_the_file(store: ObjectStore, tmp_path: Path, size: int) -> None:
    data = os.urandom(size)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "ckpt/model.pt", path, digests)
        assert (manifest.size, manifest.digest, manifest.generation) == (size, digests.digest, 7)
        assert all(c.codec == "raw" for c in manifest.chunks)
        assert await store.remote.get_object("ckpt/model.pt") == data
        fetched = await store.fetch_manifest("ckpt/model.pt")
        assert fetched == manifest
        assert await store.read_range("ckpt/model.pt", fetched, 0, size + 10) == data
        assert await store.remote.list_multipart_uploads() == []

    run(store, body)


def test_read_ranges(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 4 + 500)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "r", path, digests)
        rng = random.Random(1)
        cases = [(0, 1), (CHUNK - 1, CHUNK + 1), (CHUNK, 2 * CHUNK), (5, len(data)), (len(data) - 3, len(data) + 99)]
        cases += [tuple(sorted(rng.sample(range(len(data)), 2))) for _ in range(5)]  # type: ignore[misc]
        for start, end in cases:
            assert await store.read_range("r", manifest, start, end) == data[start:end], (start, end)
        assert await store.read_range("r", manifest, len(data), len(data) + 5) == b""
        chunks = await store.read_chunks("r", manifest, 0, len(manifest.chunks))
        assert [bytes(c) for c in chunks] == [data[i * CHUNK : (i + 1) * CHUNK] for i in range(len(chunks))]

    run(store, body)


@pytest.mark.parametrize("digests_at_close", [True, False])
def test_plain_objects_list_block_digests_and_read_by_block(
    store: ObjectStore, tmp_path: Path, digests_at_close: bool
) -> None:
    """An uncompressed object's manifest carries an xxh3 per block (smaller than a chunk), so a
    reader can fetch and verify one block; compressed objects and one-block chunks carry none."""
    block = CHUNK // 4
    store.block_size = block
    data = os.urandom(CHUNK * 2 + block + 100)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "b", path, digests if digests_at_close else None, chunk_size=CHUNK)
        expected = tuple(xxhash.xxh3_64_hexdigest(data[i : i + block]) for i in range(0, len(data), block))
        assert (manifest.block_size, manifest.blocks) == (block, expected)
        assert Manifest.from_json(manifest.to_json()) == manifest
        assert await store.fetch_manifest("b") == manifest
        by_blocks = manifest.by_blocks()
        assert (by_blocks.chunk_size, len(by_blocks.chunks), by_blocks.digest) == (block, 10, manifest.digest)
        for index in (0, 5, 9):
            (chunk,) = await store.read_chunks("b", by_blocks, index, index + 1)
            assert chunk == data[index * block : (index + 1) * block]
        assert (
            await store.read_range("b", by_blocks, 3 * block - 7, 6 * block + 1) == data[3 * block - 7 : 6 * block + 1]
        )
        compressed = await upload(
            store, "z", path, digests if digests_at_close else None, chunk_size=CHUNK, compress="lz4"
        )
        assert (compressed.block_size, compressed.blocks) == (0, ())
        store.block_size = CHUNK  # blocks as large as the chunks: nothing to add
        whole = await upload(store, "w", path, digests if digests_at_close else None, chunk_size=CHUNK)
        assert whole.blocks == () and whole.by_blocks() is whole

    run(store, body)


def test_a_flipped_byte_fails_only_its_block(tmp_path: Path) -> None:
    root = tmp_path / "remote"
    root.mkdir()
    store = make_store(FileRemote(parse_remote_url(f"file://{root}")))
    block = CHUNK // 4
    store.block_size = block
    data = os.urandom(CHUNK * 2)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        by_blocks = (await upload(store, "f", path, digests)).by_blocks()
        stored = bytearray((root / "f").read_bytes())
        stored[block + 3] ^= 0xFF
        (root / "f").write_bytes(bytes(stored))
        first, bad, third = await store.read_chunks("f", by_blocks, 0, 3)
        assert isinstance(bad, CorruptDataError) and f"bytes {block}-{2 * block} do not match" in str(bad)
        assert first == data[:block] and third == data[2 * block : 3 * block]
        with pytest.raises(CorruptDataError, match=f"bytes {block}-{2 * block} do not match"):
            await store.read_range("f", by_blocks, 0, 3 * block)  # a range touching it fails whole

    run(store, body)


def test_lz4_compressible(store: ObjectStore, tmp_path: Path) -> None:
    data = compressible(CHUNK * 3 + 77)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "c", path, digests, compress="lz4")
        assert [c.codec for c in manifest.chunks] == ["lz4"] * 4
        info = await store.remote.head("c")
        assert info is not None and info.size == sum(c.stored_size for c in manifest.chunks) < len(data) // 4
        assert await store.read_range("c", manifest, 0, len(data)) == data
        assert await store.read_range("c", manifest, CHUNK - 10, 2 * CHUNK + 10) == data[CHUNK - 10 : 2 * CHUNK + 10]

    run(store, body)


def test_lz4_incompressible_and_mixed(store: ObjectStore, tmp_path: Path) -> None:
    noise = os.urandom(CHUNK * 2)
    data = noise + compressible(CHUNK) + os.urandom(CHUNK // 2)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "m", path, digests, compress="lz4")
        assert [c.codec for c in manifest.chunks] == ["raw", "raw", "lz4", "raw"]
        stored = await store.remote.get_object("m")
        assert stored[: 2 * CHUNK] == noise  # raw chunks are stored as they are
        assert await store.read_range("m", manifest, 0, len(data)) == data

    run(store, body)


def test_parts_in_flight_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most ``concurrency`` parts are uploading (and held in memory) at once."""
    root = tmp_path / "remote"
    root.mkdir()
    remote = FileRemote(parse_remote_url(f"file://{root}"))
    in_flight = peak = 0
    real_upload_part = remote.upload_part

    async def counting_upload_part(*args: Any) -> Any:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        try:
            await asyncio.sleep(0.001)
            return await real_upload_part(*args)
        finally:
            in_flight -= 1

    monkeypatch.setattr(remote, "upload_part", counting_upload_part)
    data = os.urandom(CHUNK * 12)
    path, digests = staged(tmp_path, data)
    store = make_store(remote)
    run(store, lambda: upload(store, "bounded", path, digests, concurrency=3))
    assert 1 <= peak <= 3
    assert (root / "bounded").read_bytes() == data


@pytest.mark.s3
def test_upload_holds_at_most_its_memory_budget(s3_env: str, tmp_path: Path) -> None:
    """A multipart upload to S3 allocates no more than ``upload_memory`` (parts read ahead and in
    flight, each held once) and the requests' small buffers: the drain's budget is what it holds."""
    remote = s3_remote(s3_env, fresh_bucket(s3_env))
    chunk = 4 * 1024 * 1024
    remote.min_part_size = chunk
    store = make_store(remote)
    data = os.urandom(chunk * 6)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    digests = compute_digests(path, chunk)
    budget = store.upload_memory(chunk, 3, len(data))
    assert budget == 3 * chunk

    async def body() -> int:
        await upload(store, "warm", path, digests, concurrency=3)  # botocore's models and connections are loaded
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            await upload(store, "big", path, digests, concurrency=3)
            held = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert await remote.get_object("big") == data
        return held

    held = run(store, body)
    # Beyond the budget only the requests' and the event loop's own buffers (measured 1.5 to 4.5 MiB:
    # a 256 KiB read of each body, what the sockets did not take yet); a copy of each part in
    # flight adds another 12 MiB (25.8 MiB measured before parts were held once).
    assert held < budget * 3 // 2, f"the upload held {held} bytes; its budget is {budget}"


def test_parts_respect_remote_limits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small lz4 chunks are joined up to the minimum part size; huge files into fewer, larger parts."""
    root = tmp_path / "remote"
    root.mkdir()
    remote = FileRemote(parse_remote_url(f"file://{root}"))
    sizes: list[int] = []
    real_upload_part = remote.upload_part

    async def recording_upload_part(key: str, upload_id: str, number: int, offset: int, data: bytes) -> Any:
        sizes.append(len(data))
        return await real_upload_part(key, upload_id, number, offset, data)

    monkeypatch.setattr(remote, "upload_part", recording_upload_part)
    store = make_store(remote)
    data = compressible(CHUNK * 10)
    path, digests = staged(tmp_path, data)

    remote.min_part_size = 3 * CHUNK
    manifest = run(store, lambda: upload(store, "small-parts", path, digests, compress="lz4"))
    assert len(sizes) == 1  # ten tiny lz4 chunks make one part
    assert run(store, lambda: store.read_range("small-parts", manifest, 0, len(data))) == data

    sizes.clear()
    remote.min_part_size, remote.max_parts = 0, 4
    run(store, lambda: upload(store, "few-parts", path, digests))
    assert sizes == [3 * CHUNK, 3 * CHUNK, 3 * CHUNK, CHUNK]
    assert (root / "few-parts").read_bytes() == data


# -- corruption --------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [CHUNK // 2, CHUNK * 4])
def test_corrupt_staged_file_is_not_uploaded(store: ObjectStore, tmp_path: Path, size: int) -> None:
    data = bytearray(os.urandom(size))
    path, digests = staged(tmp_path, bytes(data))
    flip = size - 10
    data[flip] ^= 0x01
    path.write_bytes(data)

    async def body() -> None:
        with pytest.raises(CorruptDataError) as info:
            await upload(store, "bad", path, digests, concurrency=2)
        chunk_start = flip // CHUNK * CHUNK
        assert str(path) in str(info.value) and f"bytes {chunk_start}-{size}" in str(info.value)
        assert await store.remote.head("bad") is None
        assert await store.fetch_manifest("bad") is None
        assert await store.remote.list_multipart_uploads() == []

    run(store, body)


def test_staged_file_of_wrong_size(store: ObjectStore, tmp_path: Path) -> None:
    path, digests = staged(tmp_path, os.urandom(CHUNK * 2))
    with path.open("ab") as f:
        f.write(b"more")
    with pytest.raises(CorruptDataError, match="bytes"):
        run(store, lambda: upload(store, "grown", path, digests))


def test_flipped_remote_byte_is_detected(store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(CHUNK * 3)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "victim", path, digests)
        damaged = bytearray(data)
        damaged[CHUNK + 5] ^= 0x80
        await store.remote.put_object("victim", bytes(damaged))  # bit rot on the remote
        corrupt = pytest.raises(CorruptDataError, match=f"victim: bytes {CHUNK}-{2 * CHUNK}")
        with caplog.at_level(logging.ERROR, logger="burstfs.objects"), corrupt:
            await store.read_range("victim", manifest, CHUNK + 100, CHUNK + 200)
        assert any(
            "key=victim" in r.getMessage() and f"range={CHUNK}-{2 * CHUNK}" in r.getMessage() for r in caplog.records
        )
        # The chunks around it are still served.
        assert await store.read_range("victim", manifest, 0, CHUNK) == data[:CHUNK]
        assert await store.read_range("victim", manifest, 2 * CHUNK, 3 * CHUNK) == data[2 * CHUNK :]

    run(store, body)


def test_damaged_lz4_chunk_is_detected(store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = compressible(CHUNK * 2)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        manifest = await upload(store, "z", path, digests, compress="lz4")
        stored = bytearray(await store.remote.get_object("z"))
        stored[len(stored) // 2] ^= 0xFF
        await store.remote.put_object("z", bytes(stored))
        with caplog.at_level(logging.ERROR, logger="burstfs.objects"), pytest.raises(CorruptDataError):
            await store.read_range("z", manifest, 0, len(data))

    run(store, body)


def test_unverified_read_without_manifest(store: ObjectStore) -> None:
    async def body() -> None:
        await store.remote.put_object("foreign.bin", b"written by aws s3 cp")
        assert await store.fetch_manifest("foreign.bin") is None
        assert await store.read_range("foreign.bin", None, 11, 14) == b"aws"

    run(store, body)


# -- namespace and lifecycle ------------------------------------------------------------------------


def test_rename_moves_object_and_manifest(store: ObjectStore, tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 2 + 1)
    path, digests = staged(tmp_path, data)

    async def body() -> None:
        await upload(store, "old/name", path, digests, compress="lz4")
        await store.rename("old/name", "new/name")
        assert await store.remote.head("old/name") is None
        assert await store.remote.head(manifest_key("old/name")) is None
        manifest = await store.fetch_manifest("new/name")
        assert manifest is not None and manifest.key == "new/name"
        assert await store.read_range("new/name", manifest, 0, len(data)) == data
        await store.rename("old/name", "new/name")  # repeating a finished move is harmless

    run(store, body)


def test_rename_foreign_object_drops_stale_manifest(store: ObjectStore, tmp_path: Path) -> None:
    path, digests = staged(tmp_path, os.urandom(100))

    async def body() -> None:
        await upload(store, "dst", path, digests)
        await store.remote.put_object("foreign", b"no manifest")
        await store.rename("foreign", "dst")
        assert await store.fetch_manifest("dst") is None
        assert await store.read_range("dst", None, 0, 100) == b"no manifest"

    run(store, body)


def test_delete_removes_object_and_manifest(store: ObjectStore, tmp_path: Path) -> None:
    path, digests = staged(tmp_path, os.urandom(CHUNK + 1))

    async def body() -> None:
        await upload(store, "gone", path, digests)
        await store.delete("gone")
        await store.delete("gone")
        assert await store.remote.head("gone") is None
        assert await store.remote.head(manifest_key("gone")) is None

    run(store, body)


def test_a_listed_delete_spares_an_object_rewritten_since_it_was_listed(store: ObjectStore, tmp_path: Path) -> None:
    """Another node's file unlinked here goes only as the version this node listed: its owner
    may have written the key again since (the newer file is not this node's to delete)."""
    path, digests = staged(tmp_path, os.urandom(CHUNK + 1))

    async def listed_version(key: str) -> str:
        dir_key, _, name = key.rpartition("/")
        files, _ = await store.remote.list_dir(dir_key)
        return next(info.version for info in files if info.key.rpartition("/")[2] == name)

    async def body() -> None:
        await upload(store, "ck/shard", path, digests)
        seen = await listed_version("ck/shard")
        await asyncio.sleep(0.01)  # a directory remote tells versions apart by mtime only
        await upload(store, "ck/shard", *staged(tmp_path, os.urandom(CHUNK + 2), "rewritten.bin"))
        await store.delete("ck/shard", spare_foreign=False, listed_version=seen)
        assert await store.remote.head("ck/shard") is not None
        assert await store.fetch_manifest("ck/shard") is not None
        await store.delete("ck/shard", spare_foreign=False, listed_version=await listed_version("ck/shard"))
        assert await store.remote.head("ck/shard") is None
        assert await store.remote.head(manifest_key("ck/shard")) is None
        await store.delete("ck/shard", spare_foreign=False, listed_version=seen)  # already gone: fine

    run(store, body)


def test_cancelled_upload_leaves_nothing(store: ObjectStore, tmp_path: Path) -> None:
    path, digests = staged(tmp_path, os.urandom(CHUNK * 6))
    checks = 0

    async def superseded() -> bool:
        nonlocal checks
        checks += 1
        return checks > 2

    async def body() -> None:
        with pytest.raises(UploadCancelled):
            await upload(store, "cancelled", path, digests, concurrency=1, cancel_check=superseded)
        assert await store.remote.head("cancelled") is None
        assert await store.remote.list_multipart_uploads() == []

    run(store, body)


def test_task_cancellation_aborts_upload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A drain cancelled mid-upload (shutdown) leaves no multipart upload behind."""
    root = tmp_path / "remote"
    root.mkdir()
    remote = FileRemote(parse_remote_url(f"file://{root}"))
    started = asyncio.Event()

    async def stuck_part(*args: Any) -> Any:
        started.set()
        await asyncio.Event().wait()  # never answers

    monkeypatch.setattr(remote, "upload_part", stuck_part)
    path, digests = staged(tmp_path, os.urandom(CHUNK * 4))
    store = make_store(remote)

    async def body() -> list[tuple[str, str]]:
        task = asyncio.create_task(upload(store, "k", path, digests))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await remote.list_multipart_uploads()

    assert run(store, body) == []


def test_abort_stale_uploads(store: ObjectStore) -> None:
    """Only the uploads named (the ones this cache journaled) are aborted: never another node's."""

    async def body() -> None:
        a = await store.remote.create_multipart("a")
        c = await store.remote.create_multipart("b/c")
        other = await store.remote.create_multipart("other-node")
        assert await store.abort_stale_uploads([("a", a), ("b/c", c)]) == 2
        assert await store.remote.list_multipart_uploads() == [("other-node", other)]

    run(store, body)


def test_permanent_failure_aborts_upload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "remote"
    root.mkdir()
    remote = FileRemote(parse_remote_url(f"file://{root}"))
    real_upload_part = remote.upload_part

    async def failing_part(key: str, upload_id: str, part_number: int, offset: int, data: bytes) -> Any:
        if part_number == 3:
            raise RemoteError("denied", kind="access_denied")
        return await real_upload_part(key, upload_id, part_number, offset, data)

    monkeypatch.setattr(remote, "upload_part", failing_part)
    path, digests = staged(tmp_path, os.urandom(CHUNK * 5))
    store = make_store(remote)

    async def body() -> None:
        with pytest.raises(RemoteError) as info:
            await upload(store, "k", path, digests)
        assert info.value.kind == "access_denied"
        assert await remote.list_multipart_uploads() == [] and await remote.head("k") is None

    run(store, body)


@pytest.mark.s3
def test_upload_through_faults_is_byte_identical(s3_env: str, tmp_path: Path) -> None:
    data = os.urandom(CHUNK * 6 + 999)
    path, digests = staged(tmp_path, data)
    bucket = fresh_bucket(s3_env)
    with FaultProxy(s3_env) as proxy:
        store = make_store(s3_remote(proxy.endpoint, bucket))

        async def body() -> bytes:
            proxy.fail_next(4, status=503, match="partNumber=")
            proxy.reset_next(4, when="response", match="partNumber=")
            manifest = await upload(store, "ckpt", path, digests, compress="lz4", concurrency=4)
            return await store.read_range("ckpt", manifest, 0, len(data))

        assert run(store, body) == data
        assert proxy.injected == 8


def test_streaming_digests_match_a_reread_despite_writeback_patterns(tmp_path: Path) -> None:
    """Reordered writes and page-aligned rewrites of a partial page still give the file's digests."""
    from burstfs.objects import StreamingDigests

    data = os.urandom((3 << 20) + 777)
    (tmp_path / "f").write_bytes(data)
    expected = compute_digests(tmp_path / "f", 1 << 20)
    stream = StreamingDigests(1 << 20)
    stream.update(0, data[:1000])  # a partial page...
    stream.update(0, data[:70000])  # ...rewritten from its start with more
    stream.update(1 << 20, data[1 << 20 : 2 << 20])  # ahead of the hashed prefix: waits
    stream.update(69632, data[69632 : 1 << 20])  # from the partial page start: overlaps the tail, unblocks the rest
    stream.update(2 << 20, data[2 << 20 :])
    assert stream.result(len(data)) == expected
    assert stream.result(len(data) - 1) is None  # must cover exactly the file

    changed = StreamingDigests(1 << 20)
    changed.update(0, data[:1000])
    changed.update(0, b"X" + data[1:2000])  # the repeated bytes differ: a real overwrite
    assert changed.result(2000) is None

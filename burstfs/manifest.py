"""The manifest format: what was uploaded for one file, and the chunk codecs.

A manifest lives next to its object (``.burstfs/manifests/<key>.json``) and
lists each chunk's xxh3-64, codec and stored length, so any range of the
object can be fetched, decompressed and verified without the rest.  Manifests
are read from a shared, possibly hostile remote: :meth:`Manifest.from_json`
checks every type and bound and raises only :class:`ManifestError`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, TypeVar

import lz4.frame
import xxhash

from .digests import chunk_count
from .errors import CorruptDataError, ManifestError

log = logging.getLogger("burstfs.objects")

MANIFEST_VERSION = 1
CODECS = ("raw", "lz4")
# Bounds on what a manifest read from the (shared, possibly hostile) remote may
# ask for: a chunk is at most one S3 part (5 GiB) and a file at most 2**20 chunks
# (S3's 5 TiB object limit at the smallest part size, 5 MiB).  2**20 chunk
# entries take ~66 MB of JSON; three commas per entry bound the element count
# before json.loads builds anything.
MAX_MANIFEST_CHUNK_SIZE = 5 << 30
MAX_MANIFEST_CHUNKS = 1 << 20
MAX_MANIFEST_BYTES = 80 << 20
_MAX_MANIFEST_COMMAS = 4 * MAX_MANIFEST_CHUNKS + 8192  # chunks (3 each) and blocks (1 each)
#: An object stored uncompressed also lists the xxh3-64 of each block of this many bytes
#: (``blocks``): a reader verifies, and so fetches, a random read a block at a time rather
#: than a whole chunk (a chunk is an upload part: 8 MiB by default).  At most
#: MAX_MANIFEST_CHUNKS blocks (1 TiB); a larger file is verified by chunks only.
BLOCK_SIZE = 1 << 20
#: The longest node id a manifest may name (config.check_node_id allows 63 characters).
MAX_NODE_ID = 63
_INT64 = 1 << 63
#: A chunk is stored compressed only if lz4 saves at least this fraction: below
#: that, decompressing on every read costs more than the bytes it saves.
MIN_COMPRESSION_SAVING = 0.10


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk as stored: its xxh3-64 (of the plain bytes), codec, and stored length."""

    xxh3: str
    codec: str
    stored_size: int


@dataclass(frozen=True)
class StoredChunk:
    """Where chunk ``index`` lies in the stored object: ``size`` bytes at ``offset``."""

    index: int
    offset: int
    size: int


@dataclass(frozen=True)
class Manifest:
    """What was uploaded for one file, enough to verify (and decompress) any range of it.

    key: the object key.  size: the file's length.  chunk_size: plain bytes per chunk.
    digest: xxh3-128 of the whole file.  generation: the staged generation uploaded.
    mtime_ns, mode: the file's attributes at staging.  chunks: one ChunkInfo per chunk.
    """

    key: str
    size: int
    chunk_size: int
    digest: str
    generation: int
    mtime_ns: int
    mode: int
    chunks: tuple[ChunkInfo, ...]
    version: int = MANIFEST_VERSION
    block_size: int = 0  # 0: no block digests
    blocks: tuple[str, ...] = ()  # xxh3-64 of each block_size bytes of the plain file
    node: str = ""  # the node id of the mount that uploaded it ("" in manifests from before)

    def by_blocks(self) -> Manifest:
        """This manifest with its blocks as (raw) chunks, for readers that verify by block;
        itself when it lists no blocks."""
        if not self.blocks:
            return self
        chunks = tuple(
            ChunkInfo(digest, "raw", min(self.block_size, self.size - index * self.block_size))
            for index, digest in enumerate(self.blocks)
        )
        return dataclasses.replace(self, chunk_size=self.block_size, chunks=chunks, block_size=0, blocks=())

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "version": self.version,
            "key": self.key,
            "size": self.size,
            "chunk_size": self.chunk_size,
            "digest": self.digest,
            "generation": self.generation,
            "mtime_ns": self.mtime_ns,
            "mode": self.mode,
            "chunks": [dataclasses.asdict(c) for c in self.chunks],
        }
        if self.blocks:
            doc["block_size"] = self.block_size
            doc["blocks"] = list(self.blocks)
        if self.node:
            doc["node"] = self.node
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate untrusted bytes from the remote.

        Raises only :class:`~burstfs.errors.ManifestError` (a CorruptDataError:
        that one file is corrupt), naming the offending key, for anything this
        version cannot use: too large, not JSON, nested too deep, non-finite or
        non-integer numbers, wrong types, another version, sizes that do not add up.
        """
        if isinstance(data, str):
            data = data.encode()
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds the limit of {MAX_MANIFEST_BYTES}")
        if bytes(data).count(b",") > _MAX_MANIFEST_COMMAS:
            raise ManifestError("manifest has more elements than any valid manifest")
        try:
            doc = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError, TypeError) as exc:  # UnicodeDecodeError is a ValueError
            raise ManifestError(f"unreadable manifest: {type(exc).__name__}: {str(exc)[:200]}") from None
        return _manifest_from_doc(cls, doc)

    def _problem(self) -> str | None:
        """Why this manifest cannot be right (sizes, counts, codecs), or None."""
        if self.version != MANIFEST_VERSION:
            return f"'version' is {self.version} (this burstfs reads {MANIFEST_VERSION})"
        if not 0 < self.chunk_size <= MAX_MANIFEST_CHUNK_SIZE:
            return f"'chunk_size' {self.chunk_size} is outside 1..{MAX_MANIFEST_CHUNK_SIZE}"
        if not 0 <= self.size <= MAX_MANIFEST_CHUNKS * self.chunk_size:
            return f"'size' {self.size} is outside 0..{MAX_MANIFEST_CHUNKS} chunks of {self.chunk_size}"
        if len(self.chunks) != chunk_count(self.size, self.chunk_size):
            return f"'chunks' has {len(self.chunks)} entries for {self.size} bytes in chunks of {self.chunk_size}"
        for index, chunk in enumerate(self.chunks):
            start, end = self.chunk_range(index)
            length = end - start
            if chunk.codec not in CODECS:
                return f"'chunks[{index}].codec' is {chunk.codec!r}, not one of {CODECS}"
            if chunk.codec == "raw" and chunk.stored_size != length:
                return f"'chunks[{index}].stored_size' is {chunk.stored_size} for a raw chunk of {length} bytes"
            # lz4 is kept only when it saves space; allow the frame's worst-case overhead anyway.
            if chunk.codec == "lz4" and not 0 < chunk.stored_size <= length + length // 255 + 64:
                return f"'chunks[{index}].stored_size' is {chunk.stored_size} for an lz4 chunk of {length} bytes"
        return self._blocks_problem()

    def _blocks_problem(self) -> str | None:
        if not self.blocks and not self.block_size:
            return None
        if not 0 < self.block_size <= self.chunk_size or self.chunk_size % self.block_size:
            return f"'block_size' {self.block_size} does not divide 'chunk_size' {self.chunk_size}"
        if len(self.blocks) != chunk_count(self.size, self.block_size) or not self.blocks:
            return f"'blocks' has {len(self.blocks)} entries for {self.size} bytes in blocks of {self.block_size}"
        if any(chunk.codec != "raw" for chunk in self.chunks):
            return "'blocks' of an object with compressed chunks"
        return None

    @functools.cached_property
    def _stored_offsets(self) -> list[int]:
        offsets = [0]
        for chunk in self.chunks:
            offsets.append(offsets[-1] + chunk.stored_size)
        return offsets

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Logical bytes ``[start, end)`` of chunk ``index``."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.size)

    def stored_chunk(self, index: int) -> StoredChunk:
        """Where chunk ``index`` is in the stored object."""
        return StoredChunk(index, self._stored_offsets[index], self.chunks[index].stored_size)

    def stored_chunks(self, start: int, end: int) -> list[StoredChunk]:
        """The stored chunks holding logical bytes ``[start, end)`` (clamped to the file)."""
        end = min(end, self.size)
        if start >= end:
            return []
        return [self.stored_chunk(i) for i in range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)]


Stored = TypeVar("Stored", bytes, memoryview)


def encode_chunk(data: bytes, digest: str, compress: str | None) -> tuple[ChunkInfo, bytes]:
    """The stored form of one chunk whose xxh3-64 is ``digest``, and its manifest entry.

    With lz4 the chunk is one lz4 frame, kept only where it saves at least
    MIN_COMPRESSION_SAVING; otherwise the plain bytes are stored ("raw").
    Blocking: called in threads.
    """
    if compress == "lz4":
        packed = lz4.frame.compress(data, block_size=lz4.frame.BLOCKSIZE_MAX4MB, content_checksum=False)
        if len(packed) <= len(data) * (1 - MIN_COMPRESSION_SAVING):
            return ChunkInfo(digest, "lz4", len(packed)), packed
    return ChunkInfo(digest, "raw", len(data)), data


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _field(doc: dict[str, Any], name: str, kind: type, where: str = "") -> Any:
    """``doc[name]``, which must be exactly of type ``kind`` (no bool for int, no float)."""
    label = f"{where}{name}"
    if name not in doc:
        raise ManifestError(f"invalid manifest: key '{label}' is missing")
    value = doc[name]
    if type(value) is not kind:
        raise ManifestError(f"invalid manifest: key '{label}' is {type(value).__name__}, expected {kind.__name__}")
    if isinstance(value, int) and not -_INT64 <= value < _INT64:
        raise ManifestError(f"invalid manifest: key '{label}' is out of range")
    return value


_HEX_DIGITS = frozenset("0123456789abcdef")


def _hex_field(doc: dict[str, Any], name: str, length: int, where: str = "") -> str:
    return _checked_hex(_field(doc, name, str, where), length, f"{where}{name}")


def _checked_hex(value: Any, length: int, label: str) -> str:
    if type(value) is not str or len(value) != length or not set(value) <= _HEX_DIGITS:
        raise ManifestError(f"invalid manifest: key '{label}' is not {length} hex digits")
    return value


def _manifest_from_doc(cls: type[Manifest], doc: Any) -> Manifest:
    """Build a Manifest from parsed JSON, checking every type and bound (ManifestError)."""
    if type(doc) is not dict:
        raise ManifestError(f"invalid manifest: the document is a {type(doc).__name__}, expected an object")
    version = _field(doc, "version", int)
    if version != MANIFEST_VERSION:
        raise ManifestError(f"invalid manifest: key 'version' is {version} (this burstfs reads {MANIFEST_VERSION})")
    key = _field(doc, "key", str)
    if not key:
        raise ManifestError("invalid manifest: key 'key' is empty")
    raw_chunks = _field(doc, "chunks", list)
    if len(raw_chunks) > MAX_MANIFEST_CHUNKS:
        raise ManifestError(f"invalid manifest for {key}: key 'chunks' has more than {MAX_MANIFEST_CHUNKS} entries")
    chunks = []
    for index, raw in enumerate(raw_chunks):
        where = f"chunks[{index}]."
        if type(raw) is not dict:
            raise ManifestError(
                f"invalid manifest for {key}: key 'chunks[{index}]' is {type(raw).__name__}, expected object"
            )
        chunks.append(
            ChunkInfo(
                _hex_field(raw, "xxh3", 16, where),
                _field(raw, "codec", str, where),
                _field(raw, "stored_size", int, where),
            )
        )
    blocks: tuple[str, ...] = ()
    block_size = 0
    if "blocks" in doc or "block_size" in doc:
        raw_blocks = _field(doc, "blocks", list)
        if len(raw_blocks) > MAX_MANIFEST_CHUNKS:
            raise ManifestError(f"invalid manifest for {key}: key 'blocks' has more than {MAX_MANIFEST_CHUNKS} entries")
        blocks = tuple(_checked_hex(b, 16, f"blocks[{i}]") for i, b in enumerate(raw_blocks))
        block_size = _field(doc, "block_size", int)
    mode = _field(doc, "mode", int)
    if not 0 <= mode < 1 << 32:
        raise ManifestError(f"invalid manifest for {key}: key 'mode' is out of range")
    generation = _field(doc, "generation", int)
    if generation < 0:
        raise ManifestError(f"invalid manifest for {key}: key 'generation' is negative")
    node = _field(doc, "node", str) if "node" in doc else ""
    if len(node) > MAX_NODE_ID:
        raise ManifestError(f"invalid manifest for {key}: key 'node' is longer than {MAX_NODE_ID} characters")
    manifest = cls(
        key=key,
        size=_field(doc, "size", int),
        chunk_size=_field(doc, "chunk_size", int),
        digest=_hex_field(doc, "digest", 32),
        generation=generation,
        mtime_ns=_field(doc, "mtime_ns", int),
        mode=mode,
        chunks=tuple(chunks),
        version=version,
        block_size=block_size,
        blocks=blocks,
        node=node,
    )
    problem = manifest._problem()
    if problem:
        raise ManifestError(f"invalid manifest for {key}: {problem}")
    return manifest


def decode_chunk(key: str, manifest: Manifest, index: int, stored: Stored) -> Stored | bytes:
    """Decompress and verify one stored chunk (blocking: called in a thread)."""
    info = manifest.chunks[index]
    start, end = manifest.chunk_range(index)
    data = stored
    problem = None
    if len(stored) != info.stored_size:
        problem = f"stored chunk is {len(stored)} bytes, expected {info.stored_size}"
    elif info.codec == "lz4":
        decompressor = lz4.frame.LZ4FrameDecompressor()
        try:
            data = decompressor.decompress(stored, max_length=end - start)
            if not decompressor.eof:
                problem = "lz4 frame longer than the chunk"
        except RuntimeError as exc:
            problem = f"lz4 frame unreadable: {exc}"
    if problem is None and len(data) != end - start:
        problem = f"chunk is {len(data)} bytes, expected {end - start}"
    if problem is None:
        digest = xxhash.xxh3_64_hexdigest(data)
        if digest != info.xxh3:
            problem = f"xxh3 {digest}, expected {info.xxh3}"
    if problem is not None:
        log.error("event=corrupt_data key=%s range=%d-%d chunk=%d problem=%r", key, start, end, index, problem)
        raise CorruptDataError(f"{key}: bytes {start}-{end} do not match their checksum ({problem})")
    return data

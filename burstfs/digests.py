"""File digests: xxh3-64 per chunk and xxh3-128 of the whole file.

Taken as the data is written (:class:`StreamingDigests`, in the worker thread
that does the ``pwrite``) or by re-reading a staged file (:func:`compute_digests`),
journaled with the close and checked again by the upload before a byte leaves
the machine.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import xxhash

from .errors import CorruptDataError
from .fileio import pread_full

# Read size of the whole-file digest pass.
DIGEST_READ_SIZE = 8 << 20


def chunk_count(size: int, chunk_size: int) -> int:
    """How many chunks of ``chunk_size`` hold ``size`` bytes (the last may be shorter)."""
    return -(-size // chunk_size)


@dataclass(frozen=True)
class FileDigests:
    """Checksums of a staged file, computed when it was closed.

    size: bytes hashed.
    chunk_size: bytes per chunk (the last one may be shorter).
    chunks: xxh3-64 hex of each chunk, in order (empty for an empty file).
    digest: xxh3-128 hex of the whole file.
    """

    size: int
    chunk_size: int
    chunks: tuple[str, ...]
    digest: str


class StreamingDigests:
    """Digests of a file written front to back, computed as the writes land.

    A close then journals the digests without re-reading the file, and the
    upload checks them against the staged bytes.  The kernel's write-back may
    deliver writes slightly out of order (those ahead of the hashed prefix wait
    in a small buffer) and rewrites a partly written page from its start (the
    repeated bytes are compared with the last page hashed and skipped).
    Anything else (an overwrite, a hole, more than ``max_pending`` bytes out of
    order) makes the digests unusable and the drain hashes the file instead.
    Thread-safe: writes land in worker threads.
    """

    TAIL = 4096  # a page: how far back a write-back rewrite of a partial page reaches

    def __init__(self, chunk_size: int, max_pending: int = 32 << 20) -> None:
        self.chunk_size = chunk_size
        self.max_pending = max_pending
        self.size = 0  # bytes hashed: the prefix [0, size)
        self.broken = False
        self._whole = xxhash.xxh3_128()
        self._chunk = xxhash.xxh3_64()
        self._in_chunk = 0
        self._chunks: list[str] = []
        self._tail = b""  # the last bytes hashed, up to TAIL
        self._pending: dict[int, bytes] = {}
        self._pending_bytes = 0
        self._lock = threading.Lock()

    def update(self, offset: int, data: bytes) -> None:
        with self._lock:
            if self.broken or not data:
                return
            if offset > self.size:
                if offset in self._pending or self._pending_bytes + len(data) > self.max_pending:
                    self._break()
                else:
                    self._pending[offset] = data
                    self._pending_bytes += len(data)
                return
            self._consume(offset, data)
            while not self.broken:
                ready = [o for o in self._pending if o <= self.size]
                if not ready:
                    break
                for o in sorted(ready):
                    if self.broken:  # an overwrite among them: _break() dropped the rest
                        break
                    data = self._pending.pop(o)
                    self._pending_bytes -= len(data)
                    self._consume(o, data)

    def result(self, size: int) -> FileDigests | None:
        """The digests of a file of ``size`` bytes, or None if they do not cover exactly that."""
        with self._lock:
            if self.broken or self._pending or self.size != size:
                return None
            chunks = [*self._chunks, self._chunk.copy().hexdigest()] if self._in_chunk else list(self._chunks)
            return FileDigests(self.size, self.chunk_size, tuple(chunks), self._whole.hexdigest())

    def _consume(self, offset: int, data: bytes) -> None:
        """Hash ``data`` at ``offset`` <= size, skipping bytes that repeat the hashed tail."""
        overlap = self.size - offset
        if overlap:
            repeated = data[:overlap]
            if overlap > len(self._tail) or repeated != self._tail[len(self._tail) - overlap :][: len(repeated)]:
                self._break()  # a real overwrite: the journal gets no digests for this close
                return
            data = data[overlap:]
        if data:
            self._hash(data)

    def _hash(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            piece = view[: self.chunk_size - self._in_chunk]
            self._chunk.update(piece)
            self._whole.update(piece)
            self._in_chunk += len(piece)
            view = view[len(piece) :]
            if self._in_chunk == self.chunk_size:
                self._chunks.append(self._chunk.hexdigest())
                self._chunk = xxhash.xxh3_64()
                self._in_chunk = 0
        self.size += len(data)
        self._tail = (self._tail + data[-self.TAIL :])[-self.TAIL :]

    def _break(self) -> None:
        self.broken = True
        self._pending.clear()
        self._pending_bytes = 0


class WholeFileDigest:
    """xxh3-128 of the first ``size`` bytes of ``path``, taken one window per :meth:`step`.

    Stepwise so that the caller can pause between windows: the drain's pass over
    a file written through passthrough yields to writers like its uploads do.
    Each step blocks (run it in a thread) and opens the file itself: a step's
    thread can outlive a cancelled caller.
    """

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        self.path = path
        self.size = size
        self.offset = 0
        self._whole = xxhash.xxh3_128()

    @property
    def done(self) -> bool:
        return self.offset >= self.size

    def step(self) -> None:
        """Hash the next window of at most DIGEST_READ_SIZE bytes."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = pread_full(fd, min(DIGEST_READ_SIZE, self.size - self.offset), self.offset)
        finally:
            os.close(fd)
        if not data:
            raise CorruptDataError(f"staged file {self.path} shrank below {self.size} bytes while it was hashed")
        self._whole.update(data)
        self.offset += len(data)

    def hexdigest(self) -> str:
        return self._whole.hexdigest()


def compute_digests(path: str | os.PathLike[str], chunk_size: int) -> FileDigests:
    """Hash ``path`` chunk by chunk (blocking: run it in a thread)."""
    if chunk_size <= 0:
        raise ValueError(f"chunk size must be positive, not {chunk_size}")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        whole = xxhash.xxh3_128()
        chunks = []
        offset = 0
        while offset < size:
            want = min(chunk_size, size - offset)
            data = pread_full(fd, want, offset)
            chunks.append(xxhash.xxh3_64_hexdigest(data))
            whole.update(data)
            offset += len(data)
            if len(data) < want:  # the file shrank while we read it: digest what is there
                break
        return FileDigests(offset, chunk_size, tuple(chunks), whole.hexdigest())
    finally:
        os.close(fd)

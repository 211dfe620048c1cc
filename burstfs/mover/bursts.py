"""Writer bursts: a burst buffer absorbs the burst first.

A checkpoint arrives as a burst: 8 ranks open their shards at once and write for
a while, or a directory of small files is opened and closed one after another.
While one goes on, the drain keeps off the cores: on a node with few cores its
reads, hashing, journal records and requests would take what the writers need,
and every close of a small file would pay for the upload of the one before it.

- No new upload starts while opens and closes come with gaps under
  ``BURST_GAP_S``, for at most ``BURST_MAX_S``: a stream of small files that never
  pauses cannot keep its files from draining.
- No large upload starts or sends a further part while a file opened for writing
  in the last ``WRITER_YIELD_S`` is still open (``FileDrain._yield_to_writers``);
  a file kept open longer (a log) stops holding the drain back after that.

Intents of commit rounds still go out meanwhile, and small files drain beside a
long writer.
"""

from __future__ import annotations

import math
import time

from . import timing


class WriterBursts:
    """What writers do, as the FUSE thread stamps it (``touch``, ``opened``, ``released``),
    read by the mover's thread (``absorbing``, ``recent_writer``): each field is written by
    one thread only, and the dict is read as one snapshot."""

    def __init__(self) -> None:
        self._last = -math.inf  # the last open, close or release (FUSE thread)
        self._writers: dict[int, float] = {}  # ino -> when its first writer of this run opened (FUSE thread)
        self._since: float | None = None  # when the burst being absorbed began (mover thread)

    def touch(self) -> None:
        """A writer opened, closed or released a file (any thread)."""
        self._last = time.monotonic()

    def opened(self, ino: int) -> None:
        """A file was opened for writing (or closed with a writer still on it)."""
        now = time.monotonic()
        self._writers.setdefault(ino, now)
        self._last = now

    def released(self, ino: int) -> None:
        """The last writer of ``ino`` let go of it (its last release, or an fsync)."""
        self._writers.pop(ino, None)
        self._last = time.monotonic()

    def recent_writer(self) -> bool:
        """Whether a file opened for writing in the last ``WRITER_YIELD_S`` is still open."""
        oldest = time.monotonic() - timing.WRITER_YIELD_S
        return any(opened >= oldest for opened in list(self._writers.values()))

    def absorbing(self) -> float:
        """Seconds until the opens and closes pause for ``BURST_GAP_S`` (0 if they have, or
        if this burst has been absorbed for ``BURST_MAX_S`` already)."""
        now = time.monotonic()
        wait = self._last + timing.BURST_GAP_S - now
        if wait <= 0:
            self._since = None
            return 0.0
        if self._since is None:
            self._since = now
        return max(0.0, min(wait, self._since + timing.BURST_MAX_S - now))

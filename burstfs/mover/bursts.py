"""Writer bursts: a burst buffer absorbs the burst first.

A checkpoint arrives as a burst of opens and closes (8 ranks' shards, a
directory of small files).  While one goes on, new uploads wait: on a node with
few cores the drain's reads, hashing, journal records and requests would take
the cores the writers need, and every close of a small file would pay for the
upload of the one before it.  Uploads in flight go on (they yield on their own,
``FileDrain._yield_to_writers``), intents of commit rounds still go out, and a
burst is absorbed for at most ``BURST_MAX_S``: a writer that never pauses cannot
keep its files from draining.
"""

from __future__ import annotations

import math
import time

from . import timing


class WriterBursts:
    """When writers last opened, closed or released a file for writing, and since when
    they have kept at it (gaps shorter than ``BURST_GAP_S``).  ``touch`` runs on the FUSE
    thread, ``absorbing`` on the mover's: two floats, each written by one thread only."""

    def __init__(self) -> None:
        self._last = -math.inf
        self._started = -math.inf

    def touch(self) -> None:
        """A writer opened, closed or released a file (any thread)."""
        now = time.monotonic()
        if now - self._last > timing.BURST_GAP_S:
            self._started = now
        self._last = now

    def absorbing(self) -> float:
        """Seconds until the burst has paused for ``BURST_GAP_S`` (0 if it has, or if it has
        been absorbed for ``BURST_MAX_S`` already)."""
        now = time.monotonic()
        if now - self._started >= timing.BURST_MAX_S:
            return 0.0
        return max(0.0, self._last + timing.BURST_GAP_S - now)

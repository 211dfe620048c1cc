"""The mover's counters, for status and metrics."""

from __future__ import annotations

import collections
import dataclasses
import time

from ..status import CORRUPT_READ_KIND, READ_FAILED_KIND

#: A read error repeated within this many seconds is counted (and listed) once.
READ_ERROR_MERGE_S = 5.0


@dataclasses.dataclass
class MoverStats:
    """Counters for status and metrics (read from other threads; plain ints are safe)."""

    files_drained: int = 0
    bytes_drained: int = 0
    bytes_drained_recent: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=256)
    )
    #: (time, file bytes) of each part or single PUT as it landed: the rate, which a large
    #: file under way moves long before it is durable.
    bytes_sent_recent: collections.deque[tuple[float, int]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=4096)
    )
    #: Of each upload under way (by inode), the file bytes already on the remote: the ETA
    #: counts only what is left of it.
    sent_in_flight: dict[int, int] = dataclasses.field(default_factory=dict)
    errors_by_kind: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    # (time recorded, kind, message): the kind says what failed (``unavailable``: the
    # remote did not answer after retries) without matching message text.
    recent_errors: collections.deque[tuple[float, str, str]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=20)
    )
    #: When the current run of failures began: the first error recorded since the drain
    #: last made progress (None: no failure since; the retries before it: ``retrying_since``).
    trouble_since: float | None = None
    #: Retries of requests since the remote last answered one: the epoch time their first
    #: attempt started, how many, and the latest reason (None: it answered the last one).
    retrying_since: float | None = None
    retries: int = 0
    last_retry: tuple[float, str, bool] | None = None  # when, why, and whether the store throttled
    drain_latencies: collections.deque[float] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=1024)
    )
    halted: str | None = None  # the permanent error that stopped the drain

    def sent(self, ino: int, file_bytes: int) -> None:
        """A part (or a whole small file) of the upload of ``ino`` landed on the remote."""
        self.bytes_sent_recent.append((time.time(), file_bytes))
        self.sent_in_flight[ino] = self.sent_in_flight.get(ino, 0) + file_bytes

    def upload_over(self, ino: int) -> None:
        """The upload of ``ino`` ended (durable, requeued or failed)."""
        self.sent_in_flight.pop(ino, None)

    def last_progress(self) -> float:
        """When the drain last got something onto the remote: a file durable, or a part landed."""
        return max((t for t, _ in [*self.bytes_drained_recent, *self.bytes_sent_recent]), default=0.0)

    def landed_in_flight(self) -> int:
        """File bytes of the uploads under way that are on the remote already (any thread)."""
        return sum(list(self.sent_in_flight.values()))

    def throughput(self, window: float = 30.0) -> float:
        """Bytes per second sent to the remote over the last ``window`` seconds (parts as they
        land: a 100 GiB file under way is not a rate of 0 until its last part)."""
        now = time.time()
        recent = [(t, n) for t, n in list(self.bytes_sent_recent) if now - t <= window]
        if not recent:
            return 0.0
        if len(recent) == 1:
            return recent[0][1] / max(now - recent[0][0], 1.0)
        # Since the first landing in the window (its bytes went out before it): a drain that
        # began 3 s ago is not averaged over 30 s, and an idle spell since lowers the rate.
        return sum(n for _, n in recent[1:]) / max(now - recent[0][0], 1.0)

    def read_error(self, message: str, kind: str = CORRUPT_READ_KIND) -> None:
        """Record a read that failed on a corrupt object, or (``READ_FAILED_KIND``) a read or
        listing the remote did not serve: status lists it; the drain is not in trouble for
        it, so it starts no outage.  The same failure again within READ_ERROR_MERGE_S is the
        same one (the kernel asks again for one ``cat``: it was listed three times).  Any thread."""
        now = time.time()
        last = self.recent_errors[-1] if self.recent_errors else None
        if last is not None and last[1:] == (kind, message) and now - last[0] < READ_ERROR_MERGE_S:
            return
        self.errors_by_kind[kind] += 1
        self.recent_errors.append((now, kind, message))

    def read_failed(self, what: str, reason: str) -> None:
        """A listing or read that failed on the remote (after its retries, or its bound)."""
        self.read_error(reason if reason.startswith(f"{what}:") else f"{what}: {reason}", READ_FAILED_KIND)

    def error(self, kind: str, message: str) -> None:
        """Record a failure of ``kind`` (the retries before it, if any, told ``retried``)."""
        now = time.time()
        self.errors_by_kind[kind] += 1
        self.recent_errors.append((now, kind, message))
        last_progress = self.last_progress()
        if self.trouble_since is None or self.trouble_since <= last_progress:  # a new run of failures
            self.trouble_since = now

    def retried(self, reason: str, first_attempt: float, throttled: bool = False) -> None:
        """A drain request failed for now and is tried again: status says so at once, not only
        once its retries are spent (a silent remote costs a read timeout per attempt)."""
        if self.retrying_since is None:
            self.retrying_since = first_attempt
        self.retries += 1
        self.last_retry = (time.time(), reason, throttled)

    def answered(self) -> None:
        """A drain request got its answer: the remote is not silent."""
        self.retrying_since = None
        self.retries = 0

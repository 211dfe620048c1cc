"""The mover's delays and bounds, in one place (tests shorten them here)."""

from __future__ import annotations

from ..remote import INTERNAL_DIR

# The journal's event log keeps this many recent events (checked every 10 minutes).
EVENTS_KEPT = 200_000
EVENT_PRUNE_EVERY_S = 600.0
# After a wake-up, let more closes arrive before scanning the journal: a burst of
# small files costs a few passes instead of one per close.
COALESCE_S = 0.005
# How long the loop sleeps when nothing wakes it: bounds the delay of retries
# and of re-probing a halted remote without busy-looping.
IDLE_RESCAN_S = 1.0
# A halted drain (permanent error such as a missing bucket) re-probes the remote this often.
HALT_PROBE_S = 15.0
# A multipart upload whose abort failed is aborted again this often while nothing uploads
# (not only at the next start: an unfinished upload holds storage on the remote).
STALE_UPLOAD_RETRY_S = 30.0
# Requeued files wait this long per failed attempt (capped), so a flapping remote is not hammered.
REQUEUE_BACKOFF_S = 2.0
REQUEUE_BACKOFF_MAX_S = 60.0
# A file waiting for a key another inode holds (uploading, or not yet moved away) looks again after this.
KEY_BUSY_RETRY_S = 0.5
# A file/directory clash on a file remote is retried this many times (with the
# requeue backoff) before the file fails: the clashing object may be one of ours
# that a queued delete or move is about to take away.
KEY_CONFLICT_RETRIES = 5
# A relocation that failed for one file is retried after this (doubling, capped).
RELOCATE_BACKOFF_S = 5.0
RELOCATE_BACKOFF_MAX_S = 600.0
# Besides the subtrees renames touched, every durable file's key is checked this often.
RELOCATE_FULL_SCAN_S = 600.0
# A checksum mismatch with no journaled change is retried this many times (a writer
# still holding the file open) before the file is declared corrupt.
MISMATCH_RETRIES = 3
# Files this small (one PUT) drain in a pool of their own, this many at once, beside the
# --max-files large ones: small files never wait behind multipart uploads, and a directory
# of small files is bound by request latency, not by two at a time (memory: 32 x 1 MiB).
SMALL_FILE_BYTES = 1024 * 1024
SMALL_FILES_IN_FLIGHT = 32
# A small upload that ends wakes the loop only once this many of the pool's slots are free
# (or the pool runs low): each pass reads the journal several times, and a pass per small
# file made the passes a fifth of the daemon's CPU while thousands of small files drained.
SMALL_REFILL = 8
# A burst buffer absorbs the next burst first: while a file opened for writing in the last
# WRITER_YIELD_S seconds is still open, large uploads read no further chunk and send no
# further part (polling every WRITER_POLL_S); the cores go to the writers.  A file kept
# open longer (a log) stops holding the drain back after that.
WRITER_YIELD_S = 10.0
WRITER_POLL_S = 0.05
# ... and no new upload starts while writers open and close files with gaps under
# BURST_GAP_S, for at most BURST_MAX_S of such a burst (burstfs/mover/bursts.py),
# unless the tier's file system has less than BURST_MIN_FREE of its room free.
BURST_GAP_S = 0.05
BURST_MAX_S = 3.0
BURST_MIN_FREE = 0.10
# An unexpected error in a pass of the loop: wait this long, then go on.
PASS_ERROR_BACKOFF_S = 2.0
# Parked objects of a rename cycle (a→b, b→a) wait here until their target frees up.
PARK_PREFIX = f"{INTERNAL_DIR}/moving/"
# A checkpoint's files wait for its commit marker to go first (mover/keymoves.py): while
# removals keep coming in less than this apart, an ``rm -r`` may still unlink the marker.
DELETE_SETTLE_S = 2.0

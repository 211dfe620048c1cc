"""Freed I/O buffers stay in the daemon's heap for the next ones.

Every chunk the daemon moves is a fresh ``bytes`` of 1-8 MiB: a remote read, a
part, a FUSE read reply.  glibc serves such sizes with a new ``mmap`` each (or
trims them back to the kernel when freed), so each one paid a page fault per 4 KiB
page: ~160,000 faults per GiB of a cold restore, a sixth of the daemon's CPU on
the machines measured (bench/RESULTS.md).  Served from the heap and not trimmed
at once, the same pages are reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("burstfs.heap")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations up to this come from the heap (a part, a ranged GET of 8 MiB, a read reply).
MMAP_THRESHOLD = 32 << 20
#: Freed memory at the top of a heap is given back to the kernel beyond this much (two parts:
#: what glibc's own adaptive threshold would keep after freeing one; RSS stays as before).
TRIM_THRESHOLD = 16 << 20


def keep_freed_buffers() -> None:
    """Tune glibc's allocator for the daemon's buffers (before its threads start); a C
    library without ``mallopt`` (musl) is left as it is."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        log.info("event=heap_untuned reason=no mallopt in %s", name)
        return
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        log.info("event=heap_untuned reason=mallopt refused")

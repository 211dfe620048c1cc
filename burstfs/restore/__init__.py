"""Restore: fetching remote files into the local tier, chunk by chunk, verified.

Runs on the mover's asyncio loop.  A read of a file that is not local asks for
the chunks covering it, in one of two plans:

- a file read sequentially from its start (``torch.load``, a rank reading its
  shard, ``burstfs-admin prefetch``) on a remote that prefers it (S3) is
  *streamed*: one GET of the rest of the file, its body written to the tier in
  ~1 MiB pieces as it arrives and each chunk served as soon as it is complete
  and verified.  The stream runs at most as far ahead of its reader as the
  reader has read (up to ``MAX_STREAM_LEAD``), so bytes fetched stay within
  twice the bytes read; a connection lost mid-body is resumed from the first
  byte that has not landed.  One GET per file is what moto wants (it reads the
  whole object for every ranged GET) and costs real S3 nothing per byte;
- any other read (mmap, safetensors ``safe_open``, the zip directory at the end
  of a ``torch.save`` file) fetches the chunks it touches with ranged GETs (one
  GET for up to ``RANGED_RUN_BYTES`` of consecutive chunks, each chunk verified on
  its own), and a sequential run grows a prefetch window of half as many bytes
  as it has read (up to ``MAX_WINDOW_BYTES``; none after a seek), so a random
  reader fetches little more than it touches.  Chunks are the manifest's 1 MiB
  blocks where it lists them (uncompressed objects), else its chunks.

Every chunk is checked against the digests recorded at drain time before a
byte of it is served (a ranged chunk before it lands on the tier; a streamed
chunk as its pieces pass, and it is only marked present once the whole chunk
checked out); fetched chunks stay there, so the next read is local.

What a fetch is verified against is in ``verify.py``; how the tier's data
files and their descriptors are kept (an LRU, never closed under a running
``pwrite``), in ``datafiles.py``.

Modules: ``service.py`` (``RestoreService``: per-file state, the ranged plan,
finishing a fetch), ``stream.py`` (the streaming plan), ``datafiles.py`` (the
tier's data files and their descriptors), ``verify.py`` (what a fetch is checked
against), ``state.py`` (the per-file state, limits, ``OwnedTasks``).
"""

from .service import RestoreService
from .state import (
    FETCH_CONCURRENCY,
    LAYOUT_KEY,
    MAX_OPEN_FDS,
    MAX_STREAMS,
    MAX_WINDOW_BYTES,
    READ_RETRY,
    OwnedTasks,
)

__all__ = [
    "FETCH_CONCURRENCY",
    "LAYOUT_KEY",
    "MAX_OPEN_FDS",
    "MAX_STREAMS",
    "MAX_WINDOW_BYTES",
    "READ_RETRY",
    "OwnedTasks",
    "RestoreService",
]

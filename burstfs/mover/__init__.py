"""The mover: drains staged files to the remote, in close order, verified.

It runs on its own asyncio loop (aiobotocore is asyncio) in a thread of the
daemon, or alone as ``burstfs drain --cache DIR``.  It talks to the front only
through the journal: it picks ``staged`` rows, marks them ``draining``, uploads
the generation it read, and marks it ``durable`` only if that generation is
still current (every transition of ``journal.drain`` is conditional on the
generation it was computed for), so a close racing an upload always wins and
the file simply drains again.

Contract (see docs/SEMANTICS.md):
- oldest close first; at most ``max_files`` files in flight, each with at most
  ``concurrency`` parts in memory, plus up to SMALL_FILES_IN_FLIGHT small files
  (one PUT each) in a pool of their own;
- a commit marker (DCP ``.metadata``, ``latest``...) starts only when every file
  closed before it under its directory is durable;
- temporary remote failures retry with backoff (in the object layer) and then
  requeue the file; an error that belongs to one object (a name too long, an
  invalid key) fails that file only; any other permanent one halts the drain
  with the error in the status until the remote answers again (one place
  decides: :func:`burstfs.errors.error_scope`); data always stays staged;
- unlinked files' objects are deleted, renamed durable files are moved with a
  server-side copy, and a key another inode owns or is uploading to is never
  written, moved onto or deleted (the journal's ownership protocol: an upload
  holds its key in ``upload_key`` from its claim until it is recorded);
- a per-file problem (a corrupt manifest, a bug hit by one file) fails or skips
  that file, never the loop.

Parts: ``scheduler.py`` (:class:`Mover`: the loop, what drains next, commit-marker
gating, claims), ``upload.py`` (one file's upload and its record, requeue or
failure), ``keymoves.py`` (remote deletes, relocations of renamed files),
``stats.py`` (counters), ``timing.py`` (every delay and bound, in one place).

Serialization: claims, deletes and relocations are decided one at a time on
the main loop; only uploads run concurrently, each holding its key.  Every
journal call runs on the mover's journal thread (``JournalThread``), never on
the loop; a loop that would ask many small questions asks one batched call.
"""

from .scheduler import Mover
from .stats import MoverStats

__all__ = ["Mover", "MoverStats"]

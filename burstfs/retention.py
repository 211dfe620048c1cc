"""Keep the last N checkpoints, safely: an older checkpoint is deleted only once N newer
ones are durable on the remote.

A trainer that deletes checkpoint N-1 as soon as it has written N (Lightning's
``save_top_k``, Hugging Face's ``save_total_limit``) is left with nothing safe if
the node dies before N drains: N-1 is gone from the remote, N never got there.
No torch import (the framework callbacks build on this).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path

from . import client

log = logging.getLogger("burstfs.retention")


def checkpoints_in(directory: Path, pattern: str) -> list[Path]:
    """The entries of ``directory`` matching ``pattern`` (files or directories), oldest first."""
    found = [(path.stat().st_mtime, path.name, path) for path in directory.glob(pattern)]
    return [path for _, _, path in sorted(found)]


def prune_checkpoints(checkpoints: Sequence[Path], keep_last: int) -> list[Path]:
    """Delete every checkpoint older than the newest ``keep_last`` durable ones.

    ``checkpoints`` is oldest first; a checkpoint is a file or a directory (DCP).
    Newer ones that are not durable yet are kept and do not count.  Returns what
    was deleted.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest durable checkpoint is never deleted")
    durable = 0
    deleted: list[Path] = []
    for checkpoint in reversed(checkpoints):
        if durable >= keep_last:
            if checkpoint.is_dir():
                _list_afresh(checkpoint)
                shutil.rmtree(checkpoint)
            else:
                checkpoint.unlink()
            deleted.append(checkpoint)
            log.info("event=checkpoint_pruned path=%s kept_durable=%d", checkpoint, durable)
            continue
        try:
            durable += client.is_durable(checkpoint)
        except client.DrainFailedError as exc:  # kept, and not counted: burstfs-admin retry may still save it
            log.warning("event=checkpoint_not_durable path=%s error=%s", checkpoint, exc)
    return deleted


def _list_afresh(checkpoint: Path) -> None:
    """Merge the remote's listing of ``checkpoint`` first: the shards other nodes drained since
    this node listed it are deleted with it (left behind, they would bring the step back)."""
    try:
        client.refresh_listings(checkpoint)
    except client.ClientError as exc:  # no daemon to ask (or not allowed): what is listed goes
        log.warning("event=checkpoint_listing_not_refreshed path=%s error=%s", checkpoint, exc)

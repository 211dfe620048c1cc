"""Keep the last N checkpoints, safely: an older checkpoint is deleted only once N newer
ones are durable on the remote.

A trainer that deletes checkpoint N-1 as soon as it has written N (Lightning's
``save_top_k``, Hugging Face's ``save_total_limit``) is left with nothing safe if
the node dies before N drains: N-1 is gone from the remote, N never got there.
No torch import (the framework callbacks build on this).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

from . import client
from .config import DEFAULT_COMMIT_MARKERS, is_commit_marker

log = logging.getLogger("burstfs.retention")


def checkpoints_in(directory: Path, pattern: str) -> list[Path]:
    """The entries of ``directory`` matching ``pattern`` (files or directories), oldest first:
    by the numbers in their names (step, epoch: the same on every node), then by mtime.  Not by
    mtime alone: a directory's mtime is this node's, and moves when a listing brings in or drops
    what other nodes wrote or deleted there (a step pruned elsewhere looked like the newest)."""
    found = [(_numbers(path.name), path.stat().st_mtime, path.name, path) for path in directory.glob(pattern)]
    return [path for *_, path in sorted(found)]


def _numbers(name: str) -> tuple[int, ...]:
    return tuple(int(digits) for digits in re.findall(r"\d+", name))


def prune_checkpoints(checkpoints: Sequence[Path], keep_last: int) -> list[Path]:
    """Delete every checkpoint older than the newest ``keep_last`` complete, durable ones.

    ``checkpoints`` is oldest first; a checkpoint is a file or a directory (DCP).
    Newer ones that are not durable yet are kept and do not count; nor does a directory
    that holds no file (a step pruned on another node, as listed here), nor one without a
    commit marker (``--commit-marker``: DCP's ``.metadata``...) when the others have one
    (a step abandoned before its marker).  Returns what was deleted.
    """
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: the newest durable checkpoint is never deleted")
    patterns = markers = _commit_markers(checkpoints)
    if not any(_holds_marker(checkpoint, markers) for checkpoint in checkpoints):
        markers = ()  # checkpoints without markers (torch.save files, plain directories)
    durable = 0
    deleted: list[Path] = []
    for checkpoint in reversed(checkpoints):
        if durable >= keep_last:
            if checkpoint.is_dir():
                if not _list_afresh(checkpoint):
                    continue  # kept this time: the next prune tries again
                _remove_markers(checkpoint, patterns)
                shutil.rmtree(checkpoint)
            else:
                checkpoint.unlink()
            deleted.append(checkpoint)
            log.info("event=checkpoint_pruned path=%s kept_durable=%d", checkpoint, durable)
            continue
        if not _complete(checkpoint, markers):
            log.info("event=checkpoint_not_complete path=%s note=kept, not counted", checkpoint)
            continue
        try:
            durable += client.is_durable(checkpoint)
        except client.DrainFailedError as exc:  # kept, and not counted: burstfs-admin retry may still save it
            log.warning("event=checkpoint_not_durable path=%s error=%s", checkpoint, exc)
    return deleted


def _commit_markers(checkpoints: Sequence[Path]) -> tuple[str, ...]:
    """The commit-marker patterns of the mount ``checkpoints`` are in (the defaults where it
    cannot be asked)."""
    if not checkpoints:
        return ()
    try:
        patterns = client.status(checkpoints[0]).document.get("commit_markers")
    except client.AccessDeniedError:  # a job's user under a mount root made: ask through the mount
        patterns = client.commit_markers(checkpoints[0].parent)
    except client.ClientError:
        patterns = None
    return tuple(patterns) if patterns is not None else DEFAULT_COMMIT_MARKERS


def _holds_marker(checkpoint: Path, markers: tuple[str, ...]) -> bool:
    return checkpoint.is_dir() and any(is_commit_marker(entry.name, markers) for entry in checkpoint.iterdir())


def _complete(checkpoint: Path, markers: tuple[str, ...]) -> bool:
    """A file, or a directory holding a file (and a commit marker, where ``markers``)."""
    if not checkpoint.is_dir():
        return True
    if markers and not _holds_marker(checkpoint, markers):
        return False
    return any(files for _, _, files in os.walk(checkpoint))


def _remove_markers(checkpoint: Path, patterns: tuple[str, ...]) -> None:
    """Unlink the commit markers under ``checkpoint`` before its other files: the remote deletes
    go in that order, so a crash part-way through leaves no marker over a torn checkpoint."""
    for directory, _, files in os.walk(checkpoint):
        for name in files:
            if is_commit_marker(name, patterns):
                (Path(directory) / name).unlink()


def _list_afresh(checkpoint: Path) -> bool:
    """Merge the remote's listing of ``checkpoint`` first: the shards other nodes drained since
    this node listed it are deleted with it (left behind, they would bring the step back).
    False (the checkpoint stays for now) when the remote could not be listed."""
    try:
        client.refresh_listings(checkpoint)
    except (client.NotAMountError, client.DaemonGoneError) as exc:  # no daemon: what is listed goes
        log.warning("event=checkpoint_listing_not_refreshed path=%s error=%s", checkpoint, exc)
    except client.ClientError as exc:
        log.warning("event=checkpoint_kept path=%s reason=%r", checkpoint, f"not listed afresh: {exc}")
        return False
    return True

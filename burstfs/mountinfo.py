"""Finding mounts: which cache dir serves a mount point, and whether a path is mounted.

The daemon mounts with ``fsname=burstfs:<cache dir>``, so ``/proc/self/mountinfo``
alone tells ``burstfs unmount`` and ``burstfs-admin`` where the control socket is.
"""

from __future__ import annotations

import os
from pathlib import Path

FSNAME_PREFIX = "burstfs:"


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def mounts() -> list[tuple[Path, str, str]]:
    """(mount point, fs type, source) of every mount this process can see."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype, source = right.split()[:2]
            found.append((Path(_unescape(fields[4])), fstype, _unescape(source)))
    return found


def is_mounted(path: Path) -> bool:
    real = Path(os.path.realpath(path))
    return any(point == real for point, _, _ in mounts())


def find_burstfs_mount(path: Path) -> tuple[Path, Path] | None:
    """The burstfs mount containing ``path``: (mount point, cache dir), or None."""
    real = Path(os.path.realpath(path))
    best: tuple[Path, Path] | None = None
    for point, fstype, source in mounts():
        if not fstype.startswith("fuse") or not source.startswith(FSNAME_PREFIX):
            continue
        if real == point or point in real.parents:
            if best is None or len(str(point)) > len(str(best[0])):
                best = (point, Path(source[len(FSNAME_PREFIX):]))
    return best

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


def mounts() -> list[tuple[Path, str, str, str]]:
    """(mount point, fs type, source, "major:minor") of every mount this process can see."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            fstype, source = right.split()[:2]
            found.append((Path(_unescape(fields[4])), fstype, _unescape(source), fields[2]))
    return found


def device_of(mountpoint: Path) -> str | None:
    """ "major:minor" of the file system mounted at ``mountpoint`` (a resolved path).

    Never stats the path: that would ask the FUSE daemon, which may be this very
    process, before it serves requests.
    """
    devices = [device for point, _, _, device in mounts() if point == mountpoint]
    return devices[-1] if devices else None


def find_burstfs_mount(path: Path) -> tuple[Path, Path] | None:
    """The burstfs mount containing ``path``: (mount point, cache dir), or None."""
    real = Path(os.path.realpath(path))
    best: tuple[Path, Path] | None = None
    for point, fstype, source, _ in mounts():
        if not fstype.startswith("fuse") or not source.startswith(FSNAME_PREFIX):
            continue
        if (real == point or point in real.parents) and (best is None or len(str(point)) > len(str(best[0]))):
            best = (point, Path(source[len(FSNAME_PREFIX) :]))
    return best

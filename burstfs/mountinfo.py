"""Finding mounts: which cache dir serves a mount point, and whether a path is mounted.

The daemon mounts with ``fsname=burstfs:<cache dir>``, so ``/proc/self/mountinfo``
alone tells ``burstfs unmount`` and ``burstfs-admin`` where the control socket is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click

FSNAME_PREFIX = "burstfs:"


class UnexaminedPath(click.Path):
    """A command-line path taken as named: click's Path stats every value, and a stat of a
    mount whose daemon stopped answering (SIGSTOP, a hang) never returns, so ``burstfs
    unmount`` and ``burstfs-admin wait`` hung on the very mount they were meant to help with."""

    def __init__(self) -> None:
        super().__init__(path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Path:
        return value if isinstance(value, Path) else Path(os.fsdecode(value))


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
    """The burstfs mount containing ``path``: (mount point, cache dir), or None.

    A mount point named as the kernel lists it is found without a look at it: resolving its
    links would ask its daemon for the root's attributes, and a daemon that stopped
    answering (SIGSTOP, a hang) would hang ``burstfs unmount`` for good."""
    burstfs_mounts = [
        (point, Path(source[len(FSNAME_PREFIX) :]))
        for point, fstype, source, _ in mounts()
        if fstype.startswith("fuse") and source.startswith(FSNAME_PREFIX)
    ]
    named = Path(os.path.abspath(path))
    for point, cache in reversed(burstfs_mounts):  # the latest mount on a point is the one seen
        if point == named:
            return point, cache
    real = Path(os.path.realpath(path))
    best: tuple[Path, Path] | None = None
    for point, cache in burstfs_mounts:
        if (real == point or point in real.parents) and (best is None or len(str(point)) > len(str(best[0]))):
            best = (point, cache)
    return best

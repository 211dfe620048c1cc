"""Small blocking file I/O helpers shared by the tier, the objects layer and the file remote.

``os.pread``/``os.pwrite`` may transfer fewer bytes than asked (signals, network
file systems); these loop until done, so callers can treat a short result as
end of file and nothing else.
"""

from __future__ import annotations

import os


def pread_full(fd: int, length: int, offset: int) -> bytes:
    """Read ``length`` bytes at ``offset`` (fewer only at end of file)."""
    chunks = []
    while length > 0:
        chunk = os.pread(fd, length, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
        length -= len(chunk)
    return b"".join(chunks)


def pwrite_full(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset``."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def copy_fd(src: int, dst: int) -> int:
    """Copy all of ``src`` into ``dst`` from offset 0; returns the bytes copied.

    Uses ``copy_file_range`` (reflinks/server-side copy where the file system
    can), falling back to a plain read/write loop where the kernel refuses it.
    """
    offset = 0
    try:
        while True:
            n = os.copy_file_range(src, dst, 64 << 20, offset, offset)
            if n == 0:
                return offset
            offset += n
    except OSError:
        if offset:
            raise  # part copied by the kernel: a real error, not "unsupported"
    while True:
        data = pread_full(src, 8 << 20, offset)
        if not data:
            return offset
        pwrite_full(dst, data, offset)
        offset += len(data)

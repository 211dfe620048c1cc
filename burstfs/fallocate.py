"""fallocate(2) through the mount.

pyfuse3 3.5 has no FALLOCATE handler, so the ``_passthrough`` shim's read hook
turns each FALLOCATE request into a setxattr of :data:`XATTR_NAME` on the same
inode whose value is :data:`TOKEN` followed by the request (fh, offset, length,
mode); see ``burstfs/_passthrough.c``.  The token is random per daemon: a
setxattr(2) of that name from a user is refused, never taken for a fallocate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hmac
import os
import secrets
import struct

XATTR_NAME = b"burstfs.fallocate"
TOKEN = secrets.token_bytes(16)
#: The modes served; punch hole, zero range, collapse and insert range are EOPNOTSUPP.
FALLOC_FL_KEEP_SIZE = 0x01
_REQUEST = struct.Struct("=QQQII")  # struct fuse_fallocate_in: fh, offset, length, mode, padding

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def parse_request(value: bytes) -> tuple[int, int, int, int] | None:
    """``(fh, offset, length, mode)`` of a FALLOCATE the shim forwarded; None if ``value``
    does not carry this daemon's token (a user's setxattr of the reserved name)."""
    if len(value) != len(TOKEN) + _REQUEST.size or not hmac.compare_digest(value[: len(TOKEN)], TOKEN):
        return None
    fh, offset, length, mode, _ = _REQUEST.unpack_from(value, len(TOKEN))
    return fh, offset, length, mode


def allocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2) on the tier's data file (blocking: run it in a worker thread).

    A tier file system without fallocate gets the C library's emulation for the
    default mode (zeros written into each block); KEEP_SIZE then fails with its errno.
    """
    if _libc.fallocate(fd, mode, offset, length) == 0:
        return
    code = ctypes.get_errno()
    if code == errno.EOPNOTSUPP and mode == 0:
        os.posix_fallocate(fd, offset, length)
        return
    raise OSError(code, os.strerror(code))

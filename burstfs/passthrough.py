"""FUSE passthrough: file bytes go from the writer straight to the local tier.

With passthrough the kernel serves read, write and mmap of an open file from a
backing file (our ``CACHE/data/<ino>``) and the daemon sees only open, flush,
release and metadata requests: a checkpoint write runs at the local tier's own
speed.  It needs Linux 6.9+, CAP_SYS_ADMIN (the backing-file ioctl is
privileged) and the ``burstfs._passthrough`` shim, which must be loaded before
pyfuse3 because it interposes ``fuse_session_mount`` (see ``_passthrough.c``).
Without any of these the mount falls back to the writeback-cache data path.
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import logging
import os
import struct
import sys
from types import ModuleType

from . import fallocate

log = logging.getLogger("burstfs.passthrough")

# _IOW(229, 1, struct fuse_backing_map) and _IOW(229, 2, uint32_t), include/uapi/linux/fuse.h
_BACKING_OPEN = 0x4010E501
_BACKING_CLOSE = 0x4004E502
# A backing file on an overlay file system (a container's root) has stack depth 1;
# 2 is the kernel's maximum, so burstfs can stack on either.
MAX_STACK_DEPTH = 2
_CAP_SYS_ADMIN = 21


def _load_shim() -> tuple[ModuleType | None, str]:
    if "pyfuse3" in sys.modules:
        return None, "pyfuse3 was imported before the passthrough shim"
    flags = sys.getdlopenflags()
    sys.setdlopenflags(flags | os.RTLD_GLOBAL)  # our fuse_session_mount must win over libfuse's
    try:
        return importlib.import_module("burstfs._passthrough"), ""
    except ImportError as exc:
        return None, f"passthrough shim not built ({exc})"
    finally:
        sys.setdlopenflags(flags)


_shim, _shim_problem = _load_shim()


def _has_cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def unavailable_reason() -> str:
    """Why passthrough cannot be asked for in this process ('' when it can)."""
    if _shim is None:
        return _shim_problem
    if not _has_cap_sys_admin():
        return "the daemon lacks CAP_SYS_ADMIN (run it as root)"
    return ""


def request(enabled: bool) -> None:
    """What to ask for in the INIT reply of the next mount (call before ``pyfuse3.init``):
    passthrough if ``enabled``, and always FUSE_HANDLE_KILLPRIV_V2 (see ``_passthrough.c``;
    the core keeps no setuid/setgid bits on files, so there is never a privilege to kill).
    FALLOCATE requests reach the daemon on either data path (``burstfs.fallocate``), unless
    the shim was built before it could forward them (then fallocate(2) stays EOPNOTSUPP).
    A GETXATTR of a name outside ``user.*`` (burstfs stores no other) is answered ENODATA by
    the shim itself: the kernel asks for ``security.capability`` before each file's first write."""
    if _shim is not None:
        _shim.request(MAX_STACK_DEPTH if enabled else 0, True)
        if hasattr(_shim, "enable_fallocate"):
            _shim.enable_fallocate(fallocate.TOKEN)
        else:
            log.warning("event=fallocate state=off reason=the passthrough shim predates it: rebuild it")
        if hasattr(_shim, "answer_foreign_xattrs"):
            _shim.answer_foreign_xattrs()


def foreign_xattrs_answered() -> int:
    """GETXATTR requests the shim answered without the daemon (see :func:`request`)."""
    if _shim is None:
        return 0
    return int(_shim.state().get("foreign_xattrs_answered", 0))


def kernel_offers() -> bool:
    """The kernel's INIT request offered passthrough (known once INIT was read)."""
    return _shim is not None and bool(_shim.state()["kernel_offers"])


class BackingFiles:
    """Registers local-tier files with the kernel as passthrough backing files."""

    @staticmethod
    def _fuse_fd() -> int:
        """/dev/fuse of the mount (known once pyfuse3 has mounted)."""
        assert _shim is not None
        fd = int(_shim.state()["fuse_fd"])
        if fd < 0:
            raise OSError(errno.ENODEV, "the passthrough shim did not see the mount")
        return fd

    def open(self, fd: int) -> int:
        """A backing id for ``fd``; raises OSError when the kernel refuses it."""
        arg = bytearray(struct.pack("=iIQ", fd, 0, 0))
        return fcntl.ioctl(self._fuse_fd(), _BACKING_OPEN, arg, True)

    def close(self, backing_id: int) -> None:
        arg = bytearray(struct.pack("=I", backing_id))
        fcntl.ioctl(self._fuse_fd(), _BACKING_CLOSE, arg, True)

    @staticmethod
    def attach(fh: int, backing_id: int) -> None:
        """The reply to the open that made ``fh`` will pass through to ``backing_id``."""
        assert _shim is not None
        _shim.attach(fh, backing_id)

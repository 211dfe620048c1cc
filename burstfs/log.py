"""Logging set-up: one line per event, ``key=value`` fields, to the cache dir and stderr."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def setup_logging(level: str, *, log_file: Path | None = None, stderr: bool = True) -> None:
    """Configure the ``burstfs`` loggers (idempotent: replaces earlier handlers)."""
    root = logging.getLogger("burstfs")
    root.setLevel(level.upper())
    root.propagate = False
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(FORMAT)
    if log_file is not None:
        # 0600 whatever the umask, and never written through a link planted at its name.
        fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
        finally:
            os.close(fd)
        # Reopened when moved or removed (logrotate, with or without its SIGHUP).
        file_handler = logging.handlers.WatchedFileHandler(log_file)
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    if stderr:
        stream = logging.StreamHandler(sys.stderr)
        stream.setFormatter(formatter)
        root.addHandler(stream)
    # Libraries that could log request details (and so credentials) stay quiet.
    for noisy in ("botocore", "aiobotocore", "urllib3", "aiohttp"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def reopen_log_file() -> None:
    """Reopen ``burstfs.log`` if it was rotated away (SIGHUP)."""
    for handler in logging.getLogger("burstfs").handlers:
        if isinstance(handler, logging.handlers.WatchedFileHandler):
            handler.reopenIfNeeded()

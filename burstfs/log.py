"""Logging set-up: one line per event, ``key=value`` fields, to the cache dir and stderr."""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

#: Control characters (C0, DEL, C1 with NEL) and Unicode's line and paragraph separators, as escapes.
_ESCAPES = {code: f"\\x{code:02x}" for code in (*range(0x20), *range(0x7F, 0xA0))} | {
    ord("\n"): "\\n",
    ord("\r"): "\\r",
    ord("\t"): "\\t",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def escape_controls(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``): a file name with a newline
    cannot start a line of its own, forged to look like an event, in the log or a listing."""
    return text.translate(_ESCAPES)


class OneLineFormatter(logging.Formatter):
    """One line per event, whatever its fields hold (file names are anyone's to choose).  A
    traceback, or a multi-line ``detail`` (``log.warning(..., extra={"detail": stacks})``),
    follows on lines of its own, each indented: no line but an event's starts at the left
    margin."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.getMessage())
        record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        details = [str(getattr(record, "detail", ""))]
        if record.exc_info:
            details.append(self.formatException(record.exc_info))
        if record.stack_info:
            details.append(self.formatStack(record.stack_info))
        for detail in filter(None, details):
            text += "".join(f"\n    {escape_controls(line)}" for line in detail.split("\n"))
        return text


def setup_logging(level: str, *, log_file: Path | None = None, stderr: bool = True) -> None:
    """Configure the ``burstfs`` loggers (idempotent: replaces earlier handlers)."""
    root = logging.getLogger("burstfs")
    root.setLevel(level.upper())
    root.propagate = False
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    formatter = OneLineFormatter(FORMAT)
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

"""systemd's notify protocol (sd_notify(3)) in a few lines, without libsystemd.

Under ``Type=notify`` systemd waits for ``READY=1`` before it counts the unit as
started, so units ordered after ``burstfs@X.service`` (a trainer, a Slurm job)
start only once the mount is live.  ``STOPPING=1`` says the mount is going
away; ``WATCHDOG=1`` every half ``WatchdogSec=`` says the daemon's trio loop
still runs tasks (a handler that blocks the loop stops the pings, and systemd
restarts the unit; the next start drains what is staged).

Without ``$NOTIFY_SOCKET`` (a shell, Kubernetes, Slurm) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import trio

log = logging.getLogger("burstfs.sdnotify")


class SystemdNotifier:
    """Datagrams to ``$NOTIFY_SOCKET``: a path, or ``@name`` in the abstract namespace."""

    def __init__(self, address: str | None, watchdog_usec: int | None) -> None:
        self.address = address
        self.watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> SystemdNotifier:
        """Read the variables systemd sets.  ``WATCHDOG_PID`` names the process the
        watchdog is for; another process (e.g. a child of the unit's shell) does not ping."""
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        watchdog = int(usec) if usec.isdigit() and int(usec) > 0 and pid in ("", str(os.getpid())) else None
        return cls(environ.get("NOTIFY_SOCKET") or None, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> None:
        """Send ``KEY=VALUE`` fields in one datagram; a lost systemd is logged, never fatal."""
        if self.address is None:
            return
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(fields).encode(), target)
        except OSError as exc:
            log.warning("event=sd_notify_failed socket=%s error=%s", self.address, exc)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    async def keep_alive(self) -> None:
        """Ping the watchdog at half its interval while the trio loop runs this task."""
        if self.address is None or self.watchdog_usec is None:
            return
        period = self.watchdog_usec / 2e6
        log.info("event=watchdog period_s=%.3f", period)
        while True:
            self.send("WATCHDOG=1")
            await trio.sleep(period)

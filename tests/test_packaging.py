"""packaging/: the systemd unit (verified by systemd-analyze, its notify protocol
and its stop sequence against real mounts).

The notify tests play systemd: an AF_UNIX datagram socket in a temp dir is the
``$NOTIFY_SOCKET`` of a ``burstfs mount --foreground``, as under ``Type=notify``.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, FUSE_OK, MountedFS, burstfs, file_state, is_mounted

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "packaging" / "burstfs@.service"
INSTALLED_BIN = "/usr/local/bin/burstfs"  # where the unit expects the CLI (pip install into /usr/local)

# Each of these puts the service in a mount namespace of its own: the FUSE mount
# would not be seen by the trainers on the host.
NAMESPACE_OPTIONS = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts", "ReadWritePaths",
    "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths",
    "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
    "ProtectProc", "ProcSubset", "MountFlags", "RootDirectory", "RootImage", "PrivateNetwork",
}  # fmt: skip


def unit_service_section() -> dict[str, list[str]]:
    """The [Service] keys of the unit, each with all its values (systemd keys repeat)."""
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",),
                                       comment_prefixes=("#", ";"), dict_type=_MultiDict)  # fmt: skip
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(UNIT)
    return {key: value.split("\n") for key, value in parser["Service"].items()}


class _MultiDict(dict):  # type: ignore[type-arg]
    """configparser storage that keeps every value of a repeated key, one per line."""

    def __setitem__(self, key: str, value: object) -> None:
        if isinstance(value, list) and key in self and isinstance(self[key], list):
            self[key].extend(value)
        else:
            super().__setitem__(key, value)


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    if not (BIN / "burstfs").exists():
        pytest.skip("no burstfs CLI in this environment")
    # The unit as installed on a node where the CLI lives in this environment.
    instance = tmp_path / "burstfs@ckpt.service"
    instance.write_text(UNIT.read_text().replace(INSTALLED_BIN, str(BIN / "burstfs")))
    result = subprocess.run(["systemd-analyze", "verify", str(instance)], capture_output=True, text=True, timeout=60)
    problems = [line for line in (result.stdout + result.stderr).splitlines() if instance.name in line]
    assert result.returncode == 0 and not problems, result.stdout + result.stderr
    # A unit with a bad value is reported: the check above can fail.
    broken = tmp_path / "broken@ckpt.service"
    broken.write_text(instance.read_text().replace("Type=notify", "Type=notifyy"))
    result = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "Failed to parse service type" in result.stdout + result.stderr


def test_unit_is_notify_with_watchdog_and_no_private_mount_namespace() -> None:
    service = unit_service_section()
    assert service["Type"] == ["notify"]
    assert int(service["WatchdogSec"][0]) > 0
    assert not NAMESPACE_OPTIONS & set(service), "the mount would be invisible outside the service"
    assert service["DeviceAllow"] == ["/dev/fuse rw"]
    assert "CAP_SYS_ADMIN" in service["CapabilityBoundingSet"][0].split()
    drain_wait = int(next(v for v in service["Environment"] if v.startswith("BURSTFS_STOP_DRAIN_TIMEOUT="))
                     .split("=", 1)[1])  # fmt: skip
    assert int(service["TimeoutStopSec"][0]) > drain_wait + 30, "systemd would kill the drain wait"


# -- the notify protocol against a real mount --------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket playing systemd's notify socket."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(30)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def receive(sock: socket.socket) -> dict[str, str]:
    fields = sock.recv(4096).decode().split("\n")
    return dict(field.split("=", 1) for field in fields if field)


def start_foreground(fs: MountedFS, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(BIN / "burstfs"), "mount", str(fs.path), "--cache", str(fs.cache), "--remote", fs.remote_url,
         "--foreground", *args],
        env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


needs_fuse = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")


@needs_fuse
@pytest.mark.fuse
def test_notify_ready_when_live_watchdog_pings_and_stopping_at_unmount(
    mounted_factory: type[MountedFS], notify_socket: tuple[socket.socket, str]
) -> None:
    sock, address = notify_socket
    fs = mounted_factory()
    daemon = start_foreground(fs, {"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "200000"})
    try:
        ready = receive(sock)
        assert ready.get("READY") == "1", ready
        assert ready["MAINPID"] == str(daemon.pid)
        assert is_mounted(fs.path)  # READY=1 means the mount is live: it serves a write at once
        (fs.path / "after-ready").write_bytes(b"x" * 1000)
        pings = 0
        while pings < 3:
            message = receive(sock)
            assert set(message) == {"WATCHDOG"}, message
            pings += 1
        burstfs("unmount", str(fs.path))
        while "STOPPING" not in (message := receive(sock)):
            assert set(message) == {"WATCHDOG"}, message
        assert message["STOPPING"] == "1"
        assert daemon.wait(timeout=60) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


@needs_fuse
@pytest.mark.fuse
def test_notify_abstract_socket_and_no_watchdog_without_watchdog_usec(
    mounted_factory: type[MountedFS], tmp_path: Path
) -> None:
    name = f"burstfs-test-{os.getpid()}-{tmp_path.name}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(30)
    fs = mounted_factory()
    daemon = start_foreground(fs, {"NOTIFY_SOCKET": "@" + name})
    try:
        assert receive(sock).get("READY") == "1"
        burstfs("unmount", str(fs.path))
        message = receive(sock)  # the next message is STOPPING: no watchdog pings in between
        assert message.get("STOPPING") == "1", message
        assert daemon.wait(timeout=60) == 0
    finally:
        sock.close()
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def unit_command(key: str, env: dict[str, str]) -> list[str]:
    """The unit's ExecStop/ExecStart line as systemd runs it: ``-`` prefix dropped,
    ``${VAR}`` and ``$VAR`` expanded from ``env``, the CLI of this environment."""
    line = unit_service_section()[key][0].lstrip("-")
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    words = [word for part in shlex.split(line) for word in
             (env[part[1:]].split() if part.startswith("$") else [part])]  # fmt: skip
    return [str(BIN / "burstfs") if w == INSTALLED_BIN else w for w in words]


@needs_fuse
@pytest.mark.fuse
def test_unit_stop_waits_for_the_drain_then_leaves_undrained_files_staged(
    mounted_factory: type[MountedFS], notify_socket: tuple[socket.socket, str]
) -> None:
    """The unit's stop sequence: its ExecStop waits (bounded) for the drain and fails,
    systemd's SIGTERM unmounts; the staged file drains at the next start."""
    sock, address = notify_socket
    fs = mounted_factory()
    env = {"BURSTFS_MOUNTPOINT": str(fs.path), "BURSTFS_CACHE": str(fs.cache), "BURSTFS_REMOTE": fs.remote_url,
           "BURSTFS_OPTS": "--drain-delay 3600", "BURSTFS_STOP_DRAIN_TIMEOUT": "1"}  # fmt: skip
    start = unit_command("ExecStart", env)
    assert start[:2] == [str(BIN / "burstfs"), "mount"] and "--foreground" in start
    daemon = subprocess.Popen(start, env={**os.environ, "NOTIFY_SOCKET": address},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert receive(sock).get("READY") == "1"
        (fs.path / "step1").mkdir()
        data = os.urandom(1 << 20)
        (fs.path / "step1" / "model.pt").write_bytes(data)
        stop = subprocess.run(unit_command("ExecStop", env), capture_output=True, text=True, timeout=120)
        assert stop.returncode == 1 and "not durable" in stop.stderr, stop.stderr  # the bounded wait ran out
        assert is_mounted(fs.path)
        daemon.send_signal(signal.SIGTERM)  # what systemd does next
        assert receive(sock).get("STOPPING") == "1"
        assert daemon.wait(timeout=60) == 0
        assert not is_mounted(fs.path)
        assert file_state(fs.cache, "model.pt") == "staged"
        assert not (fs.remote_dir / "step1" / "model.pt").exists()
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    fs.mount("--drain-delay", "0")  # the next start drains it
    fs.unmount("--wait", "--wait-timeout", "60")
    assert (fs.remote_dir / "step1" / "model.pt").read_bytes() == data

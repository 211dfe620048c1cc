"""packaging/: the systemd unit (verified by systemd-analyze, its notify protocol
and its stop sequence against real mounts).

The notify tests play systemd: an AF_UNIX datagram socket in a temp dir is the
``$NOTIFY_SOCKET`` of a ``burstfs mount --foreground``, as under ``Type=notify``.
"""

from __future__ import annotations

import configparser
import copy
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, FUSE_OK, MountedFS, burstfs, file_state, is_mounted, wait_for

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


# -- Kubernetes ----------------------------------------------------------------------------------

DAEMONSET = REPO / "packaging" / "kubernetes-daemonset.yaml"
SIDECAR = REPO / "packaging" / "kubernetes-sidecar.yaml"


def manifests(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def burstfs_container(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, the burstfs container) of the DaemonSet or the sidecar pod."""
    for doc in manifests(path):
        spec = doc["spec"]["template"]["spec"] if doc["kind"] == "DaemonSet" else doc["spec"] if doc["kind"] == "Pod" else None
        if spec is not None:
            containers = spec.get("initContainers", []) + spec["containers"]
            return spec, next(c for c in containers if c["name"] == "burstfs")
    raise AssertionError(f"no pod spec in {path}")


@pytest.mark.parametrize("path", [DAEMONSET, SIDECAR], ids=["daemonset", "sidecar"])
def test_kubernetes_manifests_validate_against_the_api_schema(path: Path) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    version = kubernetes_validate.latest_version()
    for doc in manifests(path):
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any schema error
    broken = copy.deepcopy(doc)  # the DaemonSet or the Pod
    pod_spec = broken["spec"]["template"]["spec"] if broken["kind"] == "DaemonSet" else broken["spec"]
    pod_spec["terminationGracePeriodSeconds"] = "ten minutes"
    with pytest.raises(kubernetes_validate.ValidationError):  # the check above can fail
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("path", [DAEMONSET, SIDECAR], ids=["daemonset", "sidecar"])
def test_kubernetes_fields_that_matter(path: Path) -> None:
    spec, container = burstfs_container(path)
    assert container["securityContext"]["privileged"] is True  # /dev/fuse, mount(2)
    mount_volume = next(m for m in container["volumeMounts"] if m.get("mountPropagation") == "Bidirectional")
    command = " ".join(container["command"])
    mountpoint = mount_volume["mountPath"]
    assert f"burstfs mount {mountpoint} --cache" in command and "--foreground" in command
    cache_mount = next(m for m in container["volumeMounts"] if re.search(rf"--cache {m['mountPath']}\b", command))
    cache_volume = next(v for v in spec["volumes"] if v["name"] == cache_mount["name"])
    assert "hostPath" in cache_volume or "persistentVolumeClaim" in cache_volume  # survives the pod
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:3] == ["burstfs", "unmount", "--wait"] and pre_stop[-1] == mountpoint
    drain_wait = int(pre_stop[pre_stop.index("--wait-timeout") + 1])
    assert spec["terminationGracePeriodSeconds"] >= drain_wait + 30, "the kubelet would kill the drain wait"
    assert "burstfs-admin status" in " ".join(container["readinessProbe"]["exec"]["command"])
    metrics_port = int(re.search(r"--metrics-addr \S+:(\d+)", command).group(1))  # type: ignore[union-attr]
    assert {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"} in container["ports"]
    annotations = next(doc for doc in manifests(path) if doc["kind"] in ("DaemonSet", "Pod"))
    annotations = (annotations["spec"]["template"]["metadata"] if annotations["kind"] == "DaemonSet"
                   else annotations["metadata"])["annotations"]  # fmt: skip
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == metrics_port


def on_this_node(text: str, fs: MountedFS, port: int) -> str:
    """A manifest's shell command with the test mount's paths and a loopback metrics port."""
    text = text.replace("/mnt/burstfs", str(fs.path)).replace("0.0.0.0:9400", f"127.0.0.1:{port}")
    return re.sub(r"(?<=--cache )/cache\b", str(fs.cache), text)


@needs_fuse
@pytest.mark.fuse
def test_daemonset_commands_start_probe_restart_and_stop_a_real_mount(mounted_factory: type[MountedFS]) -> None:
    """The DaemonSet's own start command, readiness probe and preStop hook, run here:
    ready when live, not ready when the daemon died, a restart over the dead mount,
    and a stop that leaves the checkpoint durable."""
    _, container = burstfs_container(DAEMONSET)
    fs = mounted_factory()
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    start = [on_this_node(word, fs, port) for word in container["command"]]
    ready = [on_this_node(word, fs, port) for word in container["readinessProbe"]["exec"]["command"]]
    pre_stop = [on_this_node(word, fs, port) for word in container["lifecycle"]["preStop"]["exec"]["command"]]
    env = {**os.environ, "BURSTFS_REMOTE": fs.remote_url, "BURSTFS_OPTS": "--drain-delay 0",
           "PATH": f"{BIN}:{os.environ['PATH']}"}  # fmt: skip

    def probe() -> bool:
        return subprocess.run(ready, env=env, capture_output=True, timeout=60).returncode == 0

    assert not probe()  # nothing mounted yet
    daemon = subprocess.Popen(start, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(probe, what="the readiness probe")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "burstfs_" in text  # the port the Prometheus annotations name
        os.kill(fs.daemon_pid(), signal.SIGKILL)  # the container dies; its FUSE mount stays, dead
        daemon.wait(timeout=30)
        assert is_mounted(fs.path) and not probe()
        daemon = subprocess.Popen(start, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(probe, what="the restarted container to be ready over the dead mount")
        (fs.path / "step_1").mkdir()
        (fs.path / "step_1" / "model.pt").write_bytes(b"weights" * 1000)
        stop = subprocess.run(pre_stop, env=env, capture_output=True, text=True, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert daemon.wait(timeout=60) == 0
        assert (fs.remote_dir / "step_1" / "model.pt").read_bytes() == b"weights" * 1000
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()

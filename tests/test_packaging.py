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
import tomllib
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
    "ProtectSystem",
    "ProtectHome",
    "PrivateTmp",
    "PrivateDevices",
    "PrivateMounts",
    "ReadWritePaths",
    "ReadOnlyPaths",
    "InaccessiblePaths",
    "TemporaryFileSystem",
    "BindPaths",
    "BindReadOnlyPaths",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "ProtectControlGroups",
    "ProtectProc",
    "ProcSubset",
    "MountFlags",
    "RootDirectory",
    "RootImage",
    "PrivateNetwork",
}


def unit_service_section() -> dict[str, list[str]]:
    """The [Service] keys of the unit, each with all its values (systemd keys repeat)."""
    parser = configparser.ConfigParser(
        strict=False, interpolation=None, delimiters=("=",), comment_prefixes=("#", ";"), dict_type=_MultiDict
    )
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
    drain_wait = int(
        next(v for v in service["Environment"] if v.startswith("BURSTFS_STOP_DRAIN_TIMEOUT=")).split("=", 1)[1]
    )
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
        [
            str(BIN / "burstfs"),
            "mount",
            str(fs.path),
            "--cache",
            str(fs.cache),
            "--remote",
            fs.remote_url,
            "--foreground",
            *args,
        ],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


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


def unit_command(key: str, env: dict[str, str], config: Path) -> list[str]:
    """The unit's ExecStart/ExecStop/ExecStopPost line as systemd runs it for instance
    "ckpt": ``-`` prefix dropped, ``${VAR}`` expanded from ``env``, ``/etc/burstfs/%i.toml``
    at ``config``, the CLI of this environment."""
    line = unit_service_section()[key][0].lstrip("-").replace("/etc/burstfs/%i.toml", str(config))
    line = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], line)
    return [str(BIN / "burstfs") if word == INSTALLED_BIN else word for word in shlex.split(line)]


def instance_config(fs: MountedFS, *extra: str) -> Path:
    """/etc/burstfs/ckpt.toml for the test mount's paths."""
    config = fs.root / "ckpt.toml"
    config.write_text(
        "\n".join([f'mountpoint = "{fs.path}"', f'cache = "{fs.cache}"', f'remote = "{fs.remote_url}"', *extra]) + "\n"
    )
    return config


@needs_fuse
@pytest.mark.fuse
def test_unit_stop_waits_for_the_drain_then_leaves_undrained_files_staged(
    mounted_factory: type[MountedFS], notify_socket: tuple[socket.socket, str]
) -> None:
    """The unit's stop sequence: its ExecStop waits (bounded) for the drain and fails,
    systemd's SIGTERM unmounts; the staged file drains at the next start."""
    sock, address = notify_socket
    fs = mounted_factory()
    config = instance_config(fs, "drain-delay = 3600")
    env = {"BURSTFS_STOP_DRAIN_TIMEOUT": "1"}
    start = unit_command("ExecStart", env, config)
    assert start[:2] == [str(BIN / "burstfs"), "mount"] and "--foreground" in start
    daemon = subprocess.Popen(
        start,
        env={**os.environ, "NOTIFY_SOCKET": address},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert receive(sock).get("READY") == "1"
        (fs.path / "step1").mkdir()
        data = os.urandom(1 << 20)
        (fs.path / "step1" / "model.pt").write_bytes(data)
        stop = subprocess.run(unit_command("ExecStop", env, config), capture_output=True, text=True, timeout=120)
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


@needs_fuse
@pytest.mark.fuse
def test_unit_restarts_over_the_dead_mount_of_a_crash(
    mounted_factory: type[MountedFS], notify_socket: tuple[socket.socket, str]
) -> None:
    """kill -9 (or a watchdog kill) leaves a dead FUSE mount; the unit's ExecStopPost
    removes it, so Restart=on-failure mounts again."""
    sock, address = notify_socket
    fs = mounted_factory()
    config = instance_config(fs)
    start = unit_command("ExecStart", {}, config)
    daemons = [
        subprocess.Popen(
            start, env={**os.environ, "NOTIFY_SOCKET": address}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    ]
    try:
        assert receive(sock).get("READY") == "1"
        (fs.path / "a").write_bytes(b"before the crash")
        daemons[0].kill()
        daemons[0].wait()
        assert is_mounted(fs.path)  # dead: ENOTCONN
        assert burstfs("mount", "--config", str(config), "--foreground", check=False).returncode == 2
        subprocess.run(unit_command("ExecStopPost", {}, config), capture_output=True, timeout=60)
        assert not is_mounted(fs.path)
        daemons.append(
            subprocess.Popen(
                start,
                env={**os.environ, "NOTIFY_SOCKET": address},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        while receive(sock).get("READY") != "1":
            pass
        assert (fs.path / "a").read_bytes() == b"before the crash"
        burstfs("unmount", "--config", str(config), "--wait")
        assert daemons[1].wait(timeout=60) == 0
        assert (fs.remote_dir / "a").read_bytes() == b"before the crash"
    finally:
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()


# -- Kubernetes ----------------------------------------------------------------------------------

DAEMONSET = REPO / "packaging" / "kubernetes-daemonset.yaml"
SIDECAR = REPO / "packaging" / "kubernetes-sidecar.yaml"


def manifests(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def burstfs_container(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(pod spec, the burstfs container) of the DaemonSet or the sidecar pod."""
    for doc in manifests(path):
        spec = (
            doc["spec"]["template"]["spec"]
            if doc["kind"] == "DaemonSet"
            else doc["spec"]
            if doc["kind"] == "Pod"
            else None
        )
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


CONFIG_IN_POD = "/etc/burstfs/burstfs.toml"


def mount_config(path: Path) -> tuple[str, dict[str, Any]]:
    """The ``burstfs.toml`` of the manifest's ConfigMap: its text and its settings."""
    text = next(doc["data"]["burstfs.toml"] for doc in manifests(path) if doc["kind"] == "ConfigMap")
    return text, tomllib.loads(text)


@pytest.mark.parametrize("path", [DAEMONSET, SIDECAR], ids=["daemonset", "sidecar"])
def test_kubernetes_fields_that_matter(path: Path, tmp_path: Path) -> None:
    spec, container = burstfs_container(path)
    text, settings = mount_config(path)
    check = tmp_path / "burstfs.toml"
    check.write_text(text)
    assert burstfs("config", "check", str(check)).returncode == 0  # the shipped config is valid
    assert container["securityContext"]["privileged"] is True  # /dev/fuse, mount(2)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert mounts[settings["mountpoint"]]["mountPropagation"] == "Bidirectional"
    cache_mount = next(
        m
        for point, m in mounts.items()
        if settings["cache"].startswith(point.rstrip("/") + "/") or settings["cache"] == point
    )
    assert "hostPath" in volumes[cache_mount["name"]] or "persistentVolumeClaim" in volumes[cache_mount["name"]]
    config_mount = mounts[str(Path(CONFIG_IN_POD).parent)]
    assert "configMap" in volumes[config_mount["name"]]
    assert f"burstfs mount --config {CONFIG_IN_POD} --foreground" in " ".join(container["command"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:4] == ["burstfs", "unmount", "--config", CONFIG_IN_POD] and "--wait" in pre_stop
    drain_wait = int(pre_stop[pre_stop.index("--wait-timeout") + 1])
    assert spec["terminationGracePeriodSeconds"] >= drain_wait + 30, "the kubelet would kill the drain wait"
    assert f"burstfs-admin status --json {settings['mountpoint']}" in " ".join(
        container["readinessProbe"]["exec"]["command"]
    )
    metrics_port = int(settings["metrics-addr"].rsplit(":", 1)[1])
    assert {"name": "metrics", "containerPort": metrics_port, "protocol": "TCP"} in container["ports"]
    pod = next(doc for doc in manifests(path) if doc["kind"] in ("DaemonSet", "Pod"))
    annotations = (pod["spec"]["template"]["metadata"] if pod["kind"] == "DaemonSet" else pod["metadata"])[
        "annotations"
    ]
    assert annotations["prometheus.io/scrape"] == "true" and int(annotations["prometheus.io/port"]) == metrics_port


@needs_fuse
@pytest.mark.fuse
def test_daemonset_commands_start_probe_restart_and_stop_a_real_mount(mounted_factory: type[MountedFS]) -> None:
    """The DaemonSet's own config, start command, readiness probe and preStop hook, run
    here: ready when live, not ready when the daemon died, a restart over the dead mount,
    and a stop that leaves the checkpoint durable."""
    _, container = burstfs_container(DAEMONSET)
    text, settings = mount_config(DAEMONSET)
    fs = mounted_factory()
    with socket.socket() as probe_port:
        probe_port.bind(("127.0.0.1", 0))
        port = probe_port.getsockname()[1]
    config = fs.root / "burstfs.toml"  # the ConfigMap's file, with this node's paths and a loopback port
    config.write_text(
        text.replace(settings["mountpoint"], str(fs.path))
        .replace(settings["cache"], str(fs.cache))
        .replace(settings["remote"], fs.remote_url)
        .replace(settings["metrics-addr"], f"127.0.0.1:{port}")
    )

    def here(argv: list[str]) -> list[str]:
        return [word.replace(CONFIG_IN_POD, str(config)).replace(settings["mountpoint"], str(fs.path)) for word in argv]

    start, ready = here(container["command"]), here(container["readinessProbe"]["exec"]["command"])
    pre_stop = here(container["lifecycle"]["preStop"]["exec"]["command"])
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}

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


@needs_fuse
@pytest.mark.fuse
def test_mounts_over_a_volume_mount_point_as_in_a_pod(mounted_factory: type[MountedFS]) -> None:
    """In a pod every volumeMount path is itself a (bind) mount: burstfs mounts over it, and
    unmounting leaves the volume as it was."""
    fs = mounted_factory()
    subprocess.run(["mount", "--bind", str(fs.path), str(fs.path)], check=True)
    try:
        fs.mount()
        (fs.path / "model.pt").write_bytes(b"weights")
        assert is_mounted(fs.path)
        fs.unmount("--wait")
        assert (fs.remote_dir / "model.pt").read_bytes() == b"weights"
        assert is_mounted(fs.path) and not (fs.path / "model.pt").exists()  # the volume, empty as before
        fs.mount()  # and again over it
        assert (fs.path / "model.pt").read_bytes() == b"weights"
        fs.unmount()
    finally:
        subprocess.run(["umount", "-l", str(fs.path)], check=False)


def test_unmount_needs_a_mountpoint_or_a_config_file_with_one(tmp_path: Path) -> None:
    result = burstfs("unmount", check=False)
    assert result.returncode == 2 and "give MOUNTPOINT, or --config FILE" in result.stderr
    config = tmp_path / "x.toml"
    config.write_text('cache = "/tmp/c"\n')
    assert burstfs("unmount", "--config", str(config), check=False).returncode == 2
    config.write_text('mountpoint = "/nonexistent/mnt"\nbogus = 1\n')
    result = burstfs("unmount", "--config", str(config), check=False)
    assert result.returncode == 2 and f"{config}:2: key 'bogus': unknown key" in result.stderr
    config.write_text(f'mountpoint = "{tmp_path}"\n')
    result = burstfs("unmount", "--config", str(config), check=False)
    assert result.returncode == 2 and f"{tmp_path} is not a burstfs mount point" in result.stderr

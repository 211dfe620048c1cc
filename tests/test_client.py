"""``burstfs.client`` through real mounts: typed results and its exceptions."""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, FUSE_OK, MountedFS, wait_for

from burstfs import client
from burstfs.xattrs import LATEST_MEMO_S

pytestmark = [pytest.mark.fuse, pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")]

WRITER = (
    "import sys; f = open(sys.argv[1], 'wb'); f.write(b'partial'); f.flush(); print('ready', flush=True); "
    "sys.stdin.readline(); f.close()"
)


@pytest.fixture
def fs(mounted_factory: type[MountedFS]) -> MountedFS:
    mounted = mounted_factory()
    mounted.mount()
    return mounted


def admin(*args: str | Path) -> None:
    subprocess.run([str(BIN / "burstfs-admin"), *map(str, args)], check=True, capture_output=True, timeout=60)


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, burstfs.client; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_status_and_wait_durable(fs: MountedFS) -> None:
    data = os.urandom(300_000)
    (fs.path / "step_1").mkdir()
    (fs.path / "step_1" / "model.pt").write_bytes(data)
    (fs.path / "step_1" / "optim.pt").write_bytes(b"optim")
    durable = client.wait_durable(fs.path / "step_1", timeout=60)
    assert (durable.files, durable.bytes) == (2, 300_005)
    assert (fs.remote_dir / "step_1" / "model.pt").read_bytes() == data
    status = client.status(str(fs.path / "step_1"))  # any path in the mount
    assert status.mountpoint == fs.path and status.cache_dir == fs.cache and status.remote == fs.remote_url
    assert status.pid == fs.daemon_pid()
    assert status.states["durable"] == client.FileCount(2, 300_005)
    assert status.all_durable and status.undrained == client.FileCount(0, 0)
    assert status.halted is None and status.outage is None
    assert client.wait_durable([fs.path / "step_1" / "optim.pt", fs.path]).files == 2


def test_wait_durable_times_out_on_a_file_open_for_writing(fs: MountedFS) -> None:
    path = fs.path / "open.bin"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        with pytest.raises(client.DurableTimeoutError) as caught:
            client.wait_durable(fs.path, timeout=0.3)
        assert isinstance(caught.value, TimeoutError)
        assert caught.value.pending == [client.PendingFile("open.bin", "writing", None)]
        status = client.status(fs.path)
        assert not status.all_durable and status.states["writing"].files == 1
    finally:
        writer.communicate("close\n", timeout=30)
    assert client.wait_durable(path, timeout=60).files == 1


def test_wait_durable_raises_at_once_when_a_file_failed(fs: MountedFS) -> None:
    (fs.path / "a").write_bytes(b"abc")
    client.wait_durable(fs.path / "a", timeout=60)
    with sqlite3.connect(fs.cache / "journal.db", timeout=30) as db:  # a permanent failure, as the mover records it
        db.execute("UPDATE inodes SET state='failed', error='injected' WHERE name=?", (b"a",))
    with pytest.raises(client.DrainFailedError) as caught:
        client.wait_durable(fs.path / "a")  # no timeout: it must not wait forever
    assert caught.value.failed == [client.PendingFile("a", "failed", "injected")]
    assert client.status(fs.path).undrained.files == 1
    admin("retry", fs.path)
    client.wait_durable(fs.path / "a", timeout=60)


def test_prefetch_on_a_restore_node(fs: MountedFS, mounted_factory: type[MountedFS]) -> None:
    data = os.urandom(400_000)
    (fs.path / "ck").mkdir()
    (fs.path / "ck" / "w.pt").write_bytes(data)
    (fs.path / "ck" / "meta").write_bytes(b"m")
    client.wait_durable(fs.path / "ck", timeout=60)
    fs.unmount()
    node = mounted_factory("restore", remote_url=fs.remote_url)  # a fresh cache over the same remote
    node.mount()
    seen: list[client.PrefetchProgress] = []
    result = client.prefetch(node.path / "ck", on_progress=seen.append)
    assert result.bytes == 400_001 and sorted(f.path for f in result.files) == ["ck/meta", "ck/w.pt"]
    assert all(f.ok for f in result.files)
    assert sorted(p.file.path for p in seen) == ["ck/meta", "ck/w.pt"]
    assert seen[-1].done_files == seen[-1].total_files == 2 and seen[-1].done_bytes == seen[-1].total_bytes == 400_001
    assert client.status(node.path).states["durable"].files == 2  # on the local tier now
    assert (node.path / "ck" / "w.pt").read_bytes() == data
    with pytest.raises(client.ClientError, match="No such file"):
        client.prefetch(node.path / "nope")


def test_not_a_mount_and_daemon_gone(fs: MountedFS, tmp_path: Path) -> None:
    with pytest.raises(client.NotAMountError):
        client.status(tmp_path)
    pid = fs.daemon_pid()
    os.kill(pid, signal.SIGKILL)  # the daemon dies; the kernel keeps a dead mount
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), what="the daemon to die")
    with pytest.raises(client.DaemonGoneError, match="burstfs unmount"):
        client.status(fs.path)
    subprocess.run(["fusermount3", "-u", "-z", str(fs.path)], check=True)
    with pytest.raises(client.NotAMountError):  # a stopped mount's cache dir is not a live mount
        client.wait_durable(fs.cache)


def test_misuses_are_client_errors_never_an_answer(fs: MountedFS) -> None:
    """An empty list of paths raised IndexError; a mount's path with remote= answered None
    ("start from scratch") for a run whose checkpoint was there."""
    for call in (client.wait_durable, client.is_durable, client.prefetch):
        with pytest.raises(client.ClientError, match="no path given"):
            call([])
    (fs.path / "run/step_1").mkdir(parents=True)
    (fs.path / "run/step_1/__0_0.distcp").write_bytes(b"shard")
    (fs.path / "run/step_1/.metadata").write_bytes(b"metadata")
    client.wait_durable(fs.path / "run")
    wait_for(lambda: client.latest(fs.path / "run") == fs.path / "run/step_1", what="step 1 published")
    assert client.latest("run", remote=fs.remote_url) == Path("run/step_1")
    with pytest.raises(client.ClientError, match="is a local path"):
        client.latest(fs.path / "run", remote=fs.remote_url)


def test_checkpoints_are_ordered_by_the_numbers_in_their_names(tmp_path: Path) -> None:
    """Not by mtime: a directory's mtime is one node's and moves when a listing merges in or
    drops what other nodes wrote or deleted there."""
    from burstfs.retention import checkpoints_in

    for age, name in enumerate(["step_10", "step_9", "step_2", "epoch=1-step=3", "epoch=0-step=30"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1e9 - age, 1e9 - age))  # the newest names are the oldest here
    assert [p.name for p in checkpoints_in(tmp_path, "step_*")] == ["step_2", "step_9", "step_10"]
    assert [p.name for p in checkpoints_in(tmp_path, "epoch=*")] == ["epoch=0-step=30", "epoch=1-step=3"]


def test_prune_checkpoints_keeps_newer_ones_until_they_are_durable(fs: MountedFS) -> None:
    from burstfs.retention import checkpoints_in, prune_checkpoints

    run = fs.path / "run"
    for step in (1, 2):
        (run / f"step_{step}").mkdir(parents=True)
        (run / f"step_{step}" / "shard0").write_bytes(os.urandom(10_000))
    client.wait_durable(run, timeout=60)
    (run / "step_3").mkdir()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(run / "step_3" / "shard0")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        deleted = prune_checkpoints(checkpoints_in(run, "step_*"), keep_last=1)
        assert deleted == [run / "step_1"]  # step_3 is still being written: step_2 stays
        assert sorted(p.name for p in run.iterdir()) == ["step_2", "step_3"]
    finally:
        writer.communicate("close\n", timeout=30)
    client.wait_durable(run, timeout=60)
    assert prune_checkpoints(checkpoints_in(run, "step_*"), keep_last=1) == [run / "step_2"]
    fs.unmount("--wait", "--wait-timeout", "60")
    assert sorted(p.name for p in (fs.remote_dir / "run").iterdir()) == ["step_3"]


def test_a_step_the_remote_cannot_list_afresh_is_kept_by_prune(fs: MountedFS) -> None:
    """refresh_listings (and user.burstfs.listed) answered "0 listed" when the remote could
    not be listed, and prune_checkpoints deleted the step without the fresh listing it
    promises: the shards other nodes drained there since would bring the step back."""
    from burstfs.retention import checkpoints_in, prune_checkpoints

    run = fs.path / "run"
    for step in (1, 2):
        (run / f"step_{step}").mkdir(parents=True)
        (run / f"step_{step}" / "shard0").write_bytes(os.urandom(10_000))
    client.wait_durable(run, timeout=60)
    away = fs.remote_dir.with_name("remote.away")
    fs.remote_dir.rename(away)
    try:
        with pytest.raises(client.ClientError, match="could not be listed"):
            client.refresh_listings(run / "step_1")
        with pytest.raises(OSError) as caught:
            os.getxattr(run / "step_1", "user.burstfs.listed")
        assert caught.value.errno == errno.EIO
        assert prune_checkpoints(checkpoints_in(run, "step_*"), keep_last=1) == []
        assert sorted(p.name for p in run.iterdir()) == ["step_1", "step_2"]
    finally:
        away.rename(fs.remote_dir)
    assert prune_checkpoints(checkpoints_in(run, "step_*"), keep_last=1) == [run / "step_1"]


def test_wait_by_xattrs_for_users_without_the_control_socket(fs: MountedFS) -> None:
    """The route a job's user takes under a mount root made (AccessDeniedError from the
    socket): each file's user.burstfs.state through the mount.  Run as root here (this
    machine's python is not executable by other users), so it calls that route directly."""
    from burstfs.client import _wait_by_xattrs

    (fs.path / "ck").mkdir()
    (fs.path / "ck" / "a").write_bytes(os.urandom(50_000))
    # Nothing of these drains: they raised a raw OSError (ENODATA, ENOENT) here, not for root.
    os.mkfifo(fs.path / "ck" / "pipe")
    os.symlink("gone.ckpt", fs.path / "ck" / "last.ckpt")
    durable = _wait_by_xattrs([fs.path / "ck"], 60, time.monotonic())
    assert (durable.files, durable.bytes) == (1, 50_000)
    with pytest.raises(client.ClientError, match="No such file"):
        _wait_by_xattrs([fs.path / "ck" / "missing"], 1, time.monotonic())
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(fs.path / "ck" / "b")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        with pytest.raises(client.DurableTimeoutError) as caught:
            _wait_by_xattrs([fs.path / "ck"], 0.3, time.monotonic())
        assert caught.value.pending == [client.PendingFile(str(fs.path / "ck" / "b"), "writing", None)]
    finally:
        writer.communicate("close\n", timeout=30)
    assert _wait_by_xattrs([fs.path / "ck" / "b"], 60, time.monotonic()).files == 1
    with sqlite3.connect(fs.cache / "journal.db", timeout=30) as db:
        db.execute("UPDATE inodes SET state='failed', error='injected' WHERE name=?", (b"a",))
    with pytest.raises(client.DrainFailedError):
        _wait_by_xattrs([fs.path / "ck"], None, time.monotonic())


# client.latest as a job's user under a mount root made: imported as root (this machine's
# python is not readable by others), then the effective uid is nobody's: no control socket,
# no journal, no remote credentials of the daemon.
_LATEST_AS_NOBODY = """
import encodings.idna, encodings.latin_1, encodings.unicode_escape, json, os, sys
import burstfs.admin.checkpoints, burstfs.latest, burstfs.remote
from burstfs import client
os.chdir(sys.argv[1])  # entered as root: the directories above the mount point are private
os.setegid(65534)
os.seteuid(65534)
try:
    print(json.dumps({"latest": str(client.latest("run"))}))
except client.ClientError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_latest_for_a_user_without_the_control_socket_asks_the_daemon_through_the_mount(
    mounted_factory: type[MountedFS],
) -> None:
    """A Slurm job's user under the prolog's root mount: client.latest failed with "permission
    denied on control.sock", so train_example.py refused to resume any job run as a user."""
    import json

    fs = mounted_factory("n", None, ("--allow-other",))  # type: ignore[call-arg]
    fs.mount()
    os.chmod(fs.path, 0o755)

    def latest_as_nobody() -> dict[str, str]:
        result = subprocess.run(
            [sys.executable, "-c", _LATEST_AS_NOBODY, str(fs.path)], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        answer: dict[str, str] = json.loads(result.stdout)
        return answer

    (fs.path / "run").mkdir()
    assert latest_as_nobody() == {"latest": "None"}
    for step in (1, 2):
        (fs.path / f"run/step_{step}").mkdir()
        (fs.path / f"run/step_{step}/__0_0.distcp").write_bytes(os.urandom(20_000))
        (fs.path / f"run/step_{step}/.metadata").write_bytes(b"metadata")
    client.wait_durable(fs.path / "run")
    wait_for(lambda: client.latest(fs.path / "run") == fs.path / "run/step_2", what="step 2 published")
    time.sleep(LATEST_MEMO_S)  # the answer of the first call served only its own size probe
    assert latest_as_nobody() == {"latest": str(fs.path / "run/step_2")}
    remote = fs.remote_dir
    remote.rename(remote.with_name("moved"))  # the remote cannot be read: never "None"
    try:
        time.sleep(LATEST_MEMO_S)
        answer = latest_as_nobody()
    finally:
        remote.with_name("moved").rename(remote)
    assert answer.get("error") == "ClientError", answer


_REFRESH_AS_NOBODY = """
import encodings.idna, encodings.latin_1, encodings.unicode_escape, json, os, sys
from burstfs import client
os.chdir(sys.argv[1])  # entered as root: the directories above the mount point are private
os.setegid(65534)
os.seteuid(65534)
try:
    client.refresh_listings("ck/step_1")
    print(json.dumps({"listed": sorted(os.listdir("ck/step_1"))}))
except client.ClientError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_refresh_listings_for_a_user_without_the_control_socket_lists_through_the_mount(
    mounted_factory: type[MountedFS], tmp_path: Path
) -> None:
    """A Slurm job's user pruning a step (retention.prune_checkpoints): "permission denied on
    control.sock", so the step was never listed afresh and the shards other nodes drained
    since stayed on the remote (the step came back).  The directory's user.burstfs.listed
    lists it through the mount."""
    import json

    shared = tmp_path / "shared"
    shared.mkdir()
    n0 = mounted_factory("n0", f"file://{shared}", ("--allow-other", "--list-ttl", "3600"))  # type: ignore[call-arg]
    n1 = mounted_factory("n1", f"file://{shared}", ("--node-id", "n1"))  # type: ignore[call-arg]
    n0.mount()
    os.chmod(n0.path, 0o755)
    (n0.path / "ck/step_1").mkdir(parents=True)
    os.chmod(n0.path / "ck", 0o777)
    os.chmod(n0.path / "ck/step_1", 0o777)
    (n0.path / "ck/step_1/__0_0.distcp").write_bytes(b"zero")
    client.wait_durable(n0.path / "ck")
    n1.mount()
    (n1.path / "ck/step_1/__1_0.distcp").write_bytes(b"one")  # n1 lists ck/step_1 here, then adds its shard
    client.wait_durable(n1.path / "ck")
    assert os.listdir(n0.path / "ck/step_1") == ["__0_0.distcp"]  # n0 listed it before (TTL: an hour)

    result = subprocess.run(
        [sys.executable, "-c", _REFRESH_AS_NOBODY, str(n0.path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"listed": ["__0_0.distcp", "__1_0.distcp"]}


_MARKERS_AS_NOBODY = """
import encodings.idna, encodings.latin_1, encodings.unicode_escape, json, os, sys
from pathlib import Path
from burstfs import retention
os.chdir(sys.argv[1])
os.setegid(65534)
os.seteuid(65534)
print(json.dumps(list(retention._commit_markers([Path("run/step_1")]))))
"""


def test_prune_as_a_user_without_the_control_socket_counts_by_the_mounts_commit_markers(
    mounted_factory: type[MountedFS],
) -> None:
    """A job's user pruning under a mount with ``--commit-marker done.txt``: status was refused,
    so the default markers were used, a step without done.txt counted as complete, and a
    complete checkpoint was deleted that root's prune keeps.  They come through the mount."""
    import json

    fs = mounted_factory("n", None, ("--allow-other", "--commit-marker", "done.txt"))  # type: ignore[call-arg]
    fs.mount()
    os.chmod(fs.path, 0o755)
    (fs.path / "run/step_1").mkdir(parents=True)
    assert client.commit_markers(fs.path / "run") == ["done.txt"]
    result = subprocess.run(
        [sys.executable, "-c", _MARKERS_AS_NOBODY, str(fs.path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["done.txt"]


_LATEST_OF_AS_NOBODY = """
import encodings.idna, encodings.latin_1, encodings.unicode_escape, json, os, sys
import burstfs.admin.checkpoints, burstfs.latest, burstfs.remote
from burstfs import client
os.chdir(sys.argv[1])
os.setegid(65534)
os.seteuid(65534)
try:
    found = client.latest(sys.argv[2])
    opens = found is not None and os.path.isdir(os.path.relpath(found, sys.argv[1]))  # nobody: below the mount
    print(json.dumps({"latest": str(found), "opens": opens}))
except client.ClientError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def test_latest_as_a_user_without_the_control_socket_of_a_run_made_elsewhere_since_the_listing(
    mounted_factory: type[MountedFS], tmp_path: Path
) -> None:
    """A job's user asking ``latest`` of a run another node made since this mount listed its
    parent: the path is not here, so its attribute could not be asked (exit 5) while root's
    answer came from the remote.  Its nearest directory here asks for it by name."""
    import json

    shared = tmp_path / "shared"
    shared.mkdir()
    n0 = mounted_factory("n0", f"file://{shared}", ("--allow-other", "--list-ttl", "3600"))  # type: ignore[call-arg]
    n0.mount()
    os.chmod(n0.path, 0o755)
    (n0.path / "runs").mkdir()
    os.listdir(n0.path / "runs")  # listed here: empty, for the next hour
    n1 = mounted_factory("n1", f"file://{shared}", ("--node-id", "n1"))  # type: ignore[call-arg]
    n1.mount()
    (n1.path / "runs/run9/step_1").mkdir(parents=True)
    (n1.path / "runs/run9/step_1/__0_0.distcp").write_bytes(b"shard")
    (n1.path / "runs/run9/step_1/.metadata").write_bytes(b"metadata")
    client.wait_durable(n1.path / "runs")
    wait_for(lambda: client.latest(n1.path / "runs/run9") is not None, what="the step published")
    assert not (n0.path / "runs/run9").exists()
    result = subprocess.run(
        [sys.executable, "-c", _LATEST_OF_AS_NOBODY, str(n0.path), "runs/run9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"latest": str(n0.path / "runs/run9/step_1"), "opens": True}

"""The drain through a real mount, over the file remote and S3 (moto behind a fault proxy)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time

import pytest
from conftest import BIN, MountedFS, RemoteTarget, burstfs, file_state, journal_rows, wait_for

from burstfs.objects import manifest_key

pytestmark = pytest.mark.fuse


def durable(fs: MountedFS, *names: str) -> bool:
    return all(file_state(fs.cache, name) == "durable" for name in names)


def test_closed_files_drain_byte_identical_with_manifest(remote_mount: MountedFS, remote: RemoteTarget) -> None:
    data = {"step1/model.pt": os.urandom(12 << 20), "step1/tiny.bin": b"x", "step1/empty": b""}
    for path, content in data.items():
        (remote_mount.path / path).parent.mkdir(parents=True, exist_ok=True)
        (remote_mount.path / path).write_bytes(content)
    wait_for(lambda: durable(remote_mount, "model.pt", "tiny.bin", "empty"), what="drain")
    for path, content in data.items():
        assert remote.read(path) == content  # tenet 3: plain bytes at prefix/<path>
        manifest = json.loads(remote.read(f".burstfs/manifests/{path}.json") or b"{}")
        assert manifest["size"] == len(content)
        assert os.getxattr(remote_mount.path / path, "user.burstfs.digest").decode() == manifest["digest"]
    assert os.getxattr(remote_mount.path / "step1/model.pt", "user.burstfs.state") == b"durable"
    assert remote.multipart_uploads() == []


def test_names_of_up_to_255_bytes_drain_and_read_back_on_a_fresh_node(
    remote_mount: MountedFS, remote: RemoteTarget, mounted_factory: type[MountedFS]
) -> None:
    """A manifest whose name would pass NAME_MAX (a 251-255 byte file name and ``.json``)
    goes by a digest of the name: the file drains (it used to fail on a file remote:
    bad_key) and a fresh node reads it back verified."""
    names = ["l" * 250, "m" * 251, "é" * 127 + "n", "o" * 255]  # bytes: 250, 251, 255, 255
    (remote_mount.path / "step").mkdir()
    contents = {name: os.urandom(7 << 20) for name in names}  # multipart on S3 (--part-size 5M)
    for name, data in contents.items():
        (remote_mount.path / "step" / name).write_bytes(data)
    wait_for(lambda: durable(remote_mount, *names), what="drain")
    for name, data in contents.items():
        assert remote.read(f"step/{name}") == data
        assert json.loads(remote.read(manifest_key(f"step/{name}")) or b"{}")["key"] == f"step/{name}"
    if remote.directory is not None:  # made 0600, then given the mode its manifest records
        assert stat.S_IMODE(os.stat(remote.directory / "step" / names[-1]).st_mode) == 0o644
    fresh = mounted_factory("node2", remote.url, remote.extra_args)  # type: ignore[call-arg]
    fresh.mount()
    for name, data in contents.items():
        assert (fresh.path / "step" / name).read_bytes() == data
    os.unlink(remote_mount.path / "step" / names[-1])  # its manifest goes with it
    wait_for(lambda: remote.read(manifest_key(f"step/{names[-1]}")) is None, what="the delete")


def test_commit_marker_drains_after_the_files_closed_before_it(remote_mount: MountedFS, remote: RemoteTarget) -> None:
    step = remote_mount.path / "step2"
    step.mkdir()
    for rank in range(4):
        (step / f"__{rank}_0.distcp").write_bytes(os.urandom(11 << 20))
    (step / ".metadata").write_bytes(b"dcp metadata")
    (remote_mount.path / "latest").write_text("step2")
    wait_for(lambda: durable(remote_mount, ".metadata", "latest", *[f"__{r}_0.distcp" for r in range(4)]), what="drain")
    events = journal_rows(remote_mount.cache, "SELECT seq, detail FROM events WHERE event='durable' ORDER BY seq")
    order = [detail.split()[0].removeprefix("key=") for _, detail in events]
    shards = [order.index(f"step2/__{r}_0.distcp") for r in range(4)]
    assert max(shards) < order.index("step2/.metadata") < order.index("latest")
    assert remote.read("latest") == b"step2"


def test_changed_file_drains_again_and_rename_unlink_follow(remote_mount: MountedFS, remote: RemoteTarget) -> None:
    f = remote_mount.path / "a.bin"
    f.write_bytes(b"one" * 1000)
    wait_for(lambda: remote.read("a.bin") == b"one" * 1000, what="first generation")
    f.write_bytes(b"two" * 2000)
    wait_for(lambda: remote.read("a.bin") == b"two" * 2000, what="second generation")
    assert journal_rows(remote_mount.cache, "SELECT generation FROM inodes WHERE name=?", (b"a.bin",))[0][0] == 2
    os.rename(f, remote_mount.path / "b.bin")  # durable: server-side copy, then delete
    wait_for(lambda: remote.read("b.bin") == b"two" * 2000 and remote.read("a.bin") is None, what="rename")
    os.unlink(remote_mount.path / "b.bin")
    wait_for(lambda: not {"b.bin", ".burstfs/manifests/b.bin.json"} & remote.keys(), what="delete")


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_checkpoint_renamed_after_its_upload_is_durable_only_once_its_objects_moved(
    remote_mount: MountedFS, remote: RemoteTarget
) -> None:
    """The Hugging Face Trainer's pattern: save into tmp-checkpoint-N, rename it to checkpoint-N.
    Files durable before the rename keep their objects at the old names until the mover copies
    them over; every wait (and ``unmount --wait``, after which the Slurm epilog removes the cache)
    used to call them durable at once, and the remote never got checkpoint-N."""
    from burstfs import client

    assert remote.proxy is not None
    fs = remote_mount
    shards = {"model.safetensors": os.urandom(300_000), "optimizer.pt": os.urandom(200_000)}
    (fs.path / "tmp-checkpoint-8").mkdir()
    for name, data in shards.items():
        (fs.path / "tmp-checkpoint-8" / name).write_bytes(data)
    client.wait_durable(fs.path / "tmp-checkpoint-8", timeout=60)
    remote.proxy.pause()  # the moves wait on the remote
    os.rename(fs.path / "tmp-checkpoint-8", fs.path / "checkpoint-8")
    moved = fs.path / "checkpoint-8"
    assert os.getxattr(moved / "optimizer.pt", "user.burstfs.state") == b"moving"
    waited = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", "--json", "--timeout", "1", str(moved)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert waited.returncode == 3, waited.stderr
    assert {(p["path"], p["state"]) for p in json.loads(waited.stdout)["pending"]} == {
        (f"checkpoint-8/{name}", "moving") for name in shards
    }
    status = subprocess.run(
        [str(BIN / "burstfs-admin"), "status", "--json", str(fs.path)], capture_output=True, text=True, timeout=60
    )
    assert json.loads(status.stdout)["remote_work"]["moving"] == len(shards), status.stderr
    with pytest.raises(client.DurableTimeoutError) as timed_out:
        client.wait_durable(moved, timeout=0.5)
    assert {f.state for f in timed_out.value.pending} == {"moving"}
    refused = subprocess.run(
        [str(BIN / "burstfs"), "unmount", "--wait", "--wait-timeout", "1", str(fs.path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1 and "not unmounting" in refused.stderr, refused.stderr
    remote.proxy.resume()
    subprocess.run(
        [str(BIN / "burstfs"), "unmount", "--wait", "--wait-timeout", "60", str(fs.path)], check=True, timeout=90
    )
    for name, data in shards.items():
        assert remote.read(f"checkpoint-8/{name}") == data
    left = [key for key in remote.keys() if "tmp-checkpoint-8" in key and not key.startswith(".burstfs/groups/")]
    assert not left  # objects and manifests deleted before the unmount (commit rounds keep their records)
    assert journal_rows(fs.cache, "SELECT COUNT(*) FROM remote_deletes")[0][0] == 0


def test_a_renamed_checkpoint_whose_objects_vanished_is_uploaded_again_or_fails_its_wait(
    remote_mount: MountedFS, remote: RemoteTarget
) -> None:
    """Objects removed behind burstfs' back (a lifecycle rule, an operator) before the
    checkpoint is renamed: the moves find nothing to copy.  That was taken for a passing fault
    that ended every pass, so nothing renamed moved any more and the waits ran to their timeout.
    A file still on the tier is uploaded again at its new name; an evicted one cannot be, and
    its wait fails at once saying why."""
    fs = remote_mount
    local, evicted = os.urandom(300_000), os.urandom(200_000)
    (fs.path / "tmp-checkpoint-9").mkdir()
    (fs.path / "tmp-checkpoint-9" / "model.pt").write_bytes(local)
    (fs.path / "tmp-checkpoint-9" / "optimizer.pt").write_bytes(evicted)
    admin = [str(BIN / "burstfs-admin")]
    subprocess.run([*admin, "wait", "--timeout", "60", str(fs.path)], check=True, capture_output=True, timeout=90)
    subprocess.run([*admin, "evict", str(fs.path / "tmp-checkpoint-9" / "optimizer.pt")], check=True, timeout=60)
    remote.delete("tmp-checkpoint-9/model.pt")
    remote.delete("tmp-checkpoint-9/optimizer.pt")
    os.rename(fs.path / "tmp-checkpoint-9", fs.path / "checkpoint-9")
    subprocess.run(
        [*admin, "wait", "--timeout", "60", str(fs.path / "checkpoint-9" / "model.pt")], check=True, timeout=90
    )
    assert remote.read("checkpoint-9/model.pt") == local
    started = time.monotonic()
    failed = subprocess.run(
        [*admin, "wait", "--json", "--timeout", "60", str(fs.path / "checkpoint-9")],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert failed.returncode != 0 and json.loads(failed.stdout)["result"] == "failed", failed.stdout
    assert time.monotonic() - started < 50, "the wait ran to its timeout"
    assert "checkpoint-9/optimizer.pt: moving" in failed.stderr, failed.stderr
    assert "is no longer on the remote" in failed.stderr
    assert (
        "no longer on the remote"
        in os.getxattr(fs.path / "checkpoint-9" / "optimizer.pt", "user.burstfs.error").decode()
    )
    fs.unmount()  # the Slurm epilog's background `drain --cache DIR --now && rm -rf DIR` keeps the cache
    drained = burstfs("drain", "--cache", str(fs.cache), "--now", check=False, timeout=60)
    assert drained.returncode == 1 and "1 renamed files' objects could not be moved" in drained.stderr, drained.stderr


def test_each_name_of_a_hard_linked_file_drains_as_its_own_object(
    remote_mount: MountedFS, remote: RemoteTarget
) -> None:
    content = os.urandom(11 << 20)  # multipart on S3 (--part-size 5M)
    (remote_mount.path / "run").mkdir()
    (remote_mount.path / "run" / "model.pt").write_bytes(content)
    os.link(remote_mount.path / "run" / "model.pt", remote_mount.path / "latest.pt")
    wait_for(lambda: durable(remote_mount, "model.pt", "latest.pt"), what="both names")  # objects, then manifests
    assert remote.read("run/model.pt") == remote.read("latest.pt") == content
    manifests = [
        json.loads(remote.read(f".burstfs/manifests/{key}.json") or b"{}") for key in ("run/model.pt", "latest.pt")
    ]
    assert manifests[0]["digest"] == manifests[1]["digest"]
    with open(remote_mount.path / "latest.pt", "r+b") as f:  # a change through one name drains under both
        f.write(b"changed")
    changed = b"changed" + content[7:]
    wait_for(lambda: remote.read("run/model.pt") == changed and remote.read("latest.pt") == changed, what="new version")
    os.rename(remote_mount.path / "latest.pt", remote_mount.path / "best.pt")  # moves that name's object only
    wait_for(lambda: remote.read("best.pt") == changed and remote.read("latest.pt") is None, what="rename")
    os.unlink(remote_mount.path / "run" / "model.pt")  # deletes that name's object only
    wait_for(lambda: remote.read("run/model.pt") is None, what="unlink")
    assert remote.read("best.pt") == changed and (remote_mount.path / "best.pt").read_bytes() == changed
    assert remote.multipart_uploads() == []


def test_atomic_replace_of_a_durable_file(remote_mount: MountedFS, remote: RemoteTarget) -> None:
    target = remote_mount.path / "model.pt"
    target.write_bytes(b"old" * 100)
    wait_for(lambda: remote.read("model.pt") == b"old" * 100, what="old version")
    tmp = remote_mount.path / "model.pt.tmp"
    tmp.write_bytes(b"new" * 100)
    os.replace(tmp, target)
    wait_for(lambda: remote.read("model.pt") == b"new" * 100, what="new version")
    wait_for(lambda: remote.read("model.pt.tmp") is None, what="temp name gone")
    assert remote.read("model.pt") == b"new" * 100  # the delete of the replaced file spared the new object


def test_file_renamed_or_deleted_before_upload_leaves_no_stray_object(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    if remote.kind != "s3":
        pytest.skip("needs the fault proxy to hold uploads in flight")
    fs = mounted_factory("slow", remote.url, (*remote.extra_args, "--part-size", "5M"))  # type: ignore[call-arg]
    fs.mount()
    assert remote.proxy is not None
    remote.proxy.delay_next(6, 1.0, match="partNumber")
    (fs.path / "moved.bin").write_bytes(os.urandom(12 << 20))
    (fs.path / "gone.bin").write_bytes(os.urandom(12 << 20))
    os.rename(fs.path / "moved.bin", fs.path / "final.bin")
    os.unlink(fs.path / "gone.bin")
    wait_for(lambda: durable(fs, "final.bin"), what="drain of the renamed file")
    wait_for(
        lambda: os.getxattr(fs.path / "final.bin", "user.burstfs.remote_key") == b"final.bin",
        what="object moved to the new name",
    )
    bookkeeping = (".burstfs/manifests/", ".burstfs/groups/")
    wait_for(
        lambda: {k for k in remote.keys() if not k.startswith(bookkeeping)} == {"final.bin"}, what="no stray object"
    )
    assert remote.multipart_uploads() == []


@pytest.mark.parametrize("remote", ["s3"], indirect=True)
def test_a_file_unlinked_while_its_upload_completes_is_gone_before_unmount_wait_returns(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    """(An acceptance pass.)  A shard removed while its CompleteMultipartUpload was in flight:
    `burstfs-admin wait` said durable with 0 deletes and `unmount --wait` returned 0 while its
    object was still on the remote, and a fresh node restored the removed file.  The delete
    its upload's intent stands for is one the waits wait for."""
    assert remote.proxy is not None
    fs = mounted_factory("n", remote.url, (*remote.extra_args, "--part-size", "5M"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "step_1").mkdir()
    remote.proxy.delay_next(1, 3.0, match=lambda line: line.startswith("POST ") and "uploadId=" in line)
    (fs.path / "step_1/shard.bin").write_bytes(os.urandom(12 << 20))
    wait_for(
        lambda: any(r.startswith("POST ") and "uploadId=" in r for r in remote.proxy.requests),  # type: ignore[union-attr]
        what="the complete request sent",
    )
    os.unlink(fs.path / "step_1/shard.bin")
    waited = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", str(fs.path), "--timeout", "60", "--json"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "step_1/shard.bin" not in remote.keys()
    fs.unmount()
    assert "step_1/shard.bin" not in remote.keys()


def test_a_file_still_written_through_a_dup_drains_only_once_released(burst: MountedFS) -> None:
    """``cmd > file``: the shell closes its descriptor (a FLUSH) while the command's copy still
    writes.  The drain must not upload a snapshot taken mid-write nor call the file durable."""
    target = burst.path / "out.log"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    dup = os.dup(fd)
    os.write(fd, b"a" * (1 << 20))
    os.close(fd)  # FLUSH: journaled; the open file lives on in `dup`
    os.link(target, burst.path / "out.link")  # every name of it waits
    try:
        os.write(dup, b"b" * (3 << 20))
        (burst.path / "sentinel").write_bytes(b"closed after out.log")
        wait_for(lambda: durable(burst, "sentinel"), what="the drain ran past out.log")
        os.write(dup, b"c" * (1 << 20))
        assert not (burst.remote_dir / "out.log").exists() and not (burst.remote_dir / "out.link").exists()
        assert os.getxattr(target, "user.burstfs.state") in (b"staged", b"writing")
        waited = subprocess.run(
            [str(BIN / "burstfs-admin"), "wait", str(target), "--timeout", "1"], capture_output=True, text=True
        )
        assert waited.returncode != 0, waited.stdout
    finally:
        os.close(dup)  # RELEASE: now it drains, whole
    wait_for(lambda: durable(burst, "out.log", "out.link"), what="out.log after its release")
    whole = b"a" * (1 << 20) + b"b" * (3 << 20) + b"c" * (1 << 20)
    assert (burst.remote_dir / "out.log").read_bytes() == whole == (burst.remote_dir / "out.link").read_bytes()


def test_an_fsynced_file_written_on_drains_only_its_closed_versions(
    remote_mount: MountedFS, remote: RemoteTarget
) -> None:
    """With passthrough the kernel writes the data file without the daemon: an fsync'd file
    written on (a log, a streamed checkpoint) went to the remote with the bytes written after
    the fsync, recorded as the fsync'd generation (a version never fsync'd nor closed, kept
    on the remote after a crash).  The drain sends only what a close or fsync journaled."""
    if remote.proxy is None:
        pytest.skip("the S3 proxy holds the drain while the file is written on")
    target = remote_mount.path / "train.log"
    fsynced, later = b"a" * 100_000, b"b" * 100_000
    remote.proxy.pause()  # the remote is slow: the drain reads the file after the later writes
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, fsynced)
        os.fsync(fd)
        os.write(fd, later)
        remote.proxy.resume()
        (remote_mount.path / "sentinel").write_bytes(b"closed after the fsync")
        wait_for(lambda: durable(remote_mount, "sentinel"), timeout=60, what="the drain ran past train.log")
        time.sleep(5.0)  # held until its writer's next fsync or close: not re-read (and logged) every retry
        assert remote.read("train.log") in (None, fsynced)
        assert remote_mount.log_text().count("event=drain_deferred") <= 1
    finally:
        os.close(fd)
    wait_for(lambda: durable(remote_mount, "train.log"), timeout=60, what="train.log after its close")
    assert remote.read("train.log") == fsynced + later


def test_an_fsynced_file_rewritten_in_place_drains_only_its_closed_versions(
    remote_mount: MountedFS, remote: RemoteTarget
) -> None:
    """An in-place write a moment after an fsync (same size, within the record's 1 s of time
    slack) passed the drain's check: the remote got a mix of the fsync'd and later bytes, as
    durable, and its manifest did not match it.  The drain compares the data file with what it
    was when the fsync journaled it."""
    if remote.proxy is None:
        pytest.skip("the S3 proxy holds the drain while the file is written on")
    target = remote_mount.path / "model.bin"
    fsynced = b"x" * 4_000_000
    remote.proxy.pause()  # the drain reads the file after the in-place writes
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.write(fd, fsynced)
        os.fsync(fd)
        for offset in range(0, len(fsynced), 500_000):
            os.pwrite(fd, b"Y" * 4096, offset)
        remote.proxy.resume()
        (remote_mount.path / "sentinel").write_bytes(b"closed after the fsync")
        wait_for(lambda: durable(remote_mount, "sentinel"), timeout=60, what="the drain ran past model.bin")
        time.sleep(1.0)
        assert remote.read("model.bin") in (None, fsynced)
        assert os.getxattr(target, "user.burstfs.state") != b"durable"
    finally:
        os.close(fd)
    wait_for(lambda: durable(remote_mount, "model.bin"), timeout=60, what="model.bin after its close")
    final = bytearray(fsynced)
    for offset in range(0, len(fsynced), 500_000):
        final[offset : offset + 4096] = b"Y" * 4096
    assert remote.read("model.bin") == bytes(final)


def test_temporary_faults_retry_and_bytes_stay_identical(remote_mount: MountedFS, remote: RemoteTarget) -> None:
    if remote.proxy is None:
        pytest.skip("faults come from the S3 proxy")
    remote.proxy.fail_next(3, status=503, match="partNumber")
    remote.proxy.reset_next(2, when="request", match="partNumber")
    remote.proxy.fail_next(1, status=500, match="uploadId=")
    content = os.urandom(16 << 20)
    (remote_mount.path / "faulty.bin").write_bytes(content)
    wait_for(lambda: durable(remote_mount, "faulty.bin"), timeout=120, what="drain through faults")
    assert remote.read("faulty.bin") == content
    assert remote.proxy.injected >= 3
    remote_mount.expect_log("event=remote_retry")


def test_fsync_remote_waits_until_durable(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    fs = mounted_factory("fsync", remote.url, (*remote.extra_args, "--fsync", "remote"))  # type: ignore[call-arg]
    fs.mount()
    content = os.urandom(3 << 20)
    with open(fs.path / "synced.bin", "wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
        assert remote.read("synced.bin") == content  # durable when fsync returned
    os.rename(fs.path / "synced.bin", fs.path / "moved.bin")
    with open(fs.path / "moved.bin", "rb") as f:
        os.fsync(f.fileno())
        assert remote.read("moved.bin") == content  # renamed: durable once its object moved


def test_fsync_remote_fails_with_eio_when_the_bucket_is_gone(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    if remote.kind != "s3":
        pytest.skip("a missing bucket is an S3 failure")
    fs = mounted_factory("nobucket", remote.url, (*remote.extra_args, "--fsync", "remote"))  # type: ignore[call-arg]
    fs.mount()
    assert os.listdir(fs.path) == []  # listed while the bucket is there (an unseen root answers EIO)
    remote._client().delete_bucket(Bucket=remote.bucket)
    fs.expect_log("drain_halted")
    fs.expect_log("drain_retry")
    fs.expect_log("request_failed")
    with open(fs.path / "lost.bin", "wb") as f:
        f.write(b"data")
        f.flush()
        with pytest.raises(OSError) as err:
            os.fsync(f.fileno())
    assert err.value.errno == 5  # EIO
    assert (fs.path / "lost.bin").read_bytes() == b"data"  # the data stays staged
    assert file_state(fs.cache, "lost.bin") == "staged"


def test_kill_during_drain_then_drain_without_mount(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    fs = mounted_factory("crash", remote.url, (*remote.extra_args, "--part-size", "5M"))  # type: ignore[call-arg]
    fs.mount()
    if remote.proxy is not None:
        remote.proxy.delay_next(100, 0.5, match="partNumber")
    files = {f"ck/shard{i}.bin": os.urandom((11 + i) << 20) for i in range(3)}
    (fs.path / "ck").mkdir()
    for path, content in files.items():
        (fs.path / path).write_bytes(content)
    fs.kill()
    if remote.proxy is not None:
        remote.proxy.clear()
    result = subprocess.run(
        [str(BIN / "burstfs"), "drain", "--cache", str(fs.cache)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    for path, content in files.items():
        assert remote.read(path) == content
    states = journal_rows(fs.cache, "SELECT state FROM inodes WHERE kind='file' AND parent!=0")
    assert {s for (s,) in states} == {"durable"}
    assert remote.multipart_uploads() == []


def test_unmount_keeps_undrained_data_and_says_so(mounted_factory: type[MountedFS], remote: RemoteTarget) -> None:
    if remote.proxy is None:
        pytest.skip("needs the fault proxy to hold the drain back")
    fs = mounted_factory("undrained", remote.url, remote.extra_args)  # type: ignore[call-arg]
    fs.mount()
    remote.proxy.delay_next(1000, 5.0)
    (fs.path / "pending.bin").write_bytes(b"p" * 1000)
    result = subprocess.run([str(BIN / "burstfs"), "unmount", str(fs.path)], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert "not durable yet" in result.stdout
    assert file_state(fs.cache, "pending.bin") in ("staged", "draining")
    remote.proxy.clear()
    fs.mount()
    subprocess.run([str(BIN / "burstfs"), "unmount", "--wait", str(fs.path)], check=True, timeout=90)
    assert remote.read("pending.bin") == b"p" * 1000


def test_lz4_compression_round_trips_through_a_second_mount(
    mounted_factory: type[MountedFS], remote: RemoteTarget
) -> None:
    writer = mounted_factory("lz4", remote.url, (*remote.extra_args, "--compress", "lz4", "--part-size", "5M"))  # type: ignore[call-arg]
    writer.mount()
    content = b"compressible checkpoint " * (600 * 1024)  # ~14 MiB, three chunks
    (writer.path / "c.bin").write_bytes(content)
    wait_for(lambda: durable(writer, "c.bin"), what="compressed drain")
    stored = remote.read("c.bin")
    assert stored is not None and len(stored) < len(content) // 4
    manifest = json.loads(remote.read(".burstfs/manifests/c.bin.json") or b"{}")
    assert {c["codec"] for c in manifest["chunks"]} == {"lz4"}
    reader = mounted_factory("lz4-reader", remote.url, remote.extra_args)  # type: ignore[call-arg]
    reader.mount()
    assert (reader.path / "c.bin").read_bytes() == content

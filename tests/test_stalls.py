"""A sick remote never stalls local work (issue 11 #2/#3/#4).

Real mounts over moto behind a fault proxy that black-holes or pauses every
connection: a checkpoint save and an ``ls`` of the mount must complete within
a generous bound while the remote hangs, on both data paths.  The bounds are
completion timeouts, never timing ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, DATA_PATHS, FUSE_OK, MountedFS, burstfs, wait_for
from faultproxy import FaultProxy
from s3server import free_port, fresh_bucket

from burstfs.errors import RemoteError

pytestmark = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")

#: Generous: the promise is ~1 s per request; this only separates "done" from "hung".
BOUND_S = 30.0

SAVE_256M = """
import sys, torch
torch.save(torch.zeros(64 * 1024 * 1024, dtype=torch.float32), sys.argv[1])
"""


@pytest.fixture
def s3_proxy(s3_env: str) -> Iterator[tuple[FaultProxy, str]]:
    """A fresh bucket on moto behind a fault proxy: (proxy, remote URL)."""
    bucket = fresh_bucket(s3_env)
    with FaultProxy(s3_env) as proxy:
        yield proxy, f"s3://{bucket}/ckpt"
        proxy.resume()  # let the daemon's hung requests end before the mount is cleaned up


def _mount(factory: type[MountedFS], proxy: FaultProxy, url: str, data_path: str, *args: str) -> MountedFS:
    fs = factory(f"node-{data_path}", url, ("--endpoint-url", proxy.endpoint, *DATA_PATHS[data_path], *args))  # type: ignore[call-arg]
    fs.mount()
    return fs


def _durable_then_fresh_node(
    factory: type[MountedFS], proxy: FaultProxy, url: str, name: str, data: bytes, also: dict[str, bytes] | None = None
) -> MountedFS:
    """Node A writes ckpt/``name`` (and the files ``also``) and drains it; node B is mounted on a
    fresh cache (returned)."""
    a = factory("node-a", url, ("--endpoint-url", proxy.endpoint))  # type: ignore[call-arg]
    a.mount()
    (a.path / "ckpt").mkdir()
    for each, content in {name: data, **(also or {})}.items():
        (a.path / "ckpt" / each).write_bytes(content)
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(a.path / "ckpt")], "node A's drain")
    b = factory("node-b", url, ("--endpoint-url", proxy.endpoint))  # type: ignore[call-arg]
    b.mount()
    return b


def _bounded(argv: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; fail the test (not hang it) if it does not finish within BOUND_S."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what} did not complete within {BOUND_S:.0f}s while the remote hangs") from None
    assert result.returncode == 0, f"{what} failed: {result.stderr}"
    return result


@pytest.mark.parametrize("mode", ["blackhole", "pause"])
@pytest.mark.parametrize("data_path", sorted(DATA_PATHS))
def test_a_hung_remote_never_stalls_a_save_or_ls(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str], data_path: str, mode: str
) -> None:
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, data_path, "--list-ttl", "0")
    (fs.path / "step_1").mkdir()
    getattr(proxy, mode)()

    # A 256 MiB torch.save (a lookup of a new name, create, writes, close) while every
    # connection to the remote hangs; --list-ttl 0 makes every lookup miss due for a listing.
    _bounded([sys.executable, "-c", SAVE_256M, str(fs.path / "step_1" / "model.pt")], "torch.save of 256 MiB")
    wait_for(lambda: proxy.held > 0, timeout=BOUND_S, what="the daemon to reach the hung remote")
    # A DCP-like save of many new names: no lookup miss may pay for the hung listing again.
    names = [f"__{i}_0.distcp" for i in range(40)]
    script = "import sys, os\nfor n in sys.argv[2:]:\n    open(os.path.join(sys.argv[1], n), 'wb').write(b'x' * 4096)\n"
    _bounded([sys.executable, "-c", script, str(fs.path / "step_1"), *names], "40 small saves")
    for directory in (fs.path, fs.path / "step_1"):
        listing = _bounded(["ls", "-la", str(directory)], f"ls {directory}")
        assert listing.stdout
    _bounded(["stat", "-f", str(fs.path)], "statfs")
    assert (fs.path / "step_1" / "model.pt").stat().st_size > 256 << 20
    assert sorted(os.listdir(fs.path / "step_1")) == sorted([*names, "model.pt"])

    proxy.resume()
    start = time.monotonic()
    fs.unmount()
    assert time.monotonic() - start < BOUND_S * 4


WRITE_100M = """
import errno, sys, time
start = time.monotonic()
try:
    with open(sys.argv[1], "wb") as f:
        for _ in range(100):
            f.write(b"w" * (1 << 20))
except OSError as exc:
    assert exc.errno == errno.ENOSPC, exc
    print(f"ENOSPC after {time.monotonic() - start:.1f}s")
    sys.exit(0)
sys.exit("no ENOSPC")
"""


def test_full_timeout_bounds_the_stall_of_one_writer(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """Issue 11 #4: with the remote hung and the tier full, one writer gets ENOSPC
    within about --full-timeout, not once per write-back batch; statfs then counts
    durable local copies as free room."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "daemon", "--cache-size", "20M", "--full-timeout", "10")
    fs.expect_log("action=ENOSPC")
    fs.expect_log("event=request_bug")  # never expected: checked below
    proxy.blackhole()
    result = _bounded([sys.executable, "-c", WRITE_100M, str(fs.path / "big.pt")], "a writer on a full tier")
    assert "ENOSPC" in result.stdout, result.stdout
    print(result.stdout)
    assert "event=request_bug" not in fs.log_text()
    assert os.getxattr(fs.path / "big.pt", "user.burstfs.state") == b"incomplete"
    os.unlink(fs.path / "big.pt")

    # Space of durable files is free room for a writer: statfs says so.
    proxy.resume()
    (fs.path / "d.pt").write_bytes(b"d" * (12 << 20))
    wait_for(lambda: os.getxattr(fs.path / "d.pt", "user.burstfs.state") == b"durable", what="durable")
    vfs = os.statvfs(fs.path)
    assert vfs.f_bavail * vfs.f_frsize >= 19 << 20, vfs
    (fs.path / "e.pt").write_bytes(b"e" * (15 << 20))  # fits by evicting d.pt: no wait, no ENOSPC


def test_a_healed_black_hole_drains_without_a_restart_and_reads_fail_in_bounded_time(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """Files written into new directories while the remote is black-holed: their intents and
    uploads hang on connections that stay silent after the remote heals (a middlebox that lost
    their state). The drain gives those up and finishes without a restart (it waited up to 60 s
    per attempt of each, on every pass). Then, black-holed again, a read of an evicted file
    fails with EIO within the read budget (it was 8 attempts of 60 s per request), and evict
    answers without waiting for listings (20 s per directory)."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "passthrough", "--list-ttl", "1")
    fs.expect_log("event=remote_retry")
    fs.expect_log("event=request_failed")
    proxy.blackhole()
    names = [f"ckpt/step_{step}/shard.pt" for step in range(3)]
    for name in names:
        (fs.path / name).parent.mkdir(parents=True)
        (fs.path / name).write_bytes(name.encode() * 4096)
    wait_for(lambda: proxy.held >= 2, what="requests stuck in the black hole")
    proxy.resume(silently=True)
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "45", *(str(fs.path / n) for n in names)], "the drain")

    _bounded([str(BIN / "burstfs-admin"), "evict", str(fs.path / names[0])], "evict")
    proxy.blackhole()
    started = time.monotonic()
    with pytest.raises(OSError) as failed:
        (fs.path / names[0]).read_bytes()
    assert failed.value.errno == errno.EIO
    assert time.monotonic() - started < 90, "a read waited longer than its budget"
    # Evicting local copies (what frees a full tier) waits for no listing meanwhile.
    _bounded([str(BIN / "burstfs-admin"), "evict", str(fs.path / "ckpt")], "evict during the outage")
    proxy.resume()


def test_a_put_whose_body_the_remote_never_reads_is_sent_again_on_a_new_connection(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """The remote takes a PUT's head, then reads nothing and never answers (its receive
    window stays shut, as behind a middlebox that lost the connection's state), while
    other connections pass: the send of a 12 MiB body stalls, where no read timeout
    applies.  The PUT is given up after its send deadline and sent again on a new
    connection (it used to wait for good: only a restart drained it)."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "passthrough", "--part-size", "12M")
    fs.expect_log("event=remote_retry")
    fs.expect_log("event=request_failed")
    proxy.stall_next(1, match=lambda line: line.startswith("PUT ") and "/model.pt" in line)
    data = os.urandom(12 << 20)
    (fs.path / "ckpt").mkdir()
    (fs.path / "ckpt" / "model.pt").write_bytes(data)
    wait_for(lambda: proxy.injected >= 1, timeout=60, what="the PUT of model.pt stuck unread")
    result = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", "--timeout", "90", str(fs.path / "ckpt")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert sum("/model.pt" in line and line.startswith("PUT ") for line in proxy.requests) >= 2


@pytest.mark.parametrize("cached_manifest", [False, True])
def test_a_read_of_a_file_the_hung_remote_holds_fails_within_its_bound(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str], cached_manifest: bool
) -> None:
    """A read of a file that is only on the remote, while the remote hangs: EIO within the
    read's bound (30 s without progress), and the file's next read at once.  A manifest's
    GET, then a chunk's, then their retries each waited out the silent remote on their own
    (one read(2) took 100-120 s, the next one as long again).  Once the remote answers another
    file's fetch, the file reads again at once (its reads failed for 10 s more)."""
    proxy, url = s3_proxy
    data, other = os.urandom(24 << 20), os.urandom(1 << 20)
    reader = _durable_then_fresh_node(mounted_factory, proxy, url, "model.pt", data, {"other.pt": other})
    reader.expect_log("event=request_failed")
    target = reader.path / "ckpt" / "model.pt"
    if cached_manifest:
        with open(target, "rb") as f:
            assert f.read(1 << 20) == data[: 1 << 20]
    proxy.blackhole()
    reading = f"import sys; f = open({str(target)!r}, 'rb'); f.seek(20 << 20); f.read(1 << 20)"
    for what in ("the first read", "the next read"):
        try:
            result = subprocess.run([sys.executable, "-c", reading], capture_output=True, text=True, timeout=50)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{what} of a file on the hung remote did not fail within 50 s") from None
        assert result.returncode != 0 and "Input/output error" in result.stderr, (what, result.stderr)
    proxy.resume()

    def other_read() -> bool:
        try:
            return (reader.path / "ckpt" / "other.pt").read_bytes() == other
        except OSError:  # EIO until a listing lands (a fresh node whose first listing failed)
            return False

    wait_for(other_read, timeout=60, what="another file read after the heal")
    with open(target, "rb") as f:
        f.seek(20 << 20)
        assert f.read(1 << 20) == data[20 << 20 : 21 << 20]


def test_a_fresh_node_that_cannot_list_the_remote_says_eio_not_enoent(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """Node B mounts a fresh cache, then the remote hangs: a checkpoint it cannot see is
    unknown, not absent. ENOENT (and an empty ls) told a restart script there was no
    checkpoint, and its next save went over node A's on the remote."""
    proxy, url = s3_proxy
    original = os.urandom(1 << 20)
    b = _durable_then_fresh_node(mounted_factory, proxy, url, "step_100.pt", original)
    b.expect_log("event=list_failed")
    b.expect_log("event=listing_slow")
    proxy.blackhole()
    assert os.listdir(b.path) == ["ckpt"]  # the root was listed at mount: ckpt is the remote's
    for probe in (["stat", str(b.path / "ckpt" / "step_100.pt")], ["ls", str(b.path / "ckpt")]):
        result = subprocess.run(probe, capture_output=True, text=True, timeout=BOUND_S)
        assert result.returncode != 0 and "Input/output error" in result.stderr, (probe, result.stderr)
    with pytest.raises(OSError) as refused:
        (b.path / "ckpt" / "step_100.pt").write_bytes(b"a fresh start, over the checkpoint")
    assert refused.value.errno == errno.EIO
    # The EIO says "see burstfs-admin status": a node that drains nothing shows the failed
    # listings there too (it showed no error at all).
    status = [str(BIN / "burstfs-admin"), "status", str(b.path)]

    def listing_failure_shown() -> bool:
        doc = json.loads(_bounded([*status, "--json"], "status").stdout)
        return bool(doc["drain"]["errors_by_kind"].get("read_failed")) and not doc["drain"]["outage"]

    wait_for(listing_failure_shown, timeout=60, what="the failed listing in status")
    shown = _bounded(status, "status").stdout
    assert "read_failed=" in shown and "list ckpt" in shown, shown
    proxy.resume()

    def visible() -> bool:
        try:
            return (b.path / "ckpt" / "step_100.pt").exists()
        except OSError:  # EIO until a listing lands
            return False

    wait_for(visible, timeout=60, what="the listing after the heal")
    assert (b.path / "ckpt" / "step_100.pt").read_bytes() == original


def test_unmount_does_not_wait_for_a_pass_stuck_on_a_hung_remote(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """`burstfs unmount` (no --wait) while the mover's pass retries an intent record on a
    black-holed remote (3 attempts of 10 s): the pass is cancelled, the files stay staged,
    and the next mount drains them (the unmount used to wait up to 30 s for the pass)."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "passthrough")
    fs.expect_log("event=remote_retry")
    (fs.path / "ck").mkdir()
    proxy.blackhole()
    data = os.urandom(1 << 20)
    (fs.path / "ck" / "shard.pt").write_bytes(data)
    wait_for(lambda: proxy.held >= 1, timeout=30, what="the intent record stuck in the black hole")
    time.sleep(1)
    started = time.monotonic()
    fs.unmount()
    assert time.monotonic() - started < 15, "unmount waited for the hung remote"
    # Drained without a mount while the remote is a black hole: --timeout bounds it (exit 3).
    drained = burstfs("drain", "--cache", str(fs.cache), "--now", "--timeout", "3", check=False, timeout=BOUND_S)
    assert drained.returncode == 3 and "after 3s: 1 file is not durable" in drained.stderr, drained.stderr
    proxy.resume()
    fs.mount()
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path / "ck")], "the drain after the heal")
    assert (fs.path / "ck" / "shard.pt").read_bytes() == data


def test_a_file_remote_whose_file_system_unmounts_halts_the_drain_and_resumes_after(
    mounted_factory: type[MountedFS],
) -> None:
    """The parallel file system under a file:// remote goes away and leaves its empty mount
    point: the next checkpoint stayed staged until then, but went "durable" onto the local disk
    under the mount point, and was lost once the real file system came back."""
    fs = mounted_factory("pfs", None, ())  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "ck").mkdir()
    (fs.path / "ck" / "step_1.pt").write_bytes(b"one")
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path / "ck")], "the first drain")
    away = fs.root / "remote.unmounted"
    fs.remote_dir.rename(away)
    fs.remote_dir.mkdir()  # the mount point left behind
    data = os.urandom(1 << 20)
    (fs.path / "ck" / "step_2.pt").write_bytes(data)
    status = [str(BIN / "burstfs-admin"), "status", str(fs.path)]
    wait_for(
        lambda: "no longer holds .burstfs/" in subprocess.run(status, capture_output=True, text=True).stdout,
        timeout=BOUND_S,
        what="the halted drain in status",
    )
    waited = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", "--timeout", "5", str(fs.path / "ck")], capture_output=True, text=True
    )
    assert waited.returncode != 0 and "no longer holds .burstfs/" in waited.stderr
    assert list(fs.remote_dir.iterdir()) == []  # nothing went onto the mount point's disk
    assert (fs.path / "ck" / "step_1.pt").read_bytes() == b"one"  # the namespace still shows both
    assert (fs.path / "ck" / "step_2.pt").read_bytes() == data
    fs.remote_dir.rmdir()
    away.rename(fs.remote_dir)  # the file system is back
    # A wait right away succeeds: finding the drain halted, it has it look at the remote now.
    # It exited 4 ("halted") until the drain's next look, up to 15 s later (unmount --wait refused).
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path / "ck")], "the drain after the heal")
    assert (fs.remote_dir / "ck" / "step_2.pt").read_bytes() == data


def test_a_restart_refuses_an_empty_stand_in_for_a_file_remote_it_drained_to(
    mounted_factory: type[MountedFS],
) -> None:
    """The same, with the daemon restarted meanwhile (a crash, an upgrade): the new daemon took
    the empty mount point for a new remote, set it up, and drained the next checkpoint there
    ("durable" on the local disk).  Its cache drained to that remote before: it is refused."""
    fs = mounted_factory("pfs", None, ())  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "step_1.pt").write_bytes(b"one")
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path)], "the first drain")
    away = fs.root / "remote.unmounted"
    fs.remote_dir.rename(away)
    fs.remote_dir.mkdir()  # the mount point left behind
    (fs.path / "step_2.pt").write_bytes(b"two")  # staged: the running daemon halts its drain
    for rank in range(8):  # uploads in flight when the drain halts: `burstfs drain` still ends
        (fs.path / f"shard_{rank}.pt").write_bytes(b"shard")
    fs.unmount()
    refused = burstfs("mount", str(fs.path), "--cache", str(fs.cache), "--remote", fs.remote_url, check=False)
    assert refused.returncode != 0 and "no longer holds .burstfs/" in refused.stderr, refused.stderr
    # Drained without a mount: halted at once (exit 1), nothing written there.
    drained = burstfs("drain", "--cache", str(fs.cache), "--now", check=False, timeout=BOUND_S)
    assert drained.returncode == 1 and "no longer holds .burstfs/" in drained.stderr, drained.stderr
    assert list(fs.remote_dir.iterdir()) == []  # nothing set up on the mount point's disk
    fs.remote_dir.rmdir()
    away.rename(fs.remote_dir)  # the file system is back
    fs.mount()
    assert (fs.path / "step_1.pt").read_bytes() == b"one"
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path)], "the drain after the heal")
    assert (fs.remote_dir / "step_2.pt").read_bytes() == b"two"
    assert (fs.remote_dir / "shard_7.pt").read_bytes() == b"shard"


def test_status_counts_a_sparse_file_by_its_allocated_bytes(mounted_factory: type[MountedFS]) -> None:
    """Issue 11 #4: 'burstfs holds' is what the data files take, not their logical sizes."""
    fs = mounted_factory("sparse", None, ("--no-passthrough",))  # type: ignore[call-arg]
    fs.mount()
    with open(fs.path / "sparse.pt", "wb") as f:
        f.seek(300 << 20)
        f.write(b"tail")
    status = subprocess.run(
        [str(Path(sys.executable).parent / "burstfs-admin"), "status", str(fs.path), "--json"],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
        check=True,
    )
    import json

    doc = json.loads(status.stdout)
    assert doc["local_tier"]["used_bytes"] < 1 << 20, doc["local_tier"]
    assert (
        doc["states"]["staged"]["bytes"] + doc["states"]["durable"]["bytes"] + doc["states"]["draining"]["bytes"]
        == (300 << 20) + 4
    )


def test_status_during_an_outage_has_a_headline_and_no_stale_rate(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """Issue 11 #8: with the remote refusing connections, status says since when and why,
    and the drain rate is 0 (not the rate from before the outage) with no ETA."""
    import json

    proxy, url = s3_proxy
    port = free_port()
    fs = _mount(mounted_factory, proxy, url, "daemon", "--metrics-addr", f"127.0.0.1:{port}")
    admin = str(Path(sys.executable).parent / "burstfs-admin")
    (fs.path / "before.pt").write_bytes(os.urandom(1 << 20))
    wait_for(lambda: os.getxattr(fs.path / "before.pt", "user.burstfs.state") == b"durable", what="durable")
    proxy.close()  # nothing listens on its port any more: connection refused
    (fs.path / "during.pt").write_bytes(os.urandom(1 << 20))

    def outage() -> dict | None:  # type: ignore[type-arg]
        doc = json.loads(
            subprocess.run(
                [admin, "status", str(fs.path), "--json"], capture_output=True, text=True, timeout=BOUND_S, check=True
            ).stdout
        )
        return doc if doc["drain"]["outage"] else None

    kinds_seen: list[str] = []
    texts: list[str] = []
    first_since: list[float] = []

    def spent() -> dict | None:  # type: ignore[type-arg]
        doc = outage()
        if doc is not None:
            kinds_seen.append(doc["drain"]["outage"]["kind"])
            if kinds_seen == ["retrying"]:
                first_since.append(doc["drain"]["outage"]["since"])
                texts.append(
                    subprocess.run([admin, "status", str(fs.path)], capture_output=True, text=True, check=True).stdout
                )
        return doc if kinds_seen and kinds_seen[-1] != "retrying" else None

    doc = wait_for(spent, timeout=120, interval=0.3, what="an outage in status")
    # While the first request is still retried, status already says so (a silent remote
    # costs a read timeout per attempt: minutes before the retries are spent).
    assert kinds_seen[0] == "retrying", kinds_seen
    assert "REMOTE RETRYING since" in texts[0] or "REMOTE UNREACHABLE since" in texts[0], texts[0]
    assert doc["drain"]["outage"]["unreachable"], doc["drain"]
    assert doc["drain"]["outage"]["since"] <= first_since[0], (doc["drain"]["outage"], first_since)  # one outage
    assert doc["drain"]["throughput_bps"] == 0 and doc["drain"]["eta_s"] is None, doc["drain"]
    text = subprocess.run([admin, "status", str(fs.path)], capture_output=True, text=True, timeout=BOUND_S).stdout
    print(text)
    (headline,) = [line for line in text.splitlines() if line.startswith("REMOTE UNREACHABLE since")]
    assert "http://" not in headline and "Could not connect" in headline, headline
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    (outage_s,) = [
        float(line.split()[1]) for line in metrics.splitlines() if line.startswith("burstfs_remote_outage_s")
    ]
    assert outage_s > 0 and "burstfs_drain_throughput_bytes_per_second 0.0" in metrics


def test_outage_headline_uses_the_error_kind_and_the_first_failed_attempt() -> None:
    """Issue 11 leftover (c): the headline says "unreachable" from the error's kind, not by
    matching words in its message, and dates the outage from its first failed attempt
    (before the retries that preceded the recorded error)."""
    from burstfs.mover import MoverStats
    from burstfs.status import outage_of

    stats = MoverStats()
    stats.bytes_drained_recent.append((time.time() - 100, 1 << 20))
    first = time.time() - 40  # the request's first attempt; its retries ran until now
    stats.retried("put ckpt/a.pt: EndpointError", first)
    retrying = outage_of(stats)  # no answer yet: unreachable while the retries go on, too
    assert retrying is not None and retrying["kind"] == "retrying" and retrying["unreachable"], retrying
    stats.error("unavailable", "put ckpt/a.pt: remote s3://b unavailable after 8 attempts: EndpointError")
    outage = outage_of(stats)
    assert outage is not None and outage["unreachable"] and outage["kind"] == "unavailable", outage
    assert outage["since"] == first, outage
    # A refusal whose text happens to mention a connection is not "unreachable".
    stats.error("access_denied", "s3://b: put: access denied (AccessDenied) on connection 3")
    outage = outage_of(stats)
    assert outage is not None and not outage["unreachable"] and outage["kind"] == "access_denied", outage
    assert outage["since"] == first and outage["errors"] == 2, outage
    # Progress ends the outage; the next failure starts a new one.
    stats.bytes_drained_recent.append((time.time(), 1))
    assert outage_of(stats) is None
    time.sleep(0.01)
    stats.error("unavailable", "later")
    outage = outage_of(stats)
    assert outage is not None and outage["since"] > first, outage


def test_a_read_failing_again_at_once_is_listed_once_and_starts_no_outage() -> None:
    """One ``cat`` of a file on a refusing remote was ``read_failed=3``, three identical lines
    (the kernel asks again), and a listing's line said ``list ckpt: list ckpt: ...``."""
    from burstfs.mover import MoverStats
    from burstfs.status import outage_of

    stats = MoverStats()
    for _ in range(3):
        stats.read_failed("read of inode 4", "get ckpt/a.pt: remote s3://b unavailable after 8 attempts")
    stats.read_failed("list ckpt", "list ckpt: remote s3://b unavailable after 8 attempts")
    assert dict(stats.errors_by_kind) == {"read_failed": 2}
    assert [m for _, _, m in stats.recent_errors] == [
        "read of inode 4: get ckpt/a.pt: remote s3://b unavailable after 8 attempts",
        "list ckpt: remote s3://b unavailable after 8 attempts",
    ]
    assert outage_of(stats) is None
    stats.recent_errors[-1] = (time.time() - 10, *stats.recent_errors[-1][1:])  # a while later: again
    stats.read_failed("list ckpt", "list ckpt: remote s3://b unavailable after 8 attempts")
    assert stats.errors_by_kind["read_failed"] == 3


def test_an_outage_that_turns_from_retrying_to_throttled_keeps_its_start() -> None:
    """A store answering 503 SlowDown to every attempt: the headline said RETRYING since T,
    then THROTTLING since the moment the retries ran out (the throttled end was taken for an
    answer).  It is one outage, dated from its first failed attempt."""
    from botocore.exceptions import ClientError

    from burstfs.mover import MoverStats
    from burstfs.objects import reported_call
    from burstfs.remote import RetryPolicy
    from burstfs.status import outage_of

    class SlowDownStore:
        url = "s3://b/ck"

        def is_temp_failure(self, exc: BaseException) -> bool:
            return True

        def is_throttling(self, exc: BaseException) -> bool:
            return True

    async def put() -> None:
        raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}}, "PutObject")

    stats = MoverStats()
    stats.bytes_drained_recent.append((time.time() - 100, 1 << 20))
    policy = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.01)
    started = time.time()
    with pytest.raises(RemoteError) as failed:
        asyncio.run(reported_call(policy, SlowDownStore(), stats, put, what="put ck/a.pt"))  # type: ignore[arg-type]
    assert failed.value.kind == "throttled"
    retrying = outage_of(stats)
    assert retrying is not None and retrying["since"] <= started + 0.01, retrying
    assert retrying["kind"] == "retrying" and not retrying["unreachable"], retrying  # it answers: "slow down"
    stats.error(failed.value.kind, str(failed.value))
    outage = outage_of(stats)
    assert outage is not None and outage["kind"] == "throttled" and not outage["unreachable"], outage
    assert outage["since"] == retrying["since"], (outage, retrying)


def test_the_drain_rate_is_zero_during_an_outage_in_status_and_the_metric() -> None:
    """The metric kept the last 30 s average of the uploads before the outage (9.4 MB/s while
    status said 0 B/s): a dashboard showed the drain moving when it was not."""
    from burstfs.mover import MoverStats
    from burstfs.status import drain_rate, outage_of

    stats = MoverStats()
    stats.bytes_drained_recent.append((time.time() - 5, 50 << 20))
    stats.bytes_sent_recent.append((time.time() - 5, 50 << 20))
    assert drain_rate(stats, outage_of(stats)) > 0
    stats.error("unavailable", "s3://b: put: 503 Service Unavailable")
    assert drain_rate(stats, outage_of(stats)) == 0.0


def test_the_drain_rate_counts_parts_as_they_land_and_the_eta_what_is_left() -> None:
    """Found in an acceptance pass: with one 96 MiB upload under way and a tiny file durable
    just before, status said "0 B/s, ETA 161867h" (the rate counted only whole files, over
    30 s), and the file was durable a second later."""
    from burstfs.journal import DRAINING, FILE_STATES
    from burstfs.mover import MoverStats
    from burstfs.status import drain_eta, outage_of

    stats = MoverStats()
    now = time.time()
    for age in (3.0, 2.0, 1.0, 0.0):  # four 8 MiB parts of one file, one a second
        stats.bytes_sent_recent.append((now - age, 8 << 20))
    rate = stats.throughput()
    assert 7 << 20 < rate < 9 << 20, rate  # 8 MiB/s: not averaged over the 30 s window
    stats.sent(5, 8 << 20)
    stats.sent(5, 8 << 20)
    states = {s: {"files": 0, "bytes": 0} for s in FILE_STATES}
    states[DRAINING] = {"files": 1, "bytes": 96 << 20}
    assert drain_eta(states, 8 << 20, stats.landed_in_flight()) == 10.0  # 80 MiB left of it
    stats.upload_over(5)
    assert stats.landed_in_flight() == 0
    stats.error("unavailable", "s3://b: put ck/x.intent: 503 SlowDown")
    assert outage_of(stats) is not None
    stats.sent(6, 8 << 20)  # a part landed since: the drain moves, no "nothing drained since" headline
    assert outage_of(stats) is None


def test_outage_headline_comes_while_requests_are_still_retried() -> None:
    """A remote that never answers costs a read timeout per attempt: the headline comes with the
    first retry, says how many, and goes once any request is answered."""
    from burstfs.mover import MoverStats
    from burstfs.status import outage_of

    stats = MoverStats()
    stats.bytes_drained_recent.append((time.time() - 100, 1 << 20))
    assert outage_of(stats) is None
    first = time.time() - 20
    stats.retried("put ckpt/a.pt: ReadTimeoutError: Read timeout on endpoint URL", first)
    stats.retried("put ckpt/b.pt: ReadTimeoutError: Read timeout on endpoint URL", time.time() - 20)
    outage = outage_of(stats)
    assert outage is not None and outage["kind"] == "retrying" and outage["since"] == first, outage
    assert outage["errors"] == 2 and "b.pt" in outage["reason"], outage
    stats.answered()
    assert outage_of(stats) is None
    # Retries from before the last file became durable are no outage either.
    stats.retried("put ckpt/c.pt: slow", time.time() - 1)
    stats.bytes_drained_recent.append((time.time(), 1))
    assert outage_of(stats) is None


def test_a_mount_rides_out_one_503_and_a_daemon_restarted_in_an_outage_comes_back(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """One 503 on the mount's probe failed the mount ("cannot reach", exit 1): a Slurm prolog
    drained the node for it.  And a daemon killed while the remote was down could not be
    mounted again until the remote came back: no checkpoint could be taken meanwhile."""
    proxy, url = s3_proxy
    proxy.fail_next(1, status=503)
    fs = _mount(mounted_factory, proxy, url, "daemon")
    (fs.path / "before.pt").write_bytes(b"b" * 10_000)
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path)], "the drain")
    proxy.fail_next(10_000, status=503)
    (fs.path / "staged.pt").write_bytes(b"s" * 10_000)
    fs.kill()
    fs.expect_log("event=drain_error")
    fs.expect_log("event=request_failed")
    started = time.monotonic()
    remount = burstfs(
        "mount",
        str(fs.path),
        "--cache",
        str(fs.cache),
        "--remote",
        url,
        "--endpoint-url",
        proxy.endpoint,
        *DATA_PATHS["daemon"],
        check=False,
    )
    assert remount.returncode == 0, remount.stderr
    assert "mounts anyway" in remount.stderr and time.monotonic() - started < 20
    (fs.path / "during.pt").write_bytes(b"d" * 10_000)  # checkpoints go on during the outage
    proxy.clear()
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "60", str(fs.path)], "the drain after the outage")
    fresh = mounted_factory("fresh", url, ("--endpoint-url", proxy.endpoint))  # type: ignore[call-arg]
    proxy.fail_next(10_000, status=503)
    refused = burstfs(
        "mount",
        str(fresh.path),
        "--cache",
        str(fresh.cache),
        "--remote",
        url,
        "--endpoint-url",
        proxy.endpoint,
        check=False,
    )
    assert refused.returncode == 1 and "503" in refused.stderr, refused.stderr  # a cache never mounted there: refused
    proxy.clear()


def test_prefetch_of_local_files_while_the_remote_hangs_waits_for_one_listing_not_one_per_directory(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """`burstfs-admin prefetch run/step_100` of six rank directories whose files are all local
    and durable, the remote black-holed and the listings due: each directory on the way and
    under it waited out a 20 s listing attempt in turn (over two minutes for nothing to fetch)."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "passthrough", "--list-ttl", "1")
    fs.expect_log("event=list_failed")
    fs.expect_log("event=listing_slow")
    for rank in range(6):
        (fs.path / "run" / "step_100" / f"rank{rank}").mkdir(parents=True)
        (fs.path / "run" / "step_100" / f"rank{rank}" / "shard.pt").write_bytes(os.urandom(100_000))
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path)], "the drain")
    proxy.blackhole()
    time.sleep(1.5)  # every listing due
    try:  # one listing attempt (20 s), not eight
        result = subprocess.run(
            [str(BIN / "burstfs-admin"), "prefetch", str(fs.path / "run" / "step_100")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError("prefetch of local files waited a listing per directory") from None
    assert result.returncode == 0, result.stderr
    proxy.resume()


def test_directories_this_cache_made_or_listed_take_saves_after_a_restart_while_the_remote_hangs(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """kill -9 and a restart while the remote hangs: an empty directory this node made (the
    trainer's checkpoint dir), a step emptied by `rm`, and the mount root answered EIO to ls,
    create and rmdir for the whole outage: what this cache knew of them lived only in memory."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "passthrough")
    fs.expect_log("event=list_failed")
    fs.expect_log("event=listing_slow")
    fs.expect_log("remote_unreachable")
    (fs.path / "run" / "checkpoints").mkdir(parents=True)
    (fs.path / "run" / "step_50").mkdir()
    (fs.path / "run" / "step_50" / "model.pt").write_bytes(b"m" * 1000)
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path)], "the drain")
    proxy.blackhole()
    fs.kill()
    fs.mount()  # "mounted on this remote before, so it mounts anyway" after one bounded try
    assert os.listdir(fs.path / "run" / "checkpoints") == []
    (fs.path / "run" / "checkpoints" / "step100.pt").write_bytes(b"s" * 1000)
    shutil.rmtree(fs.path / "run" / "step_50")
    assert sorted(os.listdir(fs.path / "run")) == ["checkpoints"]
    (fs.path / "top.pt").write_bytes(b"t" * 1000)
    proxy.resume()
    _bounded([str(BIN / "burstfs-admin"), "wait", "--timeout", "25", str(fs.path)], "the drain after the heal")


def test_a_wait_on_an_unreachable_remote_says_so_and_counts_no_delete_nobody_asked_for(
    mounted_factory: type[MountedFS], s3_proxy: tuple[FaultProxy, str]
) -> None:
    """The endpoint refuses connections and three files are written (nothing removed): `wait`
    and `unmount --wait` said "2 remote deletes queued" (the intents of failed attempts) and
    not a word of the remote, and the progress note called the file "draining"."""
    proxy, url = s3_proxy
    fs = _mount(mounted_factory, proxy, url, "passthrough")
    proxy.close()  # from now on: connection refused
    for i in range(3):
        (fs.path / f"f{i}").write_bytes(os.urandom(200_000))

    def failed_attempts() -> int:
        with contextlib.closing(sqlite3.connect(f"file:{fs.cache / 'journal.db'}?mode=ro", uri=True)) as db:
            return int(db.execute("SELECT count(*) FROM remote_deletes WHERE reason='upload'").fetchone()[0])

    wait_for(lambda: failed_attempts() >= 2, timeout=60, what="failed upload attempts")
    waited = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", "--timeout", "3", str(fs.path)], capture_output=True, text=True, timeout=60
    )
    assert waited.returncode == 3, waited.stderr
    outage = re.compile(r"REMOTE (UNREACHABLE|RETRYING) since .*EndpointConnectionError")
    assert outage.search(waited.stderr) and "deletes queued" not in waited.stderr, waited.stderr
    stopped = burstfs("unmount", "--wait", "--wait-timeout", "3", str(fs.path), check=False, timeout=60)
    assert stopped.returncode == 1 and "3 files still not durable after 3s" in stopped.stderr, stopped.stderr
    assert outage.search(stopped.stderr) and "deletes queued" not in stopped.stderr, stopped.stderr
    assert fs.path.is_mount()
    # The daemon killed while `unmount --wait` waits: it says so as burstfs, with the way out.
    waiting = subprocess.Popen(
        [str(BIN / "burstfs"), "unmount", "--wait", str(fs.path)], stderr=subprocess.PIPE, text=True
    )
    time.sleep(1)
    os.kill(fs.daemon_pid(), 9)
    _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1 and err.startswith("burstfs: lost the daemon"), err
    assert f"`burstfs unmount {fs.path}` without --wait clears a dead mount" in err, err

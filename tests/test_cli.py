"""Bad input to the CLI: a clear message on stderr, a non-zero exit, nothing left behind.

Exit codes (burstfs/cli.py): 0 success, 1 runtime failure, 2 bad input.  A
refused mount leaves nothing mounted and changes nothing in an existing cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, FUSE_OK, MountedFS, burstfs, force_unmount, is_mounted, wait_for

from burstfs.cachelock import CacheLock, secure_cache_dir
from burstfs.committer import DEFER_S
from burstfs.config import MountConfig, parse_remote_url
from burstfs.daemon import StartupWatch, preflight
from burstfs.errors import ConfigError
from burstfs.mountinfo import device_of

USAGE = 2


def refused(*args: str) -> str:
    """Run ``burstfs *args``, expect exit 2, return stderr."""
    result = burstfs(*args, check=False)
    assert result.returncode == USAGE, (result.returncode, result.stdout, result.stderr)
    assert result.stderr.strip(), "no message on stderr"
    assert "Traceback" not in result.stderr
    return result.stderr


def cache_fingerprint(cache: Path) -> dict[str, str]:
    """Names and contents of everything in a cache dir except the lock file."""
    found = {}
    for top, _, files in os.walk(cache):
        for name in files:
            path = Path(top) / name
            if name != "lock":
                found[str(path.relative_to(cache))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path, str]:
    """(mount point, cache dir that does not exist yet, file:// remote URL)."""
    (tmp_path / "mnt").mkdir()
    (tmp_path / "remote").mkdir()
    return tmp_path / "mnt", tmp_path / "cache", f"file://{tmp_path / 'remote'}"


def test_mount_point_missing(dirs: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, cache, remote = dirs
    err = refused("mount", str(tmp_path / "nope"), "--cache", str(cache), "--remote", remote)
    assert "does not exist" in err and str(tmp_path / "nope") in err
    assert not cache.exists()  # refused before anything was created


def test_mount_point_not_a_directory(dirs: tuple[Path, Path, str], tmp_path: Path) -> None:
    _, cache, remote = dirs
    (tmp_path / "plain").write_text("x")
    err = refused("mount", str(tmp_path / "plain"), "--cache", str(cache), "--remote", remote)
    assert "is not a directory" in err
    assert not cache.exists()


def test_cache_dir_unusable(dirs: tuple[Path, Path, str], tmp_path: Path) -> None:
    mnt, _, remote = dirs
    (tmp_path / "plain").write_text("x")
    err = refused("mount", str(mnt), "--cache", str(tmp_path / "plain" / "cache"), "--remote", remote)
    assert f"{tmp_path / 'plain'} is not a directory" in err
    err = refused("mount", str(mnt), "--cache", str(tmp_path / "plain"), "--remote", remote)
    assert "is not a directory" in err
    err = refused("mount", str(mnt), "--cache", str(tmp_path / "no" / "such" / "cache"), "--remote", remote)
    assert "does not exist" in err
    err = refused("mount", str(mnt), "--cache", str(mnt / "cache"), "--remote", remote)
    assert "must not overlap" in err and "contains the cache dir" in err
    assert not is_mounted(mnt) and os.listdir(mnt) == []


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://", "missing bucket name"),
        ("s3://Bad_Bucket", "not a valid S3 bucket name"),
        ("s3://bucket/a//b", "empty, '.' or '..' components"),
        ("ftp://x", "unsupported scheme 'ftp'"),
        ("file://relative", "absolute path"),
        ("file:///", "expected file:///ABSOLUTE/DIR"),
        ("/just/a/path", "unsupported scheme"),
    ],
)
def test_malformed_remote_urls(dirs: tuple[Path, Path, str], url: str, message: str) -> None:
    mnt, cache, _ = dirs
    err = refused("mount", str(mnt), "--cache", str(cache), "--remote", url)
    assert message in err and repr(url) in err
    assert not cache.exists() and not is_mounted(mnt)


def test_bad_option_values(dirs: tuple[Path, Path, str]) -> None:
    mnt, cache, remote = dirs
    base = ("mount", str(mnt), "--cache", str(cache), "--remote", remote)
    assert "not a size: 'lots'" in refused(*base, "--cache-size", "lots")
    assert "part size must be between" in refused(*base, "--part-size", "1M")
    assert "Missing option '--remote'" in refused("mount", str(mnt), "--cache", str(cache))
    assert "--fsync" in refused(*base, "--fsync", "sometimes")
    assert not cache.exists() and not is_mounted(mnt)


def one_line(err: str) -> str:
    """``err`` when it is exactly one line (SEMANTICS.md "Command-line errors")."""
    assert len(err.strip().splitlines()) == 1, err
    return err


def admin(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the ``burstfs-admin`` CLI of this environment."""
    return subprocess.run([str(BIN / "burstfs-admin"), *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    "url", ["notaurl", "ftp://host", "http://", "http://host:99999", "http://127.0.0.1:9000/bucket"]
)
def test_a_bad_endpoint_url_is_refused_in_one_line(dirs: tuple[Path, Path, str], url: str) -> None:
    mnt, cache, _ = dirs
    err = one_line(refused("mount", str(mnt), "--cache", str(cache), "--remote", "s3://bkt/p", "--endpoint-url", url))
    assert f"--endpoint-url {url!r}: not an S3 endpoint" in err
    result = admin("latest", "--remote", "s3://bkt/p", "--endpoint-url", url)
    assert result.returncode == USAGE and "Traceback" not in result.stderr, result.stderr
    assert f"--endpoint-url {url!r}" in one_line(result.stderr)
    assert not cache.exists() and not is_mounted(mnt)


@pytest.mark.parametrize("subdir", ["../ckpt", "ckpt/./run", "ckpt//run"])
def test_latest_refuses_a_remote_subdirectory_that_is_not_one(tmp_path: Path, subdir: str) -> None:
    result = admin("latest", "--remote", f"file://{tmp_path}", subdir)
    assert result.returncode == USAGE and "is a subdirectory of the remote" in result.stderr, result.stderr


def test_a_bad_aws_endpoint_url_is_refused_and_named(dirs: tuple[Path, Path, str]) -> None:
    mnt, cache, _ = dirs
    env = {**os.environ, "AWS_ENDPOINT_URL": "garbage"}
    result = burstfs("mount", str(mnt), "--cache", str(cache), "--remote", "s3://bkt/p", check=False, env=env)
    assert result.returncode == USAGE and "AWS_ENDPOINT_URL 'garbage'" in one_line(result.stderr), result.stderr
    result = admin("latest", "--remote", "s3://bkt/p", env=env)
    assert result.returncode == USAGE and "AWS_ENDPOINT_URL 'garbage'" in one_line(result.stderr), result.stderr
    assert not cache.exists() and not is_mounted(mnt)


@pytest.mark.parametrize("scheme", ["https://", "http://admin:hunter2@"])
def test_an_endpoint_that_is_not_s3_as_configured_is_one_line(
    dirs: tuple[Path, Path, str], s3_env: str, scheme: str
) -> None:
    """TLS to a port that speaks plain HTTP (moto here), or credentials in the URL (S3 signs
    with the AWS ones): the mount says it cannot talk to the endpoint in one line, the
    password hidden (it printed botocore's SSLError / HTTPClientError traceback)."""
    mnt, cache, _ = dirs
    endpoint = s3_env.replace("http://", scheme)
    result = burstfs(
        "mount", str(mnt), "--cache", str(cache), "--remote", "s3://bkt/p", "--endpoint-url", endpoint, check=False
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    shown = endpoint.replace("hunter2", "***")
    if "@" in scheme:  # refused before any request: exit 2, the password hidden
        assert result.returncode == USAGE and "credentials in the URL are not used" in one_line(result.stderr)
    else:
        assert f"cannot talk to s3://bkt/p (endpoint {shown})" in one_line(result.stderr), result.stderr
    assert "hunter2" not in result.stderr and not is_mounted(mnt)


def test_a_bad_endpoint_url_does_not_show_its_password(dirs: tuple[Path, Path, str]) -> None:
    mnt, cache, _ = dirs
    url = "ftp://admin:hunter2@host:9000"
    err = refused("mount", str(mnt), "--cache", str(cache), "--remote", "s3://bkt/p", "--endpoint-url", url)
    assert "hunter2" not in err and "admin:***@host:9000" in err


@pytest.mark.parametrize(
    "option, value",
    [
        ("--drain-delay", "nan"),
        ("--drain-delay", "inf"),
        ("--full-timeout", "nan"),
        ("--full-timeout", "-1"),
        ("--list-ttl", "inf"),
        ("--remote-wait", "nan"),
        ("--remote-wait", "61"),
    ],
)
def test_durations_must_be_finite_and_in_range(dirs: tuple[Path, Path, str], option: str, value: str) -> None:
    mnt, cache, remote = dirs
    try:
        err = one_line(refused("mount", str(mnt), "--cache", str(cache), "--remote", remote, option, value))
    finally:
        force_unmount(mnt)  # a regression mounts with the value: leave nothing behind
    assert f"{option} must be a number of seconds" in err and f"not {float(value)}" in err
    assert not cache.exists()


@pytest.mark.parametrize(
    "option, value, says",
    [
        ("--concurrency", "100000", "--concurrency must be from 1 to 64"),
        ("--max-files", "0", "--max-files must be from 1 to 64"),
        ("--commit-marker", "", "--commit-marker pattern must not be empty"),
        # matched against names only: the checkpoint had no marker at all (no commit, no latest)
        ("--commit-marker", "step_1/.metadata", "a pattern matches a file's name, not its path"),
    ],
)
def test_drain_bounds_are_refused_in_one_line(dirs: tuple[Path, Path, str], option: str, value: str, says: str) -> None:
    """A --concurrency of 100000 mounted with a drain budget of 1.6 TB of memory."""
    mnt, cache, remote = dirs
    err = one_line(refused("mount", str(mnt), "--cache", str(cache), "--remote", remote, option, value))
    assert says in err
    assert not cache.exists()


@pytest.mark.parametrize(
    "args, says",
    [
        (("--remote", "s3://bkt/.burstfs"), "'.burstfs' is where burstfs keeps the bookkeeping"),
        (("--remote", "s3://bkt/run/.burstfs/x"), "'.burstfs' is where burstfs keeps the bookkeeping"),
        (("--remote", "file://{remote}/.burstfs"), "'.burstfs' is where burstfs keeps the bookkeeping"),
        (("--read-ahead", "3"), "--read-ahead must be a multiple of 4K (the kernel counts it in pages)"),
        (("--read-ahead", "0"), "from 4K to 1G, not 0 bytes"),
        (("--read-ahead", "6K"), "not 6144 bytes"),
        (("--node-id", ""), "--node-id is empty"),
        (("--node-id", "a@b"), "node id 'a@b': use 1-63 letters"),
        (("--region", "bad region!"), "--region 'bad region!': not a region name"),
        (("--region", ""), "--region '': not a region name"),
    ],
)
def test_bad_remote_read_ahead_node_id_and_region_are_refused_before_the_mount(
    dirs: tuple[Path, Path, str], args: tuple[str, str], says: str
) -> None:
    """Acceptance findings: a remote inside another prefix's .burstfs/ rewrote that mount's
    manifests; --read-ahead 3, --node-id "" mounted; --region "bad region!" exited 1 at
    the first request.  Each is bad input: one line, exit 2, nothing created."""
    mnt, cache, remote = dirs
    option, value = args
    value = value.replace("{remote}", remote.removeprefix("file://"))
    base = ("mount", str(mnt), "--cache", str(cache), "--remote", remote)
    try:
        err = one_line(refused(*base, option, value))
    finally:
        force_unmount(mnt)  # a regression mounts with the value: leave nothing behind
    assert says in err, err
    assert not cache.exists() and not is_mounted(mnt)
    assert os.listdir(Path(remote.removeprefix("file://"))) == []  # nothing made in the remote either


def test_admin_latest_refuses_a_bad_region_in_one_line(tmp_path: Path) -> None:
    result = admin("latest", "--remote", f"file://{tmp_path}", "--region", "bad region!")
    assert result.returncode == USAGE and "--region 'bad region!': not a region name" in one_line(result.stderr)


@pytest.mark.parametrize("option", ["--timeout", "--wait-timeout"])
def test_unmount_timeouts_must_be_finite(tmp_path: Path, option: str) -> None:
    err = one_line(refused("unmount", str(tmp_path), "--wait", option, "nan"))
    assert f"{option} must be a number of seconds" in err


def test_unmount_wait_timeout_without_wait_is_refused(tmp_path: Path) -> None:
    """Alone it was ignored: the unmount went at once, with files not yet durable."""
    err = one_line(refused("unmount", str(tmp_path), "--wait-timeout", "60"))
    assert "--wait-timeout is a bound of --wait" in err


def test_admin_wait_timeout_must_be_finite(tmp_path: Path) -> None:
    for value in ("nan", "inf", "-1"):
        result = admin("wait", str(tmp_path), "--timeout", value)
        assert result.returncode == USAGE, result.stderr
        assert "--timeout must be a number of seconds" in one_line(result.stderr)


def test_admin_journal_limit_must_be_positive(tmp_path: Path) -> None:
    result = admin("journal", str(tmp_path), "--limit", "-1")
    assert result.returncode == USAGE and "--limit" in result.stderr and "Traceback" not in result.stderr


def test_a_metrics_port_out_of_range_says_so(dirs: tuple[Path, Path, str]) -> None:
    mnt, cache, remote = dirs
    base = ("mount", str(mnt), "--cache", str(cache), "--remote", remote, "--metrics-addr")
    err = one_line(refused(*base, "127.0.0.1:99999"))
    assert "the port must be a number from 1 to 65535" in err and "host is required" not in err
    assert "a host is required" in refused(*base, ":9100")


def test_a_metrics_port_in_use_is_refused_before_the_cache_is_made(dirs: tuple[Path, Path, str]) -> None:
    mnt, cache, remote = dirs
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        err = one_line(
            refused("mount", str(mnt), "--cache", str(cache), "--remote", remote, "--metrics-addr", f"127.0.0.1:{port}")
        )
    assert f"cannot serve metrics on 127.0.0.1:{port}" in err
    assert not cache.exists()  # README: a refused mount creates nothing


def test_a_min_free_the_tier_cannot_keep_is_refused(dirs: tuple[Path, Path, str]) -> None:
    """Every write would wait --full-timeout and fail with ENOSPC: say so at mount instead."""
    mnt, cache, remote = dirs
    total = os.statvfs(cache.parent).f_blocks * os.statvfs(cache.parent).f_frsize
    base = ("mount", str(mnt), "--cache", str(cache), "--remote", remote, "--min-free")
    err = one_line(refused(*base, str(total)))
    assert "--min-free" in err and f"at {cache.parent}" in err and "nothing could ever be written" in err
    assert not cache.exists()


def test_admin_latest_of_a_missing_remote_says_it_is_missing(tmp_path: Path) -> None:
    """Exit 5, not 1 ("no complete checkpoint"): a restart script that starts over on 1 must
    not do so when it could not look."""
    result = admin("latest", "--remote", f"file://{tmp_path / 'gone'}")
    assert result.returncode == 5 and "Traceback" not in result.stderr
    assert f"remote directory {tmp_path / 'gone'} does not exist" in one_line(result.stderr), result.stderr
    assert "no complete checkpoint" not in result.stderr


def test_admin_latest_of_an_unreachable_remote_is_not_no_checkpoint(s3_env: str) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = admin("latest", "--remote", "s3://bkt/p", "--endpoint-url", f"http://127.0.0.1:{port}")
    assert result.returncode == 5 and "Traceback" not in result.stderr, result.stderr
    assert "no complete checkpoint" not in result.stderr
    assert "event=remote_retry" not in result.stderr  # the daemon's log lines are not its output
    one_line(result.stderr)


def test_a_cache_dir_that_cannot_be_created_is_refused(tmp_path: Path) -> None:
    """A dangling link (an NVMe not mounted yet) or a place no directory can be made: one line."""
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(ConfigError, match=r"symbolic link to .*nowhere/x, which does not exist"):
        secure_cache_dir(link)
    with pytest.raises(ConfigError, match="cannot create cache dir /proc/burstfs-test"):
        secure_cache_dir(Path("/proc/burstfs-test"))
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.fuse
@pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")
@pytest.mark.parametrize("foreground", [False, True])
def test_mount_on_a_cache_dir_that_cannot_be_created(
    dirs: tuple[Path, Path, str], tmp_path: Path, foreground: bool
) -> None:
    mnt, _, remote = dirs
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "x")
    flags = ("--foreground",) if foreground else ()
    err = one_line(refused("mount", str(mnt), "--cache", str(link), "--remote", remote, *flags))
    assert f"cannot use cache dir {link}" in err and "does not exist" in err
    err = one_line(refused("mount", str(mnt), "--cache", "/proc/burstfs-test", "--remote", remote, *flags))
    assert "cannot create cache dir /proc/burstfs-test" in err
    assert not is_mounted(mnt) and not (tmp_path / "nowhere").exists()


def test_remote_directory_missing_is_a_clean_failure(dirs: tuple[Path, Path, str], tmp_path: Path) -> None:
    mnt, cache, _ = dirs
    result = burstfs("mount", str(mnt), "--cache", str(cache), "--remote", f"file://{tmp_path / 'gone'}", check=False)
    assert result.returncode != 0
    assert str(tmp_path / "gone") in result.stderr and "Traceback" not in result.stderr
    assert not is_mounted(mnt)


def _config(tmp_path: Path) -> MountConfig:
    (tmp_path / "mnt").mkdir(exist_ok=True)
    return MountConfig(
        mountpoint=tmp_path / "mnt", cache_dir=tmp_path / "cache", remote=parse_remote_url(f"file://{tmp_path}/remote")
    )


def test_preflight_without_dev_fuse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: False if str(p) == "/dev/fuse" else real_exists(p))
    with pytest.raises(ConfigError, match="/dev/fuse is missing"):
        preflight(_config(tmp_path))


def test_preflight_without_fusermount3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_which = shutil.which
    monkeypatch.setattr(
        shutil, "which", lambda name, *a, **kw: None if name == "fusermount3" else real_which(name, *a, **kw)
    )
    with pytest.raises(ConfigError, match="fusermount3 not found"):
        preflight(_config(tmp_path))


def test_preflight_accepts_good_input(tmp_path: Path) -> None:
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse and fusermount3")
    preflight(_config(tmp_path))  # no exception, and nothing created
    assert not (tmp_path / "cache").exists()


@pytest.mark.fuse
def test_the_mount_gets_the_read_ahead_asked_for(mounted_factory: type[MountedFS]) -> None:
    """--read-ahead reaches the kernel's knob once INIT is answered, without the daemon
    touching its own mount (a killed daemon blocked on itself would never exit)."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory(extra_args=["--read-ahead", "3m"])  # type: ignore[call-arg]
    fs.mount()
    device = device_of(Path(os.path.realpath(fs.path)))
    knob = Path(f"/sys/class/bdi/{device}/read_ahead_kb")
    wait_for(lambda: knob.read_text().strip() == "3072", what="readahead set to 3 MiB")


@pytest.mark.fuse
def test_mount_twice_on_the_same_mount_point(burst: MountedFS, tmp_path: Path) -> None:
    err = refused("mount", str(burst.path), "--cache", str(tmp_path / "other-cache"), "--remote", burst.remote_url)
    assert "already a mount point" in err
    assert not (tmp_path / "other-cache").exists()
    (burst.path / "still").write_bytes(b"works")  # the first mount is unharmed
    assert (burst.path / "still").read_bytes() == b"works"


@pytest.mark.fuse
def test_second_mount_of_a_cache_in_use(burst: MountedFS, tmp_path: Path) -> None:
    (tmp_path / "mnt2").mkdir()
    (burst.path / "f").write_bytes(b"data")
    err = refused("mount", str(tmp_path / "mnt2"), "--cache", str(burst.cache), "--remote", burst.remote_url)
    assert "in use" in err and str(burst.daemon_pid()) in err
    assert not is_mounted(tmp_path / "mnt2")
    assert (burst.path / "f").read_bytes() == b"data"
    assert "event=daemon_failed" not in burst.log_text()


@pytest.mark.fuse
def test_cache_of_another_remote_is_refused_and_untouched(burst: MountedFS, tmp_path: Path) -> None:
    (burst.path / "ckpt").mkdir()
    (burst.path / "ckpt" / "model.pt").write_bytes(b"weights" * 1000)
    burst.unmount()
    before = cache_fingerprint(burst.cache)
    assert "journal.db" in before
    other = tmp_path / "other-remote"
    other.mkdir()
    err = refused("mount", str(burst.path), "--cache", str(burst.cache), "--remote", f"file://{other}")
    assert burst.remote_url in err and f"file://{other}" in err
    assert not is_mounted(burst.path)
    assert cache_fingerprint(burst.cache) == before
    assert os.listdir(other) == []
    burst.mount()  # the right remote still works, with the files intact
    assert (burst.path / "ckpt" / "model.pt").read_bytes() == b"weights" * 1000


def test_unmount_of_a_path_that_is_not_burstfs(tmp_path: Path) -> None:
    err = refused("unmount", str(tmp_path))
    assert "is not a burstfs mount point" in err
    err = refused("unmount", str(tmp_path / "missing"))
    assert "is not a burstfs mount point" in err
    err = refused("unmount", "/proc")
    assert "is not a burstfs mount point" in err


@pytest.mark.fuse
def test_unmount_of_a_directory_inside_a_mount(burst: MountedFS) -> None:
    (burst.path / "sub").mkdir()
    err = refused("unmount", str(burst.path / "sub"))
    assert "is not a burstfs mount point" in err
    assert is_mounted(burst.path)


def test_mount_over_a_dead_mount_says_how_to_clean_it(burst: MountedFS) -> None:
    (burst.path / "kept.bin").write_bytes(b"closed before the crash")
    os.kill(burst.daemon_pid(), 9)
    burst.expect_log("recover")
    result = burstfs("mount", str(burst.path), "--cache", str(burst.cache), "--remote", burst.remote_url, check=False)
    assert result.returncode == 2
    assert "daemon is gone" in result.stderr and f"burstfs unmount {burst.path}" in result.stderr
    assert "Traceback" not in result.stderr
    burstfs("unmount", str(burst.path))  # cleans up the dead mount
    burst.mount()
    assert (burst.path / "kept.bin").read_bytes() == b"closed before the crash"


@pytest.mark.parametrize(
    "layout",
    [
        "remote=mnt",
        "remote=cache",
        "mnt-in-cache",
        "cache-in-remote",
        "remote-in-mnt",
        "mnt-in-remote",
        "cache-link-into-mnt",
    ],
)
def test_overlapping_paths_are_refused_before_anything_is_created(tmp_path: Path, layout: str) -> None:
    """Issue 11 #1: mount point, cache dir and file:// remote must not nest, either way,
    links resolved; refused with one line, exit 2, nothing created."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    mnt, cache, remote = tmp_path / "mnt", tmp_path / "cache", tmp_path / "remote"
    if layout == "remote=mnt":
        remote = mnt
    elif layout == "remote=cache":
        cache.mkdir()
        remote = cache
    elif layout == "mnt-in-cache":
        cache.mkdir()
        mnt = cache / "mnt"
    elif layout == "cache-in-remote":
        cache = remote / "cache"
    elif layout == "remote-in-mnt":
        remote = mnt / "remote"
    elif layout == "mnt-in-remote":
        mnt = remote / "mnt"
    elif layout == "cache-link-into-mnt":
        mnt.mkdir()
        (tmp_path / "link").symlink_to(mnt)
        cache = tmp_path / "link" / "cache"
    for d in (mnt, remote):
        d.mkdir(parents=True, exist_ok=True)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    try:
        err = refused("mount", str(mnt), "--cache", str(cache), "--remote", f"file://{remote}")
    finally:
        force_unmount(mnt)  # should it have mounted after all
    assert "must not overlap" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


@pytest.mark.fuse
def test_a_cache_dir_inside_another_burstfs_mount_is_refused(burst: MountedFS, tmp_path: Path) -> None:
    """Issue 11 #7: one line, exit 2, nothing created inside the other mount."""
    (tmp_path / "mnt2").mkdir()
    (tmp_path / "remote2").mkdir()
    err = refused(
        "mount",
        str(tmp_path / "mnt2"),
        "--cache",
        str(burst.path / "cache2"),
        "--remote",
        f"file://{tmp_path / 'remote2'}",
    )
    assert f"inside the burstfs mount {burst.path}" in err and len(err.strip().splitlines()) == 1
    assert os.listdir(burst.path) == []
    assert not is_mounted(tmp_path / "mnt2")


def test_a_non_empty_mount_point_is_refused_unless_nonempty(dirs: tuple[Path, Path, str]) -> None:
    """Issue 11 #1: files in the mount point would be hidden; --nonempty mounts anyway."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    mnt, cache, remote = dirs
    (mnt / "old.pt").write_bytes(b"hidden")
    try:
        err = refused("mount", str(mnt), "--cache", str(cache), "--remote", remote)
    finally:
        force_unmount(mnt)  # should it have mounted after all
    assert "is not empty" in err and "--nonempty" in err
    assert not cache.exists() and not is_mounted(mnt)
    burstfs("mount", str(mnt), "--cache", str(cache), "--remote", remote, "--nonempty")
    try:
        assert os.listdir(mnt) == []
    finally:
        burstfs("unmount", str(mnt))
    assert (mnt / "old.pt").read_bytes() == b"hidden"


def test_a_cache_taken_after_the_checks_is_exit_2(dirs: tuple[Path, Path, str], tmp_path: Path) -> None:
    """Issue 11 #8: the daemon finds the cache locked (a second mount raced past the
    read-only checks): still exit 2, as a refused cache, with one line."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import subprocess
    import sys

    from burstfs.cachelock import CacheLock

    mnt, cache, remote = dirs
    cache.mkdir(mode=0o700)
    lock = CacheLock(cache)
    lock.acquire()
    script = (
        "import sys; from pathlib import Path\n"
        "from burstfs import daemon\n"
        "from burstfs.config import MountConfig, parse_remote_url\n"
        "daemon.preflight = lambda config: None  # as if the other mount took the cache just after\n"
        "config = MountConfig(Path(sys.argv[1]), Path(sys.argv[2]), parse_remote_url(sys.argv[3]))\n"
        "sys.exit(daemon.mount(config, foreground=False))\n"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", script, str(mnt), str(cache), remote],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    finally:
        lock.release()
        force_unmount(mnt)
    assert result.returncode == USAGE, (result.returncode, result.stderr)
    assert "in use by another burstfs process" in result.stderr and "Traceback" not in result.stderr
    assert not is_mounted(mnt)


@pytest.mark.fuse
def test_drain_says_it_waits_for_the_drain_delay_and_now_skips_it(mounted_factory: type[MountedFS]) -> None:
    """Issue 11 #6: `burstfs drain --cache` names the old mount's --drain-delay it waits
    out, and --now drains at once."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import subprocess
    import sys

    fs = mounted_factory("delayed", None, ("--drain-delay", "600"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "model.pt").write_bytes(b"w" * 1000)
    fs.unmount()
    waiting = subprocess.Popen(
        [str(Path(sys.executable).parent / "burstfs"), "drain", "--cache", str(fs.cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert waiting.stderr is not None
        line = ""
        while "drain-delay" not in line:
            line = waiting.stderr.readline()
            assert line, "no word about the drain delay"
        assert "600s" in line and "--now" in line
    finally:
        waiting.kill()
        waiting.wait()
    result = burstfs("drain", "--cache", str(fs.cache), "--now", timeout=60)
    assert "drained 1 file" in result.stdout
    assert (fs.remote_dir / "model.pt").read_bytes() == b"w" * 1000


@pytest.mark.fuse
def test_drain_of_a_cache_with_a_failed_file_exits_1_and_the_epilog_keeps_the_cache(
    mounted_factory: type[MountedFS],
) -> None:
    """The Slurm epilog runs `burstfs drain --cache DIR --now && rm -rf DIR`.  A file that
    failed to drain for good exited 0 ("drained 1 file") and the cache, its only copy, went.
    Now the drain exits 1 saying so; an incomplete file (open at a crash) is said, not an error."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import sqlite3

    fs = mounted_factory("failing", None, ("--drain-delay", "600"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "model.pt").write_bytes(b"m" * 1000)
    (fs.path / "optim.pt").write_bytes(b"o" * 1000)
    fs.unmount()
    with sqlite3.connect(fs.cache / "journal.db") as db:  # a permanent drain failure, as the mover records it
        db.execute("UPDATE inodes SET state='failed', error='injected' WHERE name=?", (b"optim.pt",))
    result = burstfs("drain", "--cache", str(fs.cache), "--now", check=False, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "drained 1 file" in result.stdout
    assert "1 file (1000 bytes) failed to drain" in result.stderr and str(fs.cache) in result.stderr
    epilog = subprocess.run(
        ["bash", "-c", '"$1" drain --cache "$2" --now && rm -rf "$2"', "drain", str(BIN / "burstfs"), str(fs.cache)],
        capture_output=True,
        timeout=60,
    )
    assert epilog.returncode == 1 and (fs.cache / "journal.db").exists()
    with sqlite3.connect(fs.cache / "journal.db") as db:
        db.execute("UPDATE inodes SET state='incomplete', error=NULL WHERE name=?", (b"optim.pt",))
    result = burstfs("drain", "--cache", str(fs.cache), "--now", timeout=60)
    assert "1 file (1000 bytes) is incomplete" in result.stderr
    assert (fs.remote_dir / "model.pt").read_bytes() == b"m" * 1000


@pytest.mark.fuse
def test_unmount_of_a_mount_whose_cache_dir_was_removed_says_so_in_one_line(mounted_factory: type[MountedFS]) -> None:
    """The cache dir deleted under a live mount: unmount still unmounts, then says it cannot
    read the journal (it ended in a sqlite3 traceback)."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory("nocache", None, ())  # type: ignore[call-arg]
    fs.mount()
    shutil.rmtree(fs.cache)
    result = burstfs("unmount", str(fs.path), check=False)
    assert "Traceback" not in result.stderr, result.stderr
    if result.returncode == 2:  # the daemon saw its cache go first (within a second) and unmounted itself
        assert "is not a burstfs mount point" in result.stderr, result.stderr
    else:
        assert result.returncode == 1 and "cannot read the journal" in one_line(result.stderr), result.stderr
    assert not is_mounted(fs.path)


def test_unmount_after_a_crash_counts_incomplete_files_apart(mounted_factory: type[MountedFS]) -> None:
    """Issue 11 #8: a file open for writing when the daemon died never drains; unmount
    must not count it among the files the next mount drains, and counts the bytes it holds."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import signal
    import subprocess
    import sys
    import time

    fs = mounted_factory("crashed", None, ("--drain-delay", "600"))  # type: ignore[call-arg]
    fs.mount()
    fs.expect_log("recover")
    (fs.path / "closed.pt").write_bytes(b"c" * 1000)
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1], 'wb'); f.write(b'x' * 100);"
            " f.flush(); print('ready', flush=True); time.sleep(60)",
            str(fs.path / "open.pt"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        time.sleep(3 * DEFER_S)  # a new file's name is journaled at most DEFER_S after its create
        pid = fs.daemon_pid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while fs.cache.joinpath("lock").exists() and time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
    finally:
        writer.kill()
        writer.wait()
    result = burstfs("unmount", str(fs.path))
    assert "1 file (1000 bytes) is not durable yet: it stays staged" in result.stdout, result.stdout
    (incomplete,) = [line for line in result.stdout.splitlines() if " incomplete (" in line]
    # the bytes its data file holds: passthrough wrote them past the journal, which said 0
    assert incomplete.startswith("1 file (100 bytes)") and "it will not drain" in incomplete, result.stdout


def test_a_slow_start_up_names_the_step_it_waits_in(caplog: pytest.LogCaptureFixture) -> None:
    """A `burstfs mount` that waited on its daemon for a minute left nothing in the log to say
    where the daemon was: the watch names the step every interval, and stops once ready."""
    caplog.set_level(logging.WARNING, logger="burstfs.daemon")
    watch = StartupWatch(warn_every=0.05)
    watch.enter("starting the mover")
    time.sleep(0.3)  # the step blocks, as a hung one would
    took = watch.ready()
    slow = [r.getMessage() for r in caplog.records if "event=start_slow" in r.getMessage()]
    assert slow and all("step='starting the mover'" in m for m in slow), slow
    assert took >= 0.3
    time.sleep(0.2)
    assert len([r for r in caplog.records if "event=start_slow" in r.getMessage()]) == len(slow)  # stopped
    stacks = [getattr(r, "detail", "") for r in caplog.records if "event=start_slow_stacks" in r.getMessage()]
    # Once, after the second warning, with this (blocked) thread's stack in it (lines of their own, see log.py).
    assert len(stacks) == 1 and "test_a_slow_start_up_names_the_step_it_waits_in" in stacks[0], slow


@contextlib.contextmanager
def _staged_on_the_store_behind_a_proxy(
    mounted_factory: type[MountedFS], s3_env: str, variable: str
) -> Iterator[tuple[MountedFS, tuple[str, ...], Any, Any]]:
    """A cache with one file staged, mounted (then unmounted) on the store behind a fault proxy
    (its endpoint given by the environment ``variable``): (mount, its mount command line, the
    proxy, a boto3 client of the store behind it)."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import boto3
    from faultproxy import FaultProxy
    from s3server import fresh_bucket

    bucket = fresh_bucket(s3_env)
    client = boto3.client("s3", endpoint_url=s3_env, region_name="us-east-1")
    with FaultProxy(s3_env) as first:
        fs = mounted_factory("moved", f"s3://{bucket}/job", ("--drain-delay", "600"))  # type: ignore[call-arg]
        mount = ("mount", str(fs.path), "--cache", str(fs.cache), "--remote", fs.remote_url, "--drain-delay", "600")
        burstfs(*mount, env={**os.environ, variable: first.endpoint})
        (fs.path / "model.pt").write_bytes(b"m" * 1000)
        fs.unmount()
        yield fs, mount, first, client


def test_a_cache_is_not_drained_into_another_store_with_the_same_bucket(
    mounted_factory: type[MountedFS], s3_env: str
) -> None:
    """Remounted with another --endpoint-url (same bucket and prefix), a cache drained its staged
    files into that store, and left its checkpoint rounds open on the first.  Refused, the way
    another remote URL is; `burstfs drain --endpoint-url` is the operator's word that it is the
    same store under another name."""
    with _staged_on_the_store_behind_a_proxy(mounted_factory, s3_env, "AWS_ENDPOINT_URL") as (fs, mount, first, client):
        bucket = fs.remote_url.split("/")[2]
        result = burstfs(*mount, "--endpoint-url", s3_env, check=False)
        assert result.returncode != 0 and not is_mounted(fs.path)
        message = one_line(result.stderr)
        assert f"on the store at {first.endpoint}" in message and f"--endpoint-url {first.endpoint}" in message
        moved_env = {**os.environ, "AWS_ENDPOINT_URL": s3_env}
        refused = burstfs("drain", "--cache", str(fs.cache), "--now", check=False, env=moved_env)
        assert refused.returncode != 0 and f"on the store at {first.endpoint}" in refused.stderr
        assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="job/model.pt")
        burstfs("drain", "--cache", str(fs.cache), "--now", "--endpoint-url", s3_env, timeout=60)
        assert client.get_object(Bucket=bucket, Key="job/model.pt")["Body"].read() == b"m" * 1000


def test_sighup_reopens_a_rotated_log_and_the_mount_lives_on(mounted_factory: type[MountedFS]) -> None:
    """logrotate's `kill -HUP` (or the hang-up of the terminal of a `--foreground` mount) killed
    the daemon outright: a dead mount, an open writer's file left incomplete.  It now reopens
    burstfs.log (moved away by the rotation) and the mount goes on."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import signal

    fs = mounted_factory("hup", None, ())  # type: ignore[call-arg]
    fs.mount()
    with open(fs.path / "open.pt", "wb") as writer:
        writer.write(b"a" * 100)
        (fs.cache / "burstfs.log").rename(fs.cache / "burstfs.log.1")
        os.kill(fs.daemon_pid(), signal.SIGHUP)
        wait_for(lambda: "action=reopen_log" in fs.log_text(), what="the reopened log")
        writer.write(b"b" * 100)
    assert (fs.path / "open.pt").read_bytes() == b"a" * 100 + b"b" * 100
    assert "event=signal signal=SIGHUP" in fs.log_text()
    fs.unmount("--wait", "--wait-timeout", "60")
    assert (fs.remote_dir / "open.pt").read_bytes() == b"a" * 100 + b"b" * 100


def test_a_mount_point_named_as_listed_is_found_without_a_look_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`burstfs unmount MNT` resolved MNT's links first: a stat of the mount's root, which a
    daemon that stopped answering (SIGSTOP, a hang) never answers once its attributes expired,
    so the unmount hung for good.  A mount point named as the kernel lists it needs no look."""
    from burstfs import mountinfo

    listed = [(Path("/jobs/ckpt"), "fuse.burstfs", f"{mountinfo.FSNAME_PREFIX}/nvme/cache", "0:99")]
    monkeypatch.setattr(mountinfo, "mounts", lambda: listed)

    def hangs(path: object) -> str:
        raise AssertionError(f"looked at {path}")

    monkeypatch.setattr(mountinfo.os.path, "realpath", hangs)
    assert mountinfo.find_burstfs_mount(Path("/jobs/ckpt")) == (Path("/jobs/ckpt"), Path("/nvme/cache"))
    assert mountinfo.find_burstfs_mount(Path("/jobs/../jobs/ckpt/")) == (Path("/jobs/ckpt"), Path("/nvme/cache"))


def test_admin_wait_and_status_are_bounded_by_a_daemon_that_stopped_answering(mounted_factory: type[MountedFS]) -> None:
    """A daemon stopped (SIGSTOP) or hung: `burstfs-admin wait --timeout 3` took 60 s and exited 1
    ("lost the daemon") instead of 3, and `status CACHE` took 60 s and printed nothing instead of
    the journal."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import signal

    fs = mounted_factory("stopped", None, ("--drain-delay", "600"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "model.pt").write_bytes(b"m" * 1000)
    time.sleep(3 * DEFER_S)  # a new file's name is journaled at most DEFER_S after its create
    pid = fs.daemon_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        waited = subprocess.run(
            [str(BIN / "burstfs-admin"), "wait", str(fs.path), "--timeout", "3"],  # a path inside would need it
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert waited.returncode == 3 and time.monotonic() - started < 30, (waited.returncode, waited.stderr)
        status = subprocess.run(
            [str(BIN / "burstfs-admin"), "status", str(fs.cache)], capture_output=True, text=True, timeout=120
        )
        assert status.returncode == 0 and "showing the journal" in status.stderr, status.stderr
        assert "undrained: 1 file" in status.stdout, status.stdout
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_cache_is_not_drained_into_another_store_named_by_the_aws_environment_or_config(
    mounted_factory: type[MountedFS], s3_env: str, tmp_path: Path
) -> None:
    """botocore takes the endpoint from $AWS_ENDPOINT_URL_S3 and the AWS config file too: the cache
    recorded "aws" for a mount whose requests went there, and a switch through them was not seen,
    so its files drained into the other store.  The store is the endpoint botocore uses, from
    whichever source; another variable naming the same store drains there."""
    aws_config = tmp_path / "aws-config"
    aws_config.write_text(f"[default]\nendpoint_url = {s3_env}\n")
    with _staged_on_the_store_behind_a_proxy(mounted_factory, s3_env, "AWS_ENDPOINT_URL_S3") as (
        fs,
        mount,
        first,
        client,
    ):
        bucket = fs.remote_url.split("/")[2]
        result = burstfs(*mount, check=False, env={**os.environ, "AWS_CONFIG_FILE": str(aws_config)})
        assert result.returncode != 0 and not is_mounted(fs.path)
        assert f"on the store at {first.endpoint}, not {s3_env}" in one_line(result.stderr), result.stderr
        moved_env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3_env}
        refused = burstfs("drain", "--cache", str(fs.cache), "--now", check=False, env=moved_env)
        assert refused.returncode != 0 and f"on the store at {first.endpoint}" in refused.stderr
        assert "Contents" not in client.list_objects_v2(Bucket=bucket, Prefix="job/model.pt")
        burstfs(
            "drain",
            "--cache",
            str(fs.cache),
            "--now",
            timeout=60,
            env={**os.environ, "AWS_ENDPOINT_URL": first.endpoint},
        )
        assert client.get_object(Bucket=bucket, Key="job/model.pt")["Body"].read() == b"m" * 1000


def test_a_cache_from_before_the_store_was_recorded_keeps_the_store_of_its_last_mount(
    mounted_factory: type[MountedFS], s3_env: str
) -> None:
    """A cache last mounted by a burstfs that did not record its store adopted whichever store its
    next mount named.  The --endpoint-url its last mount journaled with its options says it."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    import sqlite3

    from faultproxy import FaultProxy
    from s3server import fresh_bucket

    bucket = fresh_bucket(s3_env)
    with FaultProxy(s3_env) as first:
        fs = mounted_factory("old", f"s3://{bucket}/job", ("--drain-delay", "600"))  # type: ignore[call-arg]
        fs.mount("--endpoint-url", first.endpoint)
        (fs.path / "model.pt").write_bytes(b"m" * 1000)
        fs.unmount()
        with contextlib.closing(sqlite3.connect(fs.cache / "journal.db")) as db, db:
            db.execute("DELETE FROM meta WHERE key='store'")  # as a burstfs before the store check left it
        mount = ("mount", str(fs.path), "--cache", str(fs.cache), "--remote", fs.remote_url)
        result = burstfs(*mount, "--endpoint-url", s3_env, check=False)
        assert result.returncode != 0 and not is_mounted(fs.path)
        assert f"on the store at {first.endpoint}, not {s3_env}" in one_line(result.stderr), result.stderr
        fs.mount("--endpoint-url", first.endpoint)
        assert (fs.path / "model.pt").read_bytes() == b"m" * 1000
        with contextlib.closing(sqlite3.connect(fs.cache / "journal.db")) as db:
            assert db.execute("SELECT value FROM meta WHERE key='store'").fetchall() == [(first.endpoint,)]


def test_a_wait_for_a_dead_mounts_files_fails_at_once_instead_of_waiting_for_good(
    mounted_factory: type[MountedFS],
) -> None:
    """The daemon was killed with a file staged: `burstfs unmount --wait` (no --wait-timeout)
    and `burstfs-admin wait --cache` polled the journal for good, with nothing left to drain it."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory("dead", None, ("--drain-delay", "600"))  # type: ignore[call-arg]
    fs.mount()
    (fs.path / "model.pt").write_bytes(b"m" * 1000)
    pid = fs.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: CacheLock(fs.cache).owner_pid() is None, timeout=30, what="the daemon gone")
    stopped = burstfs("unmount", str(fs.path), "--wait", check=False, timeout=60)
    assert stopped.returncode == 1 and "nothing drains it" in stopped.stderr, stopped.stderr
    assert "without --wait clears the dead mount" in stopped.stderr and "retry" not in stopped.stderr
    waited = subprocess.run(
        [str(BIN / "burstfs-admin"), "wait", "--cache", str(fs.cache), str(fs.cache)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert waited.returncode == 4 and "burstfs drain --cache" in waited.stdout + waited.stderr, waited
    burstfs("unmount", str(fs.path))  # the dead mount goes; the file stays staged for the next mount
    fs.mount()
    assert (fs.path / "model.pt").read_bytes() == b"m" * 1000


def _shared_scratch_dir(path: Path) -> Path:
    """A root-owned 1777 directory holding another user's file (a shared scratch dir, /tmp)."""
    path.mkdir()
    os.chmod(path, 0o1777)
    (path / "nobody-file").write_text("hers")
    os.chown(path / "nobody-file", 65534, 65534)
    return path


def _listing(path: Path) -> tuple[int, list[str]]:
    return os.stat(path).st_mode & 0o7777, sorted(os.listdir(path))


@pytest.mark.parametrize("foreground", [False, True])
def test_a_non_empty_directory_that_is_no_cache_is_refused_unchanged(
    dirs: tuple[Path, Path, str], tmp_path: Path, foreground: bool
) -> None:
    """`--cache /tmp` by a typo, or a shared scratch dir: the mount made it 0700 for good (its
    other users locked out) and filled it with a journal, data/, a 64 MiB reserve and a lock.
    Now refused, exit 2, in one line, nothing changed; the daemon's own check refuses it too."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    mnt, _, remote = dirs
    shared = _shared_scratch_dir(tmp_path / "shared")
    before = _listing(shared)
    flags = ("--foreground",) if foreground else ()
    try:
        err = one_line(refused("mount", str(mnt), "--cache", str(shared), "--remote", remote, *flags))
    finally:  # taken over (the bug): leave nothing mounted
        force_unmount(mnt)
    assert f"cache dir {shared} is not empty and is not a burstfs cache dir" in err and "'nobody-file'" in err, err
    assert _listing(shared) == before and not is_mounted(mnt)
    with pytest.raises(ConfigError, match="is not a burstfs cache dir"):  # a mount that raced past preflight
        secure_cache_dir(shared)
    assert _listing(shared) == before


def test_a_directory_that_is_no_cache_is_refused_by_drain_unchanged(tmp_path: Path) -> None:
    """`burstfs drain --cache DIR` on a directory that is no cache refused it, but only after
    making it 0700 and leaving an empty burstfs.log in it.  Now nothing changes."""
    empty = tmp_path / "empty"
    empty.mkdir()
    os.chmod(empty, 0o1777)
    shared = _shared_scratch_dir(tmp_path / "shared")
    for directory in (empty, shared):
        before = _listing(directory)
        err = one_line(refused("drain", "--cache", str(directory), "--now", "--timeout", "5"))
        assert "is not a burstfs cache dir" in err, err
        assert _listing(directory) == before, directory


def test_an_empty_dir_a_fresh_file_systems_root_and_a_part_made_cache_are_taken(tmp_path: Path) -> None:
    """What may be given as a cache dir: an empty directory, the root of a fresh ext4 (only
    lost+found), what a first start that died part-way left (burstfs's own names only), and
    an existing cache (journal.db), whatever the operator keeps beside it."""
    fresh_fs = tmp_path / "nvme"
    (fresh_fs / "lost+found").mkdir(parents=True)
    part_made = tmp_path / "part-made"
    (part_made / "data").mkdir(parents=True)
    (part_made / "trash").mkdir()
    for name in ("burstfs.log", "burstfs.log.1", "lock", "journal.db", "reserve.partial", "alive"):
        (part_made / name).write_bytes(b"")
    (part_made / "journal.db").unlink()  # died before its journal was made
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "journal.db").write_bytes(b"")
    (cache / "NOTES.txt").write_text("the operator's")
    for directory in (tmp_path / "empty", fresh_fs, part_made, cache):
        directory.mkdir(exist_ok=True)
        os.chmod(directory, 0o755)
        secure_cache_dir(directory)
        assert os.stat(directory).st_mode & 0o777 == 0o700, directory


@pytest.mark.fuse
def test_a_mount_leaves_only_names_it_takes_back_as_a_cache(dirs: tuple[Path, Path, str], tmp_path: Path) -> None:
    """Every name a mount puts in its cache dir is in CACHE_NAMES (else a cache left by a first
    start that died part-way would be refused as someone else's directory); on a fresh file
    system's root (lost+found) it mounts, and mounts again."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    from burstfs.cachelock import CACHE_NAMES

    mnt, cache, remote = dirs
    (cache / "lost+found").mkdir(parents=True)
    burstfs("mount", str(mnt), "--cache", str(cache), "--remote", remote)
    try:
        (mnt / "model.pt").write_bytes(b"m" * 100_000)
        live = set(os.listdir(cache))
    finally:
        burstfs("unmount", str(mnt))
    assert "control.sock" in live and live - {"lost+found"} <= CACHE_NAMES, live
    assert set(os.listdir(cache)) - {"lost+found"} <= CACHE_NAMES
    burstfs("mount", str(mnt), "--cache", str(cache), "--remote", remote)
    try:
        assert (mnt / "model.pt").read_bytes() == b"m" * 100_000
    finally:
        burstfs("unmount", str(mnt))


def test_the_log_has_one_line_per_event_whatever_a_field_holds(tmp_path: Path) -> None:
    """A file name with a newline wrote a line of its own into burstfs.log, forged to look like
    an event.  Control characters in a message are escaped; a traceback or a multi-line detail
    follows on indented lines, so no line but an event's starts at the left margin."""
    from burstfs.log import setup_logging

    log_file = tmp_path / "burstfs.log"
    root = logging.getLogger("burstfs")
    saved = root.level, root.propagate, list(root.handlers)
    setup_logging("INFO", log_file=log_file, stderr=False)
    try:
        log = logging.getLogger("burstfs.mover")
        forged = "ok\n1999-01-01 00:00:00,000 ERROR burstfs.mover event=drain_halted remote=FORGED"
        log.info("event=durable key=%s", forged)
        log.info("event=closed path=%s", "a\rb\x1bc\x00d\x85e\u2028f\tg")
        log.warning("event=start_slow_stacks step=%r", "x", extra={"detail": "thread a:\n  stack\nFORGED-LINE"})
        try:
            raise ValueError("bad\nFORGED-TRACE")
        except ValueError:
            log.exception("event=request_bug op=%s", "write")
    finally:  # the loggers as they were: other tests read them with caplog
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        root.setLevel(saved[0])
        root.propagate = saved[1]
        for handler in saved[2]:
            root.addHandler(handler)
    lines = log_file.read_text().split("\n")[:-1]
    events = [line for line in lines if not line.startswith("    ")]
    assert len(events) == 4 and all(line[:4].isdigit() for line in events), lines
    assert events[0].endswith(
        "event=durable key=ok\\n1999-01-01 00:00:00,000 ERROR burstfs.mover event=drain_halted remote=FORGED"
    )
    assert events[1].endswith("event=closed path=a\\rb\\x1bc\\x00d\\x85e\\u2028f\\tg")
    assert "    thread a:" in lines and "      stack" in lines and "    FORGED-LINE" in lines
    assert "    Traceback (most recent call last):" in lines and "    FORGED-TRACE" in lines


def test_every_admin_command_takes_cache() -> None:
    """docs/ADMIN.md says every command takes --cache (latest and abandon did not)."""
    from burstfs.admin import main as admin_main

    without = [
        name for name, command in admin_main.commands.items() if not any("--cache" in p.opts for p in command.params)
    ]
    assert not without, without


def test_a_start_up_refusal_inside_a_nursery_is_printed_as_its_message() -> None:
    """The mover not starting (raised inside the mount's nursery) reached the user as a raw
    ExceptionGroup traceback; one BurstfsError alone in (nested) groups is its message."""
    from burstfs.daemon import refusal_in
    from burstfs.errors import BurstfsError

    inner = BurstfsError("the mover did not start within 30s")
    assert refusal_in(BaseExceptionGroup("serve", [ExceptionGroup("mover", [inner])])) is inner
    assert refusal_in(inner) is inner
    assert refusal_in(ExceptionGroup("two", [inner, ValueError("other")])) is None
    assert refusal_in(ValueError("a bug")) is None

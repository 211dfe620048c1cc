"""Shared fixtures: real burstfs mounts (through the CLI, as a user runs it).

A mount fixture starts the daemon with ``burstfs mount``, waits until it is live,
and at teardown unmounts (lazily if stuck) and fails the test if the daemon
logged an unexpected error or a bug (pyfuse3 test/util.py and s3ql's
pytest_checklogs are the models).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from faultproxy import FaultProxy
from s3server import fresh_bucket, moto_server, s3_env  # noqa: F401  (fixtures)

BIN = Path(sys.executable).parent
FUSE_OK = os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None and os.geteuid() == 0
needs_fuse = pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root")


def burstfs(*args: str, check: bool = True, timeout: float = 60, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run the ``burstfs`` CLI of this environment."""
    result = subprocess.run([str(BIN / "burstfs"), *args], capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and result.returncode != 0:
        raise AssertionError(f"burstfs {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def is_mounted(path: Path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == real for line in f)


def force_unmount(path: Path) -> None:
    if is_mounted(path) and subprocess.run(["fusermount3", "-u", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class MountedFS:
    """A burstfs mount started by a test: its paths and lifecycle."""

    # Log lines a test may legitimately cause are declared with expect_log().
    BAD_LOG_MARKERS = ("event=request_bug", "Traceback", "event=daemon_failed")

    def __init__(self, root: Path, remote_url: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        self.root = root
        self.path = root / "mnt"
        self.cache = root / "cache"
        self.remote_dir = root / "remote"
        self.remote_url = remote_url or f"file://{self.remote_dir}"
        self.extra_args = extra_args
        self.expected_log: list[str] = []
        self.path.mkdir(parents=True, exist_ok=True)
        self.remote_dir.mkdir(parents=True, exist_ok=True)

    def mount(self, *args: str) -> None:
        try:
            burstfs(
                "mount",
                str(self.path),
                "--cache",
                str(self.cache),
                "--remote",
                self.remote_url,
                *self.extra_args,
                *args,
            )
        except subprocess.TimeoutExpired as exc:  # the daemon's log says which step it hung in, and on what
            raise AssertionError(f"{exc}; the daemon's log ends:\n{self.log_text()[-20000:]}") from None
        assert is_mounted(self.path)

    def unmount(self, *args: str) -> subprocess.CompletedProcess[str]:
        return burstfs("unmount", str(self.path), *args)

    def daemon_pid(self) -> int:
        return int((self.cache / "lock").read_text().strip())

    def kill(self) -> None:
        """kill -9 the daemon and clean up the dead mount, as an operator would."""
        pid = self.daemon_pid()
        os.kill(pid, signal.SIGKILL)
        for _ in range(200):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.02)
        force_unmount(self.path)

    def expect_log(self, marker: str) -> None:
        self.expected_log.append(marker)

    def log_text(self) -> str:
        log = self.cache / "burstfs.log"
        return log.read_text(errors="replace") if log.exists() else ""

    def unexpected_log_lines(self) -> list[str]:
        bad = []
        for line in self.log_text().splitlines():
            if any(m in line for m in self.BAD_LOG_MARKERS) and not any(e in line for e in self.expected_log):
                bad.append(line)
        return bad

    def cleanup(self) -> None:
        if is_mounted(self.path):
            try:
                self.unmount()
            except (AssertionError, subprocess.TimeoutExpired):
                force_unmount(self.path)
        try:
            pid = self.daemon_pid()
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            pass


@pytest.fixture
def mounted_factory(tmp_path: Path) -> Iterator[type[MountedFS]]:
    """Build extra mounts (other caches, other options) that are cleaned up after the test."""
    created: list[MountedFS] = []

    def factory(name: str = "fs", remote_url: str | None = None, extra_args: tuple[str, ...] = ()) -> MountedFS:
        fs = MountedFS(tmp_path / name, remote_url, extra_args)
        created.append(fs)
        return fs

    yield factory  # type: ignore[misc]
    problems = []
    for fs in created:
        fs.cleanup()
        problems += fs.unexpected_log_lines()
    assert not problems, "daemon logged unexpected errors:\n" + "\n".join(problems)


DATA_PATHS = {"passthrough": (), "daemon": ("--no-passthrough",)}


@pytest.fixture(params=sorted(DATA_PATHS))
def burst(request: pytest.FixtureRequest, mounted_factory: type[MountedFS]) -> MountedFS:
    """A live mount over a file:// remote in a temp dir, once per data path: FUSE
    passthrough (the kernel does file I/O on the tier) and through the daemon."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory(extra_args=DATA_PATHS[request.param])  # type: ignore[call-arg]
    fs.mount()
    return fs


@pytest.fixture
def burst_mount(burst: MountedFS) -> Path:
    """The mount point of a live mount (for tests that only need a directory)."""
    return burst.path


class RemoteTarget:
    """Where a test mount drains to: a file:// directory or a bucket on moto behind a fault proxy."""

    def __init__(
        self,
        kind: str,
        url: str,
        extra_args: tuple[str, ...],
        directory: Path | None = None,
        proxy: FaultProxy | None = None,
        endpoint: str | None = None,
        bucket: str | None = None,
        prefix: str = "",
    ) -> None:
        self.kind, self.url, self.extra_args = kind, url, extra_args
        self.directory, self.proxy, self.endpoint, self.bucket, self.prefix = directory, proxy, endpoint, bucket, prefix

    def _client(self):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def read(self, path: str) -> bytes | None:
        """The object for ``path`` (relative to the prefix), or None."""
        if self.directory is not None:
            try:  # the drain may delete it between a check and the read
                return (self.directory / path).read_bytes()
            except FileNotFoundError:
                return None
        try:
            return self._client().get_object(Bucket=self.bucket, Key=self.key(path))["Body"].read()
        except self._client().exceptions.NoSuchKey:
            return None

    def write(self, path: str, data: bytes) -> None:
        """Replace an object behind burstfs' back (another tool, or corruption)."""
        if self.directory is not None:
            (self.directory / path).parent.mkdir(parents=True, exist_ok=True)
            (self.directory / path).write_bytes(data)
        else:
            self._client().put_object(Bucket=self.bucket, Key=self.key(path), Body=data)

    def delete(self, path: str) -> None:
        """Delete an object behind burstfs' back."""
        if self.directory is not None:
            (self.directory / path).unlink()
        else:
            self._client().delete_object(Bucket=self.bucket, Key=self.key(path))

    def keys(self) -> set[str]:
        """Every object path under the prefix (burstfs' own .burstfs/ included)."""
        if self.directory is not None:
            return {str(p.relative_to(self.directory)) for p in self.directory.rglob("*") if p.is_file()}
        found = set()
        pages = self._client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                found.add(obj["Key"][len(self.prefix) + 1 :] if self.prefix else obj["Key"])
        return found

    def multipart_uploads(self) -> list[str]:
        if self.directory is not None:
            uploads = self.directory / ".burstfs" / "uploads"
            return [p.name for p in uploads.iterdir()] if uploads.exists() else []
        return [u["Key"] for u in self._client().list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])]


@pytest.fixture(params=["file", "s3"])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RemoteTarget]:
    """The same test over the file remote and over S3 (moto, through a fault proxy)."""
    if request.param == "file":
        directory = tmp_path / "remote-dir"
        directory.mkdir()
        yield RemoteTarget("file", f"file://{directory}", (), directory=directory)
        return
    endpoint = request.getfixturevalue("s3_env")
    bucket = fresh_bucket(endpoint)
    with FaultProxy(endpoint) as proxy:
        yield RemoteTarget(
            "s3",
            f"s3://{bucket}/ckpts",
            ("--endpoint-url", proxy.endpoint),
            proxy=proxy,
            endpoint=endpoint,
            bucket=bucket,
            prefix="ckpts",
        )


@pytest.fixture
def remote_mount(mounted_factory: type[MountedFS], remote: RemoteTarget) -> MountedFS:
    """A live mount draining to ``remote`` (small parts so multipart paths run on small files)."""
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = mounted_factory("node1", remote.url, (*remote.extra_args, "--part-size", "5M"))  # type: ignore[call-arg]
    fs.mount()
    return fs


def wait_for(predicate, timeout: float = 60.0, interval: float = 0.05, what: str = "condition"):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def journal_rows(cache: Path, sql: str, params: tuple = ()) -> list[tuple]:  # type: ignore[type-arg]
    import sqlite3

    db = sqlite3.connect(f"file:{cache / 'journal.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, params).fetchall()
    finally:
        db.close()


def file_state(cache: Path, name: str) -> str | None:
    rows = journal_rows(cache, "SELECT state FROM inodes WHERE name=? AND parent!=0", (name.encode(),))
    return rows[0][0] if rows else None

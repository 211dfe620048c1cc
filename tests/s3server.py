"""A moto S3 server for tests: one subprocess per test session, on 127.0.0.1.

Use from a conftest (or a test module)::

    from s3server import moto_server, s3_env  # noqa: F401  (pytest fixtures)

``moto_server`` yields the endpoint URL; ``s3_env`` is the same server with
dummy credentials and no user AWS configuration in ``os.environ`` for the
session, which is what the standard AWS credential chain in burstfs reads.
``make_bucket(endpoint, name)`` creates a bucket, ``fresh_bucket(endpoint)`` one
with a unique name (a fresh bucket per test replaces resetting moto).

moto 5.2 quirks handled here or to keep in mind when writing tests:

* Parts must normally be >= 5 MiB; the server is started with
  ``S3_UPLOAD_PART_MIN_SIZE`` lowered so tests can use KiB-sized parts.
* A ranged GET reads the whole object server-side: keep test objects small.
* A listing racing a PUT of the same key can report the wrong ETag: compare
  listing ETags only with quiescent buckets.
* ``HEAD ?versionId=null`` is rejected on unversioned buckets: never pass a
  ``VersionId`` from a listing of an unversioned bucket.
* An UploadPart to an aborted (or unknown) upload gets a 500, not NoSuchUpload.
* moto stores but does not verify the ``x-amz-checksum-*`` values a client
  sends, so server-side checksum verification is not exercised by moto.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import boto3
import pytest

#: Credentials for moto; passed explicitly so a developer's real ones are never used.
DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
}
#: Variables that would point the AWS chain at a user's own configuration or endpoint.
_USER_AWS_VARS = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_CA_BUNDLE", "AWS_ROLE_ARN")

_START_TIMEOUT = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def client_env() -> dict[str, str]:
    """Environment overrides for an AWS client talking to moto (no user config, no IMDS)."""
    return {
        **DUMMY_CREDENTIALS,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class MotoServer:
    """``python -m moto.server`` on a free port; :meth:`stop` kills it by PID."""

    def __init__(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(DUMMY_CREDENTIALS)
        env["S3_UPLOAD_PART_MIN_SIZE"] = "1024"  # let tests use small parts
        env["MOTO_S3_DEFAULT_KEY_BUFFER_SIZE"] = str(16 * 1024 * 1024)  # keep test objects in memory
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"moto server exited with {self._proc.returncode}: {err[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError(f"moto server did not answer on {self.endpoint} within {_START_TIMEOUT} s")
        # Drain stderr (request logs) so a chatty server never blocks on a full pipe.
        threading.Thread(target=self._drain_stderr, daemon=True).start()

    def _drain_stderr(self) -> None:
        assert self._proc is not None and self._proc.stderr is not None
        for _ in self._proc.stderr:
            pass

    def stop(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        os.kill(self._proc.pid, signal.SIGTERM)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait(timeout=10)


# One server per process, shared by every module that imports the fixture
# (pytest makes one fixture definition per importing module).
_server: MotoServer | None = None
_users = 0
_lock = threading.Lock()


def _acquire() -> str:
    global _server, _users
    with _lock:
        if _server is None:
            server = MotoServer()
            server.start()
            _server = server
        _users += 1
        return _server.endpoint


def _release() -> None:
    global _server, _users
    with _lock:
        _users -= 1
        if _users == 0 and _server is not None:
            _server.stop()
            _server = None


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """The endpoint URL of a moto S3 server that lives for the test session."""
    endpoint = _acquire()
    try:
        yield endpoint
    finally:
        _release()


@pytest.fixture(scope="session")
def s3_env(moto_server: str) -> Iterator[str]:
    """``moto_server``, with the process environment set up for the AWS credential chain."""
    with pytest.MonkeyPatch.context() as mp:
        for name in _USER_AWS_VARS:
            mp.delenv(name, raising=False)
        for name, value in client_env().items():
            mp.setenv(name, value)
        yield moto_server


def make_bucket(endpoint: str, name: str) -> None:
    """Create bucket ``name`` on the server at ``endpoint`` (dummy credentials, synchronous)."""
    boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=DUMMY_CREDENTIALS["AWS_REGION"],
    ).create_bucket(Bucket=name)


def fresh_bucket(endpoint: str, stem: str = "test") -> str:
    """Create and return a bucket with a unique name, so tests never see each other's objects."""
    name = f"{stem}-{uuid.uuid4().hex[:12]}"
    make_bucket(endpoint, name)
    return name

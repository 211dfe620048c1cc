"""Confidentiality of the cache and of the file remote (issue 10 #14).

The cache holds every checkpoint byte and the names of all files; the daemon
runs as root.  Everything it creates there is private (0700 dir, 0600 files),
a cache dir owned by another user is refused, and a file drained to a file://
remote carries its own mode, not the daemon's default.
"""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
from conftest import MountedFS, burstfs, file_state, needs_fuse, wait_for

from burstfs.cachelock import secure_cache_dir
from burstfs.config import parse_remote_url
from burstfs.errors import ConfigError
from burstfs.objects import ObjectStore
from burstfs.remote import FileRemote


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@needs_fuse
@pytest.mark.fuse
def test_cache_files_are_private_and_the_remote_gets_each_files_mode(mounted_factory: type[MountedFS]) -> None:
    old_umask = os.umask(0o022)  # what a shell usually has: must not leak into the cache
    try:
        fs = mounted_factory("n")  # type: ignore[call-arg]
        fs.cache.mkdir(mode=0o755)
        os.chmod(fs.cache, 0o755)  # an existing, world-readable cache dir
        fs.mount()
    finally:
        os.umask(old_umask)
    with open(os.open(fs.path / "secret.pt", os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(b"weights" * 1000)
    (fs.path / "public.txt").write_bytes(b"readme")
    os.chmod(fs.path / "public.txt", 0o644)
    wait_for(
        lambda: file_state(fs.cache, "secret.pt") == "durable" and file_state(fs.cache, "public.txt") == "durable",
        what="drain",
    )
    assert mode_of(fs.cache) == 0o700
    for name in ("journal.db", "journal.db-wal", "journal.db-shm", "burstfs.log", "lock"):
        if (fs.cache / name).exists():
            assert mode_of(fs.cache / name) == 0o600, name
    for data in (fs.cache / "data").iterdir():
        assert mode_of(data) == 0o600
    assert mode_of(fs.remote_dir / "secret.pt") == 0o600  # arrived 0644 before
    assert mode_of(fs.remote_dir / "public.txt") == 0o644
    assert (fs.remote_dir / "secret.pt").read_bytes() == b"weights" * 1000


def test_cache_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / "journal.db").write_bytes(b"")
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory to another user")
    os.chown(cache, 4242, 4242)
    with pytest.raises(ConfigError) as info:
        secure_cache_dir(cache)
    assert "owned by uid 4242" in str(info.value)
    result = burstfs("drain", "--cache", str(cache), check=False)
    assert result.returncode != 0 and "owned by uid 4242" in result.stderr
    mnt, remote = tmp_path / "mnt", tmp_path / "remote"
    mnt.mkdir()
    remote.mkdir()
    result = burstfs("mount", str(mnt), "--cache", str(cache), "--remote", f"file://{remote}", check=False)
    assert result.returncode != 0 and "owned by uid 4242" in result.stderr
    assert not (cache / "burstfs.log").exists()  # nothing written into it


def test_existing_cache_is_tightened(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.chmod(cache, 0o755)
    for name in ("journal.db", "journal.db-wal", "burstfs.log"):
        (cache / name).write_bytes(b"x")
        os.chmod(cache / name, 0o644)
    secure_cache_dir(cache)
    assert mode_of(cache) == 0o700
    assert all(mode_of(cache / name) == 0o600 for name in ("journal.db", "journal.db-wal", "burstfs.log"))


@pytest.mark.parametrize("mode", [0o100600, 0o100640, 0o100644, 0o100755])
def test_file_remote_objects_carry_the_files_mode(tmp_path: Path, mode: int) -> None:
    """Objects are written 0600 and get the file's mode (& 0o666) with their manifest, also when
    copied by a rename and when they went up as a multipart upload."""
    root = tmp_path / "remote"
    root.mkdir()
    store = ObjectStore(FileRemote(parse_remote_url(f"file://{root}")))
    staged = tmp_path / "staged"
    old_umask = os.umask(0)  # the remote, not the umask, decides
    try:

        async def body() -> None:
            for key, size in (("small.bin", 100), ("big.bin", 3 * 5 * 1024 * 1024 + 1)):
                staged.write_bytes(os.urandom(size))
                await store.upload_file(
                    key, staged, None, chunk_size=5 * 1024 * 1024, generation=1, mtime_ns=0, mode=mode, concurrency=2
                )
                assert mode_of(root / key) == stat.S_IMODE(mode) & 0o666, key
            await store.rename("small.bin", "moved/small.bin")
            assert mode_of(root / "moved/small.bin") == stat.S_IMODE(mode) & 0o666
            await store.remote.put_object("plain", b"no manifest")
            assert mode_of(root / "plain") == 0o600
            await store.remote.close()

        asyncio.run(body())
    finally:
        os.umask(old_umask)
    assert mode_of(root / "moved") == 0o755
    for temp in (root / ".burstfs").rglob("*"):
        if temp.is_file():
            assert mode_of(temp) == 0o600, temp

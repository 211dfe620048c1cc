"""Reliability drills through real burstfs mounts: inject faults, verify, print figures.

    .venv/bin/python tools/drill.py --drills kill,outage,faults,full,corrupt --rounds 2 \\
        --remote s3 --seed 1 --out drill.json

Every drill mounts burstfs with the real CLI (``burstfs mount``) in a temp dir, runs
a multi-process checkpoint loop into it (N writer processes, "ranks", each
``torch.save``-ing a shard per step into ``step_NNNNN/rankR.pt``; rank 0 writes the
``latest`` marker of a step last, once every rank's shard of that step is closed),
injects faults while the ranks write, and at the end waits until everything is
durable and checks every file whose ``close()`` returned successfully:

* it reads back byte-identical through the mount,
* through a fresh cold mount (new empty cache over the same remote),
* and the remote object (S3 GET straight from the server / the file on the file
  remote) holds exactly its bytes (no compression).

Drills (one round each per ``--rounds``):

``kill``     kill -9 of the daemon at random moments (``CACHE/lock`` has its pid),
             ``burstfs unmount MNT`` to clean the dead mount, remount on the same
             cache, go on.  Recovery: remount start to every file closed before the
             kill durable.
``outage``   (s3) the fault proxy refuses or black-holes every connection for
             ``--outage-s`` seconds while the ranks save, then the remote returns.
             Recovery: remote back to everything closed so far durable.
``faults``   (s3) a fraction (``--fault-rate``) of S3 requests get a 503/500 or a
             reset connection (before the server sees it, or after it answered),
             while the mount drains and then while ``burstfs drain --cache`` drains
             what an unmount left staged.
``full``     a small ``--cache-size`` tier: ranks save ordinary shards and, every
             few steps, one larger than the whole tier; with s3 the remote also
             goes away for a while so undrained data fills the tier.  ENOSPC is
             fine for the writer (that file is then not closed); nothing closed may
             be lost.
``corrupt``  drained files are evicted (``burstfs-admin evict``), their remote
             objects corrupted (a flipped byte, a byte cut off, a byte appended,
             another file's bytes): reading them through the mount and through a
             cold mount must give EIO, never other bytes.  The objects are then
             restored and must read back right.

Figures per drill: rounds, faults injected, files closed, files lost, wrong bytes
served, recovery times; exit 1 if any file is lost or any wrong byte was served,
3 if a round broke off before its verification (e.g. a mount failed to start).
Faults counted: each kill, each outage, each reset/503/500 the proxy injected,
each ENOSPC a writer got, each corruption.

Needs root, /dev/fuse and fusermount3 (as the tests).  It reuses the tests' moto
server (tests/s3server.py), fault proxy (tests/faultproxy.py) and mount helper
(tests/conftest.py ``MountedFS``).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from conftest import FUSE_OK, MountedFS, burstfs, force_unmount, is_mounted  # noqa: E402
from faultproxy import FaultProxy, _reset, _Rule  # noqa: E402
from s3server import _USER_AWS_VARS, MotoServer, client_env, fresh_bucket  # noqa: E402

from burstfs.config import parse_size  # noqa: E402

BIN = Path(sys.executable).parent
ALL_DRILLS = ("kill", "outage", "faults", "full", "corrupt")
S3_ONLY = ("outage", "faults")


def log(msg: str) -> None:
    print(f"[drill {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------
# Writer processes (ranks)
# ---------------------------------------------------------------------------------------


class _Tee:
    """A write-only file object that hashes what goes through it (torch.save target)."""

    def __init__(self, f: Any) -> None:
        self.f, self.h, self.size = f, hashlib.sha256(), 0

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = self.f.write(mv)
        self.h.update(mv)
        self.size += len(mv)
        return n

    def flush(self) -> None:
        self.f.flush()


def _errno_of(e: BaseException) -> int | None:
    """The errno of a failed save (torch wraps the OSError of a write in a RuntimeError)."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return seen.errno
        seen = seen.__cause__ or seen.__context__
    text = str(e)
    for code in (errno.ENOSPC, errno.ENOTCONN, errno.EIO, errno.ENOENT):
        if os.strerror(code) in text:
            return code
    return None


def _writer_main(rank: int, nranks: int, cmd_q: Any, res_q: Any, stop: Any, done: Any, failed: Any) -> None:
    import torch

    torch.set_num_threads(1)
    while True:
        job = cmd_q.get()
        if job is None:
            return
        try:
            _run_job(torch, rank, nranks, job, res_q, stop, done, failed)
        except BaseException as e:  # noqa: BLE001  (report, never die silently)
            res_q.put(("crash", rank, repr(e), time.time()))
        res_q.put(("idle", rank, job["id"], time.time()))


def _run_job(
    torch: Any, rank: int, nranks: int, job: dict[str, Any], res_q: Any, stop: Any, done: Any, failed: Any
) -> None:
    base = job["base"]
    gen = torch.Generator().manual_seed(job["seed"] * 1000 + rank)

    def attempt(path: str, produce: Any) -> bool:
        """Save ``path`` (retrying transient errors); True once a close() returned."""
        for n in range(job["retries"] + 1):
            if n and stop.is_set():
                return False
            try:
                try:
                    os.mkdir(os.path.dirname(path))  # never makedirs: a dead mount must not grow a tree
                except FileExistsError:
                    pass
                with open(path, "wb") as f:
                    tee = _Tee(f)
                    produce(tee)
                res_q.put(("closed", path, tee.h.hexdigest(), tee.size, time.time()))
                return True
            except Exception as e:  # noqa: BLE001
                code = _errno_of(e)
                res_q.put(("error", path, code, f"{type(e).__name__}: {str(e)[:160]}", time.time()))
                if code == errno.ENOSPC:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
                    return False
                time.sleep(job["retry_sleep"])
        return False

    step = 0
    while not stop.is_set():
        # Lockstep, as ranks of one job: start a step once every rank finished the last.
        while min(done) < step - 1 and not stop.is_set():
            time.sleep(0.01)
        if stop.is_set():
            break
        if rank == 0:
            failed[(step + 8) % 64] = 0
        every = job["oversize_every"]
        size = job["oversize_bytes"] if every and step % every == every - 1 else job["shard_bytes"]
        size = max(4, int(size * (0.5 + random.Random(job["seed"] + step * 7 + rank).random())))
        tensor = torch.randn(size // 4, generator=gen)
        stepdir = f"{base}/step_{step:05d}"
        ok = attempt(f"{stepdir}/rank{rank}.pt", lambda f, t=tensor: torch.save({"step": step, "w": t}, f))
        if not ok:
            failed[step % 64] = 1
        done[rank] = step
        if rank == 0 and job["marker"]:
            while min(done) < step and not stop.is_set():
                time.sleep(0.01)
            if min(done) >= step and not failed[step % 64]:
                attempt(f"{stepdir}/latest", lambda f, s=step: f.write(f"step {s}\n".encode()))
        step += 1
        if job["step_sleep"]:
            time.sleep(job["step_sleep"])


@dataclass
class Ledger:
    """What the ranks reported during one drill round."""

    closed: dict[str, tuple[str, int, float]] = field(default_factory=dict)  # path -> (sha256, size, time)
    errors: Counter[Any] = field(default_factory=Counter)
    error_paths: set[str] = field(default_factory=set)
    enospc: int = 0
    crashes: list[str] = field(default_factory=list)
    idle: set[int] = field(default_factory=set)
    samples: list[str] = field(default_factory=list)


class Writers:
    """N rank processes (spawned once), driven job by job."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.n = n
        self.cmd = [ctx.Queue() for _ in range(n)]
        self.res = ctx.Queue()
        self.stop_ev = ctx.Event()
        self.done = ctx.Array("i", n)
        self.failed = ctx.Array("i", 64)
        self.procs = [
            ctx.Process(
                target=_writer_main,
                args=(r, n, self.cmd[r], self.res, self.stop_ev, self.done, self.failed),
                daemon=True,
                name=f"drill-rank{r}",
            )
            for r in range(n)
        ]
        for p in self.procs:
            p.start()
        self.lock = threading.Lock()
        self.ledger = Ledger()
        self._job = 0
        self.running = False
        self._collector = threading.Thread(target=self._collect, daemon=True)
        self._collector.start()

    def _collect(self) -> None:
        while True:
            try:
                msg = self.res.get()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            with self.lock:
                led = self.ledger
                if msg[0] == "closed":
                    _, path, digest, size, t = msg
                    led.closed[path] = (digest, size, t)
                elif msg[0] == "error":
                    _, path, code, text, _t = msg
                    led.errors[errno.errorcode.get(code, str(code)) if code else "other"] += 1
                    led.error_paths.add(path)
                    led.enospc += code == errno.ENOSPC
                    if len(led.samples) < 20:
                        led.samples.append(f"{path}: {text}")
                elif msg[0] == "crash":
                    led.crashes.append(msg[2])
                elif msg[0] == "idle":
                    led.idle.add(msg[1])

    def start(
        self,
        base: Path,
        seed: int,
        shard_bytes: int,
        oversize_bytes: int = 0,
        oversize_every: int = 0,
        marker: bool = True,
        retries: int = 40,
        retry_sleep: float = 0.25,
        step_sleep: float = 0.0,
    ) -> None:
        self._job += 1
        self.running = True
        with self.lock:
            self.ledger = Ledger()
        self.stop_ev.clear()
        for r in range(self.n):
            self.done[r] = -1
        for i in range(64):
            self.failed[i] = 0
        job = dict(
            id=self._job,
            base=str(base),
            seed=seed,
            shard_bytes=shard_bytes,
            oversize_bytes=oversize_bytes,
            oversize_every=oversize_every,
            marker=marker,
            retries=retries,
            retry_sleep=retry_sleep,
            step_sleep=step_sleep,
        )
        for q in self.cmd:
            q.put(job)

    def snapshot(self) -> dict[str, tuple[str, int, float]]:
        with self.lock:
            return dict(self.ledger.closed)

    def stop(self, timeout: float = 180) -> Ledger:
        self.stop_ev.set()
        if not self.running:
            return self.ledger
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.ledger.idle) == self.n:
                    self.running = False
                    return self.ledger
            time.sleep(0.05)
        raise RuntimeError(f"writers did not stop within {timeout:.0f}s (stuck in a write to the mount?)")

    def close(self) -> None:
        for q in self.cmd:
            q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive() and p.pid:
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        self.res.put(None)


# ---------------------------------------------------------------------------------------
# Remotes and the fault proxy
# ---------------------------------------------------------------------------------------


class DrillProxy(FaultProxy):
    """The tests' fault proxy plus an outage switch and random faults on a fraction of requests."""

    KINDS = ("503", "500", "reset-request", "reset-response")

    def __init__(self, upstream: str, seed: int) -> None:
        super().__init__(upstream)
        self.rng = random.Random(seed)
        self.fault_rate = 0.0
        self.outage: str | None = None  # None | "refuse" | "blackhole"
        self.refused = 0
        self.by_kind: Counter[str] = Counter()

    def _take(self, request_line: str) -> _Rule | None:
        rule = super()._take(request_line)
        if rule is not None:
            return rule
        with self._lock:
            if self.fault_rate <= 0 or self.rng.random() >= self.fault_rate:
                return None
            kind = self.rng.choice(self.KINDS)
            self.by_kind[kind] += 1
            self.injected += 1
        if kind in ("503", "500"):
            return _Rule("fail", 1, None, status=int(kind))
        return _Rule("reset", 1, None, when=kind.split("-")[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.outage is None:
            await super()._accept(reader, writer)
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            self.refused += 1
            while self.outage == "blackhole":  # accept, read nothing, answer nothing
                await asyncio.sleep(0.1)
            _reset(writer)
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()
            self._tasks.discard(task)


class Remote:
    """Where one drill round drains to: a fresh bucket behind the proxy, or a fresh directory."""

    def __init__(self, kind: str, root: Path, moto: str | None, proxy: DrillProxy | None, name: str) -> None:
        self.kind, self.moto, self.proxy = kind, moto, proxy
        if kind == "s3":
            assert moto is not None and proxy is not None
            self.bucket = fresh_bucket(moto, "drill")
            self.prefix = name
            self.url = f"s3://{self.bucket}/{self.prefix}"
            self.mount_args: tuple[str, ...] = ("--endpoint-url", proxy.endpoint)
            self.cold_args: tuple[str, ...] = ("--endpoint-url", moto)
            self.dir = None
        else:
            self.dir = root / f"remote-{name}"
            self.dir.mkdir(parents=True)
            self.url = f"file://{self.dir}"
            self.mount_args = self.cold_args = ()

    def _client(self) -> Any:
        import boto3

        if not hasattr(self, "_c"):
            self._c = boto3.client("s3", endpoint_url=self.moto, region_name="us-east-1")
        return self._c

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}"

    def read(self, rel: str) -> bytes | None:
        if self.dir is not None:
            p = self.dir / rel
            return p.read_bytes() if p.is_file() else None
        try:
            return self._client().get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read()
        except self._client().exceptions.NoSuchKey:
            return None

    def write(self, rel: str, data: bytes) -> None:
        if self.dir is not None:
            (self.dir / rel).write_bytes(data)
        else:
            self._client().put_object(Bucket=self.bucket, Key=self.key(rel), Body=data)


# ---------------------------------------------------------------------------------------
# Mount helpers
# ---------------------------------------------------------------------------------------


def admin(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "burstfs-admin"), *args], capture_output=True, text=True, timeout=timeout)


def kill_daemon(fs: MountedFS) -> None:
    """kill -9 the daemon, then clean the dead mount with ``burstfs unmount`` as an operator would."""
    pid = fs.daemon_pid()
    os.kill(pid, signal.SIGKILL)
    for _ in range(500):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.01)
    for _ in range(20):
        if not is_mounted(fs.path):
            return
        r = burstfs("unmount", str(fs.path), check=False, timeout=60)
        if r.returncode == 0 and not is_mounted(fs.path):
            return
        time.sleep(0.2)  # a rank may still hold a file open on the dead mount
    force_unmount(fs.path)


def wait_durable(paths: list[Path], timeout: float) -> tuple[bool, str]:
    """``burstfs-admin wait`` on these paths (in batches); (all durable, why not)."""
    deadline = time.monotonic() + timeout
    for i in range(0, len(paths), 200):
        left = max(1.0, deadline - time.monotonic())
        r = admin("wait", *map(str, paths[i : i + 200]), "--timeout", f"{left:.0f}", "--json", timeout=left + 60)
        if r.returncode != 0:
            return False, f"exit {r.returncode}: {(r.stdout + r.stderr)[-600:]}"
    return True, ""


# ---------------------------------------------------------------------------------------
# The drills
# ---------------------------------------------------------------------------------------


@dataclass
class Figures:
    drill: str
    rounds: int = 0
    faults: int = 0
    fault_kinds: Counter[str] = field(default_factory=Counter)
    files_closed: int = 0
    files_lost: int = 0
    wrong_bytes: int = 0
    recover_s: list[float] = field(default_factory=list)
    writer_errors: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    daemon_log_bugs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None
    listing_retries: int = 0
    aborted: int = 0
    corrupt_served_right: int = 0

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults += n
        self.fault_kinds[kind] += n

    def row(self) -> dict[str, Any]:
        rec = self.recover_s
        return {
            "drill": self.drill,
            "rounds": self.rounds,
            "rounds_aborted": self.aborted,
            "faults": self.faults,
            "fault_kinds": dict(self.fault_kinds),
            "files_closed": self.files_closed,
            "files_lost": self.files_lost,
            "wrong_bytes_served": self.wrong_bytes,
            "recover_s_mean": round(sum(rec) / len(rec), 2) if rec else None,
            "recover_s_max": round(max(rec), 2) if rec else None,
            "recoveries": len(rec),
            "writer_errors": dict(self.writer_errors),
            "problems": self.problems[:50],
            "daemon_log_bugs": self.daemon_log_bugs[:20],
            "listing_retries": self.listing_retries,
            "corrupt_read_right_bytes": self.corrupt_served_right,
            "seconds": round(self.seconds, 1),
            "skipped": self.skipped,
        }


class Drill:
    def __init__(self, args: argparse.Namespace, root: Path, writers: Writers, moto: str | None) -> None:
        self.a, self.root, self.writers, self.moto = args, root, writers, moto
        self.rng = random.Random(args.seed)
        self.proxy: DrillProxy | None = None
        self.mounts: list[MountedFS] = []
        self.serial = 0

    # -- plumbing ----------------------------------------------------------------------------

    def new_remote(self, name: str) -> Remote:
        if self.a.remote == "s3":
            if self.proxy is None:
                assert self.moto is not None
                self.proxy = DrillProxy(self.moto, self.a.seed)
                self.proxy.start()
            self.proxy.clear()
            self.proxy.fault_rate, self.proxy.outage = 0.0, None
        return Remote(self.a.remote, self.root, self.moto, self.proxy, name)

    def new_mount(self, name: str, remote: Remote, *args: str, cold: bool = False) -> MountedFS:
        self.serial += 1
        extra = (*(remote.cold_args if cold else remote.mount_args), "--part-size", self.a.part_size, *args)
        fs = MountedFS(self.root / f"{name}-{self.serial}", remote.url, extra)
        self.mounts.append(fs)
        return fs

    def finish_mount(self, fs: MountedFS, fig: Figures) -> None:
        if is_mounted(fs.path):
            r = burstfs("unmount", str(fs.path), check=False, timeout=120)
            if r.returncode != 0:
                fig.problems.append(f"unmount {fs.path}: {r.stderr.strip()[-300:]}")
                force_unmount(fs.path)
        fs.cleanup()
        for line in fs.unexpected_log_lines():
            fig.daemon_log_bugs.append(f"{fs.root.name}: {line[:300]}")
        leaked = list(fs.path.iterdir()) if fs.path.exists() else []
        if leaked:  # something written while the mount was down went to the bare directory
            fig.problems.append(f"files under the bare mount point {fs.path}: {[p.name for p in leaked][:5]}")

    def take_ledger(self, fig: Figures, fs: MountedFS) -> dict[str, tuple[str, int]]:
        """Stop the ranks; remove what they failed to write; closed files (mount-relative) -> (sha, size)."""
        led = self.writers.stop()
        fig.writer_errors.update(led.errors)
        fig.problems += [f"writer crashed: {c}" for c in led.crashes]
        closed = {os.path.relpath(p, fs.path): (d, s) for p, (d, s, _t) in led.closed.items()}
        for p in led.error_paths - set(led.closed):
            try:
                os.unlink(p)  # an operator deletes what the job failed to write (it is incomplete)
            except FileNotFoundError:
                pass
            except OSError as e:
                fig.problems.append(f"cleanup unlink {p}: {e}")
        return closed

    def settle(self, fs: MountedFS, fig: Figures, what: Path) -> None:
        ok, why = wait_durable([what], self.a.durable_timeout)
        if not ok:
            fig.problems.append(f"not all durable under {what}: {why}")

    def verify(self, fig: Figures, fs: MountedFS, remote: Remote, closed: dict[str, tuple[str, int]], tag: str) -> None:
        """Every closed file: through the mount, the remote object, a cold mount.  Unmounts ``fs``."""
        fig.files_closed += len(closed)
        bad: dict[str, str] = {}

        def check(where: str, rel: str, data: bytes | None, err: str | None = None) -> None:
            digest, size = closed[rel]
            if data is None:
                bad.setdefault(rel, f"{where}: {err or 'missing'}")
            elif sha(data) != digest:
                bad.setdefault(rel, f"{where}: {len(data)} bytes, expected {size}, content differs")
                if where != "remote":
                    fig.wrong_bytes += 1
                    fig.problems.append(f"WRONG BYTES {tag} {where} {rel}: {len(data)} bytes vs {size}")

        def read_all(mnt: Path, where: str) -> None:
            for rel in closed:
                try:
                    check(where, rel, self.read_through(mnt, rel, fig))
                except OSError as e:
                    check(where, rel, None, f"{errno.errorcode.get(e.errno or 0, e.errno)} {e.strerror}")

        read_all(fs.path, "mount")
        r = burstfs(
            "unmount",
            "--wait",
            "--wait-timeout",
            str(self.a.durable_timeout),
            str(fs.path),
            check=False,
            timeout=self.a.durable_timeout + 120,
        )
        if r.returncode != 0:
            fig.problems.append(f"{tag}: unmount --wait: {r.stdout.strip()[-300:]} {r.stderr.strip()[-300:]}")
        self.finish_mount(fs, fig)
        if self.proxy is not None:
            self.proxy.fault_rate, self.proxy.outage = 0.0, None
        for rel in closed:
            try:
                check("remote", rel, remote.read(rel))
            except Exception as e:  # noqa: BLE001
                check("remote", rel, None, repr(e))
        cold = self.new_mount(f"{tag}-cold", remote, "--list-ttl", "0", cold=True)
        cold.mount()
        try:
            read_all(cold.path, "cold mount")
        finally:
            self.finish_mount(cold, fig)
        fig.files_lost += len(bad)
        for rel, why in sorted(bad.items())[:20]:
            fig.problems.append(f"LOST {tag} {rel}: {why}")

    def read_through(self, mnt: Path, rel: str, fig: Figures) -> bytes:
        """Read ``mnt/rel``.  A lookup the mount answered from local entries because the
        remote listing was not in yet (documented for a slow remote) is retried while
        the listing lands; each such retry is counted (``listing_retries``)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                with open(mnt / rel, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise
                fig.listing_retries += 1
                time.sleep(0.3)
                parent = mnt
                for part in Path(rel).parts[:-1]:  # re-open each directory: its listing merges
                    try:
                        os.listdir(parent)
                    except OSError:
                        break
                    parent = parent / part

    # -- kill -9 -------------------------------------------------------------------------------

    def kill(self, fig: Figures, rnd: int) -> None:
        remote = self.new_remote(f"kill{rnd}")
        args = ("--no-passthrough",) if rnd % 2 else ()
        fs = self.new_mount(f"kill{rnd}", remote, *args)
        fs.mount()
        base = fs.path / "ckpt"
        base.mkdir()
        durable: set[str] = set()
        self.writers.start(base, self.a.seed * 100 + rnd, self.a.shard_bytes, step_sleep=self.a.step_sleep)
        try:
            for _k in range(self.a.kills):
                time.sleep(self.rng.uniform(0.2, self.a.kill_window))
                before = self.writers.snapshot()
                kill_daemon(fs)
                fig.fault("kill -9")
                t0 = time.monotonic()
                fs.mount()
                todo = [Path(p) for p in before if p not in durable]
                ok, why = wait_durable(todo, self.a.durable_timeout)
                if ok:
                    fig.recover_s.append(time.monotonic() - t0)
                    durable.update(map(str, todo))
                else:
                    fig.problems.append(f"kill round {rnd}: files closed before the kill not durable: {why}")
        finally:
            closed = self.take_ledger(fig, fs)
        self.settle(fs, fig, base)
        self.verify(fig, fs, remote, closed, f"kill{rnd}")

    # -- remote outage ----------------------------------------------------------------------------

    def outage(self, fig: Figures, rnd: int) -> None:
        remote = self.new_remote(f"outage{rnd}")
        assert self.proxy is not None
        fs = self.new_mount(f"outage{rnd}", remote)
        fs.mount()
        base = fs.path / "ckpt"
        base.mkdir()
        self.writers.start(base, self.a.seed * 100 + rnd, self.a.shard_bytes, step_sleep=0.2)
        try:
            for k in range(self.a.outages):
                time.sleep(self.rng.uniform(0.5, 2.0))
                self.proxy.outage = "blackhole" if (rnd + k) % 2 else "refuse"
                fig.fault(f"outage ({self.proxy.outage})")
                time.sleep(self.a.outage_s)
                self.proxy.outage = None
                t0 = time.monotonic()
                todo = [Path(p) for p in self.writers.snapshot()]
                ok, why = wait_durable(todo, self.a.durable_timeout)
                if ok:
                    fig.recover_s.append(time.monotonic() - t0)
                else:
                    fig.problems.append(f"outage round {rnd}: not durable after the outage: {why}")
        finally:
            self.proxy.outage = None
            closed = self.take_ledger(fig, fs)
        self.settle(fs, fig, base)
        self.verify(fig, fs, remote, closed, f"outage{rnd}")

    # -- resets / 503s ---------------------------------------------------------------------------

    def faults(self, fig: Figures, rnd: int) -> None:
        remote = self.new_remote(f"faults{rnd}")
        proxy = self.proxy
        assert proxy is not None
        fs = self.new_mount(f"faults{rnd}", remote, *(("--no-passthrough",) if rnd % 2 else ()))
        fs.mount()
        base = fs.path / "ckpt"
        base.mkdir()
        start_injected, start_kinds = proxy.injected, Counter(proxy.by_kind)
        proxy.fault_rate = self.a.fault_rate
        # Every 4th step one shard is over the part size: multipart uploads under faults too.
        self.writers.start(
            base,
            self.a.seed * 100 + rnd,
            self.a.small_shard_bytes,
            oversize_every=4,
            oversize_bytes=parse_size(self.a.part_size) * 3 // 2,
        )
        try:
            time.sleep(self.a.faults_s)
        finally:
            closed = self.take_ledger(fig, fs)
        # Part 2: unmount with files still staged, drain the cache with `burstfs drain` under faults.
        t0 = time.monotonic()
        r = burstfs("unmount", str(fs.path), check=False, timeout=120)
        if r.returncode != 0:
            fig.problems.append(f"faults round {rnd}: unmount: {r.stderr.strip()[-300:]}")
        for attempt in range(20):
            r = burstfs("drain", "--cache", str(fs.cache), check=False, timeout=self.a.durable_timeout)
            if r.returncode == 0:
                break
            fig.problems.append(
                f"faults round {rnd}: burstfs drain attempt {attempt} exit {r.returncode}: "
                f"{(r.stdout + r.stderr).strip()[-300:]}"
            )
        proxy.fault_rate = 0.0
        fig.recover_s.append(time.monotonic() - t0)
        for kind, n in (proxy.by_kind - start_kinds).items():
            fig.fault(kind, n)
        extra = proxy.injected - start_injected - sum((proxy.by_kind - start_kinds).values())
        if extra:
            fig.fault("other", extra)
        fs.mount()
        self.settle(fs, fig, base)
        self.verify(fig, fs, remote, closed, f"faults{rnd}")

    # -- full local tier ----------------------------------------------------------------------------

    def full(self, fig: Figures, rnd: int) -> None:
        remote = self.new_remote(f"full{rnd}")
        cache_size = self.a.full_cache_bytes
        fs = self.new_mount(
            f"full{rnd}", remote, "--cache-size", str(cache_size), "--full-timeout", str(self.a.full_timeout)
        )
        fs.mount()
        base = fs.path / "ckpt"
        base.mkdir()
        self.writers.start(
            base,
            self.a.seed * 100 + rnd,
            self.a.shard_bytes,
            oversize_bytes=2 * cache_size,
            oversize_every=3,
            retries=3,
        )
        try:
            t_end = time.monotonic() + self.a.full_s
            while time.monotonic() < t_end:
                time.sleep(min(2.0, max(0.0, t_end - time.monotonic())))
                if self.proxy is not None and self.rng.random() < 0.3:
                    # The remote goes away: undrained data fills the tier, writers wait, then ENOSPC.
                    self.proxy.outage = "refuse"
                    fig.fault("outage (tier fills)")
                    time.sleep(self.a.full_timeout * 2)
                    self.proxy.outage = None
        finally:
            if self.proxy is not None:
                self.proxy.outage = None
            closed = self.take_ledger(fig, fs)
            fig.fault("ENOSPC", self.writers.ledger.enospc)
        t0 = time.monotonic()
        self.settle(fs, fig, base)
        fig.recover_s.append(time.monotonic() - t0)
        self.verify(fig, fs, remote, closed, f"full{rnd}")

    # -- flipped bytes ----------------------------------------------------------------------------

    def corrupt(self, fig: Figures, rnd: int) -> None:
        remote = self.new_remote(f"corrupt{rnd}")
        fs = self.new_mount(f"corrupt{rnd}", remote)
        fs.mount()
        base = fs.path / "ckpt"
        base.mkdir()
        rng = random.Random(self.a.seed * 1000 + rnd)
        closed: dict[str, tuple[str, int]] = {}
        size = self.a.shard_bytes
        for i in range(self.a.corrupt_files):
            data = rng.randbytes(rng.randint(size // 2, size))
            rel = f"ckpt/f{i:03d}.bin"
            (fs.path / rel).write_bytes(data)
            closed[rel] = (sha(data), len(data))
        self.settle(fs, fig, base)
        rels = list(closed)
        r = admin("evict", *[str(fs.path / rel) for rel in rels], "--json")
        if r.returncode != 0:
            fig.problems.append(f"corrupt round {rnd}: evict: {(r.stdout + r.stderr)[-300:]}")
        cold = self.new_mount(f"corrupt{rnd}-cold", remote, "--list-ttl", "0", cold=True)
        cold.mount()
        modes = ("flip", "cut", "append", "swap")
        originals: dict[str, bytes] = {}
        try:
            for i, rel in enumerate(rels):
                good = remote.read(rel)
                if good is None or sha(good) != closed[rel][0]:
                    fig.problems.append(f"LOST corrupt{rnd} {rel}: remote object missing/wrong before corruption")
                    fig.files_lost += 1
                    continue
                originals[rel] = good
                mode = modes[i % len(modes)]
                if mode == "flip":
                    pos = rng.randrange(len(good))
                    bad = good[:pos] + bytes([good[pos] ^ (1 << rng.randrange(8))]) + good[pos + 1 :]
                elif mode == "cut":
                    bad = good[:-1]
                elif mode == "append":
                    bad = good + b"\0"
                else:
                    bad = rng.randbytes(len(good))
                remote.write(rel, bad)
                fig.fault(f"corrupt ({mode})")
                for where, mnt in (("mount", fs.path), ("cold mount", cold.path)):
                    try:
                        if where == "mount":  # drop pages the writer left in the page cache
                            with open(mnt / rel, "rb") as f:
                                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                        got = self.read_through(mnt, rel, fig)
                    except OSError as e:
                        if e.errno != errno.EIO:
                            fig.problems.append(f"corrupt{rnd} {where} {rel} ({mode}): {e!r} (expected EIO)")
                        continue
                    if got == good:  # e.g. an appended byte past the journaled size is never read: right bytes
                        fig.corrupt_served_right += 1
                    else:
                        fig.wrong_bytes += 1
                        fig.problems.append(f"WRONG BYTES corrupt{rnd} {where} {rel} ({mode}): served corrupt object")
        finally:
            for rel, good in originals.items():
                remote.write(rel, good)
            self.finish_mount(cold, fig)
        self.verify(fig, fs, remote, closed, f"corrupt{rnd}")

    # -- driver ------------------------------------------------------------------------------------

    def run(self, name: str, fig: Figures, rnd: int) -> None:
        t0 = time.monotonic()
        try:
            getattr(self, name)(fig, rnd)
        except Exception as e:  # noqa: BLE001  (a drill that breaks is a finding, the others still run)
            import traceback

            fig.aborted += 1
            fig.problems.append(f"{name} round {rnd} aborted: {e!r}"[:2000])
            log(traceback.format_exc())
            try:
                self.writers.stop(60)
            except RuntimeError as e2:
                fig.problems.append(str(e2))
        finally:
            for fs in self.mounts:
                if is_mounted(fs.path):
                    self.finish_mount(fs, fig)
                else:
                    fs.cleanup()
            self.mounts.clear()
            fig.rounds += 1
            fig.seconds += time.monotonic() - t0

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.fault_rate, self.proxy.outage = 0.0, None
            self.proxy.close()


def table(rows: list[dict[str, Any]]) -> str:
    cols = (
        "drill",
        "rounds",
        "rounds_aborted",
        "faults",
        "files_closed",
        "files_lost",
        "wrong_bytes_served",
        "recover_s_mean",
        "recover_s_max",
        "seconds",
    )
    heads = (
        "drill",
        "rounds",
        "aborted",
        "faults injected",
        "files closed",
        "files lost",
        "wrong bytes served",
        "recover s (mean)",
        "recover s (max)",
        "wall s",
    )
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        lines.append("| " + " | ".join("—" if r.get(c) is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--drills", default=",".join(ALL_DRILLS), help="comma-separated: " + ",".join(ALL_DRILLS))
    p.add_argument("--rounds", type=int, default=1, help="rounds of each drill")
    p.add_argument("--remote", choices=("s3", "file"), default="s3")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, help="write the figures as JSON here")
    p.add_argument("--ranks", type=int, default=3, help="writer processes")
    p.add_argument("--kills", type=int, default=8, help="kill -9 per kill round")
    p.add_argument("--kill-window", type=float, default=2.5, help="max seconds of writing between kills")
    p.add_argument("--outages", type=int, default=2, help="outages per outage round")
    p.add_argument("--outage-s", type=float, default=5.0, help="seconds per outage (the issue: 30-60)")
    p.add_argument("--fault-rate", type=float, default=0.3, help="fraction of S3 requests failed in the faults drill")
    p.add_argument("--faults-s", type=float, default=20.0, help="seconds of writing per faults round")
    p.add_argument("--full-s", type=float, default=12.0, help="seconds of writing per full-tier round")
    p.add_argument("--full-cache", default="12M", help="--cache-size of the full-tier drill")
    p.add_argument("--full-timeout", type=float, default=1.0, help="--full-timeout of the full-tier drill")
    p.add_argument("--corrupt-files", type=int, default=8, help="files corrupted per corrupt round")
    p.add_argument("--step-sleep", type=float, default=0.3, help="seconds between steps (kill drill)")
    p.add_argument("--shard", default="1M", help="shard size (each rank's file per step, +-50%%)")
    p.add_argument("--small-shard", default="256K", help="shard size in the faults drill")
    p.add_argument("--part-size", default="5M", help="--part-size of the mounts")
    p.add_argument("--durable-timeout", type=float, default=300.0, help="seconds to wait for durability")
    p.add_argument("--tmp", type=Path, default=None, help="parent of the temp dir (default: $TMPDIR)")
    a = p.parse_args(argv)

    a.shard_bytes, a.small_shard_bytes = parse_size(a.shard), parse_size(a.small_shard)
    a.full_cache_bytes = parse_size(a.full_cache)
    a.drill_list = [d.strip() for d in a.drills.split(",") if d.strip()]
    for d in a.drill_list:
        if d not in ALL_DRILLS:
            p.error(f"unknown drill {d!r} (known: {', '.join(ALL_DRILLS)})")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if not FUSE_OK:
        print("drill: needs root, /dev/fuse and fusermount3", file=sys.stderr)
        return 2
    started = time.monotonic()
    moto_server: MotoServer | None = None
    writers = Writers(a.ranks)  # spawned before any thread or server exists
    figs = {d: Figures(d) for d in a.drill_list}
    with tempfile.TemporaryDirectory(prefix="burstfs-drill-", dir=a.tmp) as tmp:
        drill: Drill | None = None
        try:
            if a.remote == "s3":
                for name in _USER_AWS_VARS:
                    os.environ.pop(name, None)
                os.environ.update(client_env())
                moto_server = MotoServer()
                moto_server.start()
            drill = Drill(a, Path(tmp), writers, moto_server.endpoint if moto_server else None)
            for rnd in range(a.rounds):
                for name in a.drill_list:
                    fig = figs[name]
                    if a.remote != "s3" and name in S3_ONLY:
                        fig.skipped = "needs --remote s3 (the fault proxy)"
                        continue
                    log(f"{name} round {rnd + 1}/{a.rounds}")
                    drill.run(name, fig, rnd)
                    row = fig.row()
                    if a.out:  # figures so far, in case the run is stopped
                        a.out.write_text(
                            json.dumps({"partial": True, "drills": [f.row() for f in figs.values()]}) + "\n"
                        )
                    log(
                        f"{name}: faults={row['faults']} closed={row['files_closed']} lost={row['files_lost']} "
                        f"wrong={row['wrong_bytes_served']} problems={len(fig.problems)}"
                    )
        finally:
            if drill is not None:
                drill.close()
            writers.close()
            if moto_server is not None:
                moto_server.stop()
    rows = [figs[d].row() for d in a.drill_list]
    total = {
        "drill": "total",
        "rounds": sum(r["rounds"] for r in rows),
        "rounds_aborted": sum(r["rounds_aborted"] for r in rows),
        "faults": sum(r["faults"] for r in rows),
        "files_closed": sum(r["files_closed"] for r in rows),
        "files_lost": sum(r["files_lost"] for r in rows),
        "wrong_bytes_served": sum(r["wrong_bytes_served"] for r in rows),
        "recover_s_mean": None,
        "recover_s_max": max((r["recover_s_max"] or 0 for r in rows), default=None),
        "seconds": round(time.monotonic() - started, 1),
    }
    print()
    print(table([*rows, total]))
    for r in rows:
        if r["skipped"]:
            print(f"- {r['drill']}: skipped, {r['skipped']}")
        for prob in r["problems"]:
            print(f"- {r['drill']}: {prob}")
        for line in r["daemon_log_bugs"]:
            print(f"- {r['drill']}: daemon log: {line}")
        if r["fault_kinds"]:
            print(f"- {r['drill']}: faults by kind {r['fault_kinds']}; writer errors {r['writer_errors']}")
    if a.out:
        doc = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
            "seed": a.seed,
            "remote": a.remote,
            "drills": rows,
            "total": total,
        }
        a.out.write_text(json.dumps(doc, indent=2) + "\n")
    if total["files_lost"] or total["wrong_bytes_served"]:
        return 1
    # A round that broke before its verification proves nothing: say so in the exit code.
    return 3 if any(r["rounds_aborted"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""packaging/slurm end to end on a one-node Slurm cluster started by the test.

munged, slurmctld and slurmd (Debian's slurm-wlm and munge) run in the
foreground on 127.0.0.1 with a generated slurm.conf in a temp dir whose Prolog
and Epilog are packaging/slurm/prolog.sh and epilog.sh.  A job runs
packaging/slurm/train.sbatch (torchrun, DCP checkpoints into the job's mount);
the epilog must leave the checkpoints durable on the remote (a file:// remote
in the temp dir), unmount, and remove the job's cache.  A later job given the
first one's RUN_NAME resumes it.  train_example.py alone on a mount: it resumes
from what `latest` calls complete, and refuses to start over when latest
cannot answer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, FUSE_OK, MountedFS, force_unmount, is_mounted, wait_for

REPO = Path(__file__).resolve().parent.parent
SLURM = REPO / "packaging" / "slurm"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")
MISSING = [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.slow,
    pytest.mark.skipif(
        bool(MISSING),
        reason=f"Slurm/munge not installed ({', '.join(MISSING)} missing): "
        "apt-get install slurm-wlm munge (tools/setup.sh does)",
    ),
    pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root"),
]


def binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Cluster:
    """A one-node Slurm cluster in ``root``; burstfs' prolog/epilog read ``site_env``."""

    def __init__(self, root: Path, mount_options: str | None = None, epilog_timeout: int = 60) -> None:
        self.root = root
        if mount_options is None:  # the packaged site file
            mount_options = (SLURM / "slurm.toml").read_text()
        self.mount_options, self.epilog_timeout = mount_options, epilog_timeout
        self.node = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.mount_root = root / "mnt"
        self.cache_root = root / "cache"
        self.remote = root / "remote"
        self.site_env = root / "burstfs-slurm.env"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.processes: list[subprocess.Popen[bytes]] = []

    def write_config(self) -> None:
        self.remote.mkdir()  # the operator makes it once (the prolog makes each user's directory in it)
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        (munge / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(munge / "munge.key", 0o600)
        for sub in ("state", "spool"):
            (self.root / sub).mkdir()
        self.site_env.write_text(
            textwrap.dedent(f"""\
            BURSTFS={BIN / "burstfs"}
            BURSTFS_ADMIN={BIN / "burstfs-admin"}
            BURSTFS_REMOTE="file://{self.remote}/{{user}}"
            BURSTFS_MOUNT_ROOT={self.mount_root}
            BURSTFS_CACHE_ROOT={self.cache_root}
            BURSTFS_CONFIG={self.root / "slurm.toml"}
            BURSTFS_EPILOG_DRAIN_TIMEOUT={self.epilog_timeout}
            """)
        )
        (self.root / "slurm.toml").write_text(self.mount_options)  # the site's mount options
        hooks = {}
        for hook in ("prolog", "epilog"):  # the packaged scripts, pointed at this site's settings
            wrapper = self.root / f"{hook}.sh"
            wrapper.write_text(f"#!/bin/sh\nBURSTFS_SLURM_CONF={self.site_env} exec {SLURM / f'{hook}.sh'}\n")
            wrapper.chmod(0o755)
            hooks[hook] = wrapper
        self.conf.write_text(
            textwrap.dedent(f"""\
            ClusterName=burstfstest
            SlurmctldHost={self.node}(127.0.0.1)
            SlurmctldPort={free_port()}
            SlurmdPort={free_port()}
            SlurmUser=root
            SlurmdUser=root
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={munge / "munge.sock"}
            StateSaveLocation={self.root / "state"}
            SlurmdSpoolDir={self.root / "spool"}
            SlurmctldPidFile={self.root / "slurmctld.pid"}
            SlurmdPidFile={self.root / "slurmd.pid"}
            SlurmctldLogFile={self.root / "slurmctld.log"}
            SlurmdLogFile={self.root / "slurmd.log"}
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_CPU
            SchedulerType=sched/builtin
            JobCompType=jobcomp/none
            AccountingStorageType=accounting_storage/none
            MpiDefault=none
            ReturnToService=2
            Prolog={hooks["prolog"]}
            Epilog={hooks["epilog"]}
            PrologFlags=Alloc
            NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
            PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
            """)
        )

    def start(self) -> None:
        munge = self.root / "munge"
        self._spawn(
            binary("munged"),
            "-F",
            "--force",
            "--num-threads=4",
            f"--key-file={munge / 'munge.key'}",
            f"--socket={munge / 'munge.sock'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'seed'}",
        )
        wait_for(lambda: (munge / "munge.sock").exists(), timeout=30, what="munged")
        self._spawn(binary("slurmctld"), "-D", "-i", "-f", str(self.conf))
        self._spawn(binary("slurmd"), "-D", "-f", str(self.conf))
        wait_for(
            lambda: self.slurm("sinfo", "-h", "-o", "%T", check=False).strip() == "idle",
            timeout=60,
            what="the node to be idle",
        )

    def _spawn(self, *argv: str) -> None:
        with open(self.root / f"{Path(argv[0]).name}.out", "wb") as log:
            self.processes.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def slurm(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        result = subprocess.run(
            [binary(argv[0]), *argv[1:]], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {result.stderr}")
        return result.stdout

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.mount_root.exists():
            for mnt in self.mount_root.iterdir():
                force_unmount(mnt)

    def diagnostics(self) -> str:
        parts = []
        for name in ("slurm.log",):
            path = self.cache_root / name
            parts.append(f"--- {path}\n{path.read_text() if path.exists() else '(none)'}")
        for name in ("slurmd.log", "slurmctld.log", "job.out"):
            path = self.root / name
            parts.append(f"--- {path}\n{path.read_text()[-4000:] if path.exists() else '(none)'}")
        return "\n".join(parts)


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path, **getattr(request, "param", {}))
    cluster.write_config()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def submit_train(cluster: Cluster, out: Path, steps: int, every: int, **extra: str) -> str:
    """sbatch train.sbatch (train_example.py) and wait for it; the job id."""
    env = {
        "PYTHON": sys.executable,
        "TRAIN": str(SLURM / "train_example.py"),
        "STEPS": str(steps),
        "EVERY": str(every),
        "RDZV_HOST": "127.0.0.1",
        "RDZV_PORT": str(free_port()),
        "BURSTFS_MOUNT_ROOT": str(cluster.mount_root),
        "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        **extra,
    }
    submitted = cluster.slurm(
        "sbatch",
        "--parsable",
        "--wait",
        f"--output={out}",
        "--chdir",
        str(cluster.root),
        "--export=ALL," + ",".join(f"{k}={v}" for k, v in env.items()),
        str(SLURM / "train.sbatch"),
        check=False,
        timeout=300,
    )
    job = submitted.strip().split(";")[0]
    assert job.isdigit() and out.exists(), cluster.diagnostics()
    return job


def wait_epilog_durable(cluster: Cluster, count: int) -> None:
    log = cluster.cache_root / "slurm.log"
    wait_for(
        lambda: log.read_text().count("event=durable") >= count,
        timeout=90,
        what="the epilog to report the checkpoints durable",
    )


def test_job_checkpoints_are_durable_after_the_epilog(cluster: Cluster) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    out = cluster.root / "job.out"
    job = submit_train(cluster, out, steps=12, every=4)
    text = out.read_text()
    assert "starting from scratch" in text and "step_000012 durable" in text, cluster.diagnostics()
    mnt, cache = cluster.mount_root / job, cluster.cache_root / f"job-{job}"
    wait_epilog_durable(cluster, 1)
    # The epilog logs "durable" before it removes the cache and the mount point: give it that moment.
    with contextlib.suppress(AssertionError):
        gone = lambda: not (is_mounted(mnt) or mnt.exists() or cache.exists())  # noqa: E731
        wait_for(gone, timeout=30, what="the epilog's cleanup")
    assert not is_mounted(mnt) and not mnt.exists() and not cache.exists(), cluster.diagnostics()
    # the file remote, read without burstfs: the job's own run (RUN_NAME defaults to run-JOBID)
    assert [p.name for p in (cluster.remote / "root").iterdir() if not p.name.startswith(".")] == [f"run-{job}"]
    run = cluster.remote / "root" / f"run-{job}"
    assert sorted(p.name for p in run.iterdir()) == ["step_000008", "step_000012"]  # the last two kept
    state = {"model": torch.nn.Linear(64, 64).state_dict(), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=run / "step_000012")
    assert int(state["step"]) == 12
    assert cluster.slurm("sinfo", "-h", "-o", "%T").strip() == "idle"  # neither hook drained the node


def test_a_job_given_an_earlier_run_name_resumes_it(cluster: Cluster) -> None:
    pytest.importorskip("torch")
    first = submit_train(cluster, cluster.root / "job.out", steps=8, every=4)
    wait_epilog_durable(cluster, 1)
    out = cluster.root / "job2.out"
    second = submit_train(cluster, out, steps=12, every=4, RUN_NAME=f"run-{first}")
    text = out.read_text()
    resumed = cluster.mount_root / second / f"run-{first}" / "step_000008"
    assert f"resumed from {resumed}" in text and "step_000012 durable" in text, cluster.diagnostics()
    wait_epilog_durable(cluster, 2)
    run = cluster.remote / "root" / f"run-{first}"
    assert sorted(p.name for p in run.iterdir()) == ["step_000008", "step_000012"]
    assert not (cluster.remote / "root" / f"run-{second}").exists()


@pytest.mark.parametrize("cluster", [{"mount_options": "drain-delay = 3600\n", "epilog_timeout": 2}], indirect=True)
def test_epilog_reports_what_is_staged_and_drains_it_after_the_job(cluster: Cluster) -> None:
    """The remote is too slow for the epilog's bound (here: files drain an hour after
    their close): the epilog reports, unmounts, and `burstfs drain` finishes the job."""
    mount_root = cluster.mount_root
    script = f"set -e; d={mount_root}/$SLURM_JOB_ID/run/step_1; mkdir -p $d; head -c 300000 /dev/urandom > $d/shard0"
    submitted = cluster.slurm(
        "sbatch", "--parsable", "--wait", f"--output={cluster.root / 'job.out'}", "--wrap", script, timeout=300
    )
    job = submitted.strip().split(";")[0]
    log = cluster.cache_root / "slurm.log"
    wait_for(
        lambda: "event=draining_in_background" in log.read_text(), timeout=90, what="the epilog to give up waiting"
    )
    text = log.read_text()
    assert "event=not_durable" in text and "not durable" in text, cluster.diagnostics()
    assert "staged" in text  # burstfs-admin status of the mount: what is still staged
    assert not is_mounted(mount_root / job)
    cache = cluster.cache_root / f"job-{job}"
    wait_for(lambda: not cache.exists(), timeout=60, what="the background drain to finish and remove the cache")
    assert (cluster.remote / "root" / "run" / "step_1" / "shard0").stat().st_size == 300_000
    assert "drained 1 file" in log.read_text()
    assert cluster.slurm("sinfo", "-h", "-o", "%T").strip() == "idle"


def train_alone(run: Path, steps: int, every: int) -> subprocess.CompletedProcess[str]:
    """train_example.py as the only rank (no Slurm, no torchrun)."""
    env = {
        **os.environ,
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    argv = [sys.executable, str(SLURM / "train_example.py"), "--checkpoint-dir", str(run)]
    argv += ["--steps", str(steps), "--every", str(every)]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)


def test_train_example_resumes_from_latest_and_never_starts_over_blind(
    mounted_factory: type[MountedFS],
) -> None:
    """The restart point is what `latest` calls complete, not the highest step_* with a
    .metadata; when latest cannot answer, the job fails instead of starting over."""
    pytest.importorskip("torch")
    first = mounted_factory("a")
    first.mount()
    done = train_alone(first.path / "run", steps=4, every=4)
    assert done.returncode == 0 and "starting from scratch" in done.stdout, done.stderr
    first.unmount()
    # A newer step whose every file and manifest is on the remote, but whose commit record
    # is not (its node died between the marker and the record): .metadata is there.
    remote = first.remote_dir
    shutil.copytree(remote / "run" / "step_000004", remote / "run" / "step_000009")
    manifests = remote / ".burstfs" / "manifests" / "run"
    shutil.copytree(manifests / "step_000004", manifests / "step_000009")

    second = mounted_factory("b", remote_url=first.remote_url)
    second.mount()
    assert (second.path / "run" / "step_000009" / ".metadata").exists()
    done = train_alone(second.path / "run", steps=8, every=4)
    assert done.returncode == 0, done.stderr
    assert f"resumed from {second.path / 'run' / 'step_000004'}" in done.stdout, done.stdout
    assert "step_000008 durable" in done.stdout
    second.unmount()

    third = mounted_factory("c", remote_url=first.remote_url)
    third.mount()
    before = sorted(p.name for p in (third.path / "run").iterdir())
    away = remote.with_name("remote.away")
    remote.rename(away)  # the remote is gone (unreachable) while the job starts
    try:
        failed = train_alone(third.path / "run", steps=12, every=4)
    finally:
        away.rename(remote)
    assert failed.returncode != 0, failed.stdout
    assert "not starting from scratch" in failed.stderr, failed.stderr
    assert "starting from scratch" not in failed.stdout and "saved" not in failed.stdout
    assert sorted(p.name for p in (third.path / "run").iterdir()) == before


class Hooks:
    """The packaged prolog and epilog run as slurmd runs them (root, a bare environment and the
    job's SLURM_* variables), without a cluster: the cases a real one cannot stage here."""

    def __init__(self, root: Path, remote: str, epilog_timeout: int = 60, env: dict[str, str] | None = None) -> None:
        self.cluster = Cluster(root, mount_options="", epilog_timeout=epilog_timeout)
        self.cluster.write_config()
        text = self.cluster.site_env.read_text()
        text = "\n".join(
            f'BURSTFS_REMOTE="{remote}"' if line.startswith("BURSTFS_REMOTE=") else line for line in text.splitlines()
        )
        self.cluster.site_env.write_text(text + "\n" + "".join(f"export {k}={v}\n" for k, v in (env or {}).items()))
        self.log = self.cluster.cache_root / "slurm.log"

    def run(self, hook: str, job: int, uid: int = 4242) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "SLURM_JOB_ID": str(job),
            "SLURM_JOB_USER": "trainer",
            "SLURM_JOB_UID": str(uid),
            "SLURM_JOB_GID": str(uid),
        }
        return subprocess.run(
            [str(self.cluster.root / f"{hook}.sh")], env=env, capture_output=True, text=True, timeout=120
        )

    def mnt(self, job: int) -> Path:
        return self.cluster.mount_root / str(job)

    def cleanup(self) -> None:
        if self.cluster.mount_root.exists():
            for mnt in self.cluster.mount_root.iterdir():
                force_unmount(mnt)


def test_a_later_jobs_user_owns_the_earlier_runs_the_mount_lists_at_start(tmp_path: Path) -> None:
    """The prolog chowned the mount after `burstfs mount` returned: the runs of earlier jobs,
    listed from the remote at mount time, took root as owner, and resuming one (a new step
    directory in it) failed with EACCES as the job's user."""
    hooks = Hooks(tmp_path, f"file://{tmp_path / 'remote'}/{{user}}")
    try:
        assert hooks.run("prolog", 201).returncode == 0, hooks.log.read_text()
        (hooks.mnt(201) / "run-201" / "step_4").mkdir(parents=True)
        (hooks.mnt(201) / "run-201" / "step_4" / "shard.pt").write_bytes(b"w" * 1000)
        assert hooks.run("epilog", 201).returncode == 0
        assert "event=durable" in hooks.log.read_text()
        assert hooks.run("prolog", 202).returncode == 0, hooks.log.read_text()
        run = hooks.mnt(202) / "run-201"
        assert (os.stat(run).st_uid, os.stat(run).st_gid) == (4242, 4242)
        # The job resumes it (started in the directory: the test's temp dir is private to root).
        subprocess.run(["mkdir", "step_8"], cwd=run, user=4242, group=4242, check=True)
        assert os.stat(run / "step_4").st_uid == 4242  # listed later: the owner of its directory
        assert hooks.run("epilog", 202).returncode == 0
    finally:
        hooks.cleanup()


def test_a_file_remote_whose_file_system_is_not_mounted_fails_the_prolog(tmp_path: Path) -> None:
    """The prolog made the remote directory with ``mkdir -p``: with the parallel file system
    not mounted on the node, the job's checkpoints went to the node's own disk under the empty
    mount point, were called durable, and the epilog removed the cache."""
    pfs = tmp_path / "pfs"
    pfs.mkdir()  # its mount point; nothing mounted there
    hooks = Hooks(tmp_path, f"file://{pfs}/checkpoints/{{user}}")
    try:
        result = hooks.run("prolog", 401)
        assert result.returncode == 1
        assert f"remote directory {pfs}/checkpoints does not exist" in hooks.log.read_text()
        assert not (pfs / "checkpoints").exists() and not hooks.mnt(401).exists()
        (pfs / "checkpoints").mkdir()  # the file system is there: the user's directory is made
        assert hooks.run("prolog", 402).returncode == 0, hooks.log.read_text()
        assert (pfs / "checkpoints" / "trainer").is_dir()
        assert hooks.run("epilog", 402).returncode == 0
    finally:
        hooks.cleanup()


def test_a_requeued_job_takes_its_cache_over_from_the_epilogs_background_drain(tmp_path: Path, s3_env: str) -> None:
    """The epilog of a job whose remote was down kept draining its cache in the background;
    the job, requeued on the same node, failed its prolog ("cache dir ... is in use by another
    burstfs process"), which drains the node.  The prolog now stops that drain and its mount
    drains the rest; the background drain's removal of the cache never takes a live one."""
    from faultproxy import FaultProxy
    from s3server import fresh_bucket

    bucket = fresh_bucket(s3_env)
    with FaultProxy(s3_env) as proxy:
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        hooks = Hooks(
            tmp_path, f"s3://{bucket}/{{user}}", epilog_timeout=2, env={**env, "AWS_ENDPOINT_URL": proxy.endpoint}
        )
        try:
            assert hooks.run("prolog", 503).returncode == 0, hooks.log.read_text()
            (hooks.mnt(503) / "ckpt.pt").write_bytes(b"c" * 10000)
            proxy.blackhole()  # the remote goes down before the drain
            assert hooks.run("epilog", 503).returncode == 0
            assert "event=draining_in_background" in hooks.log.read_text()
            cache = hooks.cluster.cache_root / "job-503"
            wait_for(lambda: "event=drain_budget" in hooks.log.read_text(), what="the background drain")
            drainer = int((cache / "lock").read_text())
            time.sleep(1.0)  # its first requests are out, and held
            proxy.resume(silently=True)  # the remote is back; the drain's requests stay unanswered
            result = hooks.run("prolog", 503)  # requeued on this node
            assert result.returncode == 0, hooks.log.read_text()
            assert f"event=background_drain_stopped pid={drainer}" in hooks.log.read_text()
            assert (hooks.mnt(503) / "ckpt.pt").read_bytes() == b"c" * 10000
            assert hooks.run("epilog", 503).returncode == 0
            assert hooks.log.read_text().count("event=durable") == 1, hooks.log.read_text()
            assert not cache.exists()
            import boto3

            s3 = boto3.client("s3", endpoint_url=s3_env)
            assert s3.get_object(Bucket=bucket, Key="trainer/ckpt.pt")["Body"].read() == b"c" * 10000
        finally:
            hooks.cleanup()

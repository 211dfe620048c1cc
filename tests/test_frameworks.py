"""Checkpoint libraries through a real mount, unchanged: torch, DCP, safetensors, numpy.

Each test writes with the library's own API into the mount and reads back
(also through mmap, which torch.load(mmap=True), safe_open and
numpy mmap_mode use), comparing values and, where the format is
deterministic, the bytes against the same save into a plain directory.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import MountedFS
from s3server import free_port

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.fuse, pytest.mark.torch]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def state_dict(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "embed.weight": torch.randn(256, 64, generator=g),
            "layer.0.weight": torch.randn(64, 64, generator=g, dtype=torch.float64),
            "layer.0.bias": torch.zeros(64, dtype=torch.bfloat16),
            "head.int8": torch.randint(-128, 127, (4096,), generator=g, dtype=torch.int8),
        },
        "step": 1234,
        "rng": torch.get_rng_state(),
        "note": "checkpoint",
    }


def assert_state_equal(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        if isinstance(value, dict):
            assert_state_equal(value, other)  # type: ignore[arg-type]
        elif isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and value.dtype == other.dtype
            assert torch.equal(value, other), key
        else:
            assert value == other, key


def test_torch_save_load_and_mmap(burst: MountedFS, tmp_path: Path) -> None:
    sd = state_dict()
    ckpt = burst.path / "step_100" / "model.pt"
    ckpt.parent.mkdir()
    torch.save(sd, ckpt)
    plain = tmp_path / "model.pt"  # same name: the archive records it
    torch.save(sd, plain)
    assert sha256(ckpt) == sha256(plain)  # the same bytes as in a plain directory
    assert_state_equal(torch.load(ckpt, weights_only=True), sd)
    mapped = torch.load(ckpt, mmap=True, weights_only=True)
    assert_state_equal(mapped, sd)
    # A file object instead of a path, as some trainers do.
    with open(burst.path / "step_100" / "opt.pt", "wb") as f:
        torch.save({"lr": torch.tensor([0.1, 0.2])}, f)
    with open(burst.path / "step_100" / "opt.pt", "rb") as f:
        assert torch.equal(torch.load(f, weights_only=True)["lr"], torch.tensor([0.1, 0.2]))


def test_write_temp_then_replace(burst: MountedFS) -> None:
    """The atomic-publish pattern: save to a temp name, fsync, os.replace over the old one."""
    final = burst.path / "latest.pt"
    for step in range(3):
        sd = state_dict(seed=step)
        tmp = burst.path / f".latest.pt.tmp{step}"
        with open(tmp, "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dfd = os.open(burst.path, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(dfd)
        os.close(dfd)
        assert_state_equal(torch.load(final, weights_only=True), sd)
    assert sorted(os.listdir(burst.path)) == ["latest.pt"]


DCP_RANK = textwrap.dedent(
    """
    import os, sys, torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    path = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    sd = {
        "shared.weight": torch.arange(1000, dtype=torch.float32),  # replicated: saved once
        f"rank{rank}.weight": torch.randn(128, 128, generator=g),
        f"rank{rank}.step": torch.tensor([rank * 10]),
    }
    dcp.save(sd, storage_writer=FileSystemWriter(path))
    dist.barrier()
    loaded = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(loaded, storage_reader=FileSystemReader(path))
    for k, v in sd.items():
        assert torch.equal(loaded[k], v), (rank, k)
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank)
    """
)


def test_torch_distributed_checkpoint_four_ranks(burst: MountedFS) -> None:
    ckpt = burst.path / "dcp" / "step_500"
    world = 4
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DCP_RANK, str(ckpt)],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (code, out, err) in enumerate(outputs):
        assert code == 0 and out.split() == ["ok", str(rank)], err[-3000:]
    names = sorted(os.listdir(ckpt))
    assert ".metadata" in names
    assert len([n for n in names if n.endswith(".distcp")]) == world
    assert not [n for n in names if "tmp" in n]
    # A reader that is not part of the job (e.g. an eval process) sees the whole checkpoint.
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    assert set(metadata.state_dict_metadata) == {"shared.weight"} | {
        f"rank{r}.{n}" for r in range(world) for n in ("weight", "step")
    }


def test_safetensors(burst: MountedFS, tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open

    tensors = {k: v for k, v in state_dict()["model"].items()}  # type: ignore[union-attr]
    path = burst.path / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"step": "100"})
    st.save_file(tensors, str(tmp_path / "plain.safetensors"), metadata={"step": "100"})
    assert sha256(path) == sha256(tmp_path / "plain.safetensors")
    loaded = st.load_file(str(path))
    assert_state_equal(loaded, tensors)
    with safe_open(str(path), framework="pt") as f:  # mmaps the file
        assert f.metadata() == {"step": "100"}
        assert set(f.keys()) == set(tensors)
        assert torch.equal(f.get_tensor("embed.weight"), tensors["embed.weight"])
        sliced = f.get_slice("embed.weight")[10:20]
        assert torch.equal(sliced, tensors["embed.weight"][10:20])
    assert st.load(path.read_bytes()).keys() == tensors.keys()


def test_numpy_save_load_and_memmap(burst: MountedFS) -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(7)
    arr = rng.standard_normal((512, 300)).astype(np.float32)
    path = burst.path / "arr.npy"
    np.save(path, arr)
    assert np.array_equal(np.load(path), arr)
    mm = np.load(path, mmap_mode="r")
    assert isinstance(mm, np.memmap) and np.array_equal(mm[100:200], arr[100:200])
    del mm
    np.savez(burst.path / "many.npz", a=arr, b=np.arange(10))
    with np.load(burst.path / "many.npz") as z:
        assert np.array_equal(z["a"], arr) and np.array_equal(z["b"], np.arange(10))
    # A writable memmap created in the mount (the kernel writes its pages back to us).
    out = np.lib.format.open_memmap(burst.path / "out.npy", mode="w+", dtype=np.int64, shape=(1000,))
    out[:] = np.arange(1000)
    out.flush()
    del out
    assert np.array_equal(np.load(burst.path / "out.npy"), np.arange(1000))

"""burstfs.pinned: async_save snapshots exactly what torch.save would write, then writes it.

Every round trip is compared against a plain torch.save of the same state: same
structure, dtypes, layouts, autograd flags, classes, bytes and storage sharing.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from conftest import FUSE_OK  # noqa: E402

from burstfs.pinned import PinnedPool, SaveHandle, async_save  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
cuda = pytest.mark.cuda
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(params=["tmpdir", "mount"])
def ckpt_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A checkpoint directory: a plain temp dir, or one inside a live burstfs mount."""
    if request.param == "tmpdir":
        return tmp_path
    if not FUSE_OK:
        pytest.skip("needs /dev/fuse, fusermount3 and root")
    fs = request.getfixturevalue("mounted_factory")()
    fs.mount()
    path = fs.path / f"pinned-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


@pytest.fixture
def gated_save(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Make torch.save wait until the returned event is set (the test controls when a write ends)."""
    gate = threading.Event()
    real_save = torch.save

    def slow_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        assert gate.wait(30), "test never opened the gate"
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", slow_save)
    yield gate
    gate.set()  # never leave a writer thread blocked


def _training_state() -> dict[str, Any]:
    """A small but complete training checkpoint: everything a real one holds."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied weights: two state_dict entries, one storage
    model = torch.nn.ModuleDict({"emb": emb, "mlp": torch.nn.Linear(8, 8), "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randint(0, 10, (4,))
        model["head"](model["mlp"](model["emb"](x))).sum().backward()
        opt.step()
        opt.zero_grad()
    np.random.seed(1)
    random.seed(2)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "views": {"base": base, "t": base.t(), "row": base[2], "cols": base[:, 1::2], "tail": base.view(-1)[5:]},
        "same_twice": [base, base],
        "dtypes": {
            "bf16": torch.randn(5).to(torch.bfloat16),
            "e4m3": torch.randn(6).to(torch.float8_e4m3fn),
            "e5m2": torch.randn(3, 2).to(torch.float8_e5m2).t(),
            "int64": torch.arange(4),
            "bool": torch.tensor([True, False]),
            "complex": torch.randn(3, dtype=torch.complex64),
        },
        "grad": torch.randn(3, requires_grad=True),
        "nonleaf": torch.randn(3, requires_grad=True) * 2,
        "param": torch.nn.Parameter(torch.randn(2, 2)),
        "frozen": torch.nn.Parameter(torch.randn(2), requires_grad=False),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(7),
        "misc": [1, 2.5, "text", None, True, (3, [4, {"deep": torch.ones(2)}])],
    }


def _tensor_bytes(t: Any) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Structure, classes and values equal; tensors bitwise (NaN and fp8 included)."""
    assert type(got) is type(want), f"{where}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape, got.stride(), got.storage_offset(), got.requires_grad, got.device) == (
            want.dtype,
            want.shape,
            want.stride(),
            want.storage_offset(),
            want.requires_grad,
            want.device,
        ), where
        assert _tensor_bytes(got) == _tensor_bytes(want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        assert getattr(got, "_metadata", None) == getattr(want, "_metadata", None), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert np.array_equal(got, want), where
    else:
        assert got == want, where


def _sharing(obj: Any) -> list[int]:
    """For each tensor in traversal order, the index of the first tensor on the same storage."""
    first: dict[int, int] = {}
    out: list[int] = []

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            out.append(first.setdefault(o.untyped_storage().data_ptr() or -len(out), len(out)))
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


def _load(path: Path, **kw: Any) -> Any:
    return torch.load(path, weights_only=False, **kw)


def test_import_does_not_need_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import burstfs.pinned; print('ok')"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_round_trip_matches_torch_save(ckpt_dir: Path) -> None:
    state = _training_state()
    torch.save(state, ckpt_dir / "reference.pt")
    handle = async_save(state, ckpt_dir / "async.pt", pool=PinnedPool())
    assert isinstance(handle, SaveHandle)
    handle.wait(60)
    assert handle.done() and handle.total_s is not None
    got, want = _load(ckpt_dir / "async.pt"), _load(ckpt_dir / "reference.pt")
    _assert_same(got, want)
    assert _sharing(got) == _sharing(want)
    assert (
        got["model"]["emb.weight"].untyped_storage().data_ptr()
        == got["model"]["head.weight"].untyped_storage().data_ptr()
    )
    assert got["views"]["row"].untyped_storage().data_ptr() == got["views"]["base"].untyped_storage().data_ptr()
    assert got["same_twice"][0] is got["same_twice"][1]


def test_caller_may_mutate_right_after_return(ckpt_dir: Path) -> None:
    big = torch.arange(16 << 20, dtype=torch.float32)  # 64 MiB
    expected = big.clone()
    # Tensors the pool does not copy itself (inside other objects, sparse) are deep-copied.
    holder = types.SimpleNamespace(t=torch.ones(3))
    sparse = torch.eye(3).to_sparse()
    state = {"big": big, "lr": [0.1], "meta": {"step": 5}, "holder": holder, "sparse": sparse}
    handle = async_save(state, ckpt_dir / "ckpt.pt")
    big.add_(1)
    big[:10] = -1
    state["lr"][0] = 0.2
    state["meta"]["step"] = 6
    holder.t.add_(1)
    sparse.mul_(2)
    handle.wait(60)
    loaded = _load(ckpt_dir / "ckpt.pt")
    assert torch.equal(loaded["big"], expected)
    assert loaded["lr"] == [0.1] and loaded["meta"] == {"step": 5}
    assert torch.equal(loaded["holder"].t, torch.ones(3))
    assert loaded["sparse"].is_sparse and torch.equal(loaded["sparse"].to_dense(), torch.eye(3))


def test_file_appears_complete_and_replaces_old_one(ckpt_dir: Path) -> None:
    target = ckpt_dir / "latest.pt"
    torch.save({"v": torch.zeros(3)}, target)
    async_save({"v": torch.ones(3)}, target).wait(60)
    assert torch.equal(_load(target)["v"], torch.ones(3))
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["latest.pt"]  # no temp file left


def test_pool_reuses_buffer_and_grows_with_the_state(tmp_path: Path) -> None:
    pool = PinnedPool()
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    for _ in range(3):
        async_save(state, tmp_path / "a.pt", pool=pool).wait(60)
    assert pool.allocations == 1
    held = pool.nbytes
    assert held >= 4040
    state["w2"] = torch.randn(1 << 20)
    async_save(state, tmp_path / "a.pt", pool=pool).wait(60)
    assert pool.allocations == 2 and pool.nbytes > held
    assert pool.pinned == torch.cuda.is_available()
    pool.clear()
    assert pool.nbytes == 0


def test_snapshot_bigger_than_max_bytes_uses_pageable_memory(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = PinnedPool(max_bytes=1024)
    state = {"w": torch.randn(4096)}
    with caplog.at_level(logging.WARNING, logger="burstfs.pinned"):
        async_save(state, tmp_path / "a.pt", pool=pool).wait(60)
    assert torch.equal(_load(tmp_path / "a.pt")["w"], state["w"])
    assert pool.nbytes == 0 and pool.allocations == 0
    assert any("exceeds PinnedPool max_bytes=1024" in r.getMessage() for r in caplog.records)


def test_save_waits_for_previous_one_of_same_pool(tmp_path: Path, gated_save: threading.Event) -> None:
    pool = PinnedPool()
    x = torch.zeros(1000)
    first = async_save({"x": x}, tmp_path / "1.pt", pool=pool)
    x.fill_(1)
    second: list[SaveHandle] = []
    caller = threading.Thread(target=lambda: second.append(async_save({"x": x}, tmp_path / "2.pt", pool=pool)))
    caller.start()
    caller.join(0.2)
    assert caller.is_alive() and not first.done()  # blocked behind the first write, which still holds the buffer
    gated_save.set()
    caller.join(30)
    first.wait(30)
    second[0].wait(30)
    assert torch.equal(_load(tmp_path / "1.pt")["x"], torch.zeros(1000))
    assert torch.equal(_load(tmp_path / "2.pt")["x"], torch.ones(1000))
    assert pool.allocations == 1


def test_wait_timeout_raises_and_save_continues(tmp_path: Path, gated_save: threading.Event) -> None:
    handle = async_save({"x": torch.ones(2)}, tmp_path / "a.pt", pool=PinnedPool())
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.01)
    assert not handle.done()
    gated_save.set()
    handle.wait(30)
    assert torch.equal(_load(tmp_path / "a.pt")["x"], torch.ones(2))


def test_write_error_raises_from_wait_and_pool_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pool = PinnedPool()
    real_save = torch.save

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with caplog.at_level(logging.INFO, logger="burstfs.pinned"):
        handle = async_save({"x": torch.ones(2)}, tmp_path / "a.pt", pool=pool)
        with pytest.raises(OSError, match="No space left"):
            handle.wait(30)
    assert handle.done()
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temp file
    assert any(r.levelno == logging.ERROR and "error=OSError" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(torch, "save", real_save)
    async_save({"x": torch.ones(2)}, tmp_path / "a.pt", pool=pool).wait(30)
    assert torch.equal(_load(tmp_path / "a.pt")["x"], torch.ones(2))


def test_a_save_whose_file_system_went_away_reports_only_through_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mount died under a save (ENOTCONN): the clean-up's unlink failed too, and its error
    escaped the writer thread as a stray traceback instead of the save's error from wait()."""
    stray: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: stray.append(args.exc_value))

    def failing_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def gone(path: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(os, "unlink", gone)
    handle = async_save({"x": torch.ones(2)}, tmp_path / "a.pt", pool=PinnedPool())
    with pytest.raises(OSError, match="not connected"):
        handle.wait(30)
    monkeypatch.undo()
    time.sleep(0.1)  # the writer thread's last steps after it set the handle done
    assert stray == []


def test_a_relative_path_is_where_the_call_was_made_not_where_the_writer_runs(
    tmp_path: Path, gated_save: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script changed directory after async_save returned: the writer resolved the
    relative path again, and wrote the checkpoint into the other directory."""
    for name in ("job", "other"):
        (tmp_path / name / "ckpt").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "job")
    handle = async_save({"x": torch.ones(2)}, "ckpt/a.pt", pool=PinnedPool())
    monkeypatch.chdir(tmp_path / "other")
    gated_save.set()
    handle.wait(30)
    assert handle.path == tmp_path / "job" / "ckpt" / "a.pt"
    assert torch.equal(_load(tmp_path / "job" / "ckpt" / "a.pt")["x"], torch.ones(2))
    assert sorted(p.name for p in (tmp_path / "other").rglob("*")) == ["ckpt"]


def test_the_last_call_wins_across_pools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pools' saves of one path (docs: a pool per save keeps writes in flight together):
    the older one finished last and its rename left the older state in the file."""
    first_may_end = threading.Event()
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if obj["step"] == 1:
            assert first_may_end.wait(30)
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    target = tmp_path / "last.pt"
    older = async_save({"step": 1, "x": torch.ones(2)}, target, pool=PinnedPool())
    newer = async_save({"step": 2, "x": torch.ones(2)}, target, pool=PinnedPool())
    newer.wait(30)
    first_may_end.set()
    older.wait(30)
    assert _load(target)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # the older one's temp file went
    third = async_save({"step": 3, "x": torch.ones(2)}, target, pool=PinnedPool())  # in order: it lands
    third.wait(30)
    assert _load(target)["step"] == 3


def test_a_full_file_system_raises_enospc_from_wait(tmp_path: Path) -> None:
    """torch's own file writer turned ENOSPC into RuntimeError('basic_ios::clear: iostream
    error'); docs/PINNED.md promises the OSError."""
    small = tmp_path / "small"
    small.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        handle = async_save({"x": torch.zeros(1 << 20)}, small / "a.pt", pool=PinnedPool())
        with pytest.raises(OSError) as raised:
            handle.wait(30)
        assert raised.value.errno == errno.ENOSPC
        assert list(small.iterdir()) == []
    finally:  # lazily if a writer still holds a file there: never leave the mount behind
        if subprocess.run(["umount", str(small)]).returncode:
            subprocess.run(["umount", "-l", str(small)], check=True)


def test_bad_paths_fail_before_snapshot(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        async_save({"x": torch.ones(1)}, tmp_path / "missing" / "a.pt")
    with pytest.raises(TypeError, match="file system path"):
        async_save({"x": torch.ones(1)}, open(os.devnull, "wb"))  # noqa: SIM115


def test_one_structured_log_line_per_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="burstfs.pinned"):
        handle = async_save({"x": torch.ones(256)}, tmp_path / "a.pt", pool=PinnedPool())
        handle.wait(30)
    lines = [r.getMessage() for r in caplog.records if r.name == "burstfs.pinned"]
    assert len(lines) == 1
    fields = dict(kv.split("=", 1) for kv in lines[0].split()[1:])
    assert fields["path"] == str(tmp_path / "a.pt") and fields["bytes"] == "1024" and fields["error"] == "None"
    assert {"blocking_s", "total_s", "waited_s", "pooled", "pinned"} <= fields.keys()


def _dcp_state() -> dict[str, Any]:
    torch.manual_seed(3)
    return {
        "w": torch.randn(8, 8),
        "bf16": torch.randn(4).to(torch.bfloat16),
        "step": 7,
        "nested": {"b": torch.ones(3)},
    }


def _dcp_target() -> dict[str, Any]:
    return {
        "w": torch.zeros(8, 8),
        "bf16": torch.zeros(4, dtype=torch.bfloat16),
        "step": 0,
        "nested": {"b": torch.zeros(3)},
    }


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_async_save_into_directory(ckpt_dir: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    state = _dcp_state()
    dcp.async_save(state, checkpoint_id=ckpt_dir / "step7", no_dist=True).result(60)
    assert (ckpt_dir / "step7" / ".metadata").exists()
    target = _dcp_target()
    dcp.load(target, checkpoint_id=ckpt_dir / "step7", no_dist=True)
    _assert_same(target, state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_async_staging_recipe(ckpt_dir: Path) -> None:
    """The docs/PINNED.md recipe, minus the CUDA-only options (pinned memory, non-blocking copies)."""
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
        )
    )
    try:
        state = _dcp_state()
        expected = {**state, "w": state["w"].clone()}
        response = dcp.async_save(state, checkpoint_id=ckpt_dir / "step7", no_dist=True, async_stager=stager)
        response.staging_completion.result(60)
        state["w"].add_(1)  # training resumes once staging is done
        response.upload_completion.result(60)
    finally:
        stager.close()
    target = _dcp_target()
    dcp.load(target, checkpoint_id=ckpt_dir / "step7", no_dist=True)
    _assert_same(target, expected)


# --- CUDA: the side-stream path ----------------------------------------------------------


def _slow_fill(x: Any, value: float) -> None:
    """Queue enough GPU work before ``x.fill_(value)`` that a copy not ordered after it would see stale data."""
    a = torch.randn(4096, 4096, device=x.device)
    for _ in range(20):
        a = a @ a
        a /= a.norm()
    x.fill_(value)


@cuda
@needs_cuda
def test_cuda_mixed_state_round_trip(ckpt_dir: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16).cuda()
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(4, 16, device="cuda")).sum().backward()
        opt.step()
    base = torch.randn(6, 8, device="cuda")
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "views": {"base": base, "t": base.t(), "cols": base[:, ::3]},
        "fp8": torch.randn(8, device="cuda").to(torch.float8_e4m3fn),
        "bf16": torch.randn(4, device="cuda").to(torch.bfloat16),
        "param": torch.nn.Parameter(torch.randn(3, device="cuda")),
        "cpu": torch.arange(5),
        "cuda_rng": torch.cuda.get_rng_state(),
    }
    torch.save(state, ckpt_dir / "reference.pt")
    pool = PinnedPool()
    async_save(state, ckpt_dir / "async.pt", pool=pool).wait(60)
    assert pool.pinned
    got = _load(ckpt_dir / "async.pt")
    want = _load(ckpt_dir / "reference.pt", map_location="cpu")
    _assert_same(got, want)  # the snapshot holds host tensors: everything loads on the CPU
    assert _sharing(got) == _sharing(want)
    on_gpu = _load(ckpt_dir / "async.pt", map_location="cuda")
    assert (
        on_gpu["views"]["base"].is_cuda
        and on_gpu["views"]["t"].untyped_storage().data_ptr() == on_gpu["views"]["base"].untyped_storage().data_ptr()
    )


@cuda
@needs_cuda
@pytest.mark.parametrize("side", ["default_stream", "user_stream"])
def test_cuda_snapshot_sees_queued_writes_and_ignores_later_ones(tmp_path: Path, side: str) -> None:
    x = torch.zeros(1 << 20, device="cuda")
    stream = torch.cuda.current_stream() if side == "default_stream" else torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _slow_fill(x, 1.0)  # still running when async_save is called
        handle = async_save({"x": x}, tmp_path / "a.pt", pool=PinnedPool())
        x.fill_(2.0)  # after the call returned: must not reach the file
    handle.wait(60)
    assert torch.equal(_load(tmp_path / "a.pt")["x"], torch.ones(1 << 20))

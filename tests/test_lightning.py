"""burstfs.lightning.DurableCheckpointRetention with the real PyTorch Lightning Trainer
on CPU, checkpointing into a real mount."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import BIN, FUSE_OK, MountedFS

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from burstfs import client  # noqa: E402
from burstfs.lightning import DurableCheckpointRetention  # noqa: E402

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.torch,
    pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root"),
]

STEPS = 6


class TinyModel(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 1)

    def training_step(self, batch: tuple[object, object], batch_idx: int) -> object:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> object:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> object:
        g = torch.Generator().manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, 1, generator=g))
        return torch.utils.data.DataLoader(data, batch_size=8)


def fit(run: Path, retention: DurableCheckpointRetention, *, save_last: bool = False) -> None:
    checkpoints = pl.callbacks.ModelCheckpoint(
        dirpath=run, every_n_train_steps=1, save_top_k=-1, filename="step-{step:02d}", save_last=save_last
    )
    trainer = pl.Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints, retention],
    )
    trainer.fit(TinyModel())


def names(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("*.ckpt"))


def test_keeps_the_last_durable_checkpoints(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory()
    fs.mount()
    run = fs.path / "run"
    fit(run, DurableCheckpointRetention(run, keep_last=2, wait_at_end=120))
    assert names(run) == ["step-step=05.ckpt", "step-step=06.ckpt"]
    fs.unmount("--wait", "--wait-timeout", "60")
    assert names(fs.remote_dir / "run") == [
        "step-step=05.ckpt",
        "step-step=06.ckpt",
    ]  # the pruned ones are gone there too
    state = torch.load(fs.remote_dir / "run" / "step-step=06.ckpt", weights_only=False)
    assert state["global_step"] == STEPS


def test_deletes_nothing_while_nothing_is_durable(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory(extra_args=("--drain-delay", "3600"))  # type: ignore[call-arg]
    fs.mount()
    run = fs.path / "run"
    retention = DurableCheckpointRetention(run, keep_last=2)
    fit(run, retention)
    assert len(names(run)) == STEPS  # a node lost now still has every checkpoint staged
    assert not client.is_durable(run)
    subprocess.run([str(BIN / "burstfs-admin"), "drain", str(fs.path), "--now"], check=True, timeout=60)
    client.wait_durable(run, timeout=60)
    assert sorted(p.name for p in retention.prune()) == [f"step-step={s:02d}.ckpt" for s in range(1, STEPS - 1)]
    assert names(run) == ["step-step=05.ckpt", "step-step=06.ckpt"]


def test_last_ckpt_is_never_pruned(mounted_factory: type[MountedFS]) -> None:
    """``save_last=True``: ``last.ckpt`` has no step number, sorted as the oldest checkpoint and
    was pruned, so ``fit(ckpt_path="last")`` silently trained from scratch."""
    fs = mounted_factory()
    fs.mount()
    run = fs.path / "run"
    fit(run, DurableCheckpointRetention(run, keep_last=2, wait_at_end=120), save_last=True)
    assert names(run) == ["last.ckpt", "step-step=05.ckpt", "step-step=06.ckpt"]
    assert client.is_durable(run / "last.ckpt")
    state = torch.load(run / "last.ckpt", weights_only=False)
    assert state["global_step"] == STEPS

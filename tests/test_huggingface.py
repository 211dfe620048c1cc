"""burstfs.huggingface.DurableCheckpointRetention with the real transformers Trainer on
CPU, checkpointing into a real mount."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import BIN, FUSE_OK, MountedFS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from burstfs import client  # noqa: E402
from burstfs.huggingface import DurableCheckpointRetention  # noqa: E402

pytestmark = [
    pytest.mark.fuse,
    pytest.mark.torch,
    pytest.mark.skipif(not FUSE_OK, reason="needs /dev/fuse, fusermount3 and root"),
]

STEPS = 6


class TinyModel(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def forward(self, x: Any, y: Any) -> dict[str, Any]:
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), y)}


class Samples(torch.utils.data.Dataset):  # type: ignore[misc]
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i]}


def train(run: Path, retention: DurableCheckpointRetention) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=None,
        per_device_train_batch_size=8,
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        disable_tqdm=True,
    )
    transformers.Trainer(model=TinyModel(), args=args, train_dataset=Samples(), callbacks=[retention]).train()


def names(run: Path) -> list[str]:
    return sorted(p.name for p in run.glob("checkpoint-*"))


def test_keeps_the_last_durable_checkpoints(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory()
    fs.mount()
    run = fs.path / "run"
    train(run, DurableCheckpointRetention(keep_last=2, wait_at_end=120))
    assert names(run) == ["checkpoint-5", "checkpoint-6"]
    fs.unmount("--wait", "--wait-timeout", "60")
    assert names(fs.remote_dir / "run") == ["checkpoint-5", "checkpoint-6"]  # the pruned ones are gone there too
    state = transformers.TrainerState.load_from_json(str(fs.remote_dir / "run" / "checkpoint-6" / "trainer_state.json"))
    assert state.global_step == STEPS


def test_deletes_nothing_while_nothing_is_durable(mounted_factory: type[MountedFS]) -> None:
    fs = mounted_factory(extra_args=("--drain-delay", "3600"))  # type: ignore[call-arg]
    fs.mount()
    run = fs.path / "run"
    retention = DurableCheckpointRetention(keep_last=2)
    train(run, retention)
    assert len(names(run)) == STEPS  # a node lost now still has every checkpoint staged
    assert not client.is_durable(run)
    subprocess.run([str(BIN / "burstfs-admin"), "drain", str(fs.path), "--now"], check=True, timeout=60)
    client.wait_durable(run, timeout=120)
    assert sorted(p.name for p in retention.prune(run)) == [f"checkpoint-{s}" for s in range(1, STEPS - 1)]
    assert names(run) == ["checkpoint-5", "checkpoint-6"]

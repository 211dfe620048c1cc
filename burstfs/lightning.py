"""A PyTorch Lightning callback: keep the last N checkpoints, deleting an older one
only once N newer ones are durable on the remote (burstfs/retention.py says why).

    from pytorch_lightning.callbacks import ModelCheckpoint
    from burstfs.lightning import DurableCheckpointRetention
    trainer = Trainer(callbacks=[
        ModelCheckpoint(dirpath="/mnt/ckpt/run", every_n_train_steps=500, save_top_k=-1),
        DurableCheckpointRetention("/mnt/ckpt/run", keep_last=2, wait_at_end=900),
    ])

``save_top_k=-1``: Lightning itself deletes nothing; this callback does.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from . import client
from .retention import checkpoints_in, prune_checkpoints


class DurableCheckpointRetention(pl.Callback):
    """Prune ``dirpath`` after each training step (rank 0 only), keeping ``keep_last``
    durable checkpoints and every newer one.  With ``wait_at_end`` (seconds), the end of
    ``fit`` waits until the newest checkpoint is durable (DurableTimeoutError if not)."""

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        keep_last: int = 2,
        pattern: str = "*.ckpt",
        wait_at_end: float | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self.dirpath = Path(dirpath)
        self.keep_last = keep_last
        self.pattern = pattern
        self.wait_at_end = wait_at_end

    def prune(self) -> list[Path]:
        """Delete what may go now; returns it."""
        checkpoints = checkpoints_in(self.dirpath, self.pattern) if self.dirpath.is_dir() else []
        if len(checkpoints) <= self.keep_last:
            return []
        return prune_checkpoints(checkpoints, self.keep_last)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            self.prune()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        checkpoints = checkpoints_in(self.dirpath, self.pattern) if self.dirpath.is_dir() else []
        if self.wait_at_end is not None and checkpoints:
            client.wait_durable(checkpoints[-1], timeout=self.wait_at_end)
        self.prune()

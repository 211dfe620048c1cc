"""A PyTorch Lightning callback: keep the last N checkpoints, deleting an older one
only once N newer ones are durable on the remote (burstfs/retention.py says why).

    from pytorch_lightning.callbacks import ModelCheckpoint
    from burstfs.lightning import DurableCheckpointRetention
    trainer = Trainer(callbacks=[
        ModelCheckpoint(dirpath="/mnt/ckpt/run", every_n_train_steps=500, save_top_k=-1),
        DurableCheckpointRetention("/mnt/ckpt/run", keep_last=2, wait_at_end=900),
    ])

``save_top_k=-1``: Lightning itself deletes nothing; this callback does.  ``save_last=True``
is welcome: ``last.ckpt`` (``last-v1.ckpt``...) is what ``fit(ckpt_path="last")`` resumes
from, never pruned, and waited for at the end like the newest checkpoint.
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
        checkpoints = self._steps()
        if len(checkpoints) <= self.keep_last:
            return []
        return prune_checkpoints(checkpoints, self.keep_last)

    def _steps(self) -> list[Path]:
        """The checkpoints of steps, oldest first: not ``last.ckpt``, which has no step number
        to order it by (it sorted first, and was pruned: a resume started from scratch)."""
        found = checkpoints_in(self.dirpath, self.pattern) if self.dirpath.is_dir() else []
        return [path for path in found if not _is_last(path)]

    def _lasts(self) -> list[Path]:
        return [path for path in self.dirpath.glob(self.pattern) if _is_last(path)] if self.dirpath.is_dir() else []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.is_global_zero:
            self.prune()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        newest = self._steps()[-1:] + self._lasts()
        if self.wait_at_end is not None and newest:
            client.wait_durable(newest, timeout=self.wait_at_end)
        self.prune()


def _is_last(path: Path) -> bool:
    """Lightning's ``save_last`` file: ``last.ckpt``, or ``last-v1.ckpt`` beside an older one."""
    last = pl.callbacks.ModelCheckpoint.CHECKPOINT_NAME_LAST
    return path.stem == last or path.stem.startswith(f"{last}-v")

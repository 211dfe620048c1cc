"""A Hugging Face ``transformers.Trainer`` callback: keep the last N checkpoints,
deleting an older one only once N newer ones are durable on the remote
(burstfs/retention.py says why).

    from transformers import Trainer, TrainingArguments
    from burstfs.huggingface import DurableCheckpointRetention
    args = TrainingArguments(output_dir="/mnt/ckpt/run", save_steps=500, save_total_limit=None)
    trainer = Trainer(model, args, callbacks=[DurableCheckpointRetention(keep_last=2, wait_at_end=900)])

``save_total_limit=None``: the Trainer itself deletes nothing; this callback does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from . import client
from .retention import checkpoints_in, prune_checkpoints


class DurableCheckpointRetention(TrainerCallback):
    """Prune ``output_dir/checkpoint-*`` after each save (main process only), keeping
    ``keep_last`` durable checkpoints and every newer one.  With ``wait_at_end``
    (seconds), the end of training waits until the newest checkpoint is durable
    (DurableTimeoutError if not)."""

    def __init__(self, keep_last: int = 2, pattern: str = "checkpoint-*", wait_at_end: float | None = None) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        self.keep_last = keep_last
        self.pattern = pattern
        self.wait_at_end = wait_at_end

    def prune(self, output_dir: str | Path | None) -> list[Path]:
        """Delete what may go now; returns it."""
        directory = Path(output_dir or "trainer_output")  # the Trainer's default output_dir
        checkpoints = checkpoints_in(directory, self.pattern) if directory.is_dir() else []
        if len(checkpoints) <= self.keep_last:
            return []
        return prune_checkpoints(checkpoints, self.keep_last)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self.prune(args.output_dir)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if not state.is_world_process_zero:
            return
        directory = Path(args.output_dir or "trainer_output")
        checkpoints = checkpoints_in(directory, self.pattern) if directory.is_dir() else []
        if self.wait_at_end is not None and checkpoints:
            client.wait_durable(checkpoints[-1], timeout=self.wait_at_end)
        self.prune(args.output_dir)

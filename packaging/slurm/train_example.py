"""A tiny training loop for packaging/slurm/train.sbatch: resumes from the newest
complete, published DCP checkpoint in --checkpoint-dir (``client.latest``), saves one
every --every steps, keeps the last two durable ones (burstfs.retention), and waits
for the last to be durable."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from burstfs import client
from burstfs.retention import checkpoints_in, prune_checkpoints


def restart_point(run: Path) -> tuple[Path | None, str | None]:
    """(checkpoint, None): the checkpoint to resume from, None to start from scratch; or
    (None, why) when burstfs cannot say, and the job must not start over.

    The newest checkpoint under ``run`` that ``client.latest`` calls complete: its commit
    record is on the remote and its marker and every node's shards match it there.  A
    step whose .metadata is only staged here, one torn (a node died in it) or being
    rewritten is never it, whatever its name (docs/SEMANTICS.md "Which checkpoint to
    restart from").  When latest cannot answer (the remote unreachable, no mount),
    starting from scratch would write new step_* over the run's checkpoints: refuse."""
    try:
        return client.latest(run), None
    except client.ClientError as exc:
        return None, (
            f"cannot tell which checkpoint in {run} to resume from ({type(exc).__name__}: {exc}); "
            f"not starting from scratch, which would overwrite the run's checkpoints. "
            f"Check `burstfs-admin latest {run}` and resubmit."
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model.state_dict(), "step": torch.tensor(0)}
    run = args.checkpoint_dir
    if local_rank == 0:
        run.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # Rank 0 asks, every rank loads its answer: ranks asking apart could see a checkpoint
    # published in between and load different steps.
    answer: list[object] = list(restart_point(run)) if rank == 0 else [None, None]
    dist.broadcast_object_list(answer, src=0)
    resume, problem = answer
    if problem is not None:
        dist.destroy_process_group()
        raise SystemExit(f"rank {rank}: {problem}")
    if resume is not None:
        dcp.load(state, checkpoint_id=resume)
        model.load_state_dict(state["model"])
        print(f"rank {rank}: resumed from {resume}", flush=True)
    elif rank == 0:
        print(f"rank {rank}: no complete checkpoint in {run}: starting from scratch", flush=True)
    step = int(state["step"])
    while step < args.steps:
        loss = model(torch.randn(32, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % args.every == 0 or step == args.steps:
            last = run / f"step_{step:06d}"
            dcp.save({"model": model.state_dict(), "step": torch.tensor(step)}, checkpoint_id=last)
            if rank == 0:
                prune_checkpoints(checkpoints_in(run, "step_*"), keep_last=2)
            print(f"rank {rank}: step {step} loss {loss.item():.4f} saved {last}", flush=True)
    if local_rank == 0:
        durable = client.wait_durable(run / f"step_{step:06d}", timeout=600)
        print(f"rank {rank}: step_{step:06d} durable ({durable.files} files, {durable.bytes} bytes)", flush=True)
    dist.barrier()
    if rank == 0:  # once every step is durable, the older ones beyond two may go
        # An older step can become durable after the last (each step's commit round is its
        # own): pruned before, the older ones would count as not durable and all be kept.
        client.wait_durable(run, timeout=600)
        prune_checkpoints(checkpoints_in(run, "step_*"), keep_last=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

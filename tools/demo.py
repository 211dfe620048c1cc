"""The main job, end to end, on the embedded default (a local directory as the remote).

Mounts burstfs, trains a small model for a few steps while checkpointing with
``torch.save`` (write to a temp name, ``os.replace``, then a ``latest`` marker),
shows the drain status, unmounts once everything is durable, and loads the last
checkpoint straight from the remote directory — without burstfs.

    .venv/bin/python tools/demo.py [--workdir DIR] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def run(*args: str) -> None:
    print(f"$ {' '.join(args)}", flush=True)
    subprocess.run(args, check=True)


def train(ckpt_dir: Path, steps: int, every: int) -> None:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data, target = torch.randn(512, 256), torch.randint(0, 10, (512,))
    for step in range(1, steps + 1):
        loss = torch.nn.functional.cross_entropy(model(data), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % every == 0:
            started = time.perf_counter()
            step_dir = ckpt_dir / f"step{step:05d}"
            step_dir.mkdir(parents=True, exist_ok=True)
            tmp = step_dir / "model.pt.tmp"
            torch.save({"step": step, "model": model.state_dict(), "optim": optimizer.state_dict()}, tmp)
            os.replace(tmp, step_dir / "model.pt")
            (ckpt_dir / "latest").write_text(step_dir.name)  # the commit marker: drains last
            blocked = time.perf_counter() - started
            print(f"step {step:3d} loss {loss.item():.4f} checkpoint {step_dir.name} blocked {blocked * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--keep", action="store_true", help="keep the demo's files (default: removed)")
    args = parser.parse_args()
    work = args.workdir or Path(
        tempfile.mkdtemp(prefix="burstfs-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    mnt, cache, remote = work / "mnt", work / "cache", work / "remote"
    for d in (mnt, remote):
        d.mkdir(parents=True, exist_ok=True)

    run(str(BIN / "burstfs"), "mount", str(mnt), "--cache", str(cache), "--remote", f"file://{remote}")
    try:
        train(mnt / "ckpt", args.steps, args.every)
        run(str(BIN / "burstfs-admin"), "status", str(mnt))
        run(str(BIN / "burstfs-admin"), "wait", str(mnt / "ckpt"), "--timeout", "120")
        run(str(BIN / "burstfs-admin"), "ls", str(mnt / "ckpt"))
    finally:
        run(str(BIN / "burstfs"), "unmount", "--wait", str(mnt))

    import torch

    latest = (remote / "ckpt" / "latest").read_text()
    state = torch.load(remote / "ckpt" / latest / "model.pt", weights_only=True)
    print(
        f"loaded {latest} from the remote directory without burstfs: step {state['step']}, "
        f"{sum(t.numel() for t in state['model'].values())} parameters"
    )
    if args.keep or args.workdir:
        print(f"demo files are in {work}")
    else:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()

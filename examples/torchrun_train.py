"""Train a small data-parallel model under torchrun (gloo, CPU), checkpointing through ckptd.

    CKPTD_ADDRESSES=/tmp/n0/d.sock,/tmp/n1/d.sock CKPT_JOB=ddp-demo \\
        torchrun --standalone --nproc-per-node 4 examples/torchrun_train.py --steps 20 --ckpt-every 5

Each rank saves its own shard (model, AdamW state, step, and its own RNG state,
which its dropout depends on) with save_async every --ckpt-every steps, and at
start resumes from the newest step that every rank can load. Batches are a pure
function of (step, rank), so a resumed run computes exactly the losses of an
uninterrupted one. Gradients are averaged with one all_reduce per parameter rather
than by DistributedDataParallel: DDP regroups its gradient buckets after its first
iteration, so a resumed DDP run sums gradients in another layout than the run it
continues and matches it only to within rounding, not bit for bit.

Which daemon a rank talks to: CKPTD_ADDRESSES lists one daemon socket per node,
and rank r uses entry r // (WORLD_SIZE / number of entries), as if the ranks were
spread evenly over that many nodes in rank order (so two daemons on one machine
can stand in for two nodes). Without it, every rank uses CKPTD_ADDRESS, the local
daemon, as on a real cluster. The job name is --job, else CKPT_JOB.

--losses FILE (written by rank 0) records {"resumed_from": step, "losses": {step: loss}}
for the steps this run trained; each loss is the mean over all ranks.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import ckpt
import torch

# Before init_process_group on purpose: torch.optim imports torch._dynamo, which, when first imported
# after it, keeps the process group alive past destroy_process_group; gloo's worker threads then
# outlive it and can abort a rank at interpreter exit ("terminate called without an active exception").
import torch._dynamo
import torch.distributed as dist
from torch import nn

SEED = 1234
FEATURES = 16
HIDDEN = 64
BATCH = 32
LEARNING_RATE = 1e-2


def make_model() -> nn.Module:
    """Return the same small regression MLP on every rank."""
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Dropout(0.1), nn.Linear(HIDDEN, 1))


def batch_for(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return this rank's (inputs, targets) of a step; no data-loader state needs saving."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * world_size + rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    y = torch.sin(x[:, :4].sum(dim=1, keepdim=True)) + 0.1 * x[:, 4:5] ** 2
    return x, y


def average_gradients(model: nn.Module, world_size: int) -> None:
    """Replace each gradient by its mean over the ranks, in the same layout at every step."""
    for p in model.parameters():
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= world_size


def daemon_address(rank: int, world_size: int) -> str | None:
    """Pick this rank's daemon from CKPTD_ADDRESSES (see the module docstring), else None: CKPTD_ADDRESS."""
    listed = [a for a in os.environ.get("CKPTD_ADDRESSES", "").split(",") if a]
    if not listed:
        return None
    if world_size % len(listed):
        raise SystemExit(f"WORLD_SIZE {world_size} does not split evenly over {len(listed)} CKPTD_ADDRESSES")
    return listed[rank // (world_size // len(listed))]


def agreed_resume_step(checkpointer: ckpt.Checkpointer) -> int | None:
    """Return the newest step that every rank's daemon reports complete, or None if some rank has none.

    Each rank asks its own daemon; a step sealed a moment ago may not be known to
    every node yet, and all ranks must load the same step.
    """
    latest = checkpointer.latest_step()
    agreed = torch.tensor([-1 if latest is None else latest], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return None if agreed.item() < 0 else int(agreed.item())


def main(argv: list[str] | None = None) -> int:
    """Train until --steps steps are complete, resuming from and saving to ckptd when --ckpt-every is set."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="train until this many steps are complete")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="save every K steps (0: no checkpoints)")
    p.add_argument("--job", default=None, help="ckpt job name (default: $CKPT_JOB)")
    p.add_argument("--wait-tier", default="nvme", help="before exiting, wait until the last save reached this tier")
    p.add_argument("--losses", type=Path, help="rank 0 writes the losses of the steps run here to this JSON file")
    args = p.parse_args(argv)

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # several ranks share a few cores
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    torch.manual_seed(SEED + rank)  # each rank draws its own dropout masks

    checkpointer = None
    completed = 0
    if args.ckpt_every > 0:
        checkpointer = ckpt.Checkpointer(job=args.job, address=daemon_address(rank, world_size))
        resume_step = agreed_resume_step(checkpointer)
        if resume_step is not None:
            state: dict[str, Any] = checkpointer.load(step=resume_step)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
            completed = int(state["step"])
            print(f"rank {rank} resumed from step {completed}", flush=True)

    losses: dict[int, float] = {}
    handle = None
    for step in range(completed + 1, args.steps + 1):
        x, y = batch_for(step, rank, world_size)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model, world_size)
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses[step] = mean_loss.item() / world_size

        if checkpointer is not None and step % args.ckpt_every == 0:
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "step": step,
                "torch_rng": torch.get_rng_state(),
            }
            handle = checkpointer.save_async(state, step=step)  # returns after one copy; training goes on

    if handle is not None:
        handle.wait(args.wait_tier, timeout=120)  # this rank's last shard is safe on that tier before exit
    if checkpointer is not None:
        checkpointer.close()
    if rank == 0 and args.losses is not None:
        args.losses.write_text(json.dumps({"resumed_from": completed, "losses": losses}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Train a small model sharded with FSDP2 (and optionally tensor parallelism) under torchrun, resuming through ckptd.

    CKPT_JOB=fsdp-demo torchrun --standalone --nproc-per-node 4 examples/fsdp_train.py --steps 20 --ckpt-every 5

The state is `get_state_dict(model, optimizer)`: DTensors, each rank holding its
shards. save_async stages only this rank's shards (no collective); at start the job
resumes with load(into=state) from the newest step, whatever world size or mesh saved
it: a job saved on 4 ranks resumes on 2, or a TP x FSDP job resumes as plain FSDP.

--mesh fsdp       FSDP2 over every rank (fully_shard)
--mesh tp-fsdp    a 2 x (WORLD_SIZE/2) mesh: tensor parallel inside pairs, FSDP2 across them
--mesh hsdp       HSDP: FSDP2 inside pairs of ranks, replicated across the pairs
Batches are a pure function of (step, data-parallel rank), so a resumed run computes
exactly the losses of an uninterrupted one. CKPTD_ADDRESSES picks a daemon per rank
as in torchrun_train.py. --dump FILE: rank 0 writes every full tensor of the model and
optimizer state (`full_tensor()`) to FILE with torch.save, after the last save of this
run, or right after loading with --dump-after-load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import ckpt
import torch
import torch._dynamo  # before init_process_group (see torchrun_train.py)
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchrun_train import daemon_address

SEED = 4321
FEATURES = 16
HIDDEN = 60  # does not split evenly over 8 ranks: uneven shards are part of the test
BATCH = 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(FEATURES, HIDDEN)
        self.down = nn.Linear(HIDDEN, 30)
        self.head = nn.Linear(30, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def build(mesh_kind: str, world_size: int) -> tuple[nn.Module, torch.optim.Optimizer, int, int]:
    """Return (model, optimizer, data-parallel rank, data-parallel size), the same initial weights on any mesh."""
    torch.manual_seed(SEED)
    model = Model()
    if mesh_kind == "tp-fsdp":
        mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        dp_mesh = mesh["dp"]
    elif mesh_kind == "hsdp":  # shards within pairs of ranks, replicated across the pairs
        hsdp = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=hsdp)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, optimizer, dist.get_rank(), world_size  # every rank is data-parallel
    else:
        dp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, dp_mesh.get_local_rank(), dp_mesh.size()


def batch_for(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + dp_rank)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, torch.sin(x[:, :4].sum(dim=1, keepdim=True))


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "step": step}


def full_tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Return every tensor of state by key, DTensors gathered whole (a collective: every rank calls it)."""
    found: dict[str, torch.Tensor] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else []
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, DTensor):
            found[key] = v.full_tensor().clone()
        elif isinstance(v, torch.Tensor):
            found[key] = v.clone()
        else:
            found.update(full_tensors(v, key))
    return found


def main(argv: list[str] | None = None) -> int:
    """Train to --steps, saving every --ckpt-every steps and resuming from the newest step at start."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="train until this many steps are complete")
    p.add_argument("--ckpt-every", type=int, default=0, metavar="K", help="save every K steps (0: no checkpoints)")
    p.add_argument("--mesh", choices=("fsdp", "tp-fsdp", "hsdp"), default="fsdp")
    p.add_argument("--job", default=None, help="ckpt job name (default: $CKPT_JOB)")
    p.add_argument("--losses", type=Path, help="rank 0 writes the losses of the steps run here to this JSON file")
    p.add_argument("--dump", type=Path, help="rank 0 writes the full model and optimizer tensors here")
    p.add_argument("--dump-after-load", action="store_true", help="dump right after loading, then stop")
    args = p.parse_args(argv)

    # The Checkpointer needs no process group: RANK and WORLD_SIZE come from torchrun.
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    checkpointer = ckpt.Checkpointer(job=args.job, address=daemon_address(rank, world_size))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model, optimizer, dp_rank, dp_size = build(args.mesh, world_size)
    completed = 0
    latest = torch.tensor([-1 if (s := checkpointer.latest_step()) is None else s])
    dist.all_reduce(latest, op=dist.ReduceOp.MIN)  # every rank loads the same step
    if latest.item() >= 0:
        state = checkpointer.load(step=int(latest.item()), into=training_state(model, optimizer, 0))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        completed = int(state["step"])
        print(f"rank {rank} resumed from step {completed} on {world_size} ranks", flush=True)
        if args.dump_after_load:
            dumped = full_tensors(training_state(model, optimizer, completed))
            if rank == 0 and args.dump is not None:
                torch.save(dumped, args.dump)
            dist.barrier()  # every gather of full_tensor() is done everywhere before the group goes
            checkpointer.close()
            dist.destroy_process_group()
            return 0

    losses: dict[int, float] = {}
    handle = None
    for step in range(completed + 1, args.steps + 1):
        x, y = batch_for(step, dp_rank)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        losses[step] = mean_loss.item() / world_size
        if args.ckpt_every and step % args.ckpt_every == 0:
            handle = checkpointer.save_async(training_state(model, optimizer, step), step=step)
            if args.dump is not None:
                dumped = full_tensors(training_state(model, optimizer, step))
                if rank == 0:
                    torch.save(dumped, args.dump)

    if handle is not None:
        handle.wait("nvme", timeout=120)
    checkpointer.close()
    if rank == 0 and args.losses is not None:
        args.losses.write_text(json.dumps({"resumed_from": completed, "losses": losses, "dp_size": dp_size}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    code = main()
    # Everything is written and closed. Skip the interpreter's teardown: with FSDP2 on gloo,
    # torch itself sometimes aborts there ("terminate called without an active exception",
    # about 1 run in 6 on CPU, with or without ckpt), which would fail a finished run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

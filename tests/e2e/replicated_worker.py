"""One rank of a DDP job (gloo): save with Checkpointer(replicated="model") on every rank, or load with into=."""

from __future__ import annotations

import sys

import ckpt
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    c = ckpt.Checkpointer(replicated="model")  # job, rank, world size, address from the environment
    if sys.argv[1] == "save":
        torch.manual_seed(rank)  # DDP broadcasts rank 0's weights: the same model on every rank
        model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 4)))
        model(torch.randn(3, 8)).sum().backward()  # gradients all-reduced: the same update on every rank
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        c.save_async({"model": model.module, "rank": rank}, step=5).wait("nvme", timeout=60)
        weights = model.module
    else:
        torch.manual_seed(100 + rank)
        weights = nn.Sequential(nn.Linear(8, 4))
        state = c.load(5, into={"model": weights, "rank": -1})
        assert state["model"] is weights and state["rank"] == (rank if rank < 2 else 0)
    total = sum(float(p.double().sum()) for p in weights.parameters())
    print(f"{sys.argv[1]} rank {rank} of {world_size}: {total:.9f}", flush=True)
    dist.barrier()
    c.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

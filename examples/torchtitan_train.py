"""torchtitan's checkpoint manager on ckptd: a tiny model trained with torchtitan's own containers.

    ckptd serve &
    python examples/torchtitan_train.py OUT --job titan-demo --steps 16
    torchrun --standalone --nproc-per-node 2 examples/torchtitan_train.py OUT --job titan-fsdp   # FSDP2, gloo
    # kill -9 it mid-run and start it again: it resumes from the job's latest step, as torchtitan would

The model (on several ranks sharded by FSDP2's fully_shard, as torchtitan shards it), its optimizer
(OptimizersContainer, AdamW) and LR schedule (LRSchedulersContainer) are torchtitan's, built as its
Trainer builds them; CkptdCheckpointManager is torchtitan's CheckpointManager with its DCP saves and
loads on ckptd (ckpt.torchtitan). Each rank's losses go to OUT/losses-rank<R>-<pid>.json as they are
computed, the model's final state_dict (gathered) to OUT/final.pt.
--die-at N: SIGKILL itself right after step N's save returned (the tests' crash). --stock: torchtitan's own
CheckpointManager instead, with step-N directories under OUT/checkpoint; a later run without --stock
resumes from the newest of them while its job holds no step, and saves on to ckptd.

With torchtitan's own trainer (`torchrun ... -m torchtitan.train --module M --config C`), the same
manager comes in through the config a config_registry function returns:

    def llama3_debugmodel_ckptd() -> Trainer.Config:
        config = llama3_debugmodel()
        config.checkpoint = CkptdCheckpointManager.Config(
            enable=True, job="llama3-debug", interval=10, async_mode="async", keep_latest_k=3,
            last_save_model_only=False,
        )
        return config
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt.torchtitan import CkptdCheckpointManager
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer, ParamGroupConfig


class TrainState(Stateful):
    """The training step, saved with the checkpoint (torchtitan's Trainer saves its own as "train_state")."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return this rank's batch of step, the same in every run."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--job", default="", help="the ckptd job; empty: env CKPT_JOB")
    parser.add_argument("--address", default="")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--keep-latest-k", type=int, default=2)
    parser.add_argument("--async-mode", default="async", choices=["disabled", "async", "async_with_pinned_mem"])
    parser.add_argument("--die-at", type=int)
    parser.add_argument("--stock", action="store_true", help="torchtitan's own CheckpointManager, files in OUT")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    # torchtitan's async modes save over a gloo group of their own: a process group must be up (torchrun's, else
    # one process on a file store of this run's own).
    store = args.out / f"pg-{os.getpid()}"
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    rank = dist.get_rank()
    if dist.get_world_size() > 1:  # sharded as torchtitan shards (FSDP2): parameters and optimizer states DTensors
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=args.steps)
    train_state = TrainState()
    on_ckptd = {} if args.stock else {"job": args.job, "address": args.address}
    manager = CheckpointManager if args.stock else CkptdCheckpointManager
    checkpointer = manager.Config(
        enable=True,
        **on_ckptd,
        folder="checkpoint",
        interval=args.interval,
        keep_latest_k=args.keep_latest_k,
        async_mode=args.async_mode,
        last_save_model_only=False,
    ).build(
        dataloader=None,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
        base_folder=str(args.out),
    )

    checkpointer.load()  # the job's latest step, if it has one
    losses: dict[int, float] = {}
    losses_file = args.out / f"losses-rank{rank}-{os.getpid()}.json"
    while train_state.step < args.steps:
        train_state.step += 1
        checkpointer.maybe_wait_for_staging()
        x, y = batch(train_state.step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        optimizers.zero_grad()
        losses[train_state.step] = loss.item()
        losses_file.write_text(json.dumps(losses))
        checkpointer.save(train_state.step, last_step=train_state.step == args.steps)
        if train_state.step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    final = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(final, args.out / "final.pt")
    dist.destroy_process_group()
    store.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

"""Train a tiny model with DeepSpeed (ZeRO 1 by default), its checkpoints saved through ckptd; run again to resume.

    ckptd serve &    # or the node's daemon
    python examples/deepspeed_train.py --job deepspeed-demo --save-dir /tmp/ds-demo --steps 24
    python examples/deepspeed_train.py --job deepspeed-demo --save-dir /tmp/ds-demo --steps 48   # resumes at 24
    torchrun --nproc-per-node 2 examples/deepspeed_train.py ...                                  # two ranks

One line enables ckptd: engine.checkpoint_engine = CkptdCheckpointEngine(job=...), once deepspeed.initialize
has made the engine. engine.save_checkpoint(save_dir) then returns once the model and optimizer states are
copied into ckptd's shared memory (the tag global_stepN is ckptd step N), and leaves in save_dir/global_stepN
small pointer files where DeepSpeed would have written its .pt files, and DeepSpeed's own `latest`. Every
run starts with engine.load_checkpoint(save_dir): the first finds no `latest`, a later one (after a crash
too) resumes from the tag `latest` names. Each step's batch is a function of the seed and the step, so a
resumed run sees the batches an uninterrupted one would. Without torchrun it runs as one rank (gloo on
CPU, DS_ACCELERATOR=cpu where there is no GPU). The daemon is --address, else CKPTD_ADDRESS, else the
default socket.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch

SEED = 1234


def one_rank_environment() -> None:
    """Set what deepspeed.initialize reads when the script is not run by torchrun (one rank, gloo on CPU)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the batch of a global step: the same in every run, resumed or not."""
    g = torch.Generator().manual_seed(SEED + step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--save-dir", required=True, help="where DeepSpeed's tags (pointer files) and latest go")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=8)
    parser.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--address")
    parser.add_argument("--losses", type=Path, help="write each step's loss into DIR/losses-<pid>.json")
    parser.add_argument("--die-at", type=int, help="SIGKILL this process after step N (a crash, for tests)")
    args = parser.parse_args(argv)

    one_rank_environment()
    import deepspeed
    from ckpt.deepspeed import CkptdCheckpointEngine

    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "zero_optimization": {"stage": args.zero_stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    engine.checkpoint_engine = CkptdCheckpointEngine(job=args.job, address=args.address)

    engine.load_checkpoint(args.save_dir)  # (None, None) on the first run: no `latest` yet
    losses: dict[int, float] = {}
    while engine.global_steps < args.steps:
        step = engine.global_steps + 1
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
        if args.losses is not None:
            args.losses.mkdir(parents=True, exist_ok=True)
            (args.losses / f"losses-{os.getpid()}.json").write_text(json.dumps(losses))
        if step % args.save_every == 0:
            engine.save_checkpoint(args.save_dir)  # returns once copied: tag global_step<step>
        if step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
    engine.checkpoint_engine.close()
    print(f"trained to step {engine.global_steps}; ckptd job {args.job}")


if __name__ == "__main__":
    main()

"""Train a tiny GPT-2 in a plain Accelerate loop, its state saved into ckptd; run it again to resume.

    ckptd serve &    # or the node's daemon
    python examples/accelerate_train.py --job accelerate-demo --steps 24
    python examples/accelerate_train.py --job accelerate-demo --steps 48    # resumes at step 24

ckpt.huggingface.AcceleratorCheckpoints is Accelerator.save_state / load_state on ckptd: every
--save-every steps it saves the prepared model, optimizer and scheduler, the objects registered
for checkpointing (here the loop's Progress: epoch and step), the scaler and the RNG states, and
returns once they are copied. Every run starts with load_state(): the first finds nothing, a
later one (after a crash too) resumes from the job's latest step and skips the batches that step
had seen. The data order is the seedable sampler's (use_seedable_sampler=True), a function of the
seed and the epoch, so a resumed run sees the batches an uninterrupted one would. The daemon is
--address, else CKPTD_ADDRESS, else the default socket.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from ckpt.huggingface import AcceleratorCheckpoints
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from huggingface_train import SEED, Tokens, tiny_gpt2


class Progress:
    """Where the loop is: the epoch and the global step, saved with the rest (register_for_checkpointing)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.step = state["epoch"], state["step"]


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-every", type=int, default=8)
    parser.add_argument("--address")
    parser.add_argument("--losses", type=Path, help="write each step's loss into DIR/losses-<pid>.json")
    parser.add_argument("--die-at", type=int, help="SIGKILL this process after step N (a crash, for tests)")
    args = parser.parse_args(argv)

    set_seed(SEED)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.1, total_iters=args.steps)
    # A generator of its own: a DataLoader draws its workers' seed at each iter() from it, not from torch's
    # RNG, which a resume puts back to the saved step's state and dropout must then find as it was.
    data = DataLoader(Tokens(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(SEED))
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    losses: dict[int, float] = {}
    with AcceleratorCheckpoints(accelerator, job=args.job, address=args.address, keep=2) as checkpoints:
        resumed = checkpoints.load_state()
        if resumed is not None:
            accelerator.print(f"resumed from step {resumed}")
        while progress.step < args.steps:
            data.set_epoch(progress.epoch)
            seen = progress.step % len(data)  # batches of this epoch that the loaded step had trained on
            for batch in accelerator.skip_first_batches(data, seen) if seen else data:
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                progress.step += 1
                if args.losses:
                    losses[progress.step] = loss.item()
                    args.losses.mkdir(parents=True, exist_ok=True)
                    (args.losses / f"losses-{os.getpid()}.json").write_text(json.dumps(losses))
                if progress.step % args.save_every == 0:
                    checkpoints.save_state(step=progress.step)
                if progress.step == args.die_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                if progress.step == args.steps:
                    break
            else:
                progress.epoch += 1
    accelerator.print(f"trained to step {progress.step}; checkpoints: ckptd ls --job {args.job}")


if __name__ == "__main__":
    main()

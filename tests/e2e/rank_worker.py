"""Act as one training rank in its own process: save steps through the daemon, maybe die right after."""

from __future__ import annotations

import argparse
import os
import signal

import ckpt
from states import every_kind_state


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--address", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, nargs="+", required=True)
    p.add_argument("--die-after-save", action="store_true", help="SIGKILL itself right after the last save_async")
    p.add_argument("--size-mib", type=int, default=0, help="add a tensor of this size")
    args = p.parse_args()
    c = ckpt.Checkpointer(job=args.job, address=args.address)  # rank and world size from RANK / WORLD_SIZE
    handles = []
    for step in args.steps:
        state = every_kind_state(seed=c.rank * 1000 + step)
        if args.size_mib:
            state["big"] = torch_full(args.size_mib, c.rank * 1000 + step)
        handles.append(c.save_async(state, step=step))
    if args.die_after_save:
        print("saved", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    for h in handles:
        h.wait("nvme", timeout=120)
    print("durable", flush=True)
    c.close()


def torch_full(size_mib: int, seed: int):
    import torch

    return torch.randn(size_mib << 18, generator=torch.Generator().manual_seed(seed))


if __name__ == "__main__":
    main()

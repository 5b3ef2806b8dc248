"""The training rank of benchmarks/chaos.py: save a known state every step, and say which steps are durable.

chaos.py starts it (and starts it again after killing it). It resumes one past the
newest step the daemon lists, saves state_for(step) and prints `durable <step>` once
h.wait("nvme") returned. A save that fails (the daemon was killed under it) is
printed as `failed <step> <error>`; the rank then goes on with the next step once
the daemon answers again. Not meant to be run by hand.
"""

from __future__ import annotations

import sys
import time

import ckpt
import torch

ELEMENTS = 64 << 10  # 256 KiB of float32 per step
STEP_S = 0.05  # the training between two saves: a campaign of minutes keeps to thousands of steps
RETRY_S = 0.05


def state_for(step: int) -> dict[str, object]:
    """Return the state saved at step: a function of the step alone, so any load can be checked."""
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ELEMENTS, generator=generator), "step": step}


def main(address: str, job: str) -> int:
    """Save step after step until killed."""
    c = ckpt.Checkpointer(job=job, rank=0, world_size=1, address=address)
    step = None
    while True:
        try:
            if step is None:
                latest = c.latest_step()
                step = 0 if latest is None else latest + 1
            h = c.save_async(state_for(step), step=step)
            h.wait("nvme", timeout=60)
            if not h.skipped:
                print(f"durable {step}", flush=True)
            step += 1
            time.sleep(STEP_S)
        except (ckpt.CheckpointError, TimeoutError) as e:
            print(f"failed {step} {type(e).__name__}", flush=True)
            if step is not None:
                step += 1  # a step half saved is never saved again: its slot may hold another run's bytes
            time.sleep(RETRY_S)  # the daemon is restarting: ask again shortly


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

"""The training rank of benchmarks/chaos.py: save a known state every step, and say which steps are durable.

chaos.py starts it (and starts it again after killing it). It resumes one past the
newest step the daemon lists, saves state_for(step) and prints `durable <step> nvme`
once h.wait("nvme") returned; then, between saves, it asks the handles of its recent
steps whether they reached the peer tier and (every `every`-th step) the object tier,
and prints `durable <step> <tier>` for each that did. A save that fails (the daemon
was killed under it, the disk is full) is printed as `failed <step> <error>`; the rank
then goes on with the next step. Not meant to be run by hand:

    chaos_rank.py ADDRESS JOB EVERY
"""

from __future__ import annotations

import sys
import time

import ckpt
import torch

ELEMENTS = 64 << 10  # 256 KiB of float32 per step
STEP_S = 0.05  # the training between two saves: a campaign of minutes keeps to thousands of steps
RETRY_S = 0.05
FOLLOWED = 32  # the recent handles asked about the slower tiers; older ones are let go


def state_for(step: int) -> dict[str, object]:
    """Return the state saved at step: a function of the step alone, so any load can be checked."""
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(ELEMENTS, generator=generator), "step": step}


def report_slower_tiers(followed: list[tuple[ckpt.SaveHandle, set[str]]]) -> None:
    """Print each tier a followed handle reached since last asked; forget what is settled."""
    for h, tiers in followed:
        for tier in sorted(tiers):
            try:
                reached = h.done(tier)
            except ckpt.CheckpointError:  # failed there, or the daemon that knew it was killed
                reached = True
            else:
                if reached:
                    print(f"durable {h.step} {tier}", flush=True)
            if reached:
                tiers.discard(tier)
    followed[:] = [(h, tiers) for h, tiers in followed[-FOLLOWED:] if tiers]


def main(address: str, job: str, every: int) -> int:
    """Save step after step until killed."""
    c = ckpt.Checkpointer(job=job, rank=0, world_size=1, address=address)
    step = None
    followed: list[tuple[ckpt.SaveHandle, set[str]]] = []
    while True:
        try:
            if step is None:
                latest = c.latest_step()
                step = 0 if latest is None else latest + 1
            h = c.save_async(state_for(step), step=step)
            h.wait("nvme", timeout=60)
            if not h.skipped:
                print(f"durable {step} nvme", flush=True)
                followed.append((h, {"peer", "object"} if step % every == 0 else {"peer"}))
            step += 1
            report_slower_tiers(followed)
            time.sleep(STEP_S)
        except (ckpt.CheckpointError, TimeoutError) as e:
            print(f"failed {step} {type(e).__name__}", flush=True)
            if step is not None:
                step += 1  # a step half saved is never saved again: its slot may hold another run's bytes
            time.sleep(RETRY_S)  # the daemon is restarting: ask again shortly


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))

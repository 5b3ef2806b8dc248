"""The job a new run saves to when its job holds another run's steps: JOB-v1, JOB-v2, ... (as Lightning names files).

The adapters (ckpt.lightning on global rank 0, ckpt.huggingface on every rank at once) call new_run_job on
the training thread before a run's first save, when that run loaded none of its job's checkpoints: a new
run never mixes its steps into another run's line, and a run resumed from a checkpoint of any version
continues that version.
"""

from __future__ import annotations

from ckpt_core.format import validate_job

from ckpt.checkpointer import Checkpointer


def new_run_job(base: str, address: str | None, every_rank: bool = False) -> tuple[str, int | None]:
    """Return a new run's job (base, or its first unused version if base holds a step) and base's newest step.

    every_rank: every rank of a distributed run calls this at once (ckpt.huggingface: each rank saves its
    part of one step), so rank 0 decides and the others take its answer through torch.distributed. Each
    rank asks its own node's daemon, and nodes may see different steps (another node's run, a rank that
    saved first): ranks that chose on their own could save one step into two jobs.
    """
    import torch.distributed as dist  # an adapter's run: torch is there

    if every_rank and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        answer = [_first_unused(base, address) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(answer, src=0)
        job, used = answer[0]  # type: ignore[misc]
        return job, used
    return _first_unused(base, address)


def _first_unused(base: str, address: str | None) -> tuple[str, int | None]:
    with Checkpointer(job=base, rank=0, world_size=1, address=address) as c:
        used = c.latest_step()
        if used is None:
            return base, None
        version = 1
        while c.daemon.newest_step(f"{base}-v{version}") is not None:
            version += 1
    return validate_job(f"{base}-v{version}"), used

"""The job a new run saves to when its job holds another run's steps: JOB-v1, JOB-v2, ... (as Lightning names files).

The adapters (ckpt.lightning, ckpt.huggingface) call new_run_job on the training thread before a run's
first save, when that run loaded none of its job's checkpoints: a new run never mixes its steps into
another run's line, and a run resumed from a checkpoint of any version continues that version.
"""

from __future__ import annotations

from ckpt_core.format import validate_job

from ckpt.checkpointer import Checkpointer


def new_run_job(base: str, address: str | None) -> tuple[str, int | None]:
    """Return a new run's job (base, or its first unused version if base holds a step) and base's newest step."""
    with Checkpointer(job=base, rank=0, world_size=1, address=address) as c:
        used = c.latest_step()
        if used is None:
            return base, None
        version = 1
        while c.daemon.newest_step(f"{base}-v{version}") is not None:
            version += 1
    return validate_job(f"{base}-v{version}"), used

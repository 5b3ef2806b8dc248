"""One torchrun rank of tests/e2e/test_dcp_interop.py: FSDP2 state saved and loaded through ckpt.dcp (gloo, CPU).

    torchrun --nproc-per-node 4 dcp_worker.py save OUT   # steps 10, 20, 30, 31, 32, one training step apart
    torchrun --nproc-per-node 2 dcp_worker.py load OUT   # steps 10, 20, 30, 32 through the Reader; 20 also by ckpt

The state is examples/fsdp_train.py's: get_state_dict(model, optimizer) and a step
number. Rank 0 writes every full tensor (full_tensor()) to OUT/saved-<step>.pt after
each save and to OUT/loaded-<how>-<step>.pt after each load, and OUT/steps.json: the
step value each load restored. CKPTD_ADDRESS names the daemon; CKPT_JOB the job.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import ckpt
import ckpt.dcp
import torch
import torch._dynamo  # before init_process_group (see examples/torchrun_train.py)
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import set_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp_train import batch_for, build, full_tensors, training_state

FUTURE_TIMEOUT_S = 120


def train_one_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, dp_rank: int) -> None:
    x, y = batch_for(step, dp_rank)
    optimizer.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def dump(state: dict[str, Any], path: Path) -> None:
    """Write every full tensor of state to path (rank 0); a collective, so every rank calls it."""
    tensors = full_tensors(state)
    if dist.get_rank() == 0:
        torch.save(tensors, path)


def save(out: Path) -> None:
    """Save five steps, each through another route, training one step before each."""
    model, optimizer, dp_rank, _ = build("fsdp", dist.get_world_size())
    job = os.environ["CKPT_JOB"]

    def next_state(step: int) -> dict[str, Any]:
        train_one_step(model, optimizer, step, dp_rank)
        return training_state(model, optimizer, step)

    # 10: async_save staged by the Writer itself, the step from checkpoint_id (known only after staging).
    state = next_state(10)
    future = dcp.async_save(state, checkpoint_id="10", storage_writer=ckpt.dcp.Writer(job=job))
    future.result(timeout=FUTURE_TIMEOUT_S)
    dump(state, out / "saved-10.pt")
    # 20: the blocking save, the step given to the Writer.
    state = next_state(20)
    with ckpt.dcp.Writer(job=job, step=20) as writer:
        dcp.save(state, storage_writer=writer)
    dump(state, out / "saved-20.pt")
    # 30: ckpt's own save of the same state.
    state = next_state(30)
    with ckpt.Checkpointer(job=job) as checkpointer:
        checkpointer.save_async(state, step=30).wait("nvme", timeout=FUTURE_TIMEOUT_S)
    dump(state, out / "saved-30.pt")
    # 31 and 32: no step given: one past the latest, picked by the coordinator (save) or by each rank (staged).
    state = next_state(31)
    with ckpt.dcp.Writer(job=job) as writer:
        dcp.save(state, storage_writer=writer)
    dump(state, out / "saved-31.pt")
    state = next_state(32)
    dcp.async_save(state, storage_writer=ckpt.dcp.Writer(job=job)).result(timeout=FUTURE_TIMEOUT_S)
    dump(state, out / "saved-32.pt")


def load(out: Path) -> None:
    """Load four steps through the Reader, and the Writer's step 20 through ckpt's load(into=), on fewer ranks."""
    job = os.environ["CKPT_JOB"]
    restored: dict[str, int] = {}
    routes = [
        ("reader", 10, lambda s: dcp.load(s, storage_reader=ckpt.dcp.Reader(job=job, step=10))),
        ("reader", 20, lambda s: dcp.load(s, checkpoint_id="20", storage_reader=ckpt.dcp.Reader(job=job))),
        ("reader", 30, lambda s: dcp.load(s, storage_reader=ckpt.dcp.Reader(job=job, step=30))),
        ("reader", 32, lambda s: dcp.load(s, storage_reader=ckpt.dcp.Reader(job=job))),  # the latest
        ("ckpt", 20, lambda s: ckpt_load(job, 20, s)),
    ]
    for how, step, load_into in routes:
        model, optimizer, _, _ = build("fsdp", dist.get_world_size())
        state = training_state(model, optimizer, -1)
        load_into(state)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        restored[f"{how}-{step}"] = state["step"]
        dump(training_state(model, optimizer, state["step"]), out / f"loaded-{how}-{step}.pt")
    if dist.get_rank() == 0:
        (out / "steps.json").write_text(json.dumps(restored))


def ckpt_load(job: str, step: int, state: dict[str, Any]) -> None:
    with ckpt.Checkpointer(job=job) as checkpointer:
        checkpointer.load(step=step, into=state)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        {"save": save, "load": load}[mode](out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    # Everything is written. Skip the interpreter's teardown: a gloo FSDP2 process (with no ckpt in it at all)
    # sometimes aborts there ("terminate called without an active exception"), which would fail the run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Checkpointer(replicated=): plain tensors every rank holds alike (DDP) are written once and load at any size."""

from __future__ import annotations

import json
from pathlib import Path

import ckpt
import pytest
import torch
from ckpt import InvalidArgument
from conftest import eventually
from torchrun import torchrun

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).resolve().parent / "replicated_worker.py"


def ddp_state(rank: int) -> dict:
    torch.manual_seed(0)  # the model and optimizer alike on every rank, as DDP keeps them
    model = {"w": torch.randn(64, 32), "b": torch.randn(32), "steps": torch.tensor(7)}
    return {"model": model, "optim": {"exp_avg": torch.ones(64, 32)}, "rng": torch.full((4,), rank), "epoch": 2}


def blank(rank_value: int = -1) -> dict:
    model = {"w": torch.zeros(64, 32), "b": torch.zeros(32), "steps": torch.tensor(0)}
    return {"model": model, "optim": {"exp_avg": torch.zeros(64, 32)}, "rng": torch.full((4,), rank_value), "epoch": 0}


def checkpointers(daemon, world_size: int, job: str = "ddp") -> list[ckpt.Checkpointer]:
    return [
        ckpt.Checkpointer(job=job, rank=r, world_size=world_size, address=daemon.address, replicated=["model", "optim"])
        for r in range(world_size)
    ]


def test_replicated_keys_are_written_once_by_rank_0_and_load_at_another_world_size(daemon):
    saving = checkpointers(daemon, 2)
    try:
        handles = [c.save_async(ddp_state(c.rank), step=1) for c in saving]
        for h in handles:
            h.wait("nvme", timeout=60)
    finally:
        for c in saving:
            c.close()
    eventually(lambda: daemon.cli("inspect", "--job", "ddp", "--step", "1").returncode == 0, what="step 1 complete")
    rows = {
        r["key"]: r
        for r in json.loads(daemon.cli("inspect", "--job", "ddp", "--step", "1", "--json").stdout)["tensors"]
    }
    assert rows["model.w"]["kind"] == "sharded" and rows["model.w"]["ranks"] == [0]  # once, by rank 0
    assert rows["optim.exp_avg"]["ranks"] == [0]
    assert rows["rng"]["kind"] == "tensor" and rows["rng (rank 1)"]["ranks"] == [1]  # not replicated: each rank's

    loading = checkpointers(daemon, 3)
    try:
        for c in loading:
            loaded = c.load(1, into=blank())
            want = ddp_state(min(c.rank, 1) if c.rank < 2 else 0)  # a rank beyond the step's reads rank 0's
            assert torch.equal(loaded["model"]["w"], want["model"]["w"]) and loaded["model"]["steps"].item() == 7
            assert torch.equal(loaded["optim"]["exp_avg"], want["optim"]["exp_avg"]) and loaded["epoch"] == 2
            assert torch.equal(loaded["rng"], want["rng"]), c.rank
    finally:
        for c in loading:
            c.close()
    with checkpointers(daemon, 2)[1] as same_size, pytest.raises(InvalidArgument, match=r"Checkpointer\(replicated=\)"):
        same_size.load(1)  # without into: the tensors written once are another rank's
    one = ckpt.load_local(daemon.root / "ddp" / "1", into=blank())  # one rank, no daemon
    assert torch.equal(one["model"]["b"], ddp_state(0)["model"]["b"])


@pytest.mark.timeout(300)
def test_a_ddp_torchrun_job_on_2_ranks_resumes_on_3(daemon):
    env = {"CKPTD_ADDRESS": daemon.address, "CKPT_JOB": "ddprun"}
    saved = torchrun(2, WORKER, "save", env=env).splitlines()
    loaded = torchrun(3, WORKER, "load", env=env).splitlines()
    sums = {line.split(": ")[1] for line in saved + loaded if " rank " in line}
    assert len([line for line in loaded if line.startswith("load rank ")]) == 3
    assert len(sums) == 1, saved + loaded  # every rank of both jobs holds the same trained weights
    rows = json.loads(daemon.cli("inspect", "--job", "ddprun", "--step", "5", "--json").stdout)["tensors"]
    assert {r["key"]: r["ranks"] for r in rows} == {"model.0.weight": [0], "model.0.bias": [0]}  # written once

"""torch.distributed.checkpoint through ckptd: ckpt.dcp's Writer and Reader against real daemons and real torchrun."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import ckpt
import ckpt.dcp
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrun import torchrun as run_torchrun

pytestmark = pytest.mark.e2e

WORKER = Path(__file__).resolve().parent / "dcp_worker.py"
PROCESS_WORKER = Path(__file__).resolve().parent / "dcp_process_worker.py"
JOB = "dcp"
KEEP_EVERY_STEP = "[retention]\nnvme = 0\n"  # the tests read old steps


def torchrun(ranks: int, daemon, *args: str) -> None:
    run_torchrun(ranks, WORKER, *args, env={"CKPTD_ADDRESS": daemon.address, "CKPT_JOB": JOB})


def assert_same_tensors(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> None:
    assert sorted(saved) == sorted(loaded)
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []


def no_dist_load(state: dict, reader: ckpt.dcp.Reader) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=reader, no_dist=True)


@pytest.mark.timeout(600)
def test_fsdp2_state_saved_on_4_ranks_loads_on_2_and_with_no_daemon(make_daemon, short_tmp):
    daemon = make_daemon(KEEP_EVERY_STEP).start()
    torchrun(4, daemon, "save", str(short_tmp))
    listed = daemon.cli("ls", "--job", JOB, "--json")
    assert listed.returncode == 0, listed.stderr
    assert {item["step"]: item["world_size"] for item in json.loads(listed.stdout)} == dict.fromkeys(
        (10, 20, 30, 31, 32), 4
    )
    saved = {step: torch.load(short_tmp / f"saved-{step}.pt") for step in (10, 20, 30, 31, 32)}
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in saved[10])
    assert not torch.equal(saved[10]["model.up.weight"], saved[20]["model.up.weight"])  # a wrong step cannot pass

    torchrun(2, daemon, "load", str(short_tmp))
    restored = json.loads((short_tmp / "steps.json").read_text())
    assert restored == {"reader-10": 10, "reader-20": 20, "reader-30": 30, "reader-32": 32, "ckpt-20": 20}
    for name, step in restored.items():
        assert_same_tensors(saved[step], torch.load(short_tmp / f"loaded-{name}.pt"))

    # With no daemon, DCP reads the step directories alone, here into whole tensors on one process.
    assert daemon.stop() == 0
    for step in (10, 31):
        into: dict = {key: torch.zeros_like(t) for key, t in saved[step].items()}
        into["step"] = -1
        no_dist_load(into, ckpt.dcp.Reader(path=daemon.root / JOB / str(step)))
        assert into.pop("step") == step
        assert_same_tensors(saved[step], into)


def values_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(5, 3, generator=g), "half": torch.randn(4, generator=g).bfloat16()},
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 3),
        "pair": (torch.arange(4) * seed, "kept in a tuple"),  # DCP stores a tuple whole, as bytes
        "array": np.arange(6).reshape(2, 3) * seed,
        "layers": [{"b": torch.full((2,), float(seed))}, {"b": torch.zeros(2)}],
        "meta": {"lr": 0.1 * seed, "name": f"run-{seed}", "ids": [1, 2, seed]},
    }


def blank_state() -> dict:
    return {
        "model": {"w": torch.zeros(5, 3), "half": torch.zeros(4, dtype=torch.bfloat16)},
        "scalar": torch.tensor(0.0),
        "empty": torch.empty(0, 3),
        "pair": None,
        "array": None,
        "layers": [{"b": torch.zeros(2)}, {"b": torch.ones(2)}],
        "meta": {"lr": 0.0, "name": "", "ids": []},
    }


def assert_same_state(expected: dict, got: dict) -> None:
    for key in ("scalar", "empty"):
        assert torch.equal(expected[key], got[key]), key
    assert all(torch.equal(expected["model"][k], got["model"][k]) for k in expected["model"])
    assert [torch.equal(a["b"], b["b"]) for a, b in zip(expected["layers"], got["layers"], strict=True)] == [True] * 2
    assert torch.equal(expected["pair"][0], got["pair"][0]) and expected["pair"][1] == got["pair"][1]
    assert np.array_equal(expected["array"], got["array"])
    assert expected["meta"] == got["meta"]


@pytest.mark.timeout(120)
def test_every_route_reads_every_other_routes_steps(make_daemon):
    daemon = make_daemon(KEEP_EVERY_STEP).start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        with ckpt.dcp.Writer(job="values", address=daemon.address) as writer:
            dcp.save(values_state(1), storage_writer=writer, no_dist=True)  # step 0: one past none
            dcp.async_save(values_state(2), storage_writer=writer, checkpoint_id=5, no_dist=True).result(timeout=60)
            dcp.save(values_state(3), storage_writer=writer, no_dist=True)  # step 6: one past the last
    with ckpt.Checkpointer(job="values", address=daemon.address) as checkpointer:
        checkpointer.save_async(values_state(4), step=7).wait("nvme", timeout=60)
        for step, seed in ((0, 1), (5, 2), (6, 3), (7, 4)):
            into = blank_state()
            no_dist_load(into, ckpt.dcp.Reader(job="values", step=step, address=daemon.address))
            assert_same_state(values_state(seed), into)
            into = blank_state()
            no_dist_load(into, ckpt.dcp.Reader(path=daemon.root / "values" / str(step)))
            assert_same_state(values_state(seed), into)
            # ckpt's own sharded load; its list items are tensors here (it fills those in place)
            assert_same_state(values_state(seed), checkpointer.load(step=step, into=blank_state()))


@pytest.mark.timeout(120)
def test_a_step_dcp_cannot_load_is_named(daemon):
    with ckpt.Checkpointer(job="listed", address=daemon.address) as checkpointer:
        checkpointer.save_async([torch.ones(2)], step=3).wait("nvme", timeout=60)
    # DCP wraps every rank's error in a CheckpointException (a BaseException), with its message.
    with pytest.raises(CheckpointException, match="listed step 3 holds a list, and DCP loads only state dicts"):
        no_dist_load({"0": torch.zeros(2)}, ckpt.dcp.Reader(job="listed", address=daemon.address))
    writer = ckpt.dcp.Writer(job="listed", address=daemon.address)
    with warnings.catch_warnings(), pytest.raises(ckpt.InvalidArgument, match="checkpoint_id 'nine' is not a step"):
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.ones(1)}, checkpoint_id="nine", storage_writer=writer, no_dist=True)


@pytest.mark.timeout(300)
def test_async_save_with_the_process_executor_copies_in_dcps_process_and_snapshots(daemon, short_tmp):
    run_torchrun(1, PROCESS_WORKER, str(short_tmp), env={"CKPTD_ADDRESS": daemon.address, "CKPT_JOB": "process"})
    saved = torch.load(short_tmp / "saved.pt")
    listed = daemon.cli("ls", "--job", "process", "--json")
    assert [item["step"] for item in json.loads(listed.stdout)] == [5, 6, 7]  # checkpoint_id, one past it, id
    for step, name in ((5, "first"), (6, "second"), (7, "third")):
        into = {"w": torch.zeros(1 << 16), "b": torch.zeros(3, 3), "note": ""}
        no_dist_load(into, ckpt.dcp.Reader(job="process", step=step, address=daemon.address))
        assert into["note"] == name
        assert_same_tensors({k: saved[name][k] for k in "wb"}, {k: into[k] for k in "wb"})

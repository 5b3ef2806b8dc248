"""`ckptd import`: a torch.save file and a DCP directory become steps of a job through a real daemon."""

from __future__ import annotations

import argparse
import json
import warnings

import ckpt
import ckpt.dcp
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from states import assert_same

pytestmark = pytest.mark.e2e


def lightning_like() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "global_step": 40,
        "state_dict": {"net.0.weight": torch.randn(8, 4, generator=g), "net.0.bias": torch.zeros(8)},
        "optimizer_states": [{"state": {0: {"step": torch.tensor(40.0), "exp_avg": torch.randn(8, 4, generator=g)}}}],
        "hyper_parameters": {"lr": 0.01, "hidden": 8},
        "half": torch.arange(6, dtype=torch.bfloat16).view(2, 3).t(),  # a non-contiguous view
    }


def steps(daemon, job: str) -> dict[int, list[str]]:
    listed = daemon.cli("ls", "--job", job, "--json")
    assert listed.returncode == 0, listed.stderr
    return {item["step"]: item["tiers"] for item in json.loads(listed.stdout)}


def test_a_torch_file_becomes_a_step_that_loads_bit_for_bit(daemon, tmp_path):
    state = lightning_like()
    torch.save(state, tmp_path / "last.ckpt")
    done = daemon.cli("import", "--job", "moved", "--step", "40", "--torch", str(tmp_path / "last.ckpt"), "--json")
    assert done.returncode == 0, done.stderr
    reported = json.loads(done.stdout)
    assert (reported["job"], reported["step"]) == ("moved", 40) and reported["size_bytes"] > 0
    assert "nvme" in steps(daemon, "moved")[40]
    with ckpt.Checkpointer(job="moved", address=daemon.address) as c:
        assert_same(c.load(40), state)
        assert c.latest_step() == 40


def test_a_torch_file_weights_only_refuses_loads_only_when_trusted(daemon, tmp_path):
    state = {"w": torch.ones(3), "args": argparse.Namespace(lr=0.1)}  # a class weights_only=True refuses
    torch.save(state, tmp_path / "old.pt")
    refused = daemon.cli("import", "--job", "old", "--step", "1", "--torch", str(tmp_path / "old.pt"))
    assert refused.returncode == 1 and "pass --trusted to load it with weights_only=False" in refused.stderr
    assert steps(daemon, "old") == {}
    done = daemon.cli("import", "--job", "old", "--step", "1", "--torch", str(tmp_path / "old.pt"), "--trusted")
    assert done.returncode == 0, done.stderr
    with ckpt.Checkpointer(job="old", address=daemon.address) as c:
        loaded = c.load(1)
    assert torch.equal(loaded["w"], torch.ones(3)) and loaded["args"] == argparse.Namespace(lr=0.1)


def test_a_dcp_directory_becomes_a_step_every_reader_reads(daemon, tmp_path):
    state = {"model": {"up.weight": torch.randn(16, 8), "up.bias": torch.randn(16)}, "step": 12, "note": "dcp"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    done = daemon.cli("import", "--job", "from-dcp", "--step", "12", "--dcp", str(tmp_path / "dcp"), "--trusted")
    assert done.returncode == 0, done.stderr
    assert "imported from-dcp step 12" in done.stdout
    with ckpt.Checkpointer(job="from-dcp", address=daemon.address) as c:
        assert_same(c.load(12), state)
    into = {"model": {"up.weight": torch.zeros(16, 8), "up.bias": torch.zeros(16)}, "step": 0, "note": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(into, storage_reader=ckpt.dcp.Reader(job="from-dcp", address=daemon.address), no_dist=True)
    assert_same(into, state)


def test_what_cannot_be_imported_is_named(daemon, tmp_path):
    np.save(tmp_path / "x.npy", np.ones(3))
    cases = [
        (["--torch", str(tmp_path / "missing.pt")], 2, "no such file"),
        (["--torch", str(tmp_path / "x.npy")], 1, "is not a torch.save file"),
        (["--dcp", str(tmp_path), "--trusted"], 2, "no .metadata in it"),
        (["--torch", "a", "--dcp", "b"], 2, "not allowed with argument"),
    ]
    for args, code, said in cases:
        run = daemon.cli("import", "--job", "bad", "--step", "1", *args)
        assert (run.returncode, said in run.stderr) == (code, True), run.stderr
    torch.save({"w": torch.ones(1)}, tmp_path / "w.pt")
    assert daemon.cli("import", "--job", "bad", "--step", "5", "--torch", str(tmp_path / "w.pt")).returncode == 0
    again = daemon.cli("import", "--job", "bad", "--step", "5", "--torch", str(tmp_path / "w.pt"))
    assert again.returncode == 1 and "step 5 is already complete; a complete step is never rewritten" in again.stderr
    older = daemon.cli("import", "--job", "bad", "--step", "4", "--torch", str(tmp_path / "w.pt"))
    assert older.returncode == 2 and "step 5" in older.stderr  # older than the job's head, which it names
    assert sorted(steps(daemon, "bad")) == [5]

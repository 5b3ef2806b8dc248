"""Nothing unpickled that was not asked for: a step holding a planted payload, through a real daemon.

The payload is what a peer, an object-store writer or another user with write access to a
tier could plant: a value whose pickle calls builtins.exec, which writes a marker file when
it runs. It is saved with the real client, so every checksum of the step is consistent.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from pathlib import Path

import ckpt
import ckpt.dcp
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt import UnsafeCheckpoint
from states import Planted, assert_same
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import Shard, distribute_tensor

pytestmark = pytest.mark.e2e

REFUSED = "holds builtins.exec, which a load with weights_only=True does not unpickle"


def model_and_optimizer_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),  # an OrderedDict with its _metadata
        "optim": optimizer.state_dict(),
        "extra": {"shape": torch.Size([2, 3]), "dtype": torch.bfloat16, "device": torch.device("cpu"), "ids": {1, 2}},
        "numbers": (7, 2.5, 1 + 2j, None, "text", b"bytes"),
    }


def save(daemon, job: str, state: dict, step: int = 1) -> Path:
    with ckpt.Checkpointer(job=job, rank=0, world_size=1, address=daemon.address) as c:
        c.save_async(state, step=step).wait("nvme", timeout=60)
    return daemon.root / job / str(step)


def dcp_load(state: dict, reader: dcp.StorageReader) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to load in a single process"
        dcp.load(state, storage_reader=reader, no_dist=True)


def test_a_weights_only_load_of_a_planted_step_runs_nothing_and_names_the_global(daemon, short_tmp):
    marker = short_tmp / "ran"
    step_dir = save(daemon, "planted", {"w": torch.arange(4.0), "x": Planted(marker)})
    with ckpt.Checkpointer(job="planted", rank=0, world_size=1, address=daemon.address) as c:
        with pytest.raises(UnsafeCheckpoint, match=REFUSED) as refused:
            c.load(1, weights_only=True)
        assert refused.value.global_name == "builtins.exec"
        assert "rank 0 shard of planted step 1" in str(refused.value) and "weights_only=False" in str(refused.value)
        with pytest.raises(UnsafeCheckpoint, match=REFUSED):
            c.load(1, into={"w": torch.zeros(4), "x": None}, weights_only=True)
    with pytest.raises(UnsafeCheckpoint, match=REFUSED):
        ckpt.load_local(step_dir, weights_only=True)
    with pytest.raises(UnsafeCheckpoint, match=REFUSED):
        ckpt.load_local(step_dir, into={"w": torch.zeros(4)}, strict=False, weights_only=True)
    for reader in (
        ckpt.dcp.Reader(path=step_dir, weights_only=True),
        ckpt.dcp.Reader(job="planted", address=daemon.address, weights_only=True),
    ):
        with reader, pytest.raises(CheckpointException, match=REFUSED):  # DCP's wrapping of the reader's error
            dcp_load({"w": torch.zeros(4)}, reader)
    assert not marker.exists()

    # weights_only=False (the default) unpickles in full, as it always did: for checkpoints one trusts.
    with ckpt.Checkpointer(job="planted", rank=0, world_size=1, address=daemon.address) as c:
        assert torch.equal(c.load(1)["w"], torch.arange(4.0))
    assert marker.read_text() == "ran"


def test_a_weights_only_load_returns_model_optimizer_and_sharded_states_bit_for_bit(daemon, mesh, short_tmp):
    state = model_and_optimizer_state()
    step_dir = save(daemon, "clean", state)
    with ckpt.Checkpointer(job="clean", rank=0, world_size=1, address=daemon.address) as c:
        assert_same(c.load(1, weights_only=True), state)
        into = model_and_optimizer_state()
        assert_same(c.load(1, into=into, weights_only=True), state)
    loaded = ckpt.load_local(step_dir, weights_only=True)
    assert_same(loaded, state)
    assert type(loaded["model"]) is OrderedDict and loaded["model"]._metadata == state["model"]._metadata
    with ckpt.dcp.Reader(path=step_dir, weights_only=True) as reader:
        into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        dcp_load(into, reader)
    assert_same(dict(into["model"]), dict(state["model"]))
    out = daemon.cli("export", "--job", "clean", "--format", "dcp", "--to", str(short_tmp / "out"))  # no --trusted
    assert out.returncode == 0, out.stderr
    into = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dcp_load(into, dcp.FileSystemReader(str(short_tmp / "out")))
    assert_same(dict(into["model"]), dict(state["model"]))

    weights = torch.arange(24.0).view(6, 4)
    sharded = {"w": distribute_tensor(weights, mesh, [Shard(0)]), "step": 3}
    save(daemon, "sharded", sharded)
    with ckpt.Checkpointer(job="sharded", rank=0, world_size=1, address=daemon.address) as c:
        into = {"w": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]), "step": 0}
        c.load(1, into=into, weights_only=True)
    assert torch.equal(into["w"].full_tensor(), weights) and into["step"] == 3


def test_a_weights_only_load_takes_the_globals_the_user_allows_as_torch_load_does(daemon, short_tmp):
    import argparse

    save(daemon, "hparams", {"w": torch.ones(2), "args": argparse.Namespace(lr=0.1)})
    with ckpt.Checkpointer(job="hparams", rank=0, world_size=1, address=daemon.address) as c:
        with pytest.raises(UnsafeCheckpoint, match=r"add_safe_globals\(\[argparse.Namespace\]\)"):
            c.load(1, weights_only=True)
        with torch.serialization.safe_globals([argparse.Namespace]):
            assert c.load(1, weights_only=True)["args"] == argparse.Namespace(lr=0.1)
        with pytest.raises(UnsafeCheckpoint, match=r"argparse\.Namespace"):
            c.load(1, weights_only=True)  # the context is over


@pytest.mark.parametrize("fmt", ["dcp", "safetensors"])
def test_export_of_a_planted_step_refuses_it_without_trusted(daemon, short_tmp, fmt):
    marker = short_tmp / "ran"
    save(daemon, "planted", {"model": {"w": torch.arange(4.0)}, "x": Planted(marker)})
    to = short_tmp / "out"
    for picked in ([], ["--include", "model"]):
        out = daemon.cli("export", "--job", "planted", "--format", fmt, "--to", str(to), *picked)
        if out.returncode == 2 and "pip install safetensors" in out.stderr:
            pytest.skip("safetensors is not installed: export --format safetensors stops before reading")
        assert out.returncode == 1, out.stderr
        assert "rank 0 shard of planted step 1 holds builtins.exec" in out.stderr
        assert "if you trust this checkpoint, pass --trusted" in out.stderr
        assert not marker.exists() and not to.exists()
        assert not [p for p in short_tmp.iterdir() if ".export-" in p.name]

    out = daemon.cli("export", "--job", "planted", "--format", fmt, "--to", str(to), "--trusted")
    assert out.returncode == 0, out.stderr
    assert marker.read_text() == "ran"  # --trusted unpickles in full: what it is for


def test_import_of_a_dcp_directory_needs_trusted_and_runs_nothing_without(daemon, short_tmp):
    import pickle

    marker = short_tmp / "ran"
    planted = short_tmp / "dcp"
    planted.mkdir()
    (planted / ".metadata").write_bytes(pickle.dumps(Planted(marker)))  # what FileSystemReader unpickles
    out = daemon.cli("import", "--job", "imported", "--step", "1", "--dcp", str(planted))
    assert out.returncode == 2, out.stderr
    assert "unpickles the directory's .metadata in full" in out.stderr and "pass --trusted" in out.stderr
    assert not marker.exists()
    assert daemon.cli("ls", "--job", "imported", "--json").stdout.strip() == "[]"

"""Loads into tensors of another dtype cast as torch.distributed.checkpoint does, through a real daemon."""

from __future__ import annotations

import logging
import warnings

import ckpt
import ckpt.dcp
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt import InvalidArgument
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

pytestmark = pytest.mark.e2e


def saved_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.rand(4, 3) * 100,  # float32: its low bits are lost in bf16 and fp16
        "steps": torch.tensor([2**40 + 5, -(2**33) - 1, 7]),  # int64: wraps in int32, as copy_ does
        "scalar": torch.tensor(1.0e-3, dtype=torch.float64),
    }


def quiet_dcp_load(state: dict, **kwargs) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load(state, no_dist=True, **kwargs)


@pytest.mark.parametrize("float_dtype", [torch.bfloat16, torch.float16])
def test_a_plain_state_casts_into_the_targets_dtypes_as_copy_does(daemon, float_dtype):
    saved = saved_state()
    with ckpt.Checkpointer(job="cast", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async(saved, step=1).wait("nvme")
        into = {
            "w": torch.zeros(4, 3, dtype=float_dtype),
            "steps": torch.zeros(3, dtype=torch.int32),
            "scalar": torch.tensor(0.0, dtype=float_dtype),
        }
        targets = dict(into)
        loaded = c.load(1, into=into)
    for key, target in targets.items():
        assert loaded[key] is target and target.dtype == targets[key].dtype
        assert torch.equal(target, torch.empty_like(target).copy_(saved[key])), key
    assert loaded["steps"].tolist() == [5, -1, 7]  # the low 32 bits, as int64 -> int32 copy_ keeps them
    # With no daemon, from the step directory: the same cast.
    again = {"w": torch.zeros(4, 3, dtype=float_dtype), "steps": torch.zeros(3, dtype=torch.int32), "scalar": 0}
    ckpt.load_local(daemon.root / "cast" / "1", into=again)
    assert torch.equal(again["w"], saved["w"].to(float_dtype))


def test_a_sharded_state_casts_into_dtensors_of_another_dtype(daemon, mesh):
    weights = torch.rand(6, 4, dtype=torch.float32)
    with ckpt.Checkpointer(job="castd", rank=0, world_size=1, address=daemon.address) as c:
        state = {"w": distribute_tensor(weights, mesh, [Shard(0)])}
        state["r"] = distribute_tensor(torch.ones(3), mesh, [Replicate()])
        c.save_async(state, step=1).wait("nvme")
        into = {
            "w": distribute_tensor(torch.zeros(6, 4, dtype=torch.bfloat16), mesh, [Shard(0)]),
            "r": distribute_tensor(torch.zeros(3, dtype=torch.float16), mesh, [Replicate()]),
        }
        c.load(1, into=into)
        plain = c.load(1, into={"w": torch.zeros(6, 4, dtype=torch.float64), "r": torch.zeros(3, dtype=torch.int64)})
    assert into["w"].dtype == torch.bfloat16 and torch.equal(into["w"].full_tensor(), weights.to(torch.bfloat16))
    assert torch.equal(into["r"].full_tensor(), torch.ones(3, dtype=torch.float16))
    assert torch.equal(plain["w"], weights.double()) and plain["r"].tolist() == [1, 1, 1]


def test_dtype_mismatch_casting(daemon, tmp_path):
    """As upstream DCP's test of it: an fp32 checkpoint loaded into bf16 templates equals the fp32 state cast."""
    saved = saved_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(saved, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    with ckpt.Checkpointer(job="castdcp", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async(saved, step=2).wait("nvme")

    def template() -> dict[str, torch.Tensor]:
        blank = {"w": torch.zeros(4, 3, dtype=torch.bfloat16), "steps": torch.zeros(3, dtype=torch.int32)}
        return blank | {"scalar": torch.tensor(0.0, dtype=torch.float16)}

    stock = template()
    quiet_dcp_load(stock, checkpoint_id=str(tmp_path / "stock"))
    through_daemon, from_dir = template(), template()
    quiet_dcp_load(through_daemon, storage_reader=ckpt.dcp.Reader(job="castdcp", step=2, address=daemon.address))
    quiet_dcp_load(from_dir, storage_reader=ckpt.dcp.Reader(path=daemon.root / "castdcp" / "2"))
    for key in saved:
        assert torch.equal(through_daemon[key], stock[key]) and torch.equal(from_dir[key], stock[key]), key
        assert torch.equal(stock[key], saved[key].to(stock[key].dtype)), key


def test_complex_into_real_keeps_the_real_part_and_says_so(daemon, caplog):
    values = torch.tensor([1.5 + 2.0j, -3.0 - 1.0j])
    with ckpt.Checkpointer(job="castc", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async({"z": values}, step=1).wait("nvme")
        with caplog.at_level(logging.WARNING, logger="ckpt"):
            loaded = c.load(1, into={"z": torch.zeros(2, dtype=torch.float64)})
    assert loaded["z"].tolist() == [1.5, -3.0]  # what copy_ (and so DCP) keeps
    assert "'z': loading complex torch.complex64 into real torch.float64 keeps only the real part" in caplog.text


def test_what_copy_cannot_cast_is_refused_naming_the_key_and_both_dtypes(daemon):
    with ckpt.Checkpointer(job="castno", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async({"a": torch.ones(2), "b": {"packed": torch.ones(4)}}, step=1).wait("nvme")
        into = {"a": torch.zeros(2), "b": {"packed": torch.empty(4, dtype=torch.bits8)}}
        message = r"'b.packed': the step holds dtype float32, `into` bits8, and torch cannot cast"
        with pytest.raises(InvalidArgument, match=message):
            c.load(1, into=into)
        assert torch.equal(into["a"], torch.zeros(2))  # refused before any byte moved
        with pytest.raises(CheckpointException, match=message):
            quiet_dcp_load(
                {"a": torch.zeros(2), "b": {"packed": torch.empty(4, dtype=torch.bits8)}},
                storage_reader=ckpt.dcp.Reader(job="castno", step=1, address=daemon.address),
            )

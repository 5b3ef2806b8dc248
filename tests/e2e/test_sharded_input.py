"""Sharded saves and in-place loads through a real daemon, in one process; bad input is a clear error, early."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import ckpt
import pytest
import torch
from ckpt import InvalidArgument
from ckpt.sharding import LocalChunks, OwnedChunk, check_placements
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.two_tensor import TwoTensor

pytestmark = pytest.mark.e2e


def sharded(mesh, value: torch.Tensor, placement=None) -> DTensor:
    return distribute_tensor(value, mesh, [placement or Shard(0)])


def test_a_dtensor_step_loads_in_place_and_only_with_into(daemon, mesh):
    weights = torch.arange(24.0).view(6, 4)
    with ckpt.Checkpointer(job="d", rank=0, world_size=1, address=daemon.address) as c:
        state = {
            "w": sharded(mesh, weights),
            "r": sharded(mesh, torch.ones(3), Replicate()),
            "n": 3,
            "t": torch.ones(2),
        }
        c.save_async(state, step=1).wait("nvme")
        with pytest.raises(InvalidArgument, match=r"holds DTensors: load it with load\(into=state\)"):
            c.load(1)
        into = {"w": sharded(mesh, torch.zeros(6, 4)), "r": sharded(mesh, torch.zeros(3), Replicate())}
        into |= {"n": 0, "t": torch.zeros(2)}
        loaded = c.load(1, into=into)
    assert loaded is into
    assert torch.equal(into["w"].full_tensor(), weights)
    assert torch.equal(into["r"].full_tensor(), torch.ones(3))
    assert into["n"] == 3
    assert torch.equal(into["t"], torch.ones(2))
    # With no daemon, from the step directory; a plain tensor takes the whole of a DTensor.
    whole = {"w": torch.zeros(6, 4), "r": torch.zeros(3), "n": 0, "t": torch.zeros(2)}
    ckpt.load_local(daemon.root / "d" / "1", into=whole)
    assert torch.equal(whole["w"], weights)


@dataclass
class Holder:
    weight: DTensor


def test_what_cannot_be_saved_is_named_before_anything_is_reserved(mesh):
    cases = [
        ({"model": {"x": TwoTensor(torch.ones(2), torch.ones(2))}}, "model.x: a TwoTensor is a wrapper"),
        ({"p": sharded(mesh, torch.ones(2), Partial())}, "cannot checkpoint p: a Partial placement holds partial sums"),
        ({"h": Holder(sharded(mesh, torch.ones(2)))}, "a DTensor inside an object"),
    ]
    one, two = (LocalChunks((2,), torch.float32, (OwnedChunk(torch.ones(2), (0,)),)) for _ in range(2))
    cases.append(({1: one, "1": two}, "two sharded tensors of the state have the key '1'"))
    # No daemon at this address: an error other than DaemonUnavailable means nothing was asked of one.
    with ckpt.Checkpointer(job="bad", rank=0, world_size=1, address="/nonexistent/ckptd.sock") as c:
        for state, message in cases:
            with pytest.raises(InvalidArgument, match=message):
                c.save_async(state, step=1)


def test_a_strided_shard_behind_another_shard_of_its_dimension_is_refused():
    scattered = SimpleNamespace(placements=[Shard(0), _StridedShard(0, split_factor=2)])
    with pytest.raises(InvalidArgument, match="scatter each rank's rows"):
        check_placements(scattered, "cannot checkpoint w")
    check_placements(SimpleNamespace(placements=[_StridedShard(0, split_factor=2), Shard(0)]), "FSDP2 over TP")


@pytest.mark.parametrize(
    "into, message",
    [
        ({"a": torch.zeros(3, 4), "b": {"c": torch.zeros(2), "d": torch.zeros(1)}}, r"'b.d' is missing from the step"),
        ({"a": torch.zeros(3, 4)}, r"'b' is in the step but missing from `into`"),
        ({"a": torch.zeros(4, 3), "b": {"c": torch.zeros(2)}}, r"'a': the step holds shape \[3, 4\], `into` \[4, 3\]"),
        (
            {"a": torch.zeros(3, 4), "b": {"c": torch.empty(2, dtype=torch.bits8)}},
            r"'b.c': the step holds dtype float32, `into` bits8, and torch cannot cast",
        ),
    ],
)
def test_an_into_that_does_not_fit_the_step_is_named_and_left_untouched(daemon, into, message):
    with ckpt.Checkpointer(job="p", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async({"a": torch.ones(3, 4), "b": {"c": torch.ones(2)}, "s": "x"}, step=1).wait("nvme")
        before = {k: v.clone() for k, v in into.items() if isinstance(v, torch.Tensor)}
        with pytest.raises(InvalidArgument, match=message):
            c.load(1, into=into)
    assert all(torch.equal(into[k], v) for k, v in before.items())  # no byte moved


def test_a_plain_state_fills_in_place_and_takes_the_saved_values(daemon):
    with ckpt.Checkpointer(job="q", rank=0, world_size=1, address=daemon.address) as c:
        saved = {"a": torch.arange(12).view(3, 4), "opt": {"lr": 0.5, "steps": [torch.tensor(7), 3]}, "extra": (1, 2)}
        saved["pair"] = (torch.ones(2), "new", (torch.ones(1), 5))
        c.save_async(saved, step=4).wait("nvme")
        target = torch.zeros(3, 4, dtype=torch.int64)
        into = {"a": target, "opt": {"lr": 0.1, "steps": [torch.tensor(0), 0]}}
        into["pair"] = (torch.zeros(2), "old", (torch.zeros(1), 0))
        loaded = c.load(into=into)
    assert loaded["a"] is target and torch.equal(target, saved["a"])
    assert loaded["opt"]["lr"] == 0.5 and loaded["opt"]["steps"][0].item() == 7 and loaded["opt"]["steps"][1] == 3
    assert loaded["extra"] == (1, 2)  # a value the step has and into lacked is added
    pair = loaded["pair"]  # tuples are rebuilt around the filled tensors, with the saved values
    assert torch.equal(pair[0], torch.ones(2)) and pair[1] == "new" and pair[2][1] == 5
    assert torch.equal(pair[2][0], torch.ones(1))

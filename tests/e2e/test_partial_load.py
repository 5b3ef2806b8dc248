"""load(into=, strict=False, keys=, exclude=) through a real daemon: what is loaded, what is left, what is said."""

from __future__ import annotations

import logging

import ckpt
import pytest
import torch
from ckpt import InvalidArgument, LoadReport

pytestmark = pytest.mark.e2e


def saved_state() -> dict:
    return {
        "model": {
            "up": {"weight": torch.ones(4, 3), "bias": torch.ones(4)},
            "down": {"weight": torch.full((3, 4), 2.0)},
        },
        "optimizer": {"state": {"0": {"exp_avg": torch.full((4, 3), 3.0)}}, "lr": 0.5},
        "step": 7,
    }


def blank_model() -> dict:
    return {"up": {"weight": torch.zeros(4, 3), "bias": torch.zeros(4)}, "down": {"weight": torch.zeros(3, 4)}}


@pytest.fixture
def saved(daemon):
    with ckpt.Checkpointer(job="part", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async(saved_state(), step=3).wait("nvme")
        yield c


def test_strict_is_the_default_and_names_the_first_key_only_one_side_holds(saved):
    model = blank_model()
    del model["down"]
    with pytest.raises(InvalidArgument, match=r"'model.down' is in the step but missing from `into`"):
        saved.load(3, into={"model": model, "optimizer": {"state": {}, "lr": 0}, "step": 0})
    with pytest.raises(InvalidArgument, match=r"'model.side' is missing from the step"):
        saved.load(3, into={"model": blank_model() | {"side": {"weight": torch.zeros(1)}}})
    assert saved.last_load is None  # nothing loaded


def test_strict_false_loads_what_both_hold_and_reports_the_rest(saved, caplog):
    model = blank_model()
    del model["down"]
    model["side"] = {"weight": torch.zeros(2), "scale": 1.5}
    into = {"model": model, "step": 0}
    with caplog.at_level(logging.INFO, logger="ckpt"):
        loaded = saved.load(3, into=into, strict=False)
    assert loaded is into
    assert torch.equal(model["up"]["weight"], torch.ones(4, 3)) and torch.equal(model["up"]["bias"], torch.ones(4))
    assert torch.equal(model["side"]["weight"], torch.zeros(2)) and model["side"]["scale"] == 1.5  # left as it was
    assert "down" not in model and loaded["step"] == 7
    assert saved.last_load == LoadReport(
        step=3,
        missing_keys=("model.side.weight", "model.side.scale"),
        unexpected_keys=("model.down.weight", "optimizer.state.0.exp_avg"),
    )
    assert "part step 3: 2 keys of `into` the step lacks, left as they were: model.side.weight" in caplog.text
    assert "2 tensors of the step `into` has no place for, not read: model.down.weight" in caplog.text


def test_exclude_leaves_a_subtree_as_it_is_whatever_the_step_holds_there(saved):
    optimizer = {"state": {"0": {"exp_avg": torch.zeros(9)}}, "lr": 0.1}  # a shape the step does not hold
    into = {"model": blank_model(), "optimizer": optimizer, "step": 0}
    saved.load(3, into=into, exclude="optimizer")
    assert torch.equal(into["model"]["down"]["weight"], torch.full((3, 4), 2.0)) and into["step"] == 7
    assert torch.equal(optimizer["state"]["0"]["exp_avg"], torch.zeros(9)) and optimizer["lr"] == 0.1
    # The step's optimizer need not be in into either: model weights only, as torchtitan loads them.
    weights_only = {"model": blank_model()}
    saved.load(3, into=weights_only, keys="model")
    assert torch.equal(weights_only["model"]["up"]["weight"], torch.ones(4, 3)) and "step" not in weights_only
    assert saved.last_load == LoadReport(step=3)


def test_keys_pick_by_glob_and_the_rest_of_into_is_left_as_it_was(saved, daemon):
    into = {"model": blank_model(), "optimizer": {"lr": 0.0}}
    saved.load(3, into=into, keys=["model.*.weight"], exclude=["model.down.*"])
    assert torch.equal(into["model"]["up"]["weight"], torch.ones(4, 3))
    assert torch.equal(into["model"]["up"]["bias"], torch.zeros(4))
    assert torch.equal(into["model"]["down"]["weight"], torch.zeros(3, 4))
    assert into["optimizer"]["lr"] == 0.0
    # With no daemon, the same; and the filters need into.
    local = {"model": blank_model()}
    ckpt.load_local(daemon.root / "part" / "3", into=local, keys="model.up")
    assert torch.equal(local["model"]["up"]["bias"], torch.ones(4))
    assert torch.equal(local["model"]["down"]["weight"], torch.zeros(3, 4))
    with pytest.raises(InvalidArgument, match=r"apply to load\(into=state\)"):
        saved.load(3, keys="model")
    with pytest.raises(InvalidArgument, match=r"apply to load_local\(into=...\)"):
        ckpt.load_local(daemon.root / "part" / "3", strict=False)

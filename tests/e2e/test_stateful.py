"""Stateful objects (state_dict/load_state_dict) through a real daemon: saved as their dicts, loaded in place."""

from __future__ import annotations

import threading
import warnings

import ckpt
import ckpt.dcp
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt.stateful import expand_stateful
from torch import nn

pytestmark = pytest.mark.e2e


class AppState:
    """What torchtitan and DCP's tutorial checkpoint: a model and its optimizer behind one Stateful."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.lock = threading.Lock()  # cannot be pickled: the object must not be
        self.loaded = 0

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.loaded += 1


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def fresh(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.5)  # no state yet, another lr


def assert_same(model, optimizer, want_model, want_optimizer) -> None:
    for (name, got), want in zip(model.state_dict().items(), want_model.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
    got, want = optimizer.state_dict(), want_optimizer.state_dict()
    assert got["param_groups"] == want["param_groups"]
    for i, s in want["state"].items():
        assert sorted(got["state"][i]) == sorted(s)
        assert all(torch.equal(got["state"][i][k], v) for k, v in s.items()), i


def test_an_app_state_is_saved_as_its_state_dict_and_loaded_in_place(daemon):
    model, optimizer = trained(0)
    with ckpt.Checkpointer(job="app", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async({"app": AppState(model, optimizer), "step": 3}, step=3).wait("nvme")
        model_into, optimizer_into = fresh(1)
        app = AppState(model_into, optimizer_into)
        into = {"app": app, "step": 0}
        loaded = c.load(3, into=into)
        assert loaded["app"] is app and app.loaded == 1 and loaded["step"] == 3
        assert_same(model_into, optimizer_into, model, optimizer)
        # Without into, the dict stands in the object's place: nothing of AppState was pickled.
        plain = c.load(3)
    assert sorted(plain) == ["app", "step"] and sorted(plain["app"]) == ["model", "optim"]
    assert torch.equal(plain["app"]["model"]["0.weight"], model[0].weight.detach())
    assert plain["app"]["optim"]["state"][0]["step"].item() == 1


def test_modules_and_optimizers_are_stateful_values_too(daemon):
    model, optimizer = trained(2)
    with ckpt.Checkpointer(job="modopt", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async({"model": model, "optim": optimizer, "extra": [model[0]]}, step=1).wait("nvme")
        model_into, optimizer_into = fresh(3)
        into = {"model": model_into, "optim": optimizer_into, "extra": [nn.Linear(4, 3)]}
        c.load(1, into=into)
        assert into["model"] is model_into and into["optim"] is optimizer_into
        assert_same(model_into, optimizer_into, model, optimizer)
        assert torch.equal(into["extra"][0].weight, model[0].weight)
        # exclude leaves an object as it is: its load_state_dict is not called
        model_into, optimizer_into = fresh(4)
        c.load(1, into={"model": model_into, "optim": optimizer_into, "extra": []}, exclude=["optim", "extra"])
        assert optimizer_into.state_dict()["state"] == {} and optimizer_into.param_groups[0]["lr"] == 0.5
        assert torch.equal(model_into[2].bias, model[2].bias)


def test_dcp_loads_a_stateful_from_a_ckptd_step(daemon):
    model, optimizer = trained(5)
    with ckpt.Checkpointer(job="appdcp", rank=0, world_size=1, address=daemon.address) as c:
        c.save_async({"app": AppState(model, optimizer)}, step=1).wait("nvme")
    model_into, optimizer_into = fresh(6)
    model_into(torch.randn(5, 4)).sum().backward()
    optimizer_into.step()  # dcp.load fills what state_dict() holds: the optimizer needs its state first
    app = AppState(model_into, optimizer_into)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to load in a single process"
        dcp.load({"app": app}, storage_reader=ckpt.dcp.Reader(path=daemon.root / "appdcp" / "1"), no_dist=True)
    assert app.loaded == 1
    assert_same(model_into, optimizer_into, model, optimizer)


def test_expand_stateful_keeps_what_holds_no_stateful_as_it_is():
    lr = {"lr": 0.1}
    state = {"a": [1, (2, lr)], "b": lr}
    assert expand_stateful(state) is state
    model = nn.Linear(2, 1)
    expanded = expand_stateful({"m": (model, lr), "c": lr})
    assert list(expanded["m"][0]) == ["weight", "bias"] and expanded["m"][1] is lr and expanded["c"] is lr
    assert expand_stateful(nn.Linear) is nn.Linear  # a class is no Stateful object

"""save_async(lazy=True): the optimizer's tensors are copied in the background, and its next step waits for them.

The background copy is held at a gate, so that each test changes tensors at a known
moment: while the copy of the optimizer-owned tensors has not started.
"""

from __future__ import annotations

import copy
import os
import threading

import ckpt
import pytest
import torch
from ckpt import lazy, save_path
from states import assert_same

pytestmark = pytest.mark.e2e

WAIT_S = 60


class Gate:
    """Hold the lazy thread's copies until opened (the saving thread's copies pass)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.reached = threading.Event()
        real = save_path.copy_into

        def gated(*args, **kwargs):
            if threading.current_thread().name.startswith("ckpt-lazy"):
                self.reached.set()
                assert self.open.wait(WAIT_S)
            return real(*args, **kwargs)

        monkeypatch.setattr(save_path, "copy_into", gated)


def _training():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(8, 16)).square().mean().backward()  # forward (BatchNorm statistics change) and backward
        optimizer.step()
        optimizer.zero_grad()

    step()  # the optimizer has its states now
    return model, optimizer, step


def _state(model, optimizer):
    return {"model": model.state_dict(), "optim": optimizer.state_dict(), "extra": torch.arange(5.0), "epoch": 3}


def test_a_lazy_save_returns_first_and_an_optimizer_step_waits_for_its_tensors(daemon, monkeypatch):
    model, optimizer, step = _training()
    state = _state(model, optimizer)
    expected = copy.deepcopy(state)
    gate = Gate(monkeypatch)
    with ckpt.Checkpointer(job="lazy", address=daemon.address) as c:
        h = c.save_async(state, step=1, lazy=True)
        assert gate.reached.wait(WAIT_S)
        assert not h.done("memory")  # returned before the parameters and moments were copied

        # Everything the contract allows while the copy has not even started:
        model(torch.randn(8, 16)).square().mean().backward()  # a forward pass (BatchNorm buffers) and gradients
        state["extra"].add_(100)  # a tensor no optimizer owns: copied before save_async returned
        state["epoch"] = 4
        stepping = threading.Thread(target=optimizer.step)
        stepping.start()
        stepping.join(timeout=0.5)
        assert stepping.is_alive()  # held by the pre-hook until its tensors are copied
        gate.open.set()
        stepping.join(WAIT_S)
        assert not stepping.is_alive()
        h.wait("memory", timeout=WAIT_S)
        step()
        h.wait("nvme", timeout=WAIT_S)
        assert_same(expected, c.load(1))
        assert not torch.equal(c.load(1)["model"]["0.weight"], model[0].weight)  # training went on meanwhile


def test_what_the_contract_forbids_leaks_into_the_checkpoint(daemon, monkeypatch):
    model, optimizer, _ = _training()
    state = _state(model, optimizer)
    gate = Gate(monkeypatch)
    with ckpt.Checkpointer(job="forbidden", address=daemon.address) as c:
        h = c.save_async(state, step=1, lazy=True)
        assert gate.reached.wait(WAIT_S)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # changed by hand, not by an optimizer step, before h.wait("memory")
        changed = model[0].weight.detach().clone()
        gate.open.set()
        h.wait("nvme", timeout=WAIT_S)
        assert torch.equal(c.load(1)["model"]["0.weight"], changed)  # the change is in the checkpoint


def test_without_an_optimizer_or_with_lazy_off_the_save_is_whole_when_it_returns(daemon, monkeypatch):
    gate = Gate(monkeypatch)  # never opened: nothing may wait for it
    plain = {"w": torch.arange(10.0), "b": torch.ones(3)}
    model, optimizer, _ = _training()
    with ckpt.Checkpointer(job="eager", address=daemon.address) as c:
        h = c.save_async(plain, step=1, lazy=True)  # no optimizer owns these: copied at once
        state = _state(model, optimizer)
        expected = copy.deepcopy(state)
        h2 = c.save_async(state, step=2)  # lazy off: the parameters too
        assert not gate.reached.is_set()
        plain["w"].zero_()
        optimizer.step()
        h.wait("nvme", timeout=WAIT_S)
        h2.wait("nvme", timeout=WAIT_S)
        assert_same({"w": torch.arange(10.0), "b": torch.ones(3)}, c.load(1))
        assert_same(expected, c.load(2))
        assert "no known optimizer owns a tensor of this state" in h.reason and "saved eagerly" in h.reason
        assert "optimizer" not in h2.reason


def test_a_lazy_save_copies_at_the_call_what_an_optimizer_stepped_in_a_cuda_graph_owns(daemon, monkeypatch):
    gate = Gate(monkeypatch)  # never opened: nothing may wait for it
    model, optimizer, _ = _training()
    monkeypatch.setattr(lazy, "_capturing", lambda: True)  # as if this step were being captured into a graph
    optimizer.step()  # the pre-hook sees it: a replay of the graph would step without it
    monkeypatch.setattr(lazy, "_capturing", lambda: False)
    with ckpt.Checkpointer(job="graphed", address=daemon.address) as c:
        state = _state(model, optimizer)
        expected = copy.deepcopy(state)
        h = c.save_async(state, step=1, lazy=True)
        assert not gate.reached.is_set()  # nothing was left for the background
        assert "captured into a CUDA graph" in h.reason
        optimizer.step()
        h.wait("nvme", timeout=WAIT_S)
        assert_same(expected, c.load(1))


def test_lazy_saves_one_after_another_each_hold_their_own_step(make_daemon):
    daemon = make_daemon("[retention]\nnvme = 0\n").start()  # every step stays, to be loaded at the end
    model, optimizer, step = _training()
    with ckpt.Checkpointer(job="many", address=daemon.address) as c:
        handles, expected = [], []
        for i in range(5):
            state = _state(model, optimizer)
            expected.append(copy.deepcopy(state))
            handles.append(c.save_async(state, step=i, lazy=True))
            step()  # at once: the pre-hook makes the step wait for this save's copy
        for i, h in enumerate(handles):
            h.wait("nvme", timeout=WAIT_S)
            assert_same(expected[i], c.load(i))


def test_the_background_copy_runs_on_the_daemons_cpus(make_daemon, monkeypatch):
    cpu = max(os.sched_getaffinity(0))
    daemon = make_daemon()
    daemon.env["CKPTD_NODE__CPUS"] = f'"{cpu}"'
    daemon.start()
    model, optimizer, _ = _training()
    gate = Gate(monkeypatch)
    with ckpt.Checkpointer(job="beside", address=daemon.address) as c:
        h = c.save_async(_state(model, optimizer), step=1, lazy=True)
        assert gate.reached.wait(WAIT_S)
        lazy_thread = next(t for t in threading.enumerate() if t.name.startswith("ckpt-lazy"))
        assert os.sched_getaffinity(lazy_thread.native_id) == {cpu}
        assert os.sched_getaffinity(0) != {cpu} or os.cpu_count() == 1  # the training thread stays where it was
        gate.open.set()
        h.wait("nvme", timeout=WAIT_S)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one for the trainer, one for the daemon")
def test_a_saves_copy_threads_may_use_the_daemons_cpus_beside_the_trainers(make_daemon):
    trainer, daemon_cpu = sorted(os.sched_getaffinity(0))[:2]
    daemon = make_daemon()
    daemon.env["CKPTD_NODE__CPUS"] = f'"{daemon_cpu}"'
    daemon.start()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {trainer})  # this thread only: the trainer pinned to its core, as OPERATIONS says
    try:
        with ckpt.Checkpointer(job="widen", address=daemon.address, copy_threads=2) as c:
            c.save_async({"a": torch.ones(32 << 20), "b": torch.ones(32 << 20)}, step=1).wait("nvme", timeout=WAIT_S)
            copiers = [t for t in threading.enumerate() if t.name.startswith("ckpt-copy")]
            assert copiers  # 256 MiB in two tensors: copied on the pool
            for t in copiers:
                assert os.sched_getaffinity(t.native_id) == {trainer, daemon_cpu}
    finally:
        os.sched_setaffinity(0, before)


def test_prepare_finds_an_optimizer_made_since_the_first_scan_so_the_first_lazy_save_is_lazy(daemon, monkeypatch):
    lazy.owners([])  # this process scanned its heap already (an earlier job)
    model = torch.nn.Linear(16, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # made since, never stepped: no hook has seen it
    gate = Gate(monkeypatch)
    with ckpt.Checkpointer(job="rescanned", address=daemon.address) as c:
        state = {"model": model.state_dict()}
        expected = copy.deepcopy(state)
        c.prepare(state).result(timeout=WAIT_S)
        h = c.save_async(state, step=1, lazy=True)
        assert gate.reached.wait(WAIT_S)  # the parameters were left to the background: their optimizer is known
        assert "no known optimizer" not in h.reason
        gate.open.set()
        h.wait("nvme", timeout=WAIT_S)
        assert_same(expected, c.load(1))
    del optimizer

"""What a save waits for before its copy is reported: a new slot (Checkpointer.prepare() takes that ahead), the
previous lazy save's copy when saves outrun the host copy (waited for under "block", skipped under "skip").

Real daemon, real shared memory: a slot of 256 MiB takes tens of milliseconds to allocate in /dev/shm
and as long again to map and fault in, well above what a save with its slot ready spends before copying.
"""

from __future__ import annotations

import threading

import ckpt
import pytest
import torch
from ckpt import save_path

pytestmark = pytest.mark.e2e
MIB = 1 << 20
WAIT_S = 120


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((256 * MIB // 4,), float(step)), "step": step}


def test_an_unprepared_first_save_reports_its_wait_and_a_steady_one_none(daemon):
    with ckpt.Checkpointer(job="unprepared", address=daemon.address) as c:
        first = c.save_async(_state(1), step=1)
        first.wait("nvme", timeout=WAIT_S)
        later = []
        for step in (2, 3):  # the second gets the spare slot, mapped in the background meanwhile
            later.append(c.save_async(_state(step), step=step))
            later[-1].wait("nvme", timeout=WAIT_S)
        assert c.load(3)["step"] == 3
    assert first.blocked_s > 0.0 and "new slot" in first.reason, (first.blocked_s, first.reason)
    assert (later[-1].blocked_s, later[-1].reason) == (0.0, "")


def test_a_prepared_first_save_waits_for_nothing(daemon):
    with ckpt.Checkpointer(job="prepared", address=daemon.address) as c:
        c.prepare(_state(0)).result(timeout=WAIT_S)
        handles = [c.save_async(_state(step), step=step) for step in (1, 2)]
        for h in handles:
            h.wait("nvme", timeout=WAIT_S)
        assert torch.equal(c.load(2)["w"], _state(2)["w"])
    assert [(h.blocked_s, h.reason) for h in handles] == [(0.0, ""), (0.0, "")]


def test_a_save_that_comes_while_prepare_works_waits_for_it_and_says_so(daemon):
    with ckpt.Checkpointer(job="preparing", address=daemon.address) as c:
        preparing = c.prepare(_state(0))
        h = c.save_async(_state(1), step=1)
        assert preparing.done()  # the save waited for the preparation
        h.wait("nvme", timeout=WAIT_S)
    assert h.reason in ("", "Checkpointer.prepare() mapping and pinning the slots")
    assert (h.blocked_s > 0.0) == bool(h.reason)


def test_prepare_refuses_a_closed_checkpointer(daemon):
    c = ckpt.Checkpointer(job="closed", address=daemon.address)
    c.close()
    with pytest.raises(ckpt.CheckpointError, match="closed"):
        c.prepare(_state(0))


def _held_lazy_copy(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Hold the lazy thread's copies until the returned event is set (the saving thread's copies pass)."""
    release = threading.Event()
    real = save_path.copy_into

    def held(*args, **kwargs):
        if threading.current_thread().name.startswith("ckpt-lazy"):
            assert release.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(save_path, "copy_into", held)
    return release


def _owned_state() -> tuple[dict[str, object], torch.optim.Optimizer]:
    w = torch.nn.Parameter(torch.zeros(4 * MIB // 4))
    optimizer = torch.optim.SGD([w], lr=0.0)
    optimizer.step()  # known to ckpt.lazy from its first step: it owns w (the heap is scanned once per process)
    return {"w": w}, optimizer


def test_a_save_that_outruns_the_lazy_copy_waits_for_it_and_says_so(daemon, monkeypatch):
    state, _optimizer = _owned_state()
    release = _held_lazy_copy(monkeypatch)
    with ckpt.Checkpointer(job="outrun-block", address=daemon.address) as c:
        c.save_async(state, step=1, lazy=True)
        second: list[ckpt.SaveHandle] = []
        saving = threading.Thread(target=lambda: second.append(c.save_async(state, step=2)))
        saving.start()
        saving.join(timeout=0.2)
        assert saving.is_alive()  # waits for the first save's copy, held back
        release.set()
        saving.join(WAIT_S)
        second[0].wait("nvme", timeout=WAIT_S)
    assert second[0].blocked_s > 0.0 and second[0].reason == "the previous lazy save's copy"


def test_under_policy_skip_a_save_that_outruns_the_lazy_copy_is_skipped(make_daemon, monkeypatch):
    daemon = make_daemon('policy = "skip"\n').start()  # appended to the fixture's [staging] section
    state, _optimizer = _owned_state()
    release = _held_lazy_copy(monkeypatch)
    with ckpt.Checkpointer(job="outrun-skip", address=daemon.address) as c:
        first = c.save_async(state, step=1, lazy=True)
        skipped = c.save_async(state, step=2)
        release.set()
        first.wait("nvme", timeout=WAIT_S)
        third = c.save_async(state, step=3)  # the copy is done: saved again
        third.wait("nvme", timeout=WAIT_S)
    assert skipped.skipped and "previous lazy save's copy is still running" in skipped.reason
    with pytest.raises(ckpt.SaveSkipped, match=r"staging\.policy = skip"):
        skipped.wait("memory", timeout=WAIT_S)
    assert not third.skipped

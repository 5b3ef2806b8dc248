"""The first save of a job: what it waits for is reported, and Checkpointer.prepare() takes that wait ahead.

Real daemon, real shared memory: a slot of 256 MiB takes tens of milliseconds to allocate in /dev/shm
and as long again to map and fault in, well above what a save with its slot ready spends before copying.
"""

from __future__ import annotations

import ckpt
import pytest
import torch

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
    with pytest.raises(ckpt.errors.CheckpointError, match="closed"):
        c.prepare(_state(0))

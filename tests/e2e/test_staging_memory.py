"""Staging memory is given back: by idle jobs, and by a daemon whose NVMe root is gone (issue 12)."""

from __future__ import annotations

import json
import shutil

import ckpt
import pytest
import torch
from conftest import eventually

pytestmark = pytest.mark.e2e


def test_an_idle_job_gives_its_staging_memory_back_and_loads_from_nvme(make_daemon):
    node = make_daemon()
    node.env["CKPTD_STAGING__IDLE_TTL_S"] = "1"
    node.start()
    with ckpt.Checkpointer(job="idle", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(1000)}, step=1).wait("nvme", timeout=30)
    job_dir = node.staging_dir / "idle"
    eventually(lambda: not job_dir.exists(), timeout_s=30, what="the idle job's slots given back")
    status = json.loads(node.cli("status", "--json", "--address", node.address).stdout)
    assert "idle" not in status["staging"]["bytes_by_job"] and status["staging"]["slots"] == 0
    assert "released 2 staging slots" in node.log()
    with ckpt.Checkpointer(job="idle", rank=0, world_size=1, address=node.address) as c:
        assert torch.equal(c.load(1)["w"], torch.arange(1000))  # from NVMe now
        c.save_async({"w": torch.ones(3)}, step=2).wait("nvme", timeout=30)  # new slots for a new save
        assert torch.equal(c.load(2)["w"], torch.ones(3))


def test_a_daemon_whose_root_is_removed_gives_its_staging_back_and_stops(make_daemon):
    node = make_daemon().start()
    with ckpt.Checkpointer(job="gone", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(1000)}, step=1).wait("nvme", timeout=30)
    assert any(node.staging_dir.glob("gone/rank-00000.slot-*"))
    shutil.rmtree(node.root)  # a test harness cleaning up its temporary root, an operator's rm -r
    assert node.proc is not None
    assert node.proc.wait(timeout=60) == 1  # the root is checked every 5 s
    assert not node.staging_dir.exists()
    log = node.log()
    assert "is gone (removed, or replaced by another)" in log and "Traceback" not in log


def test_slots_taken_for_another_root_are_removed_at_start_never_flushed(make_daemon):
    node = make_daemon().start()
    with ckpt.Checkpointer(job="old", rank=0, world_size=1, address=node.address) as c:
        c.save_async({"w": torch.arange(1000)}, step=7).wait("nvme", timeout=30)
    node.kill()
    shutil.rmtree(node.root)  # the disk was wiped (or replaced) while the daemon was down
    node.start()
    assert not (node.staging_dir / "old").exists()
    assert "they were taken for another NVMe root" in node.log()
    with ckpt.Checkpointer(job="old", rank=0, world_size=1, address=node.address) as c:
        assert c.latest_step() is None  # step 7 of the gone root is not resurrected into the new one
        c.save_async({"w": torch.ones(3)}, step=0).wait("nvme", timeout=30)
        assert torch.equal(c.load(0)["w"], torch.ones(3))
    node.stop()
    node.start()  # the same root again: its slots stay
    assert any((node.staging_dir / "old").glob("rank-00000.slot-*"))
    assert node.stop() == 0

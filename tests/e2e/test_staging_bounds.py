"""Staging is bounded by default: a share of the filesystem it is on (/dev/shm is RAM), and a cap per job."""

from __future__ import annotations

import json

import ckpt
import pytest
import torch

from ckptd.save.staging import default_budget_bytes

pytestmark = pytest.mark.e2e


def test_a_daemon_with_no_budget_configured_is_bounded_by_a_share_of_its_staging_filesystem(make_daemon):
    node = make_daemon().start()
    out = node.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    staging = json.loads(out.stdout)["staging"]
    assert staging["budget_bytes"] == default_budget_bytes(node.staging_dir) > 0
    assert "budget" in node.cli("status").stdout


def test_a_job_past_its_share_of_staging_is_refused_and_another_job_saves(make_daemon):
    node = make_daemon(f"job_budget_bytes = {4 << 20}\n").start()  # lands in [staging]
    with (
        ckpt.Checkpointer(job="greedy", address=node.address) as c,
        pytest.raises(ckpt.InvalidArgument, match=r"staging\.job_budget_bytes"),
    ):
        c.save_async({"w": torch.zeros(2 << 20)}, step=1)  # 8 MiB: never fits a 4 MiB share
    with ckpt.Checkpointer(job="modest", address=node.address) as c:
        c.save_async({"w": torch.ones(1000)}, step=1).wait("nvme", timeout=30)
    status = json.loads(node.cli("status", "--json").stdout)["staging"]
    assert status["job_budget_bytes"] == 4 << 20

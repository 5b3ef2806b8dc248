"""The job a new run saves to, chosen once for every rank of a distributed run (ckpt.job_versions)."""

from __future__ import annotations

import json
import subprocess
import sys

import ckpt
import pytest
import torch
from conftest import free_port

pytestmark = pytest.mark.e2e

_RANK = """
import json, sys
import torch.distributed as dist
from ckpt.job_versions import new_run_job
rank, port, address = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
try:
    print(json.dumps(new_run_job("hf", address, every_rank=True)), flush=True)
finally:
    dist.destroy_process_group()
"""


def test_every_rank_of_a_run_takes_rank_0s_version_though_its_own_node_sees_other_steps(make_daemon):
    # Rank 0's node holds an earlier run's steps of the job, rank 1's node (not its peer) none: chosen on its
    # own, rank 1 would save to "hf" and rank 0 to "hf-v1", one step split over two jobs.
    nodes = [make_daemon().start(), make_daemon().start()]
    with ckpt.Checkpointer(job="hf", address=nodes[0].address) as c:
        c.save_async({"w": torch.zeros(4)}, step=7).wait("nvme", timeout=60)
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(rank), port, node.address], stdout=subprocess.PIPE, text=True
        )
        for rank, node in enumerate(nodes)
    ]
    answers = [json.loads(r.communicate(timeout=120)[0]) for r in ranks]
    assert [r.returncode for r in ranks] == [0, 0]
    assert answers == [["hf-v1", 7], ["hf-v1", 7]]

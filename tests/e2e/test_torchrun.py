"""A real torchrun job over two daemons standing in for two nodes: lose one node, resume, same losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_core.format import data_name
from torchrun import torchrun as run_torchrun

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torchrun_train.py"
JOB = "ddp"
STEPS = 20
CKPT_EVERY = 5
FIRST_RUN_STEPS = 12  # the last save is step 10; steps 11 and 12 are lost with the run and trained again
TORCHRUN_TIMEOUT_S = 120


def torchrun(nodes, losses: Path, *args: str, steps: int = STEPS) -> dict:
    """Run the example on 4 ranks, ranks 0-1 on nodes[0] and 2-3 on nodes[1]; return rank 0's losses file."""
    env = {"CKPTD_ADDRESSES": ",".join(n.address for n in nodes), "CKPT_JOB": JOB}
    args = ["--steps", str(steps), "--losses", str(losses), *args]
    run_torchrun(4, SCRIPT, *args, env=env, timeout_s=TORCHRUN_TIMEOUT_S)
    result = json.loads(losses.read_text())
    return {"resumed_from": result["resumed_from"], "losses": {int(s): v for s, v in result["losses"].items()}}


def ls(node) -> dict[int, list[str]]:
    out = node.cli("ls", "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    return {item["step"]: item["tiers"] for item in json.loads(out.stdout)}


@pytest.mark.timeout(300)
def test_a_job_resumes_bit_for_bit_after_losing_a_node(make_cluster, short_tmp):
    nodes = [d.start() for d in make_cluster(2)]
    reference = torchrun(nodes, short_tmp / "reference.json")  # no checkpoints, never interrupted
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))

    checkpointed = ["--ckpt-every", str(CKPT_EVERY)]
    # The last save must have reached the peer tier before a node can be lost without losing it.
    first = torchrun(nodes, short_tmp / "first.json", *checkpointed, "--wait-tier", "peer", steps=FIRST_RUN_STEPS)
    assert first["resumed_from"] == 0
    assert first["losses"] == {s: reference["losses"][s] for s in range(1, FIRST_RUN_STEPS + 1)}
    assert ls(nodes[0]) == {5: ["nvme", "peer"], 10: ["nvme", "peer"]}

    lost = nodes[1]
    lost.lose()
    lost.start()  # a fresh daemon with an empty disk, on the same address
    assert not (lost.root / JOB).exists()
    resumed = torchrun(nodes, short_tmp / "resumed.json", *checkpointed)
    assert resumed["resumed_from"] == 10
    assert resumed["losses"] == {s: reference["losses"][s] for s in range(11, STEPS + 1)}  # bit for bit
    for rank in (2, 3):  # the lost node's ranks loaded their own shards, fetched from the peer
        assert (lost.root / JOB / "10" / data_name(rank)).exists()
    assert f"fetched rank 2 shard of {JOB} step 10" in lost.log()

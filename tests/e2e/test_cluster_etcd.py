"""The etcd cluster view with real daemons: etcd stopped during saves loses nothing, and commits resume."""

from __future__ import annotations

import json
import urllib.request

import ckpt
import pytest
import torch
from conftest import eventually, free_port
from states import assert_same

pytestmark = pytest.mark.e2e

JOB = "train"


@pytest.fixture
def cluster_backend() -> str:
    return "etcd"


def state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"w": torch.randn(1 << 18, generator=g), "rank": rank, "step": step}


def steps_listed(node) -> dict[int, list[str]]:
    out = node.cli("ls", "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    return {item["step"]: item["tiers"] for item in json.loads(out.stdout)}


def cluster_status(node) -> dict:
    return json.loads(node.cli("status", "--json").stdout)["cluster"]


def metric(port: int, name: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return float(next(line.split()[-1] for line in page.splitlines() if line.startswith(name + " ")))


def test_etcd_down_during_saves_loses_nothing_and_commits_resume(make_cluster, etcd_server):
    # No replicas: every node holds only its own rank, so each step needs the cluster view to be sealed.
    ports = [free_port(), free_port()]
    nodes = make_cluster(2, replicas=0)
    for node, port in zip(nodes, ports, strict=True):
        node.config_path.write_text(node.config_path.read_text() + f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        node.start()

    def save(step: int) -> list:
        handles = []
        for rank, node in enumerate(nodes):
            c = ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=node.address)
            handles.append((c, c.save_async(state(rank, step), step=step)))
        for c, h in handles:
            h.wait("nvme", timeout=60)  # durable on this node's NVMe: etcd plays no part
            c.close()
        return [h for _, h in handles]

    save(1)
    eventually(lambda: all(1 in steps_listed(n) for n in nodes), 30, "step 1 committed on both nodes")
    assert all(cluster_status(n)["connected"] for n in nodes)

    etcd_server.stop()
    for step in (2, 3):
        save(step)  # saves and NVMe flushes go on without etcd
    eventually(lambda: not any(cluster_status(n)["connected"] for n in nodes), 30, "status saying etcd is away")
    assert all(metric(p, "ckptd_cluster_connected") == 0 for p in ports)
    assert all(cluster_status(n)["pending_reports"] >= 1 for n in nodes), "the reports wait"
    assert all(set(steps_listed(n)) == {1} for n in nodes), "no step is complete while its commit cannot be made"

    etcd_server.start()  # the same data, the same ports
    eventually(lambda: all(set(steps_listed(n)) == {1, 2, 3} for n in nodes), 60, "the commits resuming")
    assert all(cluster_status(n)["connected"] and cluster_status(n)["pending_reports"] == 0 for n in nodes)
    assert all(metric(p, "ckptd_cluster_connected") == 1 for p in ports)
    for rank, node in enumerate(nodes):
        with ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=node.address) as c:
            assert c.latest_step() == 3
            for step in (2, 3):
                assert_same(c.load(step), state(rank, step))

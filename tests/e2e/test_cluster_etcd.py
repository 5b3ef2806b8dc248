"""The etcd cluster view with real daemons: etcd stopped during saves loses nothing, and commits resume."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import ckpt
import pytest
import torch
from conftest import eventually, free_port
from states import assert_same

pytestmark = pytest.mark.e2e

JOB = "train"
# the lease's keepalive call, every few seconds with a deadline of its own (ckptd/cluster/etcd_client.py)
ETCD_CUT_NOTICED_S = 20.0
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"  # the fault proxy the campaign uses


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


def test_a_node_cut_off_from_etcd_says_so_keeps_saving_and_commits_once_the_link_heals(make_cluster, etcd_server):
    # A cut, not a stop: node 0 reaches etcd through a proxy that goes silent (nothing relayed, nothing answered,
    # no reset), as a dropped route does; node 1 reaches etcd directly. The lease's keepalive call misses its
    # deadline within seconds; the channels' own keepalive closes the dead connections (not measured here).
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from fault_proxy import FaultProxy
    finally:
        sys.path.remove(str(BENCHMARKS))
    proxy = FaultProxy(int(etcd_server.endpoint.rsplit(":", 1)[1]))
    try:
        nodes = make_cluster(2, replicas=0)
        cut_off, other = nodes
        cut_off.config_path.write_text(
            cut_off.config_path.read_text().replace(etcd_server.endpoint, f"127.0.0.1:{proxy.port}")
        )
        for node in nodes:
            node.start()

        def save(step: int) -> None:
            for rank, node in enumerate(nodes):
                with ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=node.address) as c:
                    c.save_async(state(rank, step), step=step).wait("nvme", timeout=60)

        save(1)
        eventually(lambda: all(1 in steps_listed(n) for n in nodes), 30, "step 1 committed on both nodes")
        proxy.set_mode("blackhole")
        cut_at = time.monotonic()
        save(2)  # durable on each node's NVMe: etcd plays no part
        eventually(lambda: not cluster_status(cut_off)["connected"], 30, "the cut-off node's status saying so")
        noticed_s = time.monotonic() - cut_at
        print(f"a silent cut from etcd noticed after {noticed_s:.1f} s")
        assert noticed_s < ETCD_CUT_NOTICED_S, f"a cut from etcd was noticed after {noticed_s:.1f} s"
        assert cluster_status(other)["connected"], "the node that still reaches etcd says so"
        assert 2 not in steps_listed(other), "no step is complete while a rank's report cannot reach etcd"
        proxy.set_mode("pass")
        eventually(lambda: all(2 in steps_listed(n) for n in nodes), 60, "step 2 committed after the heal")
        assert cluster_status(cut_off)["connected"]
        for rank, node in enumerate(nodes):
            with ckpt.Checkpointer(job=JOB, rank=rank, world_size=2, address=node.address) as c:
                assert_same(c.load(2), state(rank, 2))
    finally:
        proxy.close()

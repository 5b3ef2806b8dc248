"""Metrics of a cluster: each node reports its own view, and the dashboard's `max by` is the cluster's."""

from __future__ import annotations

import urllib.request

import ckpt
import pytest
import torch
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e

JOB = "wide"
WORLD_SIZE = 4  # ranks 0 and 2 save on the first node, 1 and 3 on the second


def samples(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        page = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }


def newest(found: dict, tier: str) -> float | None:
    return found.get(("ckptd_newest_complete_step", (("job_name", JOB), ("tier", tier))))


def test_each_node_reports_a_step_on_the_peer_tier_once_its_own_shards_have_their_replicas(make_cluster):
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    nodes = make_cluster(2)
    for node, address in zip(nodes, addresses, strict=True):
        node.config_path.write_text(node.config_path.read_text() + f'[metrics]\nlisten = "{address}"\n')
        node.start()
    for step in (1, 2):
        checkpointers = [
            ckpt.Checkpointer(job=JOB, rank=r, world_size=WORLD_SIZE, address=nodes[r % 2].address)
            for r in range(WORLD_SIZE)
        ]
        handles = [c.save_async({"w": torch.full((1000,), step + r)}, step=step) for r, c in enumerate(checkpointers)]
        for h in handles:
            h.wait("peer", timeout=60)
            h.wait("nvme", timeout=60)
        for c in checkpointers:
            c.close()

    found = [samples(a) for a in addresses]
    for node in found:
        assert newest(node, "peer") == 2  # this node's two shards of step 2 have their replicas
        assert newest(node, "memory") is None  # no node holds every rank of a step in its slots
        assert node[("ckptd_replica_bytes_sent_total", ())] >= 2 * 2 * 4000
        assert node[("ckptd_bytes_written_total", (("tier", "peer"),))] >= 2 * 2 * 4000  # the other's replicas
    # The node that sealed a step reports it; `max by (job_name, tier)` over the nodes is the cluster's view.
    assert max(newest(node, "nvme") or 0 for node in found) == 2

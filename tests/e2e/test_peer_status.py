"""What `ckptd status` and the log say of the peers: no false alarms, each event once (real daemons)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import ckpt
import pytest
import torch
from conftest import eventually, free_port

from ckptd.cluster.peer_inventory import PeerInventory
from ckptd.cluster.peer_link import PeerLink
from ckptd.config import PeerConfig

pytestmark = pytest.mark.e2e


def _peer_status(node) -> dict:
    out = node.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tiers"]["peer"]


def test_a_peer_is_connecting_until_a_first_attempt_fails():
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    tier = PeerInventory([PeerLink(address, PeerConfig(insecure=True))], ThreadPoolExecutor(1))  # one peer: no thread
    try:
        assert tier.connecting() == [address] and not tier.unreachable
        assert tier.ask(timeout_s=0.5) == []
        assert tier.connecting() == [] and address in tier.unreachable
    finally:
        for link in tier.links:
            link.close()


def test_status_does_not_call_a_peer_that_came_up_unreachable(make_cluster):
    a, b = make_cluster(2)
    a.start()
    eventually(lambda: b.listen in _peer_status(a)["unreachable"], what="a finds b unreachable")
    b.start()
    peer = _peer_status(a)  # at once: status asks again the peers it last found unreachable
    assert b.listen not in peer["unreachable"], peer["unreachable"]
    assert f"{b.listen}: ok" in a.cli("status").stdout


def test_complete_across_the_cluster_is_logged_once_per_step_on_each_node(make_cluster):
    nodes = [d.start() for d in make_cluster(3, replicas=2)]  # each node holds every rank: it seals, and hears
    handles = []
    for rank, node in enumerate(nodes):
        c = ckpt.Checkpointer(job="once", rank=rank, world_size=3, address=node.address)
        handles.append((c, c.save_async({"w": torch.full((1000,), float(rank))}, step=7)))
    for c, h in handles:
        h.wait("peer", timeout=60)
        c.close()
    line = "once step 7 is complete across the cluster"
    eventually(lambda: all(line in n.log() for n in nodes), what="every node learns the step is complete")
    for n in nodes:  # a listing learns the cluster's commits again: still once
        assert n.cli("ls", "--job", "once").returncode == 0
    assert [n.log().count(line) for n in nodes] == [1, 1, 1]

"""Replica failover with real daemons: a dead placed peer gets a stand-in, retired when the peer returns."""

from __future__ import annotations

import json

import ckpt
import pytest
import torch
from ckpt.transport import DaemonClient
from ckpt_core.format import data_name
from ckpt_core.wire.v1 import ckptd_pb2 as pb
from conftest import eventually
from states import assert_same

from ckptd.cluster.placement import reseat, seated_placement

pytestmark = pytest.mark.e2e


def _state(step: int) -> dict:
    return {"w": torch.arange(1 << 16, dtype=torch.float32) + step, "step": step}


def _job_placed_on(peers: list[str], wanted: str) -> str:
    """Return a job name whose rank 0 replica the saving node places on `wanted` (rendezvous hashing)."""
    for n in range(1000):
        job = f"failover-{n}"
        if seated_placement(job, 0, reseat({}, peers), 1) == [wanted]:
            return job
    raise AssertionError("no job name places its replica there")


def _replica_held(node, job: str, step: int) -> bool:
    return (node.root / ".peer" / job / str(step) / data_name(0)).exists()


def test_a_dead_placed_peer_gets_a_stand_in_and_its_copy_moves_back_when_it_returns(make_cluster):
    a, b, c = make_cluster(3, extra_toml="failover_s = 1\n")
    for node in (a, b, c):
        node.start()
    job = _job_placed_on([b.listen, c.listen], c.listen)
    with ckpt.Checkpointer(job=job, address=a.address) as saver:
        saver.save_async(_state(1), step=1).wait("peer", timeout=60)
        assert _replica_held(c, job, 1) and not _replica_held(b, job, 1)
        c.kill()
        saver.save_async(_state(2), step=2).wait("peer", timeout=60)  # within failover_s and a retry or two
        assert _replica_held(b, job, 2), "the next node in placement order keeps the copy while c is dead"
        peer = json.loads(a.cli("status", "--json").stdout)["tiers"]["peer"]
        assert peer["under_replicated"]["on_stand_in"] >= 1
        assert peer["peers"][b.listen]["stood_in_for"] >= 1
        text = a.cli("status").stdout
        assert "kept by a stand-in" in text

        c.start()  # the placed node returns: it gets its copy, and the stand-in's goes
        eventually(lambda: _replica_held(c, job, 2), what="the returned node holds its replica")
        eventually(lambda: not _replica_held(b, job, 2), what="the stand-in's copy is retired")
        peer = json.loads(a.cli("status", "--json").stdout)["tiers"]["peer"]
        assert peer["under_replicated"] == {"shards": 0, "oldest_s": 0.0, "on_stand_in": 0}

    a.kill()  # lose the saving node: the step loads from the replica on the node placed to keep it
    with ckpt.Checkpointer(job=job, address=c.address) as reader:
        assert_same(reader.load(step=2), _state(2))


def test_a_load_after_losing_the_saving_node_reads_the_stand_ins_copy(make_cluster):
    a, b, c = make_cluster(3, extra_toml="failover_s = 1\n")
    for node in (a, b, c):
        node.start()
    job = _job_placed_on([b.listen, c.listen], c.listen)
    c.kill()
    with ckpt.Checkpointer(job=job, address=a.address) as saver:
        saver.save_async(_state(3), step=3).wait("peer", timeout=60)
    a.kill()  # two of three nodes lost: the stand-in's copy is the step's last
    with ckpt.Checkpointer(job=job, address=b.address) as reader:
        assert_same(reader.load(step=3), _state(3))


def test_a_listing_asks_the_peers_again_after_a_copy_there_is_removed(make_cluster):
    """A listing shows what the peers hold now, not an inventory cached from before a copy was removed there.

    Raw RPCs, not the CLI: the removal must come within the moment a node keeps a peer's inventory.
    """
    a, b = make_cluster(2)
    for node in (a, b):
        node.start()
    with ckpt.Checkpointer(job="listed", address=a.address) as saver:
        saver.save_async(_state(1), step=1).wait("peer", timeout=60)
    lister, remover = DaemonClient(a.address), DaemonClient(b.address)
    try:

        def peer_listed() -> bool:
            steps = lister.call("List", pb.ListRequest(job="listed")).steps
            return any(s.step == 1 and "peer" in s.tiers for s in steps)

        assert peer_listed()  # a asked b's inventory just now
        remover.call("RemoveStep", pb.RemoveStepRequest(job="listed", step=1, force=True))  # the head: force
        assert not (b.root / ".peer" / "listed" / "1").exists()
        assert not peer_listed(), "a listing showed a copy the peer no longer holds"
    finally:
        lister.close()
        remover.close()


def test_an_old_step_fetched_back_for_a_load_is_not_sent_to_the_peers_again(make_cluster, s3_server):
    """The peers keep the job's newest steps: an older one a load fetched onto NVMe is not replicated again.

    Else the peer's retention drops it at once, and this node sends it again, every round (seen in the
    fault campaign: "no longer holds the replica ... sending it again" every 2 s).
    """
    store = s3_server.toml(f"s3://{s3_server.new_bucket()}/ckpts")
    a, b = make_cluster(2, extra_toml="[retention]\nnvme = 2\npeer = 3\n" + store)
    for node in (a, b):
        node.start()
    with ckpt.Checkpointer(job="old", address=a.address) as saver:
        for step in range(1, 7):
            h = saver.save_async(_state(step), step=step)
            h.wait("peer", timeout=60)
            h.wait("object", timeout=60)
    on_nvme = a.root / "old"
    eventually(lambda: sorted(int(p.name) for p in on_nvme.iterdir()) == [5, 6], what="NVMe keeps the newest 2")
    eventually(lambda: not _replica_held(b, "old", 1), what="the peer keeps the newest 3")
    logged = len(a.log())
    with ckpt.Checkpointer(job="old", address=a.address) as reader:
        assert_same(reader.load(step=1), _state(1))  # from the store, onto a's NVMe
    assert (on_nvme / "1").is_dir()

    def asked() -> int:
        return json.loads(b.cli("status", "--json").stdout)["tiers"]["peer"]["inventories_answered"]

    rounds = asked() + 3
    eventually(lambda: asked() >= rounds, what="a few rounds of a's replication")
    since_load = a.log()[logged:]
    assert "fetched rank 0 shard of old step 1 from s3://" in since_load
    assert "shard of old step 1 to peer" not in since_load, "an old step fetched back was replicated again"

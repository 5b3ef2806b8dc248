"""A peer that hangs is handled like a dead one: daemons on hosts of their own (tests/netns.py), links cut under them.

A cut drops packets silently, as a switch port or a firewall does: no refusal, no reset, the
peer's process alive. Each test measures the time it bounds and prints it (pytest -s shows it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import ckpt
import pytest
import torch
from ckpt_core.errors import SaveFailed
from ckpt_core.format import ShardMeta, data_name, meta_name
from conftest import eventually
from states import assert_same

from ckptd.cluster.data_channel import SILENT_CONNECTION_S
from ckptd.cluster.placement import reseat, seated_placement

pytestmark = pytest.mark.e2e

FAILOVER_S = 2.0
STAND_IN_BOUND_S = FAILOVER_S + 4.0  # the first unanswered request, failover_s, the stand-in's copy (docs/DESIGN.md)
HEAL_BOUND_S = 6.0  # a healed link carries the replicas owed within this (docs/DESIGN.md)
CUT_S = 30.0  # long enough that the kernel's retransmissions on a reused connection back off past it
# An isolated node's wait("peer") raises within failover_s and two attempts (CONNECT_TIMEOUT_S each) of the save;
# a later wait, on a shard of the same cut, within one fresh attempt (docs/DESIGN.md).
ISOLATED_WAIT_BOUND_S = FAILOVER_S + 2 * 3.0
DRAIN_BOUND_S = 6.0  # SIGTERM with every peer cut off: drained and exited within this


def _state(step: int) -> dict:
    return {"w": torch.arange(1 << 16, dtype=torch.float32) + step, "step": step}


def _job_placed_on(peers: list[str], wanted: str) -> str:
    """Return a job name whose rank 0 replica the saving node places on `wanted` (rendezvous hashing)."""
    for n in range(1000):
        job = f"cut-{n}"
        if seated_placement(job, 0, reseat({}, peers), 1) == [wanted]:
            return job
    raise AssertionError("no job name places its replica there")


def _replica_held(node, job: str, step: int) -> bool:
    return (node.root / ".peer" / job / str(step) / data_name(0)).exists()


@pytest.mark.parametrize("cut", ["both ways", "its answers lost"])
def test_a_cut_off_peer_is_stood_in_for_within_failover_s_not_a_request_deadline(make_host_cluster, network, cut):
    a, b, c = make_host_cluster(3, extra_toml=f"failover_s = {FAILOVER_S}\n")
    for node in (a, b, c):
        node.start()
    job = _job_placed_on([b.listen, c.listen], c.listen)
    with ckpt.Checkpointer(job=job, address=a.address) as saver:
        saver.save_async(_state(1), step=1).wait("peer", timeout=60)
        assert _replica_held(c, job, 1)
        if cut == "both ways":
            network.cut(a.host, c.host)  # c lives on, and hears nothing from a, nor a from c
        else:
            network.cut_one_way(c.host, a.host)  # a's requests reach c; nothing c sends back reaches a
        started = time.monotonic()
        saver.save_async(_state(2), step=2).wait("peer", timeout=60)
        took = time.monotonic() - started
    print(f"stand-in after a cut: {took:.2f} s (failover_s = {FAILOVER_S})")
    assert _replica_held(b, job, 2), "the next node in placement order keeps the copy while c is cut off"
    assert took < STAND_IN_BOUND_S, f"the stand-in came {took:.1f} s after the save, failover_s is {FAILOVER_S}"


def test_a_healed_link_carries_the_replicas_owed_at_once(make_host_cluster, network):
    a, b = make_host_cluster(2)
    for node in (a, b):
        node.start()
    with ckpt.Checkpointer(job="healed", address=a.address) as saver:
        saver.save_async(_state(1), step=1).wait("peer", timeout=60)
        network.cut(a.host, b.host)
        cut_at = time.monotonic()
        saver.save_async(_state(2), step=2).wait("nvme", timeout=60)
        time.sleep(max(0.0, cut_at + CUT_S - time.monotonic()))  # the cut lasts CUT_S: the fault, not a wait
        network.heal()
        healed_at = time.monotonic()
        eventually(lambda: _replica_held(b, "healed", 2), timeout_s=60, what="the replica after healing")
        took = time.monotonic() - healed_at
    print(f"replicated {took:.2f} s after healing a {CUT_S:.0f} s cut")
    assert took < HEAL_BOUND_S, f"replication resumed {took:.1f} s after the link healed"
    a.kill()
    with ckpt.Checkpointer(job="healed", address=b.address) as reader:
        assert_same(reader.load(step=2), _state(2))


def test_an_isolated_nodes_wait_for_peer_raises_naming_the_peers_it_cannot_reach(make_host_cluster, network):
    a, b, c = make_host_cluster(3, extra_toml=f"failover_s = {FAILOVER_S}\n")
    for node in (a, b, c):
        node.start()
    with ckpt.Checkpointer(job="isolated", address=a.address) as saver:
        saver.save_async(_state(1), step=1).wait("peer", timeout=60)
        network.isolate(a.host)
        handles = [saver.save_async(_state(step), step=step) for step in (2, 3, 4)]
        for h in handles:
            started = time.monotonic()
            with pytest.raises(SaveFailed) as failed:
                h.wait("peer", timeout=60)
            took = time.monotonic() - started
            print(f"an isolated node's wait('peer') for step {h.step} raised after {took:.2f} s")
            assert b.listen in str(failed.value) and c.listen in str(failed.value), failed.value
            assert took < ISOLATED_WAIT_BOUND_S, f"wait('peer') took {took:.1f} s to say the peers cannot be reached"
        for h in handles:
            h.wait("nvme", timeout=10)  # the node itself keeps saving
        # status says so on the cut-off side (it said "connected" before), and not on the side that still meets
        eventually(
            lambda: "NOT CONNECTED: no peer answers" in a.cli("status").stdout,
            timeout_s=30,
            what="the isolated node's status saying it is cut off",
        )
        on_a, on_b = a.cli("status").stdout, b.cli("status").stdout
        assert f"{b.listen}: unreachable" in on_a and f"{c.listen}: unreachable" in on_a, on_a
        assert "NOT CONNECTED" not in on_b, on_b
    print(failed.value)
    print(on_a)


def test_sigterm_drains_promptly_and_cleanly_with_every_peer_cut_off(make_host_cluster, network):
    a, b, c = make_host_cluster(3, extra_toml=f"failover_s = {FAILOVER_S}\n")
    for node in (a, b, c):
        node.start()
    with ckpt.Checkpointer(job="draining", address=a.address) as saver:
        saver.save_async(_state(1), step=1).wait("peer", timeout=60)
        network.isolate(a.host)
        for step in (2, 3):
            saver.save_async(_state(step), step=step).wait("nvme", timeout=60)
    eventually(lambda: "failed" in a.log(), timeout_s=30, what="a's replication meets the cut")
    started = time.monotonic()
    assert a.stop() == 0
    took = time.monotonic() - started
    print(f"SIGTERM with every peer cut off: exited after {took:.2f} s")
    assert took < DRAIN_BOUND_S, f"draining took {took:.1f} s"
    assert "Traceback" not in a.log(), a.log()[-4000:]


_SINK = """
import socket, time
server = socket.create_server(("0.0.0.0", 7272))
print("ready", flush=True)
conn = server.accept()[0]
conn.recv(16)
time.sleep(3600)  # takes the bytes and never answers: a receiver still writing them, as far as the sender knows
"""

_SEND = """
import socket, sys, time
from ckptd.cluster.data_channel import STALL_TIMEOUT_S, close_when_silent
conn = socket.create_connection((sys.argv[1], 7272), timeout=3)
close_when_silent(conn)
conn.settimeout(STALL_TIMEOUT_S)
conn.sendall(bytes(16))
print("sent", flush=True)
try:
    conn.recv(4)  # the receiver's status
except OSError as e:
    print(f"failed {time.monotonic():.3f} {e}", flush=True)
"""


def test_a_data_connection_waiting_on_a_cut_peer_fails_within_seconds_and_on_a_slow_one_waits(network):
    """A sender waiting for a receiver's status: the receiver alive but slow answers TCP, one cut off does not."""
    sender_host, receiver_host = network.host("s"), network.host("r")
    sink = subprocess.Popen([*receiver_host.command(), sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    sender = subprocess.Popen(
        [*sender_host.command(), sys.executable, "-c", _SEND, receiver_host.address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        assert sender.stdout is not None and sender.stdout.readline().strip() == "sent"
        with pytest.raises(subprocess.TimeoutExpired):  # a live receiver answers the probes: no end
            sender.wait(timeout=SILENT_CONNECTION_S + 2)
        network.cut(sender_host, receiver_host)
        cut_at = time.monotonic()
        said = sender.stdout.readline().split()
        took = float(said[1]) - cut_at
        print(f"a waiting data connection failed {took:.2f} s after the cut: {' '.join(said[2:])}")
        assert said[0] == "failed" and took < SILENT_CONNECTION_S + 3
    finally:
        for process in (sender, sink):
            process.kill()
            process.wait()


def _rank_state(rank: int, step: int, run: int) -> dict:
    return {"w": torch.full((1 << 14,), float(1000 * run + 10 * step + rank)), "rank": rank, "run": run}


def test_a_step_saved_again_across_a_partition_is_sealed_from_one_run_only(make_host_cluster, network):
    # Two ranks on two nodes split by a partition (a | b c): each rank's shard of step 2 is durable on its own
    # node, but the step cannot be committed across the cut. The job restarts (a new run) and saves step 2
    # again while the cut lasts, then the link heals: the step must be sealed from the new run's shards on
    # both nodes, never from one run's rank 0 and the other's rank 1, and each rank loads what it saved last.
    a, b, c = make_host_cluster(3, extra_toml=f"failover_s = {FAILOVER_S}\n")
    for node in (a, b, c):
        node.start()
    saving_nodes = (a, b)

    def save(step: int, run: int) -> None:
        savers = [
            ckpt.Checkpointer(job="split", rank=rank, world_size=2, address=node.address, run_id=f"run-{run}")
            for rank, node in enumerate(saving_nodes)
        ]
        handles = [s.save_async(_rank_state(rank, step, run), step=step) for rank, s in enumerate(savers)]
        for h in handles:
            h.wait("nvme", timeout=60)  # durable on its own node: the cut plays no part
        for s in savers:
            s.close()

    def complete_on(node) -> set[int]:
        out = node.cli("ls", "--job", "split", "--json")
        return {item["step"] for item in json.loads(out.stdout)} if out.returncode == 0 else set()

    save(1, run=1)
    eventually(lambda: all(1 in complete_on(n) for n in saving_nodes), 30, "step 1 committed on both nodes")
    network.partition([a.host], [b.host, c.host])
    save(2, run=1)
    save(2, run=2)  # the job restarted, the cut still there
    assert not any(2 in complete_on(n) for n in saving_nodes), "step 2 committed across a cut"
    network.heal()
    eventually(lambda: all(2 in complete_on(n) for n in saving_nodes), 60, "step 2 committed after the heal")
    for rank, node in enumerate(saving_nodes):
        with ckpt.Checkpointer(job="split", rank=rank, world_size=2, address=node.address) as loader:
            assert_same(loader.load(step=2), _rank_state(rank, 2, run=2))
    for rank, node in enumerate(saving_nodes):  # the sealed shard records name the run that wrote them
        path = node.root / "split" / "2" / meta_name(rank)
        assert ShardMeta.from_bytes(path.read_bytes(), str(path)).run_id == "run-2"

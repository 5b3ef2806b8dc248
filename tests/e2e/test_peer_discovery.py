"""Cluster discovery end to end: real daemons find each other through a DNS name that changes under them.

Each daemon listens on a loopback address of its own (127.0.0.2, 127.0.0.3, ...: all
of 127/8 reaches lo on Linux), on one port for all, as the pods behind a Kubernetes
headless service do; [peer] addresses names only "ckptd-peers.test:PORT". The name
resolves through a hosts file the test owns, bind-mounted over /etc/hosts in a mount
namespace of each daemon's own and rewritten in place (same inode) to change what it
resolves to.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections import Counter
from pathlib import Path

import ckpt
import pytest
import torch
from certs import CertificateAuthority
from ckpt_core.errors import SaveFailed
from ckpt_core.format import data_name
from conftest import Daemon, eventually, free_port
from states import assert_same

pytestmark = pytest.mark.e2e

JOB = "train"
NAME = "ckptd-peers.test"
HOSTS_FILE_BYTES = 1024  # every version of the file is this long: one write replaces it whole
# Runs the rest of the line with NAME's hosts file ($0) as /etc/hosts, in a mount namespace of its own.
WITH_HOSTS_FILE = [
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount --bind "$0" /etc/hosts && exec "$@"',
]


def _why_no_mount_namespace(tmp: Path) -> str:
    hosts = tmp / "probe-hosts"
    hosts.write_text(f"127.0.0.2 {NAME}\n")
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    try:
        out = subprocess.run(
            [*WITH_HOSTS_FILE, str(hosts), "getent", "hosts", NAME], capture_output=True, text=True, timeout=30
        )
    except OSError as e:
        return f"cannot run unshare: {e}"
    if out.returncode != 0 or "127.0.0.2" not in out.stdout:
        return f"a private mount namespace with its own /etc/hosts is not permitted here: {out.stderr.strip()}"
    return ""


def _free_on_all(ips: list[str]) -> int:
    """Return a port that was free a moment ago on every one of the addresses."""
    for _ in range(50):
        port = free_port()
        try:
            for ip in ips:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no port is free on all of {ips}")


class DnsCluster:
    """Daemons on their own loopback addresses, one port, finding each other through NAME."""

    def __init__(self, make_daemon, base: Path, ips: list[str], tls: bool = False) -> None:
        self.make_daemon = make_daemon
        self.hosts = base / "hosts"
        self.hosts.touch()
        self.resolve_to([])  # NAME resolves to nothing yet
        self.port = _free_on_all(ips)
        security = "insecure = true\n"
        if tls:  # every node's certificate names the service's name alone: no IP of any node
            ca = CertificateAuthority(base / "ca")
            cert, key = ca.issue("node", dns_names=(NAME,))
            security = f'cert = "{cert}"\nkey = "{key}"\nca = "{ca.ca_path}"\n'
        self.toml = f'[peer]\naddresses = ["{NAME}:{self.port}"]\nreplicas = 1\n{security}resolve_interval_s = 1\n'

    def resolve_to(self, ips: list[str]) -> None:
        """Have NAME resolve to ips from now on, writing the hosts file in place (its inode is what is mounted)."""
        text = "".join(f"{ip} {NAME}\n" for ip in ips).encode()
        with open(self.hosts, "r+b") as f:
            f.write(text + b"#" * (HOSTS_FILE_BYTES - 1 - len(text)) + b"\n")  # the same length, in one write

    def node(self, ip: str) -> Daemon:
        d = self.make_daemon(self.toml, name=ip, listen=f"{ip}:{self.port}")
        d.wrapper = [*WITH_HOSTS_FILE, str(self.hosts)]
        return d


@pytest.fixture
def dns_cluster(make_daemon, short_tmp):
    """Return a factory of DnsClusters over the given addresses, or skip where mount namespaces are not allowed."""
    why = _why_no_mount_namespace(short_tmp)
    if why:
        pytest.skip(why)
    return lambda ips, tls=False: DnsCluster(make_daemon, short_tmp, ips, tls)


def rank_state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"w": torch.randn(1 << 18, generator=g), "rank": rank, "step": step}


def save_step(nodes: list[Daemon], step: int, world_size: int) -> None:
    """Save one step with rank r on node r % len(nodes), and wait for every shard's replica."""
    clients = [
        ckpt.Checkpointer(job=JOB, rank=r, world_size=world_size, address=nodes[r % len(nodes)].address)
        for r in range(world_size)
    ]
    handles = [c.save_async(rank_state(r, step), step=step) for r, c in enumerate(clients)]
    for c, h in zip(clients, handles, strict=True):
        h.wait("peer", timeout=60)
        c.close()


def ls(node: Daemon) -> dict[int, list[str]]:
    out = node.cli("ls", "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    return {item["step"]: item["tiers"] for item in json.loads(out.stdout)}


def peer_status(node: Daemon) -> dict:
    out = node.cli("status", "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["tiers"]["peer"]


def peers_seen(node: Daemon) -> set[str]:
    """Return the peers a node follows: its membership, which its replication must agree with."""
    status = peer_status(node)
    assert set(status["peers"]) <= set(status["membership"]["peers"]), status
    return set(status["membership"]["peers"])


def replica_holders(nodes: list[Daemon], step: int, world_size: int) -> dict[int, list[str]]:
    """Return, for each rank of a step, the nodes (by address) whose replica store keeps its shard."""
    return {
        rank: [d.listen for d in nodes if (d.root / ".peer" / JOB / str(step) / data_name(rank)).exists()]
        for rank in range(world_size)
    }


def test_a_node_replaced_in_dns_takes_over_only_the_replicas_of_the_node_it_replaced(dns_cluster):
    world_size = 8  # two ranks on each node
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]
    cluster = dns_cluster([*ips, "127.0.0.6"])
    cluster.resolve_to(ips)
    nodes = [cluster.node(ip).start() for ip in ips]
    for d in nodes:
        eventually(lambda d=d: peers_seen(d) == {n.listen for n in nodes if n is not d}, what=f"{d.listen}'s peers")
    save_step(nodes, step=1, world_size=world_size)
    before = {rank: holders[0] for rank, holders in replica_holders(nodes, 1, world_size).items() if len(holders) == 1}
    assert len(before) == world_size, "replicas = 1: one other node keeps each rank"

    # Replace the node that keeps the most replicas (at least two, of other nodes' ranks): lost, and
    # in its place a new node on a new address, which the name now resolves to instead.
    old = next(d for d in nodes if d.listen == Counter(before.values()).most_common(1)[0][0])
    old.lose()
    cluster.resolve_to([*(ip for ip in ips if f"{ip}:{cluster.port}" != old.listen), "127.0.0.6"])
    new = cluster.node("127.0.0.6").start()
    nodes = [new if d is old else d for d in nodes]
    for d in nodes:
        eventually(lambda d=d: peers_seen(d) == {n.listen for n in nodes if n is not d}, what=f"{d.listen}'s peers")

    # Step 1's replicas that the old node kept are sent again, to the new node; the others stay where they are.
    moved = {rank for rank, holder in before.items() if holder == old.listen}
    assert moved, "the old node kept replicas"
    expected = {rank: [new.listen if holder == old.listen else holder] for rank, holder in before.items()}
    eventually(lambda: replica_holders(nodes, 1, world_size) == expected, what="step 1's replicas sent again")
    eventually(lambda: "peer" in ls(nodes[0]).get(1, []), what="step 1 whole on the peer tier again")

    # The next step's replicas go where the last one's did, the old node's share to the new node.
    save_step(nodes, step=2, world_size=world_size)
    assert replica_holders(nodes, 2, world_size) == expected

    # Every step stays loadable from a node whose own copy is gone: the new node (for the lost node's
    # ranks), and a node that stayed, lost in its turn (its ranks' replicas include those sent again).
    on_new = [r for r in range(world_size) if nodes[r % len(nodes)] is new]
    for rank in on_new:
        with ckpt.Checkpointer(job=JOB, rank=rank, world_size=world_size, address=new.address) as c:
            assert_same(c.load(1), rank_state(rank, 1))
    second = next(d for d in nodes if d is not new and any(nodes[r % len(nodes)] is d for r in moved))
    second.lose()
    second.start()  # an empty disk, on the same address
    for rank in [r for r in range(world_size) if nodes[r % len(nodes)] is second]:
        with ckpt.Checkpointer(job=JOB, rank=rank, world_size=world_size, address=second.address) as c:
            assert c.latest_step() == 2
            for step in (1, 2):
                assert_same(c.load(step), rank_state(rank, step))


def test_a_node_that_joins_the_name_gets_the_replicas_that_waited_for_a_peer(dns_cluster):
    cluster = dns_cluster(["127.0.0.2", "127.0.0.3"])
    a = cluster.node("127.0.0.2").start()  # the name resolves to nothing yet: not fatal, the node runs alone
    status = peer_status(a)
    assert status["enabled"] and status["membership"]["peers"] == []
    assert f"{NAME}:{cluster.port}" in status["membership"]["failing"]
    with ckpt.Checkpointer(job=JOB, rank=0, world_size=1, address=a.address) as c:
        h = c.save_async(rank_state(0, 1), step=1)
        h.wait("nvme", timeout=60)
        with pytest.raises((TimeoutError, SaveFailed)):  # no peer to keep a replica yet
            h.wait("peer", timeout=2)
        b = cluster.node("127.0.0.3").start()
        cluster.resolve_to(["127.0.0.2", "127.0.0.3"])
        h.wait("peer", timeout=60)
    assert (b.root / ".peer" / JOB / "1" / data_name(0)).exists()
    status = peer_status(a)
    assert status["membership"]["peers"] == [b.listen] and status["membership"]["failing"] == {}
    assert peers_seen(b) == {a.listen}
    assert a.log().count(f"cannot resolve {NAME}") == 1, "a failure streak is logged once"


def test_peers_found_by_name_are_checked_with_tls_against_that_name(dns_cluster):
    # Dialled by the addresses the name resolves to, each peer is still held to the name: its
    # certificate names NAME only (as a headless service's nodes share one name), and it serves
    # callers whose certificates name NAME, the host of [peer] addresses.
    ips = ["127.0.0.2", "127.0.0.3"]
    cluster = dns_cluster(ips, tls=True)
    cluster.resolve_to(ips)
    nodes = [cluster.node(ip).start() for ip in ips]
    save_step(nodes, step=1, world_size=2)  # every replica arrived: over TLS, both ways
    for node, other in zip(nodes, reversed(ips), strict=True):
        peer = json.loads(node.cli("status", "--json").stdout)["tiers"]["peer"]
        assert peer["tls"] is True and peer["membership"]["peers"] == [f"{other}:{cluster.port}"]
        assert sum(p["ranges_sent"]["data_channel"] for p in peer["peers"].values()) == 1

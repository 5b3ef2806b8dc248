"""Every cluster view backend keeps the same contract (ckptd.cluster.view): one suite, run on each.

Real transports only: the built-in view's nodes serve CkptdCluster on loopback ports,
the etcd view's talk to a real etcd server (tests/etcd_server.py). Nodes are views in
one process, as benchmarks/bench_cluster.py hosts them; their disks are not involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.format import CommitRecord
from conftest import free_port

from ckptd.cluster.cluster_link import ClusterLinks
from ckptd.cluster.etcd_view import EtcdView
from ckptd.cluster.peer_membership import ResolvedPeers
from ckptd.cluster.peers_view import PeersView
from ckptd.cluster.placement import Holding
from ckptd.cluster.view import ClusterView, coordinator_of
from ckptd.config import load_config
from ckptd.rpc.cluster_server import serve_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
JOB = "train"
THREADS = ThreadPoolExecutor(4)  # every built-in view's DNS lookups and records here (Executors.resolve, records)


def holding(node: str, step: int, rank: int, world: int = 8, tier: str = "nvme", digest: str = "") -> Holding:
    return Holding(node, tier, JOB, step, rank, world, 1000 + rank, digest or f"{rank:032x}", "run-1")


class Node:
    """One node's view, the commits it handed on, and (built-in view) its server."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.learned: list[CommitRecord] = []
        self.server = None
        self.tasks: list[asyncio.Task] = []

        async def on_commit(record: CommitRecord) -> None:
            self.learned.append(record)

        view.watch(on_commit)

    async def start(self) -> None:
        await self.view.membership.refresh()
        await self.view.start()
        self.tasks = [
            asyncio.create_task(self.view.run_forever()),
            asyncio.create_task(self.view.membership.run_forever()),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.stop(0)
        await self.view.close()
        self.view.membership.close()


class Cluster:
    """Build n nodes of one backend; each test gets a fresh cluster (and, for etcd, a fresh server)."""

    def __init__(self, backend: str, etcd_endpoint: str = "") -> None:
        self.backend = backend
        self.etcd_endpoint = etcd_endpoint
        self.addresses: list[str] = []
        self.nodes: list[Node] = []

    def _config(self, address: str):
        env = {"CKPTD_NODE__LISTEN": f'"{address}"', "CKPTD_PEER__INSECURE": "true"}
        env["CKPTD_PEER__ADDRESSES"] = "[" + ", ".join(f'"{a}"' for a in self.addresses) + "]"
        if self.backend == "etcd":
            env |= {"CKPTD_CLUSTER__BACKEND": '"etcd"', "CKPTD_CLUSTER__ENDPOINTS": f'["{self.etcd_endpoint}"]'}
            env["CKPTD_CLUSTER__LEASE_TTL_S"] = "3"
        return load_config(env=env)

    async def start(self, n: int) -> list[Node]:
        """Start n nodes: every node's server first, then the views (as daemons that start together)."""
        self.addresses = [f"127.0.0.1:{free_port()}" for _ in range(n)]
        nodes = [await self._node(a) for a in self.addresses]
        for node in nodes:
            await node.start()
            self.nodes.append(node)
        return self.nodes

    async def add(self) -> Node:
        """Start one more node (the others' membership does not list it: it finds them, they learn of it)."""
        self.addresses.append(f"127.0.0.1:{free_port()}")
        node = await self._node(self.addresses[-1])
        await node.start()
        self.nodes.append(node)
        return node

    async def _node(self, address: str) -> Node:
        config = self._config(address)
        if self.backend == "etcd":
            node = Node(EtcdView(config, kept_records=8))
        else:
            membership = ResolvedPeers(config, THREADS)
            links = ClusterLinks(config.peer)
            view = PeersView(address, membership, links, 8, anti_entropy_s=1, record_threads=THREADS, resend_s=0.5)
            node = Node(view)
            node.server, _ = await serve_cluster(view, address, config.peer, THREADS)
        return node

    async def close(self) -> None:
        for node in self.nodes:
            with contextlib.suppress(Exception):
                await node.stop()


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait for the views' background work to make a condition true, up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(0.05)


@pytest.fixture(params=["peers", "etcd"])
def run(request, tmp_path):
    """Run a test body against a fresh cluster of the backend: run(body) with body(cluster) a coroutine."""

    def go(body):
        async def main(endpoint: str) -> None:
            cluster = Cluster(request.param, endpoint)
            try:
                await body(cluster)
            finally:
                await cluster.close()

        if request.param == "etcd":
            etcd = request.getfixturevalue("etcd_server")
            asyncio.run(main(etcd.endpoint))
        else:
            asyncio.run(main(""))

    return go


def report_ranks(nodes: list[Node], step: int, world: int = 8, skip: tuple[int, ...] = ()) -> None:
    """Have the nodes report the ranks of a step between them, round robin, each its own ranks at once."""
    for i, node in enumerate(nodes):
        mine = [holding(node.view.node, step, r, world) for r in range(world) if r % len(nodes) == i and r not in skip]
        node.view.report(JOB, step, mine)


def test_a_step_reported_whole_is_committed_on_every_node(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(4)
        report_ranks(nodes, 10)
        await until(lambda: all(n.view.newest_complete(JOB) == 10 for n in nodes), "the commit on every node")
        records = {n.learned[0] for n in nodes}
        assert len(records) == 1, "every node learned the same record"
        record = records.pop()
        assert (record.job, record.step, record.world_size) == (JOB, 10, 8)
        assert record.shard_meta_xxh3_128 == tuple(f"{r:032x}" for r in range(8))
        assert record.size_bytes == sum(1000 + r for r in range(8))
        assert all(len(n.learned) == 1 for n in nodes), "each node hands a commit on once"
        assert all(n.view.commit_record(JOB, 10) == record for n in nodes)
        assert not await nodes[0].view.learned(record), "a known commit is no news"
        assert await nodes[0].view.learned(record, again=True), "handed on again when asked (a reader's catch-up)"
        assert nodes[0].learned == [record, record]

    run(body)


def test_a_step_missing_a_rank_or_with_two_records_of_one_is_never_committed(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(3)
        report_ranks(nodes, 1, skip=(5,))  # rank 5 is held nowhere
        nodes[0].view.report(JOB, 2, [holding(nodes[0].view.node, 2, r) for r in range(4)])
        second = [holding(nodes[1].view.node, 2, r) for r in range(4, 8)]
        nodes[1].view.report(JOB, 2, [*second, holding(nodes[1].view.node, 2, 3, digest="f" * 32)])  # another rank 3
        report_ranks(nodes, 3)  # reported after the others: once it is committed, they were all seen
        await until(lambda: all(n.view.newest_complete(JOB) == 3 for n in nodes), "step 3's commit")
        for n in nodes:
            assert n.view.commit_record(JOB, 1) is None
            assert n.view.commit_record(JOB, 2) is None
            assert [r.step for r in n.learned] == [3]

    run(body)


def test_holders_names_every_live_node_holding_a_rank(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(3)
        a, b, c = (n.view.node for n in nodes)
        nodes[0].view.report(JOB, 4, [holding(a, 4, r) for r in range(4)])
        nodes[1].view.report(JOB, 4, [holding(b, 4, r) for r in range(4, 8)] + [holding(b, 4, 0, tier="peer")])
        nodes[2].view.report(JOB, 4, [holding(c, 4, 0, tier="peer")])
        await until(lambda: all(n.view.newest_complete(JOB) == 4 for n in nodes), "the commit")
        want = sorted([(a, "nvme"), (b, "peer"), (c, "peer")])
        deadline = time.monotonic() + 20  # a report may still be on its way when the commit is known
        while sorted((h.node, h.tier) for h in await nodes[0].view.holders(JOB, 4, 0)) != want:
            assert time.monotonic() < deadline, "every report of rank 0 did not reach the view within 20 s"
            await asyncio.sleep(0.05)
        for n in nodes:
            found = await n.view.holders(JOB, 4, 0)
            assert sorted((h.node, h.tier) for h in found) == want
            assert {h.node for h in await n.view.holders(JOB, 4, 7)} == {b}

    run(body)


def test_every_node_knows_the_others(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(3)
        for n in nodes:
            others = {m.view.node for m in nodes} - {n.view.node}
            await until(lambda n=n, others=others: n.view.membership.peers() >= others, "membership")
            assert n.view.node not in n.view.membership.peers()
            assert n.view.status()["backend"] == cluster.backend

    run(body)


def test_a_coordinator_that_dies_is_replaced_without_losing_the_commit(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(4)
        name = coordinator_of(JOB, [n.view.node for n in nodes])
        (coordinator,) = [n for n in nodes if n.view.node == name]
        first, second, last = [n for n in nodes if n is not coordinator]
        first.view.report(JOB, 7, [holding(first.view.node, 7, r) for r in (0, 1)])
        second.view.report(JOB, 7, [holding(second.view.node, 7, r) for r in (2, 3)])
        taken = coordinator.view.collector  # both backends collect in one
        await until(lambda: len(taken.reported(JOB, 7)) == 2, "the coordinator taking the first reports")
        await coordinator.stop()  # it dies with the reports it took
        cluster.nodes.remove(coordinator)
        # Its own ranks live on as replicas on the last node, which holds the rest too.
        last.view.report(JOB, 7, [holding(last.view.node, 7, r, tier="peer") for r in range(4, 8)])
        survivors = (first, second, last)
        await until(lambda: all(n.view.newest_complete(JOB) == 7 for n in survivors), "the commit", 30)
        assert len({n.view.commit_record(JOB, 7) for n in survivors}) == 1

    run(body)


def test_a_node_that_joins_late_learns_the_commits_there_are(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(3)
        for step in (1, 2):
            report_ranks(nodes, step)
            await until(lambda s=step: all(n.view.newest_complete(JOB) == s for n in nodes), f"step {step}")
        late = await cluster.add()
        await until(lambda: late.view.newest_complete(JOB) == 2, "the late node's catch-up", 30)
        assert late.view.commit_record(JOB, 2) == nodes[0].view.commit_record(JOB, 2)

    run(body)


def test_a_commit_sealed_by_one_node_alone_reaches_the_others(run):
    async def body(cluster: Cluster) -> None:
        nodes = await cluster.start(3)
        record = CommitRecord(JOB, 9, 2, ("a" * 32, "b" * 32), 10)
        nodes[1].view.announce(record)
        await until(lambda: all(n.view.commit_record(JOB, 9) == record for n in nodes), "the announced commit")
        assert nodes[1].learned == [], "the node that sealed it adopted it already: not handed on again"
        assert all(n.learned == [record] for n in (nodes[0], nodes[2]))

    run(body)

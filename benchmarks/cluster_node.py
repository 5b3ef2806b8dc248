"""One worker process of bench_cluster.py: many simulated nodes' cluster views on one event loop.

The parent sends commands over a multiprocessing pipe, one at a time, and reads one
answer to each: ("bind", n) -> addresses; ("start", settings) -> "started";
("members",) -> the fewest peers any node here sees; ("step", job, step) -> the step's
measurements; ("stop",) -> None. A node is the real view (PeersView with its own
CkptdCluster server on a loopback port, or EtcdView with its own etcd connection) and
the real membership; only the disks are left out: a node reports 8 ranks as durable.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections import Counter
from typing import Any

from ckpt_core.format import CommitRecord

from ckptd.cluster.cluster_link import ClusterLinks
from ckptd.cluster.etcd_view import EtcdView
from ckptd.cluster.peer_membership import ResolvedPeers
from ckptd.cluster.peers_view import PeersView
from ckptd.cluster.placement import Holding
from ckptd.cluster.view import ClusterView
from ckptd.config import load_config
from ckptd.node import Executors
from ckptd.rpc.cluster_server import serve_cluster

THREADS = Executors.build()  # the daemon's pools, shared by this process's nodes (only resolve and records start)


class Later:
    """Stands for a node's view in its server until the view exists (the port comes first)."""

    def __init__(self) -> None:
        self.view: Any = None
        self.counters: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.view, name)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def counters_of(view: ClusterView) -> Counter[str]:
    counters = view.counters if isinstance(view, PeersView) else view.client.counters  # type: ignore[attr-defined]
    return Counter(counters)


class Worker:
    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.addresses: list[str] = []
        self.proxies: list[Later] = []
        self.servers: list[Any] = []
        self.views: list[ClusterView] = []
        self.learned: dict[tuple[str, int], list[float]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    async def bind(self, n: int, backend: str) -> list[str]:
        """Give this process's n nodes their addresses (peers: bind their servers) and return them."""
        if backend == "etcd":  # a node's name only: etcd nodes take no calls from each other
            self.addresses = [f"127.0.0.{1 + os.getpid() % 200}:{10000 + i}" for i in range(n)]
            return self.addresses
        for _ in range(n):
            proxy = Later()
            peer = load_config(env={}).peer
            server, port = await serve_cluster(proxy, "127.0.0.1:0", peer, THREADS.records)  # type: ignore[arg-type]
            self.proxies.append(proxy)
            self.servers.append(server)
            self.addresses.append(f"127.0.0.1:{port}")
        return self.addresses

    async def start(self, settings: dict[str, Any]) -> str:
        everyone = settings["addresses"]
        self.ranks = settings["ranks"]
        self.world = self.ranks * len(everyone)
        self.first_ranks = [everyone.index(a) * self.ranks for a in self.addresses]
        for i, address in enumerate(self.addresses):
            env = {
                "CKPTD_NODE__LISTEN": f'"{address}"',
                "CKPTD_PEER__INSECURE": "true",
                "CKPTD_PEER__RESOLVE_INTERVAL_S": "0",
                "CKPTD_CLUSTER__ANTI_ENTROPY_S": str(settings["anti_entropy_s"]),
            }
            if settings["backend"] == "etcd":
                env |= {"CKPTD_CLUSTER__BACKEND": '"etcd"', "CKPTD_CLUSTER__ENDPOINTS": f'["{settings["etcd"]}"]'}
                view: ClusterView = EtcdView(load_config(env=env), kept_records=8)
            else:
                env["CKPTD_PEER__ADDRESSES"] = "[" + ", ".join(f'"{a}"' for a in everyone) + "]"
                config = load_config(env=env)
                links = ClusterLinks(config.peer)
                membership = ResolvedPeers(config, THREADS.resolve)
                view = PeersView(address, membership, links, 8, config.cluster.anti_entropy_s, THREADS.records)
                self.proxies[i].view = view
                self.proxies[i].counters = view.counters
            view.watch(self._on_commit(view))
            self.views.append(view)
        for view in self.views:
            await view.membership.refresh()
            await view.start()
            self.tasks += [
                asyncio.create_task(view.run_forever()),
                asyncio.create_task(view.membership.run_forever()),
            ]
        return "started"

    def _on_commit(self, view: ClusterView) -> Any:
        async def on_commit(record: CommitRecord) -> None:
            self.learned.setdefault((record.job, record.step), []).append(time.monotonic())

        return on_commit

    async def step(self, job: str, step: int, timeout_s: float) -> dict[str, Any]:
        """Report every node's ranks of a step as durable at once; wait until every node here learned the commit."""
        before = [counters_of(v) for v in self.views]
        cpu_before = cpu_s()
        reported_at = time.monotonic()
        for view, first in zip(self.views, self.first_ranks, strict=True):
            ranks = range(first, first + self.ranks)
            view.report(
                job,
                step,
                [Holding(view.node, "nvme", job, step, r, self.world, 1 << 20, f"{r:032x}", "run") for r in ranks],
            )
        deadline = time.monotonic() + timeout_s
        while len(self.learned.get((job, step), [])) < len(self.views) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # polls the views' progress; the step's work runs meanwhile
        times = self.learned.get((job, step), [])
        after = [counters_of(v) for v in self.views]
        return {
            "reported_at": reported_at,
            "learned": len(times),
            "last_learned": max(times, default=float("nan")),
            "cpu_s": cpu_s() - cpu_before,
            "per_node": [dict(a - b) for a, b in zip(after, before, strict=True)],
        }

    async def hop(self, address: str, samples: int, world: int) -> list[float]:
        """Time round trips from this process's first node carrying a commit record of `world` ranks.

        The built-in view: one Announce to another node (it parses and adopts the record); etcd:
        one put of the record (what a coordinator's commit costs before etcd's watchers get it).
        """
        view = self.views[0]
        rtts = []
        for i in range(samples):
            raw = CommitRecord("hop-probe", i, world, tuple(f"{r:032x}" for r in range(world)), world).to_bytes()
            started = time.monotonic()
            if isinstance(view, PeersView):
                await view.links.announce(address, raw, [])
            else:
                await view.client.put(b"/ckptd-bench/hop", raw)  # type: ignore[attr-defined]
            rtts.append(time.monotonic() - started)
        return rtts

    async def members(self) -> int:
        return min(len(v.membership.peers()) for v in self.views)

    async def periodic(self, seconds: float) -> list[dict[str, int]]:
        """Count what the nodes send and receive while no step is saved: heartbeats, membership, anti-entropy."""
        before = [counters_of(v) for v in self.views]
        await asyncio.sleep(seconds)  # the window measured
        return [dict(counters_of(v) - b) for v, b in zip(self.views, before, strict=True)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for view in self.views:
            await view.close()
            view.membership.close()
        for server in self.servers:
            await server.stop(0)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            command, *args = await loop.run_in_executor(None, self.conn.recv)
            if command == "stop":
                await self.stop()
                self.conn.send(None)
                return
            self.conn.send(await getattr(self, command)(*args))


def run_worker(conn: Any) -> None:
    """The worker process's entry point (multiprocessing, spawn)."""
    asyncio.run(Worker(conn).serve())

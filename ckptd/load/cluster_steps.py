"""What the cluster holds, for loads: its complete steps, and a shard this node lacks fetched from the peers.

The Locator and ShardedReads call it on the event loop (load path: locate, then fetch);
blocking work runs on the peer threads, whole shards on the fetch threads. A step is
complete in the cluster when the inventories of every peer and this node's holdings
cover every rank (cluster.placement.loadable_steps), or when the cluster view knows its
commit. Nothing here writes but fetch(), through the NVMe tier's one write path.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckpt_core.errors import CheckpointError
from ckpt_core.format import CommitRecord

from ckptd.cluster.peer_inventory import PeerInventory
from ckptd.cluster.placement import StepHoldings, loadable_steps
from ckptd.cluster.view import ClusterView
from ckptd.keyed import KeyCounts, KeyedLocks
from ckptd.load.fetch import fetch_shard
from ckptd.tiers.base import DurableTier, Tier, has_committed_shard
from ckptd.tiers.catalog import StepInfo

log = logging.getLogger(__name__)


class ClusterSteps:
    """List the steps complete across the cluster, and fetch a rank's shard of one from the peers."""

    def __init__(
        self,
        view: ClusterView | None,
        peers: PeerInventory | None,
        peer_tier: Callable[[Collection[str] | None], Tier],
        nvme: DurableTier,
        local_holdings: Callable[[str, int | None], list[StepHoldings]],
        replicas: Callable[[], int],
        threads: ThreadPoolExecutor,
        fetch_threads: ThreadPoolExecutor,
    ) -> None:
        """peers: the links to the peers and what they hold (None: no cluster); peer_tier(among): the peer tier over
        those peers, or only over the addresses among (the holders the view names), to fetch from.
        local_holdings(job, step): what this node holds (Peering's, on a thread); replicas(): copies per shard now.

        threads: the peer threads, for inventories and listings; fetch_threads: whole shards fetched.
        """
        self.view = view
        self.peers = peers
        self._peer_tier = peer_tier
        self.nvme = nvme
        self._local_holdings = local_holdings
        self._replicas = replicas
        self._threads = threads
        self._fetch_threads = fetch_threads
        self._fetch_locks: KeyedLocks[tuple[str, int, int]] = KeyedLocks()  # one fetch of a shard at a time
        self._fetching: KeyCounts[tuple[str, int]] = KeyCounts()  # steps being fetched: retention keeps off

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    def committed(self, job: str) -> list[CommitRecord]:
        """Return the commit records of the job's steps the cluster view knows committed (none without a view)."""
        return self.view.committed(job) if self.view is not None else []

    async def complete_records(self, job: str, newest: bool = False) -> list[CommitRecord]:
        """Return the commit records of the steps of a job that this node's shards and its peers' make whole.

        newest: only the job's head (the newest step of its newest line).
        """
        return [record for record, _ in await self._loadable(job, newest)]

    async def _loadable(self, job: str, newest: bool = False) -> list[tuple[CommitRecord, list[str]]]:
        """Return the steps of a job (or of every job) complete in the cluster, by every peer's inventory and ours.

        newest: only the job's newest, which the view answers alone once it knows a commit of
        the job (at a restart every rank asks, on every node: no peer is asked). A step this
        node holds part of unsealed, whose commit a peer holds, is handed to the view (it may lag
        after an outage) and adopted before this returns: a load finds what a listing showed.
        """
        if self.peers is None or self.view is None:
            return []
        known = self.view.newest_complete(job) if newest and job else None
        record = self.view.commit_record(job, known) if known is not None else None
        if record is not None:
            return [(record, [])]  # committed, on tiers the view does not say
        self.peers.forget()
        local = await self._run(self._local_holdings, job, None)
        loadable = loadable_steps(await self._run(self.peers.inventories, job) + local, self._replicas())
        unsealed = {(s.job, s.step) for s in local if s.shards} - {(s.job, s.step) for s in local if s.record}
        for record, _ in loadable:
            if (record.job, record.step) in unsealed:
                await self.view.learned(record, again=True)  # SavePath.commit_learned: under the seal lock
        return loadable

    async def fetch(self, job: str, step: int, rank: int, replace: bool = False) -> None:
        """Copy a rank's shard of a complete step from the peers onto this node's NVMe, verified.

        replace: over a copy this node holds that failed its checks.
        """
        if self.peers is None:
            return
        async with self._fetch_locks.hold((job, step, rank)):
            if not replace and await self._run(has_committed_shard, self.nvme, job, step, rank):
                return  # another load fetched it meanwhile
            with self._fetching.counting((job, step)):
                # The nodes the cluster view names first: asking every peer is for when they cannot serve.
                named = {h.node for h in await self.view.holders(job, step, rank)} if self.view else set()
                # On threads of their own: whole shards take long, and must not starve the
                # inventories, receives and seals that share the peer threads.
                await asyncio.get_running_loop().run_in_executor(
                    self._fetch_threads, self._fetch, job, step, rank, replace, named
                )

    def _fetch(self, job: str, step: int, rank: int, replace: bool, named: set[str]) -> None:
        assert self.peers is not None
        self.peers.forget()
        meta = None
        if named:
            try:
                meta = fetch_shard(self._peer_tier(named), self.nvme, job, step, rank, replace)
            except CheckpointError as e:
                log.info("rank %d of %s step %d: the holders named (%s) could not serve it (%s); asking every peer",
                         rank, job, step, ", ".join(sorted(named)), e)  # fmt: skip
        if meta is None:
            meta = fetch_shard(self._peer_tier(None), self.nvme, job, step, rank, replace)
        log.info("fetched rank %d shard of %s step %d from the peers (%d bytes, verified)", rank, job, step,
                 meta.data_size_bytes)  # fmt: skip

    async def list_steps(self, local: list[StepInfo], job: str, newest: bool = False) -> list[StepInfo]:
        """Return the cluster's view of complete steps: "nvme" and "peer" count every node's copies."""
        if self.peers is None:
            return local
        in_memory = {(i.job, i.step) for i in local if "memory" in i.tiers}
        found = []
        for r, tiers in await self._loadable(job, newest):
            if not job or r.job == job:
                memory = ["memory"] if (r.job, r.step) in in_memory else []
                found.append(StepInfo.of(r, (*memory, *tiers)))
        return found

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps being fetched: retention keeps off them (BusySteps)."""
        return set(self._fetching.keys())

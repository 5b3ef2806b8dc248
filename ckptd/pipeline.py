"""Order the node's roles for each RPC: what the servicers call, and in which order the roles answer.

One Pipeline per daemon, on the event loop. The daemon awaits start() before serving,
then the servicers call the methods below as RPCs arrive, and drain() on shutdown.
The roles live in their own modules, in save order:

    staging.py (SlotPool)  ->  flush.py (Flusher)  ->  progress.py (ShardProgress)
    -> replication.py / receiving.py / peering.py  ->  uploading.py (Uploader)
    locate.py (Locator): loads;  retention.py (RetentionRunner);  status.py (StatusReport)
    lifecycle.py (Lifecycle): wiring, start-up recovery, reconciliation, drain
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt.errors import CheckpointError, InvalidArgument
from ckpt.format import CommitRecord, ShardMeta
from ckpt.shard_io import ShardSource

from ckptd.cluster.placement import StepHoldings
from ckptd.config import Config
from ckptd.node import Lifecycle
from ckptd.operations.retention import RETAINED_TIERS, Removal
from ckptd.replication.receiving import ReplicaReceiver
from ckptd.save.progress import ShardWait
from ckptd.save.staging import ShardKey, Slot, Snapshot
from ckptd.tiers.catalog import StepInfo

log = logging.getLogger(__name__)


class Pipeline:
    """Answer the servicers' calls by ordering the roles of one node."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.node = Lifecycle(config)
        self.receiver: ReplicaReceiver = self.node.receiver
        self.serve_io: ThreadPoolExecutor = self.node.serve_threads
        self.instance = self.node.peering.instance  # this daemon's run, to refuse calls from itself

    async def start(self) -> None:
        """Recover what an earlier run left; before any RPC is served."""
        await self.node.start()

    async def drain(self) -> None:
        """Finish the work under way; after the servers stopped."""
        await self.node.drain()

    # -- the save path: Reserve, Commit, WaitShard ---------------------------------------

    async def reserve(self, key: ShardKey, size_bytes: int) -> tuple[Slot | None, float, str]:
        """Find staging room for a shard."""
        return await self.node.flusher.reserve(key, size_bytes)

    async def prepare(self, key: ShardKey, size_bytes: int) -> list[Slot]:
        """Allocate a rank's slots ahead of its first save; return its free slots (see SlotPool.prepare)."""
        return await self.node.pool.prepare(key.job, key.rank, size_bytes)

    def spare(self, job: str, rank: int) -> Slot | None:
        """Return the slot the rank's next save will get, if one is allocated."""
        return self.node.pool.spare(job, rank)

    async def commit(self, snapshot: Snapshot) -> None:
        """Take over a filled slot; its flush, seal, replicas and upload follow."""
        await self.node.flusher.commit(snapshot)

    async def wait_shard(self, key: ShardKey, tier: str, timeout_s: float) -> ShardWait:
        """Return whether a shard reached a tier, or why it cannot, waiting up to timeout_s."""
        return await self.node.progress.wait(key, tier, timeout_s, self.node.locator.object_step)

    # -- loads and listings ------------------------------------------------------------------

    async def locate(
        self, job: str, step: int | None, rank: int, tier: str = "auto", refetch: bool = False
    ) -> tuple[int, int, list[ShardSource]]:
        """Return (step, world_size, sources fastest first) for a rank's shard of a complete step."""
        return await self.node.locator.locate(job, step, rank, tier, refetch)

    async def locate_step(
        self, job: str, step: int | None, tier: str = "auto"
    ) -> tuple[CommitRecord, bytes, list[list[ShardSource]]]:
        """Return (commit record, sealed index, this node's sources by rank) of a complete step: sharded loads."""
        return await self.node.sharded_reads.locate_step(job, step, tier)

    def read_shard(self, job: str, step: int, rank: int, ranges: list[tuple[int, int]]) -> AsyncIterator[bytes]:
        """Yield a rank's shard record, then ranges of its bytes from the peers or the store (see ShardedReads)."""
        return self.node.sharded_reads.read_shard(job, step, rank, ranges)

    async def list_steps(self, job: str = "", newest: bool = False) -> list[StepInfo]:
        """Return every complete step on any tier, as the cluster sees it (newest: only a job's newest)."""
        return await self.node.locator.list_steps(job, newest)

    async def status(self) -> dict[str, Any]:
        """Return the status document of `ckptd status --json`."""
        return await self.node.report.document()

    async def metrics_page(self) -> str:
        """Return the /metrics page."""
        return await self.node.report.metrics_page()

    async def collect(self, dry_run: bool, job: str = "") -> list[Removal]:
        """Apply retention on every tier (`ckptd gc`), or report what it would remove."""
        return await self.node.retention.collect(dry_run=dry_run, job=job, tiers=RETAINED_TIERS)

    async def remove_job(self, job: str, dry_run: bool, object_too: bool) -> list[Removal]:
        """Remove a finished job from this node (`ckptd gc --job J --all`): its slots, then its steps."""
        receiving = sorted({step for j, step in self.receiver.busy_steps() if j == job})
        if receiving:  # its files would go under the writes, and the sender's seal would find nothing
            raise InvalidArgument(f"job {job} is still receiving replicas of steps {receiving} on this node: wait")
        slots = await self.node.idle_release.remove(job, dry_run)  # refuses a job still saving
        removals = [Removal("memory", job, s.shard.step, f"rank {s.rank}'s staging slot") for s in slots if s.shard]
        tiers = ("nvme", "peer", "object") if object_too else ("nvme", "peer")
        removals += await self.node.retention.remove_job(job, dry_run, tiers)
        if not dry_run:  # `status` and /metrics stop reporting its newest steps there, nor the cluster view
            self.node.progress.newest.forget(job, ("memory", *tiers))
            if self.node.view is not None:
                await self.node.view.forget_job(job)
        return removals

    # -- the peers' calls ----------------------------------------------------------------------

    async def holdings(self, job: str, step: int | None) -> list[StepHoldings]:
        """Return what this node holds, for a peer's Inventory."""
        peering = self.node.peering
        peering.inventories_answered += 1
        return list(await self._on_peer_threads(peering.local_holdings, job, step))

    async def adopt_commit(self, record: CommitRecord) -> None:
        """Seal a step that a peer found complete, where this node holds part of it (CommitStep)."""
        await self.node.adopt_commit(record)

    async def replica_arrived(self, meta: ShardMeta) -> None:
        """Seal the step of a replica that just became durable here, if it was the last rank missing.

        Before the sender hears that its replica is in: once every rank has waited for
        "peer", losing any one node can no longer lose the step.
        """
        self.node.report.replica_bytes_received += meta.data_size_bytes
        try:
            record = await self.node.flusher.seal(meta.job, meta.step)
        except (CheckpointError, OSError) as e:
            log.warning("sealing %s step %d after a replica arrived failed: %s", meta.job, meta.step, e)
            return
        if record is not None:
            log.info("%s step %d is complete across the cluster", meta.job, meta.step)
            await self.node.note_nvme_complete(record)

    async def shard_for_peer(self, job: str, step: int, rank: int, tier: str) -> tuple[ShardMeta, bytes, Path]:
        """Return (record, its bytes, data file) of a shard of a complete step that a peer asks for."""
        return await self.node.locator.shard_for_peer(job, step, rank, tier)

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way in."""
        self.node.verification_failed(tier)

    async def _on_peer_threads(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.node.peer_threads, fn, *args)

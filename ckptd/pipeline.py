"""What the RPC edges call: each RPC answered by the role that owns it, in the order the roles must answer.

One Pipeline per daemon, built by the composition root (node.py) with the roles it
orders; the servicers (rpc/) call it on the event loop as RPCs arrive. A save's calls go
to SavePath (save/save_path.py, where the save is written once, in order), a load's to
the Locator (load/locate.py: locate → fetch → verify → serve) and ShardedReads, the
peers' calls to Peering and SavePath, the operators' to retention, idle release and the
status report.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import InvalidArgument
from ckpt_core.format import CommitRecord, ShardMeta
from ckpt_core.history import Line
from ckpt_core.shard_io import ShardSource
from ckpt_core.shard_key import ShardKey

from ckptd.cluster.placement import StepHoldings
from ckptd.cluster.view import ClusterView
from ckptd.load.locate import Located, Locator
from ckptd.load.sharded_reads import ShardedReads
from ckptd.operations.idle_release import IdleRelease
from ckptd.operations.job_retention import JobRetention
from ckptd.operations.retention import RETAINED_TIERS, Removal, RetentionRunner
from ckptd.operations.status import StatusReport
from ckptd.replication.peering import Peering
from ckptd.replication.receiving import ReplicaReceiver
from ckptd.save.progress import ShardProgress, ShardWait
from ckptd.save.save_path import ReserveAnswer, SavePath
from ckptd.save.staging import SlotPool, Snapshot
from ckptd.tiers.catalog import StepInfo


class Pipeline:
    """Answer the servicers' calls with the roles of one node."""

    def __init__(
        self,
        pool: SlotPool,
        save_path: SavePath,
        progress: ShardProgress,
        locator: Locator,
        sharded_reads: ShardedReads,
        peering: Peering,
        receiver: ReplicaReceiver,
        retention: RetentionRunner,
        job_retention: JobRetention,
        idle_release: IdleRelease,
        report: StatusReport,
        view: ClusterView | None,
        instance: str,
        peer_threads: ThreadPoolExecutor,
    ) -> None:
        """peer_threads: where a peer's Inventory lists this node's holdings."""
        self._pool = pool
        self._save_path = save_path
        self._progress = progress
        self._locator = locator
        self._sharded_reads = sharded_reads
        self._peering = peering
        self._receiver = receiver
        self._retention = retention
        self._job_retention = job_retention
        self._idle_release = idle_release
        self._report = report
        self._view = view
        self._peer_threads = peer_threads
        self.instance = instance  # this daemon's run, to refuse calls from itself

    # -- the save path: Reserve, Commit, WaitShard ---------------------------------------

    async def reserve(
        self,
        key: ShardKey,
        size_bytes: int,
        asked: Line | None,
        after: int,
        retention: tuple[int | None, int | None] | None,
        prepare: bool,
    ) -> ReserveAnswer:
        """Answer a rank's Reserve (see SavePath.reserve_for)."""
        return await self._save_path.reserve_for(key, size_bytes, asked, after, retention, prepare)

    async def commit(self, snapshot: Snapshot) -> None:
        """Take over a filled slot; its flush, seal, replicas and upload follow (SavePath)."""
        await self._save_path.commit(snapshot)

    async def wait_shard(self, key: ShardKey, tier: str, timeout_s: float) -> ShardWait:
        """Return whether a shard reached a tier, or why it cannot, waiting up to timeout_s."""
        return await self._save_path.wait_shard(key, tier, timeout_s, self._locator.object_step)

    # -- loads and listings ------------------------------------------------------------------

    async def locate(self, job: str, step: int | None, rank: int, tier: str = "auto", refetch: bool = False) -> Located:
        """Return where a rank's shard of a complete step lies, fastest first (step None: the job's head)."""
        return await self._locator.locate(job, step, rank, tier, refetch)

    async def locate_step(
        self, job: str, step: int | None, tier: str = "auto"
    ) -> tuple[CommitRecord, bytes, list[list[ShardSource]], Line]:
        """Return (commit record, sealed index, this node's sources by rank, the line a save after the load
        continues) of a complete step: sharded loads."""
        return await self._sharded_reads.locate_step(job, step, tier)

    def read_shard(self, job: str, step: int, rank: int, ranges: list[ByteRange]) -> AsyncIterator[bytes]:
        """Yield a rank's shard record, then ranges of its bytes from the peers or the store (see ShardedReads)."""
        return self._sharded_reads.read_shard(job, step, rank, ranges)

    async def list_steps(self, job: str = "", newest: bool = False) -> list[StepInfo]:
        """Return every complete step on any tier, as the cluster sees it (newest: only a job's head), pins marked."""
        steps = await self._locator.list_steps(job, newest)
        return [dataclasses.replace(s, pinned=s.step in self._job_retention.pinned(s.job)) for s in steps]

    # -- operations -------------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Return the status document of `ckptd status --json`."""
        return await self._report.document()

    async def metrics_page(self) -> str:
        """Return the /metrics page."""
        return await self._report.metrics_page()

    async def collect(self, dry_run: bool, job: str = "") -> list[Removal]:
        """Apply retention on every tier (`ckptd gc`), or report what it would remove."""
        return await self._retention.collect(dry_run=dry_run, job=job, tiers=RETAINED_TIERS)

    async def remove_step(self, job: str, step: int, force: bool, dry_run: bool) -> list[Removal]:
        """Remove one step from every tier of this node (`ckptd rm`): its durable copies, then its settled slots."""
        removals = await self._retention.remove_step(job, step, force, dry_run)  # refuses, or raises NotFound
        slots = self._pool.drop_step(job, step, dry_run)  # no await between: nothing took them meanwhile
        removals += [Removal("memory", job, step, f"rank {s.rank}'s staging slot") for s in slots]
        if slots and not dry_run:
            await self._pool.changed()
        return removals

    async def pin(self, job: str, step: int, pinned: bool) -> list[int]:
        """Pin a step complete on this node (never removed by retention) or unpin it; return the job's pins."""
        return await self._retention.pin(job, step, pinned)

    async def remove_job(self, job: str, dry_run: bool, object_too: bool) -> list[Removal]:
        """Remove a finished job from this node (`ckptd gc --job J --all`): its slots, then its steps."""
        receiving = sorted({step for j, step in self._receiver.busy_steps() if j == job})
        if receiving:  # its files would go under the writes, and the sender's seal would find nothing
            raise InvalidArgument(f"job {job} is still receiving replicas of steps {receiving} on this node: wait")
        slots = await self._idle_release.remove(job, dry_run)  # refuses a job still saving
        removals = [Removal("memory", job, s.shard.step, f"rank {s.rank}'s staging slot") for s in slots if s.shard]
        tiers = ("nvme", "peer", "object") if object_too else ("nvme", "peer")
        removals += await self._retention.remove_job(job, dry_run, tiers)
        if not dry_run:  # `status` and /metrics stop reporting its newest steps there, nor the cluster view
            self._progress.forget_job(job, ("memory", *tiers))
            await self._job_retention.forget(job)  # its pins and its client's settings
            if self._view is not None:
                await self._view.forget_job(job)
        return removals

    # -- the peers' calls ----------------------------------------------------------------------

    async def holdings(self, job: str, step: int | None) -> list[StepHoldings]:
        """Return what this node holds, for a peer's Inventory."""
        self._report.inventory_answered()
        return list(await self._on_peer_threads(self._peering.local_holdings, job, step))

    async def adopt_commit(self, record: CommitRecord) -> None:
        """Seal a step that a peer found complete, where this node holds part of it (CommitStep)."""
        await self._save_path.adopt_commit(record)

    async def replica_arrived(self, meta: ShardMeta, record: CommitRecord | None) -> None:
        """Count a replica that just became durable here, adopt the commit record its sender gave, and seal its step
        if it was the last rank missing."""
        await self._save_path.replica_arrived(meta, record)  # a record not adopted: the sender hears it, uncounted
        self._report.replica_received(meta.data_size_bytes)

    async def shard_for_peer(self, job: str, step: int, rank: int, tier: str) -> tuple[ShardMeta, bytes, Path]:
        """Return (record, its bytes, data file) of a shard of a complete step that a peer asks for."""
        return await self._locator.shard_for_peer(job, step, rank, tier)

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way in."""
        self._report.verification_failed(tier)

    async def _on_peer_threads(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._peer_threads, fn, *args)

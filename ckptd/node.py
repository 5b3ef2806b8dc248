"""Wire one node's roles together, recover what an earlier run left, keep up with the peers, and drain.

The daemon builds one Lifecycle (the constructor wires every role), awaits start()
before serving any RPC, and awaits drain() after the servers stopped. Everything
runs on the event loop; the roles put their byte work on their own threads.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from concurrent.futures import ThreadPoolExecutor

from ckpt.errors import CheckpointError
from ckpt.format import CommitRecord

from ckptd.cluster.backends import open_view
from ckptd.config import Config
from ckptd.load.locate import Locator
from ckptd.load.sharded_reads import ShardedReads
from ckptd.operations import root_identity
from ckptd.operations.idle_release import IdleRelease
from ckptd.operations.retention import BusySteps, RetentionRunner
from ckptd.operations.status import StatusReport
from ckptd.replication.peering import Peering
from ckptd.replication.receiving import ReplicaReceiver
from ckptd.save.flush import Flusher
from ckptd.save.progress import ShardProgress
from ckptd.save.staging import ShardKey, SlotPool
from ckptd.save.uploading import Uploader
from ckptd.storage.object_store import open_store
from ckptd.tiers.base import DurableTier, Tier
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object.tier import ObjectTier

log = logging.getLogger(__name__)

PEER_THREADS = 8
RECONCILE_S = 2.0  # how often a node catches up with its peers
LOCAL_TIERS = ("nvme", "peer")


class Lifecycle:
    """Own the roles of one node, from start-up recovery to drain."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = SlotPool(
            config.staging_dir, config.staging.budget_bytes, config.staging.policy, config.nvme.flush_every
        )
        self.memory = MemoryTier(self.pool.copies)  # read on worker threads
        self.nvme = LocalDirTier(config.root)
        self.replica_store = LocalDirTier(config.replica_root, name="peer")  # replicas other nodes sent here
        self.tiers: list[Tier] = [self.memory, self.nvme, self.replica_store]  # fastest first: loads try them so
        self.durable_tiers: list[DurableTier] = [self.nvme, self.replica_store]
        self.peer_threads = ThreadPoolExecutor(max_workers=PEER_THREADS, thread_name_prefix="peer")
        # Serving shards to peers reads whole files: on threads of their own, never in the way of seals.
        self.serve_threads = ThreadPoolExecutor(max_workers=PEER_THREADS, thread_name_prefix="serve")
        self.receiver = ReplicaReceiver(self.replica_store, self.peer_threads)
        self.view = open_view(config)  # the cluster view ([cluster] backend); None: no peers, every step sealed here
        if self.view is not None:
            self.view.watch(self.commit_learned)
        self.peering = Peering(
            config, self.view, self.nvme, self.replica_store, self.peer_threads, self._replication_changed
        )
        self.object_tier: ObjectTier | None = None
        self.uploader: Uploader | None = None
        if config.object.url:
            self.object_tier = ObjectTier(
                open_store(config.object.url, config.object.storage_options), compression=config.object.compression
            )
            self.uploader = Uploader(config, self.nvme, self.object_tier, self._upload_changed)
        self.progress = ShardProgress(self.pool, self.nvme, self.peering, self.uploader)
        self.flusher = Flusher(self.pool, self.nvme, self.durable_tiers, self.peering, self.uploader, self.progress)
        self.locator = Locator(config, self.tiers, self.nvme, self.peering, self.object_tier, self.verification_failed)
        self.sharded_reads = ShardedReads(self.locator)
        holders: list[BusySteps] = [self.flusher, self.progress, self.locator, self.receiver, self.peering]
        if self.uploader is not None:
            holders.append(self.uploader)
        self.retention = RetentionRunner(
            config,
            self.durable_tiers,
            self.object_tier,
            self.peering,
            holders,
            self.locator.on_object_threads,
            self.uploader,
        )
        self.flusher.retention = lambda job: self.retention.collect(dry_run=False, job=job, tiers=LOCAL_TIERS)
        self.idle_release = IdleRelease(self.pool, self.nvme, config.staging.idle_ttl_s, self.retention.cleanup_thread)
        self.report = StatusReport(
            config, self.pool, self.memory, self.nvme,
            self.flusher, self.progress, self.peering, self.uploader, self.retention,
        )  # fmt: skip
        self._background: list[asyncio.Task[None]] = []
        self.root_id = ""  # the NVMe root's identity, read at start()

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way (see StatusReport)."""
        self.report.verification_failed(tier)

    async def start(self) -> None:
        """Clean up after an interrupted run, resume the flushes it left, and start catching up with peers."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.peer_threads, self._prepare_disk)
        if self.view is not None:
            # The peers first, so that the flushes resumed replicate to them; then the commits the cluster knows.
            await self.view.membership.refresh()
            self._background.append(loop.create_task(self.view.membership.run_forever()))
            self.view.seeded(await loop.run_in_executor(self.peer_threads, self._commits_on_disk))
            await self.view.start()
            self._background.append(loop.create_task(self.view.run_forever()))
        await self.flusher.resume()
        for job in await loop.run_in_executor(self.peer_threads, self.nvme.jobs):
            await self.retention.collect_quietly(job, LOCAL_TIERS, keep_newest=False)
        await loop.run_in_executor(self.peer_threads, self.report.seed)
        if self.uploader is not None:
            self.uploader.start()
        self._background.append(loop.create_task(self.report.probe_loop()))
        self._background.append(loop.create_task(self.idle_release.run_forever()))
        if self.peering.peer_tier is not None:
            self._background.append(loop.create_task(self._reconcile_forever()))

    def _prepare_disk(self) -> None:
        self.config.root.mkdir(parents=True, exist_ok=True)
        self.config.replica_root.mkdir(exist_ok=True)
        self.root_id = root_identity.claim(self.config.root, self.config.staging_dir)
        for tier in self.durable_tiers:
            for path in tier.remove_leftovers():
                log.info("removed leftover %s from tier %s", path, tier.name)

    def _commits_on_disk(self) -> list[CommitRecord]:
        found = []
        for tier in (self.nvme, self.replica_store):
            for job in tier.jobs():
                found += [r for s in tier.complete_steps(job) if (r := tier.checked_commit(job, s)) is not None]
        return found

    async def commit_learned(self, record: CommitRecord) -> None:
        """The view's on_commit: adopt_commit, its refusals logged (the view goes on following commits)."""
        try:
            await self.adopt_commit(record)
        except (CheckpointError, OSError) as e:
            log.warning("%s step %d: the cluster's commit was not adopted here: %s", record.job, record.step, e)

    async def adopt_commit(self, record: CommitRecord) -> None:
        """Seal a step the cluster found complete, where this node holds part of it (the view, a peer's CommitStep).

        As a seal: under the flusher's commit lock, and not while a shard of the step is still
        flushing (that flush seals the step when it ends, with the record the view now knows).
        Raises StepAlreadyComplete where this node holds the step with another record.
        """
        try:
            async with self.flusher.commit_lock:
                if self.flusher.flushing(record.job, record.step):
                    if self.view is not None:
                        self.view.seeded([record])
                    return
                adopted = await self.peering.adopt_told(record)
            if adopted:
                log.info("%s step %d is complete across the cluster", record.job, record.step)
                await self.note_nvme_complete(record)
        finally:
            await self.progress.changed()

    async def note_nvme_complete(self, record: CommitRecord) -> None:
        """Tell `status` and /metrics that a step sealed here is complete on this node's NVMe, if its shards are."""
        held = await asyncio.get_running_loop().run_in_executor(
            self.peer_threads, self.nvme.checked_commit, record.job, record.step
        )
        if held is not None:
            self.progress.step_completed("nvme", record.job, record.step)

    async def _reconcile_forever(self) -> None:
        full = True  # the first round, at start-up, asks every peer: recovery
        while True:
            try:
                self.receiver.drop_idle()
                await self.peering.reconcile(self.flusher.commit_lock, self.flusher.flushing, full)
                full = False
                await self.retention.collect(dry_run=False, tiers=LOCAL_TIERS)  # adopted commits bring retention
            except (CheckpointError, OSError) as e:
                log.warning("catching up with the peers failed: %s", e)
            except Exception:  # the loop must outlive any one bad round
                log.exception("catching up with the peers failed unexpectedly")
            await asyncio.sleep(RECONCILE_S)  # a period, not a wait for anything

    def _replication_changed(self, key: ShardKey, replicated: bool) -> None:
        if replicated:
            self.progress.reached(key, "peer")  # stays known after the shard is no longer tracked
        self.progress.changed_soon()

    def _upload_changed(self, key: ShardKey, committed: bool) -> None:
        state = self.uploader.state(key) if self.uploader is not None else None
        if state is not None and state.committed:  # its step's commit record is in the store
            self.progress.step_completed("object", key.job, key.step)
        self.progress.changed_soon()
        if committed:  # a new step in the store: [retention] object may now remove an older one
            self.retention.collect_soon(key.job, ("object",))

    async def watch_root(self) -> None:
        """Return once the NVMe root is gone: removed, or replaced by another (daemon.serve awaits it)."""
        await root_identity.watch(self.config.root, self.root_id)

    async def give_back_staging(self) -> int:
        """Drop every slot and remove the staging directory, whose root is gone; return the bytes freed."""
        for job in {s.job for s in self.pool.slots()}:
            self.pool.drop_job(job)
        _, size = await asyncio.to_thread(root_identity.remove_slots, self.config.staging_dir)
        await asyncio.to_thread(shutil.rmtree, self.config.staging_dir, True)
        return size

    async def drain(self) -> None:
        """Wait for every queued flush and replica under way to finish, then release threads and files."""
        for task in self._background:
            task.cancel()
        await self.flusher.drain()
        await self.peering.drain()
        if self.view is not None:
            await self.view.close()
            self.view.membership.close()
        if self.uploader is not None:
            await self.uploader.drain()
        await self.retention.drain()
        self.receiver.close()
        self.peer_threads.shutdown(wait=True)
        self.serve_threads.shutdown(wait=True)
        self.locator.close()
        for tier in self.durable_tiers:
            tier.close()

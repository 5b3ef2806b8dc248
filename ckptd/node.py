"""The composition root: build every executor and every role of one node, start them in order, drain them.

daemon.serve builds the Executors (its first act: the root's lock is taken on one), then one
Node on them, awaits start() before serving any RPC, hands the RPC edges the roles each calls
(the save path, the load path's Locator and ShardedReads, retention, job removal, the status
report, Peering, the receiver, the cluster view, and the threads they use from node.executors),
and awaits drain() after the servers stopped. Everything here runs on the
event loop. No role builds another role or a thread pool of its own, and none reaches into
another's attributes: each gets here, at construction, what it uses. The threads of the
daemon are the Executors below (the thread map, with who submits what and what may block, is
in docs/INTERNALS.md, and tests/test_layering.py checks it against this record); the offline
tools (`ckptd restore`, `verify`, `inspect`, `export`, `ls` without a daemon) build the same
record, and use the few pools their tiers read with (offline.restore.tool_threads).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

from ckpt_core.errors import CheckpointError
from ckpt_core.format import CommitRecord
from ckpt_core.shard_key import ShardKey

from ckptd.cluster.backends import open_view
from ckptd.cluster.peer_inventory import INVENTORY_THREADS, PeerInventory
from ckptd.cluster.peer_link import STREAMS_PER_SHARD
from ckptd.config import Config, ConfigError
from ckptd.keyed import SharedLocks
from ckptd.load.cluster_steps import ClusterSteps
from ckptd.load.locate import Locator
from ckptd.load.sharded_reads import ShardedReads
from ckptd.operations import root_identity
from ckptd.operations.idle_release import IdleRelease
from ckptd.operations.job_removal import JobRemoval
from ckptd.operations.job_retention import ClientRetention, JobRetention
from ckptd.operations.retention import BusySteps, RetentionRunner, lowest_priority
from ckptd.operations.status import StatusReport
from ckptd.replication.peering import Peering
from ckptd.replication.receiving import MAX_RANGES_IN_FLIGHT, ReplicaReceiver
from ckptd.replication.sending import MAX_SENDERS, Replication
from ckptd.rpc.data_listener import CONNECTION_THREADS
from ckptd.save.flush import Flusher
from ckptd.save.progress import ShardProgress
from ckptd.save.save_path import SavePath
from ckptd.save.staging import SlotPool, default_budget_bytes
from ckptd.save.uploading import UPLOAD_THREADS, Uploader
from ckptd.storage.object_store import open_store, shown_url
from ckptd.storage.owned_dir import DIR_MODE, claim_dir
from ckptd.tiers.base import DurableTier, Listed, StepCatalog, Tier
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier
from ckptd.tiers.object.layout import READ_THREADS
from ckptd.tiers.object.shards import COMMIT_CHECK_THREADS
from ckptd.tiers.object.tier import ObjectTier
from ckptd.tiers.peer import PeerTier
from ckptd.tiers.replica_store import ReplicaStore
from ckptd.tiers.slot_files import Slot

log = logging.getLogger(__name__)

RECONCILE_S = 2.0  # how often a node catches up with its peers
OBJECT_THREADS = 4  # shards fetched from the object store at once (Executors.object), READ_THREADS GETs each
NOT_WAITED_FOR = ("receive", "resolve")  # pools whose threads may block on another machine at drain


@dataclass(frozen=True)
class Executors:
    """Every thread pool of the daemon, by role; daemon.serve builds them once, Node shuts them down last.

    In the order they are shut down: a pool whose threads wait on another's comes before it (flush
    before nvme_writes; every caller of the tiers before the tiers' own fan-outs, the last three).
    """

    save: ThreadPoolExecutor  # Reserve's and Commit's disk work: never queued behind a flush
    flush: ThreadPoolExecutor  # hash a slot and feed it to the NVMe writers, one slot per thread
    nvme_writes: ThreadPoolExecutor  # the NVMe tier's direct-I/O writes of 32 MiB blocks, several at once
    replica_writes: ThreadPoolExecutor  # the replica store's, likewise (fetches onto it, tests of it)
    peer: ThreadPoolExecutor  # short tier work of the peer tier: inventories, seals, receiver writes, lookups
    serve: ThreadPoolExecutor  # whole shards read for peers' fetches: never in the way of seals
    receive: ThreadPoolExecutor  # one per replica range arriving: fills its buffers from the socket or PutShard
    data_connections: ThreadPoolExecutor  # the data channel's TLS handshakes, tickets, statuses and drains
    fetch: ThreadPoolExecutor  # whole shards fetched for a load, from the peers or the object store
    replicate: ThreadPoolExecutor  # one per shard being sent to a peer (blocks on the peer)
    replicate_streams: ThreadPoolExecutor  # the byte ranges of those shards, several per shard
    locate: ThreadPoolExecutor  # loads' lookups on this node's tiers
    object: ThreadPoolExecutor  # object-store queries of one step, reshards' reads and retention there (not fetches)
    object_listings: ThreadPoolExecutor  # a job's whole history in the store (ls, latest): long, never in the way
    upload: ThreadPoolExecutor  # uploads to the object store, and the reads of their NVMe copies
    cleanup: ThreadPoolExecutor  # retention's removals, at the lowest CPU priority
    slot_memory: ThreadPoolExecutor  # staging slots' shared memory allocated (gigabytes, zeroed by the kernel)
    records: ThreadPoolExecutor  # commit and shard records from and to peers: parsed, signatures checked, serialized
    status: ThreadPoolExecutor  # the Status RPC's listings, /metrics pages, the NVMe root's identity checked
    resolve: ThreadPoolExecutor  # the built-in cluster view's DNS lookups, one at a time: a slow DNS holds up nothing
    inventories: ThreadPoolExecutor  # PeerInventory: every peer's inventory at once, INVENTORY_THREADS by a call
    object_reads: ThreadPoolExecutor  # ObjectTier: a shard's ranged GETs, READ_THREADS by each read
    object_requests: ThreadPoolExecutor  # ObjectTier: a job's commit records, a step's ranks checked or removed

    @classmethod
    def build(cls) -> Executors:
        """Make every pool (their threads start lazily, on first use: a program starts only those it uses)."""
        return cls(
            save=ThreadPoolExecutor(4, thread_name_prefix="save"),
            flush=ThreadPoolExecutor(2, thread_name_prefix="flush"),
            nvme_writes=ThreadPoolExecutor(4, thread_name_prefix="nvme-io"),
            replica_writes=ThreadPoolExecutor(4, thread_name_prefix="peer-io"),
            peer=ThreadPoolExecutor(8, thread_name_prefix="peer"),
            serve=ThreadPoolExecutor(8, thread_name_prefix="serve"),
            receive=ThreadPoolExecutor(MAX_RANGES_IN_FLIGHT, thread_name_prefix="replica-recv"),
            data_connections=ThreadPoolExecutor(CONNECTION_THREADS, thread_name_prefix="data-conn"),
            fetch=ThreadPoolExecutor(4, thread_name_prefix="fetch"),
            replicate=ThreadPoolExecutor(MAX_SENDERS, thread_name_prefix="replicate"),
            replicate_streams=ThreadPoolExecutor(
                MAX_SENDERS * STREAMS_PER_SHARD, thread_name_prefix="replicate-stream"
            ),
            locate=ThreadPoolExecutor(4, thread_name_prefix="locate"),
            object=ThreadPoolExecutor(OBJECT_THREADS, thread_name_prefix="object"),
            object_listings=ThreadPoolExecutor(2, thread_name_prefix="object-listing"),
            upload=ThreadPoolExecutor(UPLOAD_THREADS + 1, thread_name_prefix="upload"),
            cleanup=ThreadPoolExecutor(1, thread_name_prefix="cleanup", initializer=lowest_priority),
            slot_memory=ThreadPoolExecutor(16, thread_name_prefix="slot-memory"),  # 8 ranks' slot and spare at once
            records=ThreadPoolExecutor(4, thread_name_prefix="records"),
            status=ThreadPoolExecutor(2, thread_name_prefix="status"),
            resolve=ThreadPoolExecutor(1, thread_name_prefix="resolve"),
            inventories=ThreadPoolExecutor(INVENTORY_THREADS, thread_name_prefix="inventory"),
            object_reads=ThreadPoolExecutor(OBJECT_THREADS * READ_THREADS, thread_name_prefix="object-read"),
            object_requests=ThreadPoolExecutor(2 * COMMIT_CHECK_THREADS, thread_name_prefix="object-request"),
        )

    def shutdown(self) -> None:
        """Wait for what runs on every pool, then stop them, in field order (after every role drained).

        Not for a receiving thread nor a DNS lookup: one may still block on a peer that went
        quiet, or on a DNS server (the process exits without it; its transfer was dropped already,
        its answer is not wanted). Called again, it does nothing more.
        """
        for f in fields(self):
            getattr(self, f.name).shutdown(wait=f.name not in NOT_WAITED_FOR)


class Node:
    """Own the roles of one node, from start-up recovery to drain."""

    def __init__(self, config: Config, executors: Executors) -> None:
        """executors: every thread pool of the daemon (daemon.serve built them to take the root's lock on one)."""
        self.config = config
        self.executors = x = executors
        instance = uuid.uuid4().hex  # this daemon's run: peer calls that carry it have come back to it
        # -- the tiers, fastest first (loads try them in this order)
        self.pool = SlotPool(
            config.staging_dir,
            config.staging.budget_bytes or default_budget_bytes(config.staging_dir),
            config.staging.policy,
            config.nvme.flush_every,
            job_budget_bytes=config.staging.job_budget_bytes,
            access=config.staging_access,
            memory_threads=x.slot_memory,
        )
        memory = MemoryTier(self.pool.copies)
        self.nvme = LocalDirTier(config.root, write_threads=x.nvme_writes, commit_keys=config.commit_keys)
        # the replicas other nodes sent
        replica_store = ReplicaStore(config.replica_root, x.replica_writes, config.commit_keys)
        tiers: list[Tier] = [memory, self.nvme, replica_store]
        self.durable_tiers: list[DurableTier] = [self.nvme, replica_store]
        object_tier = None
        if config.object.url:
            store = self.object_store = open_store(config.object.url, config.object.storage_options)
            object_tier = ObjectTier(
                store, x.object_reads, x.object_requests, config.object.compression, config.commit_keys
            )

        # SavePath orders the others, so it is built last; the replicas and uploads report to it through these,
        # and retention asks it through these to adopt what this node missed and to remove what it decided goes.
        def replication_changed(key: ShardKey, replicated: bool) -> None:
            save_path.replication_changed(key, replicated)

        def upload_changed(key: ShardKey, committed: bool) -> None:
            save_path.upload_changed(key, committed)

        async def adopt_missed_commits(tier: DurableTier, job: str) -> None:
            await save_path.adopt_missed_commits(tier, job)

        async def release(tier: StepCatalog, job: str, step: int, listed: Listed | None) -> None:
            await save_path.release(tier, job, step, listed)

        async def release_slots(job: str, step: int, dry_run: bool) -> list[Slot]:
            return await save_path.release_slots(job, step, dry_run)

        # -- the cluster: its view, and the peer tier wherever a view is (peers may come later)
        self.view = open_view(config, x.resolve, x.records)  # [cluster] backend; None: no peers, every step sealed here
        self.membership = self.view.membership if self.view is not None else None  # whom the view follows
        peers = PeerInventory([], x.inventories) if self.view is not None else None
        peer_tier = PeerTier(peers) if peers is not None else None

        def peer_tier_among(among: Collection[str] | None) -> Tier:
            assert peers is not None and peer_tier is not None
            return peer_tier if among is None else PeerTier(peers.among(among))

        replication = None
        if self.view is not None and config.peer.replicas:
            replication = Replication(
                [], config.peer.replicas, replication_changed, x.replicate, x.replicate_streams, config.peer.failover_s
            )
        self.receiver = ReplicaReceiver(replica_store, x.peer, x.receive)
        self.job_retention = JobRetention(config, x.save)  # each job's settings and pins, read at start()
        self.peering = Peering(
            config, self.view, self.nvme, replica_store, peers, replication, instance, x.peer,
            lambda job, tier: self.job_retention.effective(job).keep[tier],
        )  # fmt: skip
        cluster = ClusterSteps(
            *(self.view, peers, peer_tier_among, self.nvme, self.peering.local_holdings, lambda: self.peering.replicas),
            *(x.peer, x.fetch),
        )
        uploader = None
        if object_tier is not None:
            uploader = Uploader(config, self.nvme, object_tier, upload_changed, x.upload)
        # -- the save path, the load path, operations
        self.progress = ShardProgress(self.pool, self.nvme, replication, uploader, config.node.name, x.locate)
        flusher = Flusher(self.pool, self.nvme, x.flush)
        steps_in_use: SharedLocks[tuple[str, int]] = SharedLocks()  # a load's locate, shared; a removal, alone
        self.locator = Locator(
            *(config, tiers, self.nvme, replica_store, cluster, peer_tier is not None, object_tier),
            self.verification_failed,
            *(x.locate, x.object, x.object_listings, x.fetch, self.job_retention.pinned, steps_in_use),
        )
        self.sharded_reads = ShardedReads(
            self.locator, self.view, [t for t in (peer_tier, object_tier) if t is not None]
        )
        holders: list[BusySteps] = [flusher, self.progress, self.locator, cluster, self.receiver, self.peering]
        if uploader is not None:
            holders.append(uploader)
        self.retention = RetentionRunner(
            config, self.durable_tiers, object_tier, adopt_missed_commits, release, release_slots, holders,
            x.object, x.cleanup, self.job_retention, steps_in_use, uploader,
        )  # fmt: skip
        save_path = SavePath(
            self.pool, flusher, self.nvme, replica_store, self.durable_tiers, self.peering, uploader,
            self.progress, self.retention, self.view, x.save, x.peer, x.cleanup, x.object,
            lambda job, keep, keep_every: self.job_retention.client_asked(job, ClientRetention(keep, keep_every)),
            self.locator.object_step,
        )  # fmt: skip
        self.save_path = save_path
        self.uploader = uploader
        if self.view is not None:
            self.view.watch(save_path.commit_learned)
        self.idle_release = IdleRelease(self.pool, self.nvme, config.staging.idle_ttl_s, x.cleanup)
        self.job_removal = JobRemoval(
            self.receiver, self.idle_release, self.retention, self.progress, self.job_retention, self.view
        )
        self.report = StatusReport(
            config, self.pool, memory, self.nvme, flusher, save_path,
            self.progress, self.peering, self.view, uploader, self.retention, self.job_retention, x.status,
        )  # fmt: skip
        self.instance = instance  # this daemon's run: the peer servicer refuses calls that carry it
        self._background: list[asyncio.Task[None]] = []
        self.root_id = ""  # the NVMe root's identity, read at start()

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way (see StatusReport)."""
        self.report.verification_failed(tier)

    def serving(self, data_port: int, rpc_counters: dict[str, int]) -> None:
        """Tell the status report what the RPC edges serve: the peer data port (0: none) and their counters."""
        self.report.serving(data_port, rpc_counters)

    async def start(self) -> None:
        """Clean up after an interrupted run, resume the flushes it left, and start catching up with peers."""
        loop = asyncio.get_running_loop()
        peer_threads = self.executors.peer
        await loop.run_in_executor(peer_threads, self._prepare_disk)
        if self.view is not None and self.membership is not None:
            # The peers first, so that the flushes resumed replicate to them; then the commits the cluster knows.
            await self.membership.refresh()
            self._background.append(loop.create_task(self.membership.run_forever()))
            self.view.seeded(await loop.run_in_executor(peer_threads, self._commits_on_disk))
            await self.view.start()
            self._background.append(loop.create_task(self.view.run_forever()))
        await self.save_path.resume()
        for job in await loop.run_in_executor(peer_threads, self.nvme.jobs):
            await self.retention.retain("started", job)
        await loop.run_in_executor(peer_threads, self.report.seed)
        if self.uploader is not None:
            bucket = await loop.run_in_executor(peer_threads, self.object_store.bucket_missing)
            if bucket is not None:
                raise ConfigError(
                    f"object.url: the bucket {bucket} does not exist ({shown_url(self.config.object.url)}): "
                    f"create it first (ckptd never creates buckets), e.g. `aws s3 mb s3://{bucket}` with the "
                    "same endpoint"
                )
            self.uploader.start()
        self._background.append(loop.create_task(self.report.probe_loop()))
        self._background.append(loop.create_task(self.idle_release.run_forever()))
        if self.view is not None:  # the peer tier is on wherever a cluster view is
            self._background.append(loop.create_task(self._reconcile_forever()))

    def _prepare_disk(self) -> None:
        self.config.root.mkdir(parents=True, exist_ok=True)
        claim_dir(self.config.replica_root, DIR_MODE, "the replica store", "node.root", group_may_write=True)
        self.root_id = root_identity.claim(self.config.root, self.config.staging_dir, self.config.staging_access)
        self.job_retention.load()  # before any retention pass: pins and the clients' settings of the last run
        for tier in self.durable_tiers:
            for path in tier.remove_leftovers():
                log.info("removed leftover %s from tier %s", path, tier.name)

    def _commits_on_disk(self) -> list[CommitRecord]:
        found = []
        for tier in self.durable_tiers:
            assert isinstance(tier, LocalDirTier)
            for job in tier.jobs():
                found += [r for s in tier.complete_steps(job) if (r := tier.checked_commit(job, s)) is not None]
        return found

    async def _reconcile_forever(self) -> None:
        full = True  # the first round, at start-up, asks every peer: recovery
        while True:
            try:
                self.receiver.drop_idle()
                await self.save_path.catch_up(full)
                full = False
                await self.retention.retain("caught up")  # adopted commits bring retention
            except (CheckpointError, OSError) as e:
                log.warning("catching up with the peers failed: %s", e)
            except Exception:  # the loop must outlive any one bad round
                log.exception("catching up with the peers failed unexpectedly")
            await asyncio.sleep(RECONCILE_S)  # a period, not a wait for anything

    async def watch_root(self) -> None:
        """Return once the NVMe root is gone: removed, or replaced by another (daemon.serve awaits it)."""
        await root_identity.watch(self.config.root, self.root_id, self.executors.status)

    async def give_back_staging(self) -> int:
        """Drop every slot and remove the staging directory, whose root is gone; return the bytes freed."""
        for job in {s.job for s in self.pool.slots()}:
            self.pool.drop_job(job)
        loop, slot_files = asyncio.get_running_loop(), self.executors.save
        _, size = await loop.run_in_executor(slot_files, root_identity.remove_slots, self.config.staging_dir)
        await loop.run_in_executor(slot_files, shutil.rmtree, self.config.staging_dir, True)
        return size

    async def drain(self) -> None:
        """Wait for every queued flush and replica under way to finish, then release threads and files."""
        for task in self._background:
            task.cancel()
        await self.save_path.drain()
        self.executors.fetch.shutdown(wait=True)  # loads' fetches under way end before the peer links close
        await self.peering.drain()
        if self.view is not None:
            await self.view.close()
        if self.membership is not None:
            self.membership.close()
        if self.uploader is not None:
            await self.uploader.drain()
        await self.retention.drain()
        self.receiver.close()
        self.executors.shutdown()

"""Move each committed snapshot down the tiers: staging slot -> NVMe, then retention.

One Pipeline per daemon, driven from the event loop: the servicer calls
start() once, then reserve/commit/wait_shard/locate/list_steps/collect as RPCs
arrive, and drain() on shutdown. Flushes of one rank run in commit order; the
byte work runs on worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt.errors import CheckpointError, CorruptCheckpoint, InvalidArgument, NotFound
from ckpt.format import CHUNK_SIZE_BYTES, MAX_SHARD_BYTES, CommitRecord, ShardMeta, digest, validate_tier
from ckpt.shard_io import ShardSource

from ckptd import __version__, metrics
from ckptd.config import Config
from ckptd.datapath.peering import Peering
from ckptd.datapath.receiving import ReplicaReceiver
from ckptd.datapath.replication import FAILURES_REPORTED
from ckptd.datapath.retention import plan_removals
from ckptd.datapath.staging import ShardKey, Slot, SlotPool, Snapshot
from ckptd.datapath.uploading import FAILURES_REPORTED as UPLOAD_FAILURES_REPORTED
from ckptd.datapath.uploading import Uploader
from ckptd.storage.object_store import open_store
from ckptd.tiers.base import DurableTier, Tier
from ckptd.tiers.catalog import StepInfo, list_steps, merge_steps
from ckptd.tiers.cluster import StepHoldings
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier, ShardWriteError
from ckptd.tiers.object import ObjectTier
from ckptd.tiers.transfer import fetch_shard

log = logging.getLogger(__name__)

FLUSH_THREADS = 2
PEER_THREADS = 8
RECONCILE_S = 2.0  # how often a node catches up with its peers
RECENT_ERRORS = 20
REMEMBERED_SHARDS = 1 << 16  # shards known to have reached a tier, for waiters that come after retention
RETAINED_TIERS = ("nvme", "peer", "object")  # the tiers [retention] applies to
OBJECT_THREADS = 4  # object-store queries, fetches and retention (uploads have their own)
OBJECT_QUERY_TIMEOUT_S = 5.0
LOAD_LEASE_S = 600.0  # how long retention keeps off a step a load was pointed at


@dataclass(frozen=True)
class Removal:
    """One step that gc removes (or would remove) from a tier, and why."""

    tier: str
    job: str
    step: int
    reason: str


class Pipeline:
    """Own the staging slots and the tiers of one node."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.pool = SlotPool(config.staging_dir, config.staging.budget_bytes, config.staging.policy)
        self.memory = MemoryTier(self.pool.slots)
        self.nvme = LocalDirTier(config.root)
        self.replica_store = LocalDirTier(config.replica_root, name="peer")  # replicas other nodes sent here
        self.tiers: list[Tier] = [self.memory, self.nvme, self.replica_store]  # fastest first: loads try them so
        self.durable_tiers: list[DurableTier] = [self.nvme, self.replica_store]
        self.peer_io = ThreadPoolExecutor(max_workers=PEER_THREADS, thread_name_prefix="peer")
        # Serving shards to peers reads whole files: on threads of its own, never in the way of seals.
        self.serve_io = ThreadPoolExecutor(max_workers=PEER_THREADS, thread_name_prefix="serve")
        self.receiver = ReplicaReceiver(self.replica_store, self.peer_io)
        self.peering = Peering(config, self.nvme, self.replica_store, self.peer_io, self._replication_changed)
        self._object_io = ThreadPoolExecutor(max_workers=OBJECT_THREADS, thread_name_prefix="object")
        self.object_tier: ObjectTier | None = None
        self.uploader: Uploader | None = None
        if config.object.url:
            self.object_tier = ObjectTier(open_store(config.object.url, config.object.storage_options))
            self.uploader = Uploader(config, self.nvme, self.object_tier, self._upload_changed)
        self._reconciler: asyncio.Task[None] | None = None
        self._flush_threads = ThreadPoolExecutor(max_workers=FLUSH_THREADS, thread_name_prefix="flush")
        # Removing old steps is never urgent: at the lowest CPU priority, unlinking gigabytes
        # (with discard, seconds of kernel time) yields to training and to flushes.
        self._cleanup_thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cleanup", initializer=_lowest_priority
        )
        self._rank_locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._flushes: set[asyncio.Task[None]] = set()
        self._failures: dict[ShardKey, str] = {}
        self._reached: dict[tuple[ShardKey, str], None] = {}  # insertion-ordered, oldest dropped first
        self._sealing: set[ShardKey] = set()  # flushed, and the step not yet sealed (if it can be)
        # The run that committed each step last: shards of any other run are stale.
        self._latest_run: dict[tuple[str, int], str] = {}
        self._changed = asyncio.Condition()
        self._collect_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self._errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self._fetching_from_object: Counter[tuple[str, int]] = Counter()
        # Steps a client was pointed at to load, until when: a client reads the files itself.
        self._being_read: dict[tuple[str, int], float] = {}
        self._object_fetch_locks: dict[tuple[str, int, int], asyncio.Lock] = {}
        self._started_unix_s = time.time()
        self._counters = {"saves": 0, "skipped": 0, "flushed": 0, "flush_failures": 0, "bytes_flushed": 0}
        self._verification_failures: Counter[str] = Counter()  # by tier: a bad byte caught on its way
        self._reserved_at: dict[tuple[str, int], float] = {}  # (job, rank) -> when its slot was reserved
        self.save_seconds = metrics.Histogram(
            "ckptd_save_duration_seconds", "From a rank's slot reserved to its snapshot committed (the copy)"
        )
        self.flush_seconds = metrics.Histogram(
            "ckptd_flush_duration_seconds", "From a snapshot committed to its shard durable on NVMe"
        )
        self._replica_bytes_received = 0
        self._completed_unix_s: dict[str, float] = {}  # tier -> when a step last became complete there

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Clean up after an interrupted run, resume the flushes it left, and start catching up with peers."""
        self.config.root.mkdir(parents=True, exist_ok=True)
        self.config.replica_root.mkdir(exist_ok=True)
        for tier in self.durable_tiers:
            for path in tier.remove_leftovers():
                log.info("removed leftover %s from tier %s", path, tier.name)
        held = self.pool.recover()
        for slot in sorted(held, key=lambda s: s.committed_seq):
            assert slot.shard is not None
            self._note_run(slot.shard, slot.run_id)
        for slot in sorted(held, key=lambda s: s.shard.step if s.shard else 0):
            key = slot.shard
            assert key is not None
            complete = self.nvme.complete_steps(key.job)
            # Complete, or older than the newest complete step (removed by retention, or never
            # to complete), or this very copy already on disk: nothing left to flush.
            if key.step <= max(complete, default=-1) or self._on_disk_already(slot):
                await self.pool.settle(slot)
            else:
                log.info("resuming flush of %s", slot.shard)
                self._start_flush(slot)
        await self._finish_interrupted_commits()
        self._seed_completion_times()
        if self.uploader is not None:
            self.uploader.start()
        if self.peering.peer_tier is not None:
            self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_forever())

    async def _reconcile_forever(self) -> None:
        while True:
            try:
                self.receiver.drop_idle()
                await self.peering.reconcile(self._commit_lock, self._flushing)
                await self.collect(dry_run=False, tiers=("nvme", "peer"))  # adopted commits bring retention along
            except (CheckpointError, OSError) as e:
                log.warning("catching up with the peers failed: %s", e)
            except Exception:  # the loop must outlive any one bad round
                log.exception("catching up with the peers failed unexpectedly")
            await asyncio.sleep(RECONCILE_S)  # a period, not a wait for anything

    def _replication_changed(self, key: ShardKey, replicated: bool) -> None:
        if replicated:
            self._completed_unix_s["peer"] = time.time()
            self._remember(key, "peer")  # stays known after the shard is no longer tracked
        self._wake_waiters()

    def _upload_changed(self, key: ShardKey, committed: bool) -> None:
        self._wake_waiters()
        if committed:  # a new step in the store: [retention] object may now remove an older one
            task = asyncio.get_running_loop().create_task(self._collect_quietly(key.job, ("object",), False))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)

    async def _collect_quietly(self, job: str, tiers: tuple[str, ...], unfinished_uploads: bool) -> None:
        try:
            await self.collect(dry_run=False, job=job, tiers=tiers, unfinished_uploads=unfinished_uploads)
        except (CheckpointError, OSError) as e:
            log.warning("retention for %s on %s failed: %s", job, ", ".join(tiers), e)

    def _wake_waiters(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        task = asyncio.get_running_loop().create_task(wake())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def drain(self) -> None:
        """Wait for every queued flush and replica under way to finish."""
        if self._reconciler is not None:
            self._reconciler.cancel()
        while self._flushes:
            await asyncio.gather(*list(self._flushes), return_exceptions=True)
        await self.peering.drain()
        if self.uploader is not None:
            await self.uploader.drain()
        self.receiver.close()
        self._flush_threads.shutdown(wait=True)
        self._cleanup_thread.shutdown(wait=True)
        self.peer_io.shutdown(wait=True)
        self._object_io.shutdown(wait=True)
        self.serve_io.shutdown(wait=True)
        for tier in self.durable_tiers:
            tier.close()

    # -- the save path -------------------------------------------------------------

    async def reserve(self, key: ShardKey, size_bytes: int) -> tuple[Slot | None, float, str]:
        """Find staging room for a shard (see SlotPool.reserve)."""
        if not 0 <= size_bytes <= MAX_SHARD_BYTES:
            raise InvalidArgument(f"{key}: size_bytes {size_bytes} is out of range (0 to {MAX_SHARD_BYTES})")
        if self._is_complete(key.job, key.step):
            reason = f"{key.job} step {key.step} is already complete; a complete step is never rewritten"
            log.warning("skipped %s: %s", key, reason)
            self._counters["skipped"] += 1
            return None, 0.0, reason
        slot, blocked_s, reason = await self.pool.reserve(key.job, key.rank, size_bytes)
        if slot is None:
            self._counters["skipped"] += 1
            log.warning("skipped %s: %s (staging.policy = skip)", key, reason)
        elif blocked_s > 0.5:
            log.warning("%s waited %.1f s for staging room", key, blocked_s)
        if slot is not None:
            self._reserved_at[(key.job, key.rank)] = time.monotonic()
        return slot, blocked_s, reason

    async def commit(self, snapshot: Snapshot) -> None:
        """Take over a filled slot and queue its flush."""
        key = snapshot.key
        if self._is_complete(key.job, key.step):
            raise InvalidArgument(f"{key.job} step {key.step} is already complete; a complete step is never rewritten")
        if len(snapshot.run_id) > 256:
            raise InvalidArgument(f"{key}: run_id is longer than 256 characters")
        slot = self.pool.commit(snapshot)
        reserved_at = self._reserved_at.pop((key.job, key.rank), None)
        if reserved_at is not None:
            self.save_seconds.observe(time.monotonic() - reserved_at)
        self._note_run(key, snapshot.run_id)
        self._failures.pop(key, None)
        self._reached.pop((key, "nvme"), None)  # saved again: the new copy has not reached the disk yet
        self._reached.pop((key, "peer"), None)
        self._sealing.discard(key)  # an earlier copy's seal, still queued, must not count for this one
        self.peering.forget_replicas(key)
        if self.uploader is not None:
            self.uploader.forget(key)
        self._remember(key, "memory")
        self._counters["saves"] += 1
        self._start_flush(slot)

    def _is_complete(self, job: str, step: int) -> bool:
        # Only a durable copy seals a step: one complete in memory alone may be saved again
        # (say, after its flush failed on a full disk).
        return any(step in t.complete_steps(job) for t in self.durable_tiers)

    def _start_flush(self, slot: Slot) -> None:
        task = asyncio.get_running_loop().create_task(self._flush(slot))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self, slot: Slot) -> None:
        key = slot.shard
        assert key is not None
        lock = self._rank_locks.setdefault((key.job, key.rank), asyncio.Lock())
        async with lock:
            loop = asyncio.get_running_loop()
            try:
                hashed_before = slot.meta is not None  # a flush resumed after a restart
                started = time.monotonic()
                await loop.run_in_executor(self._flush_threads, self._flush_to_nvme, slot, key, loop)
                self.flush_seconds.observe(time.monotonic() - started)
                if not any(s is not slot and s.shard == key and s.state == "pending" for s in self.pool.slots()):
                    self._sealing.add(key)  # reached once the step is sealed if it can be: see _reached_tier
                if hashed_before and slot.meta is not None:
                    self.peering.replicate(key, slot.meta, slot.path)
                if self.uploader is not None:
                    self.uploader.upload(key)
                self._counters["flushed"] += 1
                self._counters["bytes_flushed"] += slot.data_size_bytes
            except Exception as e:  # a flush must never fail silently, whatever broke
                self._counters["flush_failures"] += 1
                if not isinstance(e, (ShardWriteError, OSError)):
                    log.exception("flush of %s failed unexpectedly", key)
                self._record_failure(key, "nvme", str(e))
            finally:
                await self.pool.settle(slot)
        await self._after_flush(key)  # outside the rank's lock: its next flush need not wait for retention

    def _flush_to_nvme(self, slot: Slot, key: ShardKey, loop: asyncio.AbstractEventLoop) -> None:
        meta = slot.meta or ShardMeta(
            key.job,
            key.step,
            key.rank,
            key.world_size,
            slot.data_size_bytes,
            CHUNK_SIZE_BYTES,
            (),
            slot.layout_json,
            slot.run_id,
        )
        with open(slot.path, "rb") as f:
            m = mmap.mmap(f.fileno(), slot.size_bytes, prot=mmap.PROT_READ)
        try:

            def hashed(full: ShardMeta) -> None:
                self.pool.record_hashed(slot, full)
                # Replicas go straight from shared memory while the NVMe writes run.
                loop.call_soon_threadsafe(self.peering.replicate, key, full, slot.path)

            self.nvme.write_shard(meta, memoryview(m), on_hashed=hashed)
        finally:
            with contextlib.suppress(BufferError):  # a traceback may still hold a view; then GC unmaps it
                m.close()

    async def _after_flush(self, key: ShardKey) -> None:
        record = None
        try:
            record = await self._seal(key.job, key.step)
        except (CheckpointError, OSError) as e:
            self._record_failure(key, "nvme", f"commit of {key.job} step {key.step} failed: {e}")
        finally:
            if key in self._sealing:  # whatever happened: waiters must hear, retention must not keep off
                self._sealing.discard(key)
                self._remember(key, "nvme")
        async with self._changed:
            self._changed.notify_all()  # waiters first: retention below may take a while
        if record is not None:
            self._completed_unix_s["nvme"] = time.time()
            log.info("%s step %d is complete on nvme (%d bytes)", key.job, key.step, record.size_bytes)
            try:
                await self.collect(dry_run=False, job=key.job, tiers=("nvme", "peer"))
            except (CheckpointError, OSError) as e:
                self._record_failure(key, "nvme", f"retention for {key.job} failed: {e}")

    def _busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps retention keeps off: being flushed, sealed, received, fetched or read,
        or not yet on a slower tier."""
        busy = {(s.shard.job, s.shard.step) for s in self.pool.slots() if s.state == "pending" and s.shard}
        busy |= {(k.job, k.step) for k in self._sealing}
        # A faster tier keeps a step until the slower tiers have it (those [retention] keeps).
        busy |= self.uploader.busy_steps() if self.uploader is not None else set()
        busy |= self.peering.replicating_steps()
        now = time.monotonic()
        busy |= {step for step, until in self._being_read.items() if until > now}
        return busy | self.receiver.busy_steps() | self.peering.fetching | set(self._fetching_from_object)

    def _flushing(self, job: str, step: int) -> bool:
        """Say whether a shard of the step is still on its way to NVMe (then the step is not sealed yet)."""
        return any(
            s.state == "pending" and s.shard and (s.shard.job, s.shard.step) == (job, step) for s in self.pool.slots()
        )

    async def _seal(self, job: str, step: int) -> CommitRecord | None:
        """Seal a step that just got a durable shard here (flushed or received), if it can be now.

        One seal at a time (two ranks finishing together must not both write the record),
        and none while another shard of the step is still on its way: a re-saved shard
        replaces the old one before the step is sealed. The peers are asked outside the
        lock, so that no seal waits on the network.
        """
        if self._flushing(job, step):
            return None  # sealed when the last of its flushes ends
        peer_shards = await self.peering.peer_shards(job, step)
        async with self._commit_lock:
            if self._flushing(job, step):
                return None
            # Sealed from the latest run that committed the step: a late flush of an
            # earlier run never counts beside the newer run's shards.
            return await self.peering.seal(job, step, self._latest_run.get((job, step)), peer_shards)

    async def _finish_interrupted_commits(self) -> None:
        # A crash between the last shard's rename and the commit record leaves a
        # step with every shard in place: commit it now.
        for job in self.nvme.jobs():
            complete = set(self.nvme.complete_steps(job))
            for step in self.nvme.all_steps(job):
                world_size = None if step in complete else self.nvme.saved_world_size(job, step)
                if world_size:
                    await self._after_flush(ShardKey(job, step, 0, world_size))
            await self.collect(dry_run=False, job=job, keep_newest=False, tiers=("nvme", "peer"))

    def _on_disk_already(self, slot: Slot) -> bool:
        # Not even checksummed: flush it (a rewrite of an incomplete step is harmless).
        return slot.meta is not None and self.nvme.holds(slot.meta)

    def _note_run(self, key: ShardKey, run_id: str) -> None:
        self._latest_run.pop((key.job, key.step), None)  # re-insert: the dict stays ordered by commit
        self._latest_run[(key.job, key.step)] = run_id
        if len(self._latest_run) > REMEMBERED_SHARDS:
            del self._latest_run[next(iter(self._latest_run))]

    def _remember(self, key: ShardKey, tier: str) -> None:
        self._reached[(key, tier)] = None
        if len(self._reached) > REMEMBERED_SHARDS:
            del self._reached[next(iter(self._reached))]

    def _record_failure(self, key: ShardKey, tier: str, message: str) -> None:
        log.error("%s", message)
        self._failures[key] = message
        self._errors.append({"time_unix_s": time.time(), "tier": tier, "shard": str(key), "error": message})

    # -- queries ---------------------------------------------------------------------

    def _reached_tier(self, key: ShardKey, tier: str) -> bool:
        """Say whether the shard has reached the tier (retention may have removed it since)."""
        if (key, tier) in self._reached:
            return True
        if tier == "memory":
            return any(s.shard == key and s.state != "writing" for s in self.pool.slots())
        if (
            key in self._failures
            or key in self._sealing
            or any(s.shard == key and s.state == "pending" for s in self.pool.slots())
        ):
            return False  # the copy being flushed is the one asked about, not an older one on disk
        return self.nvme.has_shard(key.job, key.step, key.rank)

    async def wait_shard(self, key: ShardKey, tier: str, timeout_s: float) -> tuple[bool, str]:
        """Return (done, error) for a shard on a tier, waiting up to timeout_s for it."""
        validate_tier(tier)
        if (tier == "object" and self.uploader is None) or (tier == "peer" and self.peering.replication is None):
            return False, f"tier {tier} is not configured on node {self.config.node.name}"
        if tier == "object":
            verdict = await self._upload_verdict(key)
        elif tier == "peer":
            verdict = self._replica_verdict(key)
        else:

            def verdict() -> tuple[bool, str] | None:
                return (True, "") if self._reached_tier(key, tier) else None

        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                answer = verdict()
                if answer is not None:
                    return answer
                if key in self._failures:
                    return False, self._failures[key]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False, ""
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return False, ""

    def _replica_verdict(self, key: ShardKey) -> Callable[[], tuple[bool, str] | None]:
        """Return what says whether a shard's replicas are in, or why they failed (None: not yet)."""
        attempts_before = self.peering.replicated(key)[3]
        if self.peering.replicated(key)[2] >= FAILURES_REPORTED and self.peering.replication:
            self.peering.replication.retry_now(key)  # failing so far: a waiter hears how a fresh attempt goes

        def verdict() -> tuple[bool, str] | None:
            done, error, failures, attempts = self.peering.replicated(key)
            if done or (key, "peer") in self._reached:
                return True, ""
            if failures >= FAILURES_REPORTED and attempts > attempts_before:
                return False, error
            return None

        return verdict

    async def _upload_verdict(self, key: ShardKey) -> Callable[[], tuple[bool, str] | None]:
        """Return what says whether a shard's step is complete in the store, or why not (None: not yet)."""
        assert self.uploader is not None
        uploader = self.uploader
        if not uploader.wanted(key.step):
            error = f"{key.job} step {key.step} is not uploaded: [object] every = {self.config.object.every}"
            return lambda: (False, error)
        before = uploader.state(key)
        attempts_before = before.attempts if before is not None else 0
        if before is None and key.step in (await self._ask_object_store(self._object_steps, key.job) or []):
            return lambda: (True, "")  # uploaded and committed before this daemon started

        def verdict() -> tuple[bool, str] | None:
            state = uploader.state(key)
            if state is not None and state.committed:
                return True, ""
            if state is not None and (
                state.gave_up or (state.failures >= UPLOAD_FAILURES_REPORTED and state.attempts > attempts_before)
            ):
                return False, state.error
            return None

        return verdict

    def _tiers(self, tier: str) -> list[Tier]:
        if tier in ("", "auto"):
            return self.tiers
        return [t for t in self.tiers if t.name == validate_tier(tier)]

    async def locate(
        self, job: str, step: int | None, rank: int, tier: str = "auto", refetch: bool = False
    ) -> tuple[int, int, list[ShardSource]]:
        """Return (step, world_size, sources fastest first) for a rank's shard of a complete step.

        A shard that no tier of this node holds is fetched from the peers (a wiped disk,
        or the ranks of a lost node), else from the object store, verified and written
        to NVMe first. refetch (the client found this node's copies bad) does so over them.
        """
        tiers = self._tiers(tier)
        from_peers = tier in ("", "auto", "peer") and self.peering.peer_tier is not None
        from_object = tier in ("", "auto", "object") and self.object_tier is not None
        steps = {s for t in tiers for s in t.complete_steps(job)}
        peer_steps: set[int] = set()
        if from_peers and (step is None or step not in steps):
            peer_steps = set(await self.peering.complete_steps(job))
        object_steps: set[int] = set()
        store_silent = False  # then "not found" cannot be told: a caller must not start afresh on it
        if from_object and (refetch or step is None or step not in steps | peer_steps):
            answer = await self._ask_object_store(self._object_steps, job)
            store_silent, object_steps = answer is None, set(answer or [])
        steps |= peer_steps | object_steps
        if step is None and steps:
            step = max(steps)
        if step is None or step not in steps:
            what = f"job {job} has no complete step" if step is None else f"{job} step {step} is not complete"
            if store_silent:
                raise CheckpointError(
                    f"{what} on this node or its peers, and the object store ({self.config.object.url}) "
                    "did not answer: it may hold it; try again"
                )
            raise NotFound(f"{what} on tier {tier or 'auto'}")
        record = self._commit_record(job, step)
        if record is not None and rank >= record.world_size:
            raise NotFound(f"{job} step {step} has no rank {rank} (world_size {record.world_size})")
        if refetch:
            self.verification_failed("nvme")  # the client found this node's copies bad
        if refetch and not (from_peers or from_object):
            raise CorruptCheckpoint(f"{job} step {step} rank {rank}: no other tier to fetch a good copy from")
        sources = [] if refetch else self._local_sources(tiers, job, step, rank, record)
        fetched_to = ShardSource(
            tier if tier in ("peer", "object") else "nvme", "dir", str(self.nvme.step_dir(job, step)), job, step
        )
        if not sources and from_peers and (refetch or step not in object_steps):
            try:
                await self.peering.fetch(job, step, rank, replace=refetch)
                sources = [fetched_to]
            except CheckpointError as e:
                if not from_object:
                    raise
                log.warning("%s; trying the object store", e)
                answer = await self._ask_object_store(self._object_steps, job)
                if answer is None or step not in answer:
                    raise  # the peers' error says more than "not found": the step does exist
                object_steps = set(answer)
        if not sources and step in object_steps:
            await self._fetch_from_object(job, step, rank, again=tier == "object" or refetch, replace=refetch)
            sources = [fetched_to]
        record = self._commit_record(job, step)
        if record is None or not sources:
            world_size = record.world_size if record else 0
            raise NotFound(f"{job} step {step} has no rank {rank} on tier {tier or 'auto'} (world_size {world_size})")
        self._lease_for_reading(job, step)
        return step, record.world_size, sources

    def _lease_for_reading(self, job: str, step: int) -> None:
        """Keep retention off a step a client is about to read, for LOAD_LEASE_S."""
        now = time.monotonic()
        for key in [k for k, until in self._being_read.items() if until <= now]:
            del self._being_read[key]
        self._being_read[(job, step)] = now + LOAD_LEASE_S

    async def _on_object_threads(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._object_io, fn, *args)

    async def _ask_object_store(self, fn: Callable[..., list[Any] | None], *args: Any) -> list[Any] | None:
        """Return fn(*args) from an object-store thread, or None if the store does not answer in time.

        Loads and listings ask the store too; one that hangs must not hold them up for
        minutes of HTTP timeouts.
        """
        try:
            answer = await asyncio.wait_for(self._on_object_threads(fn, *args), OBJECT_QUERY_TIMEOUT_S)
        except TimeoutError:
            log.warning("the object store did not answer within %.0f s: going on without it", OBJECT_QUERY_TIMEOUT_S)
            return None
        return None if answer is None else list(answer)

    def _object_steps(self, job: str) -> list[int] | None:
        """Return the job's steps complete in the store, or None if the store failed to say."""
        assert self.object_tier is not None
        try:
            return self.object_tier.complete_steps(job)
        except CheckpointError as e:
            log.warning("%s", e)
            return None

    async def _fetch_from_object(self, job: str, step: int, rank: int, again: bool, replace: bool = False) -> None:
        """Copy a rank's shard of a step complete in the object store onto this node's NVMe, verified.

        again: read and check the store's copy even if NVMe holds the shard (a load that named tier "object").
        """
        lock = self._object_fetch_locks.setdefault((job, step, rank), asyncio.Lock())
        async with lock:
            if not again and self.nvme.has_shard(job, step, rank) and self.nvme.checked_commit(job, step) is not None:
                return  # another load fetched it meanwhile
            self._fetching_from_object[(job, step)] += 1  # ranks of one step may be fetched at once
            try:
                await self._on_object_threads(self._copy_from_object, job, step, rank, replace)
            except CorruptCheckpoint:
                self.verification_failed("object")
                raise
            finally:
                self._fetching_from_object[(job, step)] -= 1
                if not self._fetching_from_object[(job, step)]:
                    del self._fetching_from_object[(job, step)]

    def _copy_from_object(self, job: str, step: int, rank: int, replace: bool) -> None:
        assert self.object_tier is not None
        started = time.monotonic()
        meta = fetch_shard(self.object_tier, self.nvme, job, step, rank, replace)
        log.info(
            "fetched rank %d shard of %s step %d from %s (%d bytes, verified, %.2f s)",
            rank,
            job,
            step,
            self.object_tier.store.describe(job, str(step)),
            meta.data_size_bytes,
            time.monotonic() - started,
        )

    def _commit_record(self, job: str, step: int) -> CommitRecord | None:
        for t in self.tiers:
            if step in t.complete_steps(job):
                return t.commit_record(job, step)
        return None

    def _local_sources(
        self, tiers: list[Tier], job: str, step: int, rank: int, record: CommitRecord | None
    ) -> list[ShardSource]:
        """Return the copies of a rank's shard on this node that belong to the step's commit record."""
        if record is None or rank >= record.world_size:
            return []
        sources = []
        for t in tiers:
            if not t.has_shard(job, step, rank):
                continue
            if step not in t.complete_steps(job):  # a snapshot in memory of a step sealed across nodes
                try:
                    if digest(t.read_meta(job, step, rank).to_bytes()) != record.shard_meta_xxh3_128[rank]:
                        continue
                except CheckpointError:
                    continue
            sources.append(t.shard_source(job, step, rank))
        return sources

    async def list_steps(self, job: str = "") -> list[StepInfo]:
        """Return every complete step on any tier, by job and step (with peers, as the cluster sees it)."""
        steps = await self.peering.list_steps(list_steps(self.tiers, job), job)
        if self.object_tier is None:
            return steps
        tier = self.object_tier
        return merge_steps(steps, await self._ask_object_store(_listed_or_nothing, tier, job) or [])

    async def holdings(self, job: str, step: int | None) -> list[StepHoldings]:
        """Return what this node holds, for a peer's Inventory."""
        return list(
            await asyncio.get_running_loop().run_in_executor(self.peer_io, self.peering.local_holdings, job, step)
        )

    async def adopt_commit(self, record: CommitRecord) -> None:
        """Seal a step that a peer found complete, where this node holds part of it."""
        if await self.peering.adopt(record):
            log.info("%s step %d is complete across the cluster", record.job, record.step)
        async with self._changed:
            self._changed.notify_all()

    async def replica_arrived(self, meta: ShardMeta) -> None:
        """Seal the step of a replica that just became durable here, if it was the last rank missing.

        Before the sender hears that its replica is in: once every rank has waited for
        "peer", losing any one node can no longer lose the step.
        """
        self._replica_bytes_received += meta.data_size_bytes
        try:
            record = await self._seal(meta.job, meta.step)
        except (CheckpointError, OSError) as e:
            log.warning("sealing %s step %d after a replica arrived failed: %s", meta.job, meta.step, e)
            return
        if record is not None:
            log.info("%s step %d is complete across the cluster", meta.job, meta.step)

    async def shard_for_peer(self, job: str, step: int, rank: int, tier: str) -> tuple[ShardMeta, bytes, Path]:
        """Return (record, its bytes, data file) of a shard of a complete step that a peer asks for."""
        for t in (self.nvme, self.replica_store):
            if tier in ("", t.name) and step in t.complete_steps(job) and t.has_shard(job, step, rank):
                source = t.shard_source(job, step, rank)
                meta_bytes = source.meta_path(rank).read_bytes()
                return ShardMeta.from_bytes(meta_bytes, str(source.meta_path(rank))), meta_bytes, source.data_path(rank)
        raise NotFound(
            f"node {self.config.node.name} holds no rank {rank} shard of {job} step {step} on tier {tier or 'any'}"
        )

    async def collect(
        self,
        dry_run: bool,
        job: str = "",
        keep_newest: bool = True,
        tiers: tuple[str, ...] = RETAINED_TIERS,
        unfinished_uploads: bool = True,
    ) -> list[Removal]:
        """Apply retention: remove what the config says not to keep; with dry_run only report it.

        keep_newest=False removes only the incomplete steps that can no longer complete;
        tiers limits the pass to some tiers (a flush touches NVMe, an upload the object store);
        unfinished_uploads (`ckptd gc`) also removes what crashes left in the object store:
        incomplete steps older than the newest complete one, and unfinished multipart
        uploads. Passes of their own accord never do: another node may be uploading them.
        """
        async with self._collect_lock:  # one pass at a time: two would race to remove the same step
            removals = await self._collect(dry_run, job, keep_newest, tiers)
            if "object" in tiers and self.object_tier is not None:
                busy = self._busy_steps() | (self.uploader.unsettled_steps() if self.uploader else set())
                removals += await self._on_object_threads(
                    self._collect_object, dry_run, job, keep_newest, busy, unfinished_uploads
                )
            return removals

    def _collect_object(
        self, dry_run: bool, job: str, keep_newest: bool, busy: set[tuple[str, int]], unfinished_uploads: bool
    ) -> list[Removal]:
        """Apply [retention] object to the object store (on an upload thread: every call is a request)."""
        tier = self.object_tier
        assert tier is not None
        removals = []
        keep = self.config.retention.object if keep_newest else 0
        for j in [job] if job else tier.jobs():
            complete = tier.complete_steps(j)
            plan = plan_removals(
                all_steps=tier.all_steps(j),
                complete_steps=complete,
                keep=keep,
                busy={s for bj, s in busy if bj == j} | set(tier.damaged_steps(j)),
            )
            plan = [(step, reason) for step, reason in plan if unfinished_uploads or step in complete]
            for step, reason in plan:
                removals.append(Removal(tier.name, j, step, reason))
                if not dry_run:
                    tier.remove_step(j, step)
                    log.info("removed %s step %d from object: %s", j, step, reason)
            if not unfinished_uploads:
                continue
            # Uploads a crash left unfinished, of steps no upload of this node will resume:
            # their parts cost storage and no listing shows them.
            newest = max(tier.complete_steps(j), default=-1)
            for step in tier.steps_with_unfinished_uploads(j):
                if step <= newest and (j, step) not in busy and step not in dict(plan):
                    removals.append(Removal(tier.name, j, step, "unfinished multipart uploads of a crashed upload"))
                    if not dry_run:
                        count = tier.abort_uploads(j, step)
                        log.info("aborted %d unfinished upload(s) of %s step %d in the object store", count, j, step)
        return removals

    async def _collect(self, dry_run: bool, job: str, keep_newest: bool, tiers: tuple[str, ...]) -> list[Removal]:
        loop = asyncio.get_running_loop()
        removals: list[Removal] = []
        for tier in [t for t in self.durable_tiers if t.name in tiers]:
            keep = getattr(self.config.retention, tier.name) if keep_newest else 0
            for j in [job] if job else tier.jobs():
                # A step that looks abandoned here may be complete in the cluster (its commit
                # notice missed while this node was down): adopt it rather than remove it.
                await self.peering.adopt_missed_commits(tier, j)
                busy = self._busy_steps()  # now, after the awaits above
                plan = plan_removals(
                    all_steps=tier.all_steps(j),
                    complete_steps=tier.complete_steps(j),
                    keep=keep,
                    busy={s for bj, s in busy if bj == j} | set(tier.damaged_steps(j)),
                )
                for step, reason in plan:
                    removals.append(Removal(tier.name, j, step, reason))
                    if not dry_run:
                        await loop.run_in_executor(self._cleanup_thread, tier.remove_step, j, step)
                        log.info("removed %s step %d from %s: %s", j, step, tier.name, reason)
        return removals

    def verification_failed(self, tier: str) -> None:
        """Count a bad byte caught on its way (a chunk that did not match its checksum)."""
        self._verification_failures[tier] += 1

    def metrics_page(self) -> str:
        """Return the /metrics page: what `status` says, and the durations observed."""
        histograms = [self.save_seconds, self.flush_seconds]
        if self.uploader is not None:
            histograms.append(self.uploader.upload_seconds)
        return metrics.page(self.status(), histograms)

    def _newest_step_ages(self) -> dict[str, float]:
        """Return, per tier, seconds since a step last became complete there (kept in memory: scrapes touch no disk)."""
        now = time.time()
        ages = {tier: max(0.0, now - t) for tier, t in self._completed_unix_s.items()}
        if self.uploader is not None and self.uploader.last_commit_unix_s:
            ages["object"] = max(0.0, now - self.uploader.last_commit_unix_s)
        return ages

    def _seed_completion_times(self) -> None:
        """Learn when the newest complete step of each durable tier was committed, once, at start."""
        for tier in self.durable_tiers:
            for job in tier.jobs():
                steps = tier.complete_steps(job)
                if steps:
                    with contextlib.suppress(OSError):
                        t = tier.committed_unix_s(job, steps[-1])
                        self._completed_unix_s[tier.name] = max(self._completed_unix_s.get(tier.name, 0.0), t)

    def status(self) -> dict[str, Any]:
        """Return the status document of `ckptd status --json`."""
        slots = self.pool.slots()
        return {
            "version": __version__,
            "node": self.config.node.name,
            "uptime_s": round(time.time() - self._started_unix_s, 3),
            "socket": str(self.config.socket_path),
            "tiers": {
                "memory": {"dir": str(self.config.staging_dir), "jobs": self.memory.jobs()},
                "nvme": {"root": str(self.config.root), "jobs": self.nvme.jobs()},
                "peer": {"replica_root": str(self.config.replica_root), **self.peering.status()},
                "object": self.uploader.status() if self.uploader is not None else {"enabled": False},
            },
            "staging": {
                "policy": self.config.staging.policy,
                "budget_bytes": self.config.staging.budget_bytes,
                "in_use_bytes": self.pool.in_use_bytes(),
                "slots": len(slots),
                "pending_flushes": sum(1 for s in slots if s.state == "pending"),
            },
            "counters": {
                **self._counters,
                "replica_bytes_received": self._replica_bytes_received,
                "verification_failures": {
                    **dict.fromkeys(("memory", "nvme", "peer", "object"), 0),
                    **self._verification_failures,
                    "nvme": self._verification_failures["nvme"]
                    + (self.uploader.verification_failures if self.uploader else 0),
                },
            },
            "newest_complete_age_s": {tier: round(age, 3) for tier, age in self._newest_step_ages().items()},
            "recent_errors": list(self._errors),
        }


def _listed_or_nothing(tier: Tier, job: str) -> list[StepInfo]:
    try:
        return list_steps([tier], job)
    except CheckpointError as e:  # a store that is down must not hide the other tiers
        log.warning("%s", e)
        return []


def _lowest_priority() -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux

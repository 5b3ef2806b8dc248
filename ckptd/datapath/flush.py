"""The save path on the daemon: reserve a slot, take over the committed snapshot, flush it to NVMe, seal the step.

Called on the event loop, in this order for each save of a rank: reserve(), then
commit(), which queues the flush; flushes of one rank run one at a time, in commit
order, on the flush threads; after each, the step is sealed if every rank is in
(here or on the peers), then retention runs for the job. At start-up, resume()
takes over the slots an earlier run left before any RPC is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from ckpt.errors import CheckpointError, InvalidArgument
from ckpt.format import CHUNK_SIZE_BYTES, MAX_SHARD_BYTES, CommitRecord, ShardMeta

from ckptd import metrics
from ckptd.datapath.keyed import KeyedLocks
from ckptd.datapath.peering import Peering
from ckptd.datapath.progress import REMEMBERED_SHARDS, ShardProgress
from ckptd.datapath.staging import ShardKey, Slot, SlotPool, Snapshot
from ckptd.datapath.uploading import Uploader
from ckptd.tiers.base import DurableTier
from ckptd.tiers.nvme import LocalDirTier

log = logging.getLogger(__name__)

FLUSH_THREADS = 2
# A flush waits (this long at most) while other ranks of its step on this node are still
# copying into their slots: hashing and writing beside their copies would slow the very
# copies their save_async waits for, on a node whose cores the daemon shares.
FLUSH_HOLD_MAX_S = 2.0
SAVE_THREADS = 4

Retention = Callable[[str], Awaitable[object]]  # runs retention for a job on NVMe and the replica store


class Flusher:
    """Take snapshots from the staging slots down to NVMe and seal their steps."""

    def __init__(
        self,
        pool: SlotPool,
        nvme: LocalDirTier,
        durable_tiers: list[DurableTier],
        peering: Peering,
        uploader: Uploader | None,
        progress: ShardProgress,
    ) -> None:
        self.pool = pool
        self.nvme = nvme
        self.durable_tiers = durable_tiers
        self.peering = peering
        self.uploader = uploader
        self.progress = progress
        self.retention: Retention | None = None  # set by the pipeline once retention exists
        self.threads = ThreadPoolExecutor(max_workers=FLUSH_THREADS, thread_name_prefix="flush")
        # Reserve and Commit block a training rank: their disk work never queues behind a flush.
        self.save_threads = ThreadPoolExecutor(max_workers=SAVE_THREADS, thread_name_prefix="save")
        self.commit_lock = asyncio.Lock()  # one seal at a time on this node (reconciliation takes it too)
        self._rank_locks: KeyedLocks[tuple[str, int]] = KeyedLocks()  # a rank's flushes run one at a time, in order
        self._latest_run: OrderedDict[tuple[str, int], str] = OrderedDict()  # the run that committed a step last
        self._reserved_at: dict[tuple[str, int], tuple[float, int]] = {}  # (job, rank) -> (when, step) reserved
        self._copies_changed = asyncio.Condition()  # a reserved copy was committed
        self.tasks: set[asyncio.Task[None]] = set()
        self.counters = {
            "saves": 0, "skipped": 0, "bytes_saved": 0, "flushed": 0, "flush_failures": 0, "bytes_flushed": 0,
        }  # fmt: skip
        self.save_seconds = metrics.Histogram(
            "ckptd_save_duration_seconds",
            "From a rank's slot reserved to its snapshot committed (the copy: what the daemon sees of a save's stall)",
            metrics.SAVE_BUCKETS_S,
        )
        self.flush_seconds = metrics.Histogram(
            "ckptd_flush_duration_seconds",
            "From a snapshot committed to its shard durable on NVMe",
            metrics.SAVE_BUCKETS_S,
        )

    # -- the save path ------------------------------------------------------------

    async def reserve(self, key: ShardKey, size_bytes: int) -> tuple[Slot | None, float, str]:
        """Find staging room for a shard (see SlotPool.reserve)."""
        if not 0 <= size_bytes <= MAX_SHARD_BYTES:
            raise InvalidArgument(f"{key}: size_bytes {size_bytes} is out of range (0 to {MAX_SHARD_BYTES})")
        # A skipped save is the caller's to report, and the servicer's to log (at a pace a caller cannot flood).
        if await self.is_complete(key.job, key.step):  # before any slot is claimed for a save that will not be
            self.counters["skipped"] += 1
            return None, 0.0, f"{key.job} step {key.step} is already complete; a complete step is never rewritten"
        slot, blocked_s, reason = await self.pool.reserve(key.job, key.rank, size_bytes)
        if slot is None:
            self.counters["skipped"] += 1
            return None, 0.0, f"{reason} (staging.policy = skip)"
        if blocked_s > 0.5:
            log.warning("%s waited %.1f s for staging room", key, blocked_s)
        self._reserved_at[(key.job, key.rank)] = (time.monotonic(), key.step)
        return slot, blocked_s, reason

    async def commit(self, snapshot: Snapshot) -> None:
        """Take over a filled slot and queue its flush."""
        key = snapshot.key
        if len(snapshot.run_id) > 256:
            raise InvalidArgument(f"{key}: run_id is longer than 256 characters")
        slot = self.pool.take(snapshot)
        # Once taken, the slot is committed and flushed even if the client goes away meanwhile.
        task = asyncio.get_running_loop().create_task(self._take_over(slot, snapshot))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        await asyncio.shield(task)

    async def _take_over(self, slot: Slot, snapshot: Snapshot) -> None:
        key = snapshot.key
        try:
            # Off the event loop: the slot's layout, megabytes, is read and written beside it.
            loop = asyncio.get_running_loop()
            layout_json = await loop.run_in_executor(self.save_threads, self._write_markers, slot, snapshot)
        except BaseException:
            self.pool.abandon(slot)
            raise
        self.pool.committed(slot, snapshot, layout_json)
        reserved = self._reserved_at.pop((key.job, key.rank), None)
        if reserved is not None:
            self.save_seconds.observe(time.monotonic() - reserved[0])
            async with self._copies_changed:
                self._copies_changed.notify_all()
        self.note_run(key, snapshot.run_id)
        self.progress.copy_committed(key)
        self.peering.forget_replicas(key)
        if self.uploader is not None:
            self.uploader.forget(key)
        self.counters["saves"] += 1
        self.counters["bytes_saved"] += snapshot.data_size_bytes
        self.start(slot)

    def _write_markers(self, slot: Slot, snapshot: Snapshot) -> str:
        """Refuse a snapshot of a step complete meanwhile, else mark the slot committed (one hop: a save thread)."""
        key = snapshot.key
        if self._complete(key.job, key.step):
            raise InvalidArgument(f"{key.job} step {key.step} is already complete; a complete step is never rewritten")
        return self.pool.write_markers(slot, snapshot)

    def _complete(self, job: str, step: int) -> bool:
        return any(t.is_complete(job, step) for t in self.durable_tiers)

    async def is_complete(self, job: str, step: int) -> bool:
        """Say whether a durable tier holds the step complete (one complete in memory alone may be saved again)."""
        return await asyncio.get_running_loop().run_in_executor(self.save_threads, self._complete, job, step)

    def start(self, slot: Slot) -> None:
        """Queue a committed slot's flush (its flush time counts from now)."""
        task = asyncio.get_running_loop().create_task(self._flush(slot, time.monotonic()))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _flush(self, slot: Slot, committed_at: float) -> None:
        key = slot.shard
        assert key is not None
        async with self._rank_locks.hold((key.job, key.rank)):
            await self._while_others_copy(key)
            try:
                hashed_before = slot.meta is not None  # a flush resumed after a restart
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.threads, self._flush_to_nvme, slot, key, loop)
                self.flush_seconds.observe(time.monotonic() - committed_at)  # queued behind the rank's flushes too
                if not any(s is not slot and s.shard == key and s.state == "pending" for s in self.pool.slots()):
                    self.progress.sealing_started(key)
                if hashed_before and slot.meta is not None:
                    self.peering.replicate(key, slot.meta, slot.path)
                if self.uploader is not None:
                    self.uploader.upload(key)
                self.counters["flushed"] += 1
                self.counters["bytes_flushed"] += slot.data_size_bytes
            except Exception as e:  # a flush must never fail silently, whatever broke
                self.counters["flush_failures"] += 1
                if not isinstance(e, (CheckpointError, OSError)):
                    log.exception("flush of %s failed unexpectedly", key)
                self.progress.failed(key, "nvme", str(e))
            finally:
                await self.pool.settle(slot)
        await self.after_flush(key)  # outside the rank's lock: its next flush need not wait for retention

    async def _while_others_copy(self, key: ShardKey) -> None:
        """Wait (up to FLUSH_HOLD_MAX_S) until no other rank of the step on this node is copying into its slot."""

        def others_copying() -> bool:
            return any(
                job == key.job and rank != key.rank and step == key.step and time.monotonic() - at < FLUSH_HOLD_MAX_S
                for (job, rank), (at, step) in self._reserved_at.items()
            )

        async with self._copies_changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._copies_changed.wait_for(lambda: not others_copying()), FLUSH_HOLD_MAX_S)

    def _flush_to_nvme(self, slot: Slot, key: ShardKey, loop: asyncio.AbstractEventLoop) -> None:
        """Write a slot's snapshot to NVMe (a flush thread); replicas start as soon as its checksums are known."""
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

    async def after_flush(self, key: ShardKey) -> None:
        """Seal the shard's step if it can be, tell the waiters, then apply retention to the job."""
        record = None
        try:
            record = await self.seal(key.job, key.step)
        except (CheckpointError, OSError) as e:
            self.progress.failed(key, "nvme", f"commit of {key.job} step {key.step} failed: {e}")
        finally:
            self.progress.sealing_done(key)
        await self.progress.changed()  # waiters first: retention below may take a while
        if record is not None:
            self.progress.step_completed("nvme", key.job, key.step)
            log.info("%s step %d is complete on nvme (%d bytes)", key.job, key.step, record.size_bytes)
            if self.retention is not None:
                try:
                    await self.retention(key.job)
                except (CheckpointError, OSError) as e:
                    self.progress.failed(key, "nvme", f"retention for {key.job} failed: {e}")

    def flushing(self, job: str, step: int) -> bool:
        """Say whether a shard of the step is still on its way to NVMe (then the step is not sealed yet)."""
        return any(
            s.state == "pending" and s.shard and (s.shard.job, s.shard.step) == (job, step) for s in self.pool.slots()
        )

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps with a shard being flushed: retention keeps off them (BusySteps)."""
        return {(s.shard.job, s.shard.step) for s in self.pool.slots() if s.state == "pending" and s.shard}

    async def seal(self, job: str, step: int) -> CommitRecord | None:
        """Seal a step that just got a durable shard here (flushed or received), if it can be now.

        One seal at a time (two ranks finishing together must not both write the record),
        and none while another shard of the step is still on its way: a re-saved shard
        replaces the old one before the step is sealed. Where other nodes hold ranks of the
        step, it is reported to the cluster view instead, and sealed when its commit comes.
        """
        if self.flushing(job, step):
            return None  # sealed when the last of its flushes ends
        async with self.commit_lock:
            if self.flushing(job, step):
                return None
            # Sealed from the latest run that committed the step: a late flush of an
            # earlier run never counts beside the newer run's shards.
            return await self.peering.seal(job, step, self._latest_run.get((job, step)))

    def note_run(self, key: ShardKey, run_id: str) -> None:
        """Remember the run that committed a step last (bounded, oldest first)."""
        self._latest_run.pop((key.job, key.step), None)  # re-insert: the table stays ordered by commit
        self._latest_run[(key.job, key.step)] = run_id
        while len(self._latest_run) > REMEMBERED_SHARDS:
            self._latest_run.popitem(last=False)

    # -- recovery -------------------------------------------------------------------

    async def resume(self) -> None:
        """Take over the slots an earlier run left: flush what is not on NVMe yet, seal what a crash left whole.

        The checks run on the save threads: resumed flushes take the flush threads meanwhile.
        """
        loop = asyncio.get_running_loop()
        held = await loop.run_in_executor(self.save_threads, self.pool.recover)
        for slot in sorted(held, key=lambda s: s.committed_seq):
            assert slot.shard is not None
            self.note_run(slot.shard, slot.run_id)
        for slot in sorted(held, key=lambda s: s.shard.step if s.shard else 0):
            key = slot.shard
            assert key is not None
            if await loop.run_in_executor(self.save_threads, self._flushed_already, slot, key):
                await self.pool.settle(slot)
            else:
                log.info("resuming flush of %s", slot.shard)
                self.start(slot)
        # A crash between the last shard's rename and the commit record leaves a
        # step with every shard in place: commit it now.
        for job, step, world_size in await loop.run_in_executor(self.save_threads, self._interrupted_commits):
            await self.after_flush(ShardKey(job, step, 0, world_size))

    def _flushed_already(self, slot: Slot, key: ShardKey) -> bool:
        # Complete, or older than the newest complete step (removed by retention, or never
        # to complete), or this very copy already on disk: nothing left to flush. A copy
        # not even checksummed is flushed again (a rewrite of an incomplete step is harmless).
        complete = self.nvme.complete_steps(key.job)
        return key.step <= max(complete, default=-1) or (slot.meta is not None and self.nvme.holds(slot.meta))

    def _interrupted_commits(self) -> list[tuple[str, int, int]]:
        found = []
        for job in self.nvme.jobs():
            complete = set(self.nvme.complete_steps(job))
            for step in self.nvme.all_steps(job):
                world_size = None if step in complete else self.nvme.saved_world_size(job, step)
                if world_size:
                    found.append((job, step, world_size))
        return found

    async def drain(self) -> None:
        """Wait for every queued flush and seal, then stop the flush threads."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)
        self.threads.shutdown(wait=True)
        self.save_threads.shutdown(wait=True)

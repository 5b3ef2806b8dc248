"""The save path on the daemon: reserve a slot, take over the committed snapshot, flush it to NVMe, seal the step.

Called on the event loop, in this order for each save of a rank: reserve(), then
commit(), which wakes its job's flush rounds. A job flushes in rounds, one at a time:
each picks one step (see rounds: the newest that its ranks on this node hold, or the
oldest that [nvme] flush_every keeps), pins every local rank's slot of it, passes over
the older snapshots not yet flushed, and writes the shards on the flush threads (shared
by every job of the node). After each shard the step is sealed if every rank is in
(here or on the peers), then retention runs for the job. A save that finds no free slot
replaces its rank's snapshot whose flush has not started (SlotPool.reserve): that step
is passed over for the rank. At start-up, resume() takes over the slots an earlier run
left before any RPC is served, and flushes them by rounds too.
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
from ckpt.format import CHUNK_SIZE_BYTES, CommitRecord, ShardMeta

from ckptd.operations import metrics
from ckptd.replication.peering import Peering
from ckptd.save.progress import REMEMBERED_SHARDS, ShardProgress
from ckptd.save.rounds import Round, plan_round
from ckptd.save.slot_files import UNFLUSHED
from ckptd.save.staging import ShardKey, Slot, SlotPool, Snapshot
from ckptd.save.uploading import Uploader
from ckptd.tiers.base import DurableTier
from ckptd.tiers.nvme import LocalDirTier

log = logging.getLogger(__name__)

FLUSH_THREADS = 2
# A round waits (this long at most) while ranks of its job on this node are still copying
# into their slots, or do not yet hold a common step: it then picks the step they are all
# saving, and hashing and writing beside their copies would slow the very copies their
# save_async waits for, on a node whose cores the daemon shares.
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
        self._rounds: dict[str, asyncio.Task[None]] = {}  # job -> its rounds, while a snapshot of it waits
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
        # A skipped save is the caller's to report, and the servicer's to log (at a pace a caller cannot flood).
        if await self.is_complete(key.job, key.step):  # before any slot is claimed for a save that will not be
            self.counters["skipped"] += 1
            return None, 0.0, f"{key.job} step {key.step} is already complete; a complete step is never rewritten"
        reserved = await self.pool.reserve(key.job, key.rank, size_bytes)
        if reserved.slot is None:
            self.counters["skipped"] += 1
            return None, 0.0, f"{reserved.reason} (staging.policy = skip)"
        if reserved.blocked_s > 0.5:
            log.warning("%s waited %.1f s for staging room: %s", key, reserved.blocked_s, reserved.reason)
        self._reserved_at[(key.job, key.rank)] = (time.monotonic(), key.step)
        if reserved.replaced is not None and reserved.replaced.step != key.step:  # the same step: saved again
            self.progress.passed_over.passed_over(reserved.replaced, key.step)
            await self.progress.changed()
        return reserved.slot, reserved.blocked_s, reserved.reason

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
        self.flush_soon(key.job)

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

    def flush_soon(self, job: str) -> None:
        """Start the job's flush rounds unless they run: they go on while a snapshot of the job waits for its flush."""
        if job in self._rounds:
            return  # the running rounds look again after their current one
        task = asyncio.get_running_loop().create_task(self._rounds_of(job))
        self._rounds[job] = task
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _rounds_of(self, job: str) -> None:
        """Flush the job round after round until no snapshot of it waits (a task per job, see flush_soon)."""
        try:
            while True:
                await self._until_ranks_agree(job)
                chosen = self._begin_round(job)
                if chosen is None:
                    return  # and, before any await, out of _rounds: the next commit starts them again
                await self.pool.changed()  # the slots passed over are free: saves waiting for one may go on
                await self.progress.changed()  # their waiters hear they were passed over
                await asyncio.gather(*(self._flush(slot) for slot in chosen.flushed))
        finally:
            self._rounds.pop(job, None)

    def _begin_round(self, job: str) -> Round | None:
        """Pick the round's step, pin its slots and pass over older snapshots, with no await in between."""
        chosen = plan_round([s for s in self.pool.slots() if s.job == job], self.pool.flush_every)
        if chosen is None:
            return None
        for slot in chosen.flushed:
            self.pool.start_flush(slot)
        for slot in chosen.passed_over:
            assert slot.shard is not None
            self.progress.passed_over.passed_over(slot.shard, chosen.step)
            self.pool.pass_over(slot)
        for slot in chosen.superseded:  # its rank saved the step again: the later copy is flushed instead
            self.pool.pass_over(slot)
        return chosen

    async def _flush(self, slot: Slot) -> None:
        """Write one pinned slot of a round to NVMe, settle it, and seal its step in the background."""
        key, committed_seq = slot.shard, slot.committed_seq
        assert key is not None

        def still_ours() -> bool:  # the slot was not dropped or claimed since the round pinned it
            return slot.state == "flushing" and slot.shard == key and slot.committed_seq == committed_seq

        if not still_ours():
            return  # another snapshot is in it now: neither written nor settled here
        try:
            hashed_before = slot.meta is not None  # a flush resumed after a restart
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.threads, self._flush_to_nvme, slot, key, loop)
            self.flush_seconds.observe(time.monotonic() - slot.committed_at_s)  # queued behind earlier rounds too
            if not any(s is not slot and s.shard == key and s.state in UNFLUSHED for s in self.pool.slots()):
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
            if still_ours():
                await self.pool.settle(slot)
        # Not awaited by the round: the job's next round need not wait for the seal and retention.
        task = asyncio.get_running_loop().create_task(self.after_flush(key))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _until_ranks_agree(self, job: str) -> None:
        """Wait (up to FLUSH_HOLD_MAX_S) until no rank of the job here is copying and its ranks hold a common step.

        A reservation older than FLUSH_HOLD_MAX_S counts as abandoned. Commits wake it.
        """

        def agreed() -> bool:
            now = time.monotonic()
            if any(j == job and now - at < FLUSH_HOLD_MAX_S for (j, _), (at, _) in self._reserved_at.items()):
                return False
            chosen = plan_round([s for s in self.pool.slots() if s.job == job], self.pool.flush_every)
            return chosen is None or chosen.agreed

        async with self._copies_changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._copies_changed.wait_for(agreed), FLUSH_HOLD_MAX_S)

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
            s.state in UNFLUSHED and s.shard and (s.shard.job, s.shard.step) == (job, step) for s in self.pool.slots()
        )

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps with a shard on its way to NVMe: retention keeps off them (BusySteps)."""
        return {(s.shard.job, s.shard.step) for s in self.pool.slots() if s.state in UNFLUSHED and s.shard}

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

        What is not on NVMe is flushed by rounds, as any save: of each rank, the snapshot of
        the step its job's round picks (the newest, or one [nvme] flush_every keeps); older
        ones are passed over, their markers removed, so recovery never writes a step it would
        pass over. The checks run on the save threads: resumed flushes take the flush threads meanwhile.
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
        newest: dict[tuple[str, int], Slot] = {}  # of each rank, the snapshot its rounds will flush
        for slot in sorted((s for s in held if s.state == "pending"), key=lambda s: s.committed_seq):
            newest[(slot.job, slot.rank)] = slot
        for slot in newest.values():
            log.info("resuming flush of %s", slot.shard)
        for job in sorted({job for job, _ in newest}):
            self.flush_soon(job)
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

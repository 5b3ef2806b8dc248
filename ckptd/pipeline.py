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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckpt.errors import CheckpointError, InvalidArgument, NotFound
from ckpt.format import CHUNK_SIZE_BYTES, ShardMeta, meta_name, validate_tier
from ckpt.shard_io import ShardSource

from ckptd import __version__
from ckptd.catalog import StepInfo, list_steps
from ckptd.config import Config
from ckptd.retention import plan_removals
from ckptd.staging import ShardKey, Slot, SlotPool, Snapshot
from ckptd.tiers.base import DurableTier, Tier
from ckptd.tiers.memory import MemoryTier
from ckptd.tiers.nvme import LocalDirTier, ShardWriteError

log = logging.getLogger(__name__)

FLUSH_THREADS = 2
MAX_SHARD_BYTES = 1 << 50
RECENT_ERRORS = 20
REMEMBERED_SHARDS = 1 << 16  # shards known to have reached a tier, for waiters that come after retention


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
        self.tiers: list[Tier] = [self.memory, self.nvme]  # fastest first: loads try them in this order
        self.durable_tiers: list[DurableTier] = [self.nvme]
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
        # The run that committed each step last: shards of any other run are stale.
        self._latest_run: dict[tuple[str, int], str] = {}
        self._changed = asyncio.Condition()
        self._collect_lock = asyncio.Lock()
        self._commit_lock = asyncio.Lock()
        self._errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self._started_unix_s = time.time()
        self._counters = {"saves": 0, "skipped": 0, "flushed": 0, "flush_failures": 0, "bytes_flushed": 0}

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Clean up after an interrupted run and resume the flushes it left."""
        self.config.root.mkdir(parents=True, exist_ok=True)
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

    async def drain(self) -> None:
        """Wait for every queued flush to finish."""
        while self._flushes:
            await asyncio.gather(*list(self._flushes), return_exceptions=True)
        self._flush_threads.shutdown(wait=True)
        self._cleanup_thread.shutdown(wait=True)
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
        return slot, blocked_s, reason

    async def commit(self, snapshot: Snapshot) -> None:
        """Take over a filled slot and queue its flush."""
        key = snapshot.key
        if self._is_complete(key.job, key.step):
            raise InvalidArgument(f"{key.job} step {key.step} is already complete; a complete step is never rewritten")
        if len(snapshot.run_id) > 256:
            raise InvalidArgument(f"{key}: run_id is longer than 256 characters")
        slot = self.pool.commit(snapshot)
        self._note_run(key, snapshot.run_id)
        self._failures.pop(key, None)
        self._reached.pop((key, "nvme"), None)  # saved again: the new copy has not reached the disk yet
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
                await loop.run_in_executor(self._flush_threads, self._flush_to_nvme, slot, key)
                self._remember(key, "nvme")
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

    def _flush_to_nvme(self, slot: Slot, key: ShardKey) -> None:
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
            self.nvme.write_shard(meta, memoryview(m), on_hashed=lambda full: self.pool.record_hashed(slot, full))
        finally:
            with contextlib.suppress(BufferError):  # a traceback may still hold a view; then GC unmaps it
                m.close()

    async def _after_flush(self, key: ShardKey) -> None:
        record = None
        # One commit at a time (two ranks finishing together must not both write the
        # record), and none while another shard of the step is still on its way: a
        # re-saved shard replaces the old one before the step is sealed.
        async with self._commit_lock:
            if not any(
                s.state == "pending" and s.shard and (s.shard.job, s.shard.step) == (key.job, key.step)
                for s in self.pool.slots()
            ):
                try:
                    # Sealed from the latest run that committed the step: a late flush of an
                    # earlier run drops its own shard here, never the newer run's.
                    run_id = self._latest_run.get((key.job, key.step), "")
                    record = await asyncio.to_thread(self.nvme.try_commit, key.job, key.step, key.world_size, run_id)
                except (CheckpointError, OSError) as e:
                    self._record_failure(key, "nvme", f"commit of {key.job} step {key.step} failed: {e}")
        async with self._changed:
            self._changed.notify_all()  # waiters first: retention below may take a while
        if record is not None:
            log.info("%s step %d is complete on nvme (%d bytes)", key.job, key.step, record.size_bytes)
            try:
                await self.collect(dry_run=False, job=key.job)
            except (CheckpointError, OSError) as e:
                self._record_failure(key, "nvme", f"retention for {key.job} failed: {e}")

    async def _finish_interrupted_commits(self) -> None:
        # A crash between the last shard's rename and the commit record leaves a
        # step with every shard in place: commit it now.
        for job in self.nvme.jobs():
            complete = set(self.nvme.complete_steps(job))
            for step in self.nvme.all_steps(job):
                world_size = None if step in complete else self.nvme.saved_world_size(job, step)
                if world_size:
                    await self._after_flush(ShardKey(job, step, 0, world_size))
            await self.collect(dry_run=False, job=job, keep_newest=False)

    def _on_disk_already(self, slot: Slot) -> bool:
        key = slot.shard
        if slot.meta is None or key is None:
            return False  # not even checksummed: flush it (a rewrite of an incomplete step is harmless)
        path = self.nvme.step_dir(key.job, key.step) / meta_name(key.rank)
        try:
            return path.read_bytes() == slot.meta.to_bytes()
        except OSError:
            return False

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
        if key in self._failures or any(s.shard == key and s.state == "pending" for s in self.pool.slots()):
            return False  # the copy being flushed is the one asked about, not an older one on disk
        return self.nvme.has_shard(key.job, key.step, key.rank)

    async def wait_shard(self, key: ShardKey, tier: str, timeout_s: float) -> tuple[bool, str]:
        """Return (done, error) for a shard on a tier, waiting up to timeout_s for it."""
        validate_tier(tier)
        if tier in ("peer", "object"):
            return False, f"tier {tier} is not configured on node {self.config.node.name}"
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                if self._reached_tier(key, tier):
                    return True, ""
                if key in self._failures:
                    return False, self._failures[key]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False, ""
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return False, ""

    def _tiers(self, tier: str) -> list[Tier]:
        if tier in ("", "auto"):
            return self.tiers
        return [t for t in self.tiers if t.name == validate_tier(tier)]

    def locate(self, job: str, step: int | None, rank: int, tier: str = "auto") -> tuple[int, int, list[ShardSource]]:
        """Return (step, world_size, sources fastest first) for a rank's shard of a complete step."""
        tiers = self._tiers(tier)
        complete = {t.name: set(t.complete_steps(job)) for t in tiers}
        steps = set().union(*complete.values())
        if step is None:
            if not steps:
                raise NotFound(f"job {job} has no complete step on tier {tier or 'auto'}")
            step = max(steps)
        if step not in steps:
            raise NotFound(f"{job} step {step} is not complete on tier {tier or 'auto'}")
        sources, world_size = [], 0
        for t in tiers:
            if step in complete[t.name]:
                world_size = t.commit_record(job, step).world_size
                if rank < world_size:
                    sources.append(t.shard_source(job, step, rank))
        if not sources:
            raise NotFound(f"{job} step {step} has no rank {rank} (world_size {world_size})")
        return step, world_size, sources

    def list_steps(self, job: str = "") -> list[StepInfo]:
        """Return every complete step on any tier, by job and step."""
        return list_steps(self.tiers, job)

    async def collect(self, dry_run: bool, job: str = "", keep_newest: bool = True) -> list[Removal]:
        """Apply retention: remove what the config says not to keep; with dry_run only report it.

        keep_newest=False removes only the incomplete steps that can no longer complete.
        """
        async with self._collect_lock:  # one pass at a time: two would race to remove the same step
            return await self._collect(dry_run, job, keep_newest)

    async def _collect(self, dry_run: bool, job: str, keep_newest: bool) -> list[Removal]:
        loop = asyncio.get_running_loop()
        busy = {(s.shard.job, s.shard.step) for s in self.pool.slots() if s.state == "pending" and s.shard}
        removals: list[Removal] = []
        for tier in self.durable_tiers:
            keep = getattr(self.config.retention, tier.name) if keep_newest else 0
            for j in [job] if job else tier.jobs():
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
                "peer": {"enabled": False},
                "object": {"enabled": False},
            },
            "staging": {
                "policy": self.config.staging.policy,
                "budget_bytes": self.config.staging.budget_bytes,
                "in_use_bytes": self.pool.in_use_bytes(),
                "slots": len(slots),
                "pending_flushes": sum(1 for s in slots if s.state == "pending"),
            },
            "counters": dict(self._counters),
            "recent_errors": list(self._errors),
        }


def _lowest_priority() -> None:
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux

"""Flush committed snapshots from the staging slots to NVMe, in rounds per job.

SavePath (save_path.py) drives it on the event loop. While a snapshot of a job waits, the
save path runs the job's rounds one at a time: until_ranks_agree(), then begin_round(),
which picks one step (see rounds: the newest that the job's ranks on this node hold, or the
oldest that [nvme] flush_every keeps), pins every local rank's slot of it and passes over
the older snapshots not yet flushed; then write() for each pinned slot, which hashes and
writes it on the flush threads (shared by every job of the node) through the NVMe tier's
one write path (ShardSink.write_shard). The save path learns of a reservation and of its
commit (reserved(), copied()), so that a round waits for ranks still copying.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta
from ckpt_core.shard_key import ShardKey

from ckptd import metrics
from ckptd.save.rounds import Round, plan_round
from ckptd.save.staging import SlotPool
from ckptd.tiers.base import ShardSink
from ckptd.tiers.slot_files import UNFLUSHED, Slot

# A round waits (this long at most) while ranks of its job on this node are still copying
# into their slots, or do not yet hold a common step: it then picks the step they are all
# saving, and hashing and writing beside their copies would slow the very copies their
# save_async waits for, on a node whose cores the daemon shares.
FLUSH_HOLD_MAX_S = 2.0


class Flusher:
    """Write the pinned slots of each round to NVMe; know which steps are still on their way."""

    def __init__(self, pool: SlotPool, nvme: ShardSink, threads: ThreadPoolExecutor) -> None:
        """threads: the flush threads (Executors.flush), where each slot is hashed and fed to the NVMe writers."""
        self.pool = pool
        self.nvme = nvme
        self.threads = threads
        self._reserved_at: dict[tuple[str, int], float] = {}  # (job, rank) -> when it reserved a slot
        self._copies_changed = asyncio.Condition()  # a reserved copy was committed
        self.counters = {"flushed": 0, "flush_failures": 0, "bytes_flushed": 0}
        self.flush_seconds = metrics.Histogram(
            "ckptd_flush_duration_seconds",
            "From a snapshot committed to its shard durable on NVMe",
            metrics.SAVE_BUCKETS_S,
        )

    def reserved(self, key: ShardKey) -> None:
        """Note that a rank reserved a slot: its job's rounds wait for its copy (up to FLUSH_HOLD_MAX_S)."""
        self._reserved_at[(key.job, key.rank)] = time.monotonic()

    async def copied(self, key: ShardKey) -> float | None:
        """Note that a rank's copy was committed; return the seconds since its reservation, if one was noted."""
        reserved_at = self._reserved_at.pop((key.job, key.rank), None)
        if reserved_at is None:
            return None
        async with self._copies_changed:
            self._copies_changed.notify_all()
        return time.monotonic() - reserved_at

    async def until_ranks_agree(self, job: str) -> None:
        """Wait (up to FLUSH_HOLD_MAX_S) until no rank of the job here is copying and its ranks hold a common step.

        A reservation older than FLUSH_HOLD_MAX_S counts as abandoned. Commits wake it.
        """

        def agreed() -> bool:
            now = time.monotonic()
            if any(j == job and now - at < FLUSH_HOLD_MAX_S for (j, _), at in self._reserved_at.items()):
                return False
            chosen = plan_round([s for s in self.pool.slots() if s.job == job], self.pool.flush_every)
            return chosen is None or chosen.agreed

        async with self._copies_changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._copies_changed.wait_for(agreed), FLUSH_HOLD_MAX_S)

    def begin_round(self, job: str) -> tuple[Round, list[ShardKey]] | None:
        """Pick the round's step, pin its slots and pass over older snapshots, with no await in between.

        Return the round and the shards it passed over: their waiters are the caller's to tell.
        """
        chosen = plan_round([s for s in self.pool.slots() if s.job == job], self.pool.flush_every)
        if chosen is None:
            return None
        passed_over = [slot.shard for slot in chosen.passed_over if slot.shard is not None]
        for slot in chosen.flushed:
            self.pool.start_flush(slot)
        for slot in (*chosen.passed_over, *chosen.superseded):  # superseded: its rank saved the step again
            self.pool.pass_over(slot)
        return chosen, passed_over

    async def write(self, slot: Slot, on_hashed: Callable[[ShardMeta], None]) -> bool:
        """Write one pinned slot of a round to NVMe and settle it; return False if it is no longer the round's.

        on_hashed(meta) runs on the event loop as soon as the shard's checksums are known,
        before the writes are durable (replicas start from the slot then). Raises what the
        write raised; the slot is settled either way, before this returns. The caller's
        bookkeeping after it (sealing started, or the failure) runs before any waiter does:
        settle() takes SlotPool's lock, which is never held across an await, so it never yields.
        """
        key, committed_seq = slot.shard, slot.committed_seq
        assert key is not None

        def still_ours() -> bool:  # the slot was not dropped or claimed since the round pinned it
            return slot.state == "flushing" and slot.shard == key and slot.committed_seq == committed_seq

        if not still_ours():
            return False  # another snapshot is in it now: neither written nor settled here
        loop = asyncio.get_running_loop()

        def hashed(meta: ShardMeta) -> None:  # on the flush thread
            loop.call_soon_threadsafe(on_hashed, meta)

        try:
            await loop.run_in_executor(self.threads, self._write_to_nvme, slot, key, hashed)
            self.flush_seconds.observe(time.monotonic() - slot.committed_at_s)  # queued behind earlier rounds too
            self.counters["flushed"] += 1
            self.counters["bytes_flushed"] += slot.data_size_bytes
        except Exception:
            self.counters["flush_failures"] += 1
            raise
        finally:
            if still_ours():
                await self.pool.settle(slot)
        return True

    def _write_to_nvme(self, slot: Slot, key: ShardKey, on_hashed: Callable[[ShardMeta], None]) -> None:
        """Write a slot's snapshot to NVMe (a flush thread); its checksums are kept in the slot once known."""
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
            slot.line,
            slot.saved_at,
        )
        with open(slot.path, "rb") as f:
            m = mmap.mmap(f.fileno(), slot.size_bytes, prot=mmap.PROT_READ)
        try:

            def hashed(full: ShardMeta) -> None:
                self.pool.record_hashed(slot, full)
                on_hashed(full)

            self.nvme.write_shard(meta, memoryview(m), on_hashed=hashed)
        finally:
            with contextlib.suppress(BufferError):  # a traceback may still hold a view; then GC unmaps it
                m.close()

    def flushing(self, job: str, step: int) -> bool:
        """Say whether a shard of the step is still on its way to NVMe (then the step is not sealed yet)."""
        return any(
            s.state in UNFLUSHED and s.shard and (s.shard.job, s.shard.step) == (job, step) for s in self.pool.slots()
        )

    def others_unflushed(self, slot: Slot) -> bool:
        """Say whether another slot holds the same shard, not flushed yet (its rank saved the step again)."""
        return any(s is not slot and s.shard == slot.shard and s.state in UNFLUSHED for s in self.pool.slots())

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps with a shard on its way to NVMe: retention keeps off them (BusySteps)."""
        return {(s.shard.job, s.shard.step) for s in self.pool.slots() if s.state in UNFLUSHED and s.shard}

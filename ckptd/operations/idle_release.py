"""Give back the staging memory of jobs that stopped saving: `[staging] idle_ttl_s` after their last save.

Node starts run_forever() on the event loop at start-up. Every CHECK_S (or sooner
for a short TTL) it asks the pool for the jobs whose last save is older than the TTL and
none of whose slots is being written or flushed; for each, on the cleanup thread, it
checks that NVMe holds every snapshot those slots hold (a slot whose flush failed keeps
the only copy: it stays), then drops the job's slots from the pool on the event loop
(checking again that nothing started meanwhile) and unlinks their files on the thread.
Loads of that job then come from NVMe. A training process that still maps a slot keeps
its memory until it unmaps it, which its next save does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from ckpt_core.errors import InvalidArgument

from ckptd.save.staging import SlotPool
from ckptd.tiers.base import ShardSink
from ckptd.tiers.slot_files import UNFLUSHED, Slot

log = logging.getLogger(__name__)

CHECK_S = 60.0
BUSY_STATES = frozenset({"allocating", "writing", "committing"}) | UNFLUSHED


class IdleRelease:
    """Release the slots of jobs idle for longer than the TTL, once their snapshots are durable."""

    def __init__(self, pool: SlotPool, nvme: ShardSink, idle_ttl_s: float, thread: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.nvme = nvme
        self.idle_ttl_s = idle_ttl_s
        self.thread = thread
        self.released_bytes = 0

    def idle_jobs(self) -> list[str]:
        """Return the jobs past the TTL with no slot being written or flushed (event loop)."""
        now = time.monotonic()
        slots: dict[str, list[Slot]] = {}
        for s in self.pool.slots():
            slots.setdefault(s.job, []).append(s)
        return [
            job
            for job, held in slots.items()
            if now - self.pool.last_saved_at(job, now) >= self.idle_ttl_s
            and not any(s.state in BUSY_STATES for s in held)
        ]

    async def run_forever(self) -> None:
        """Check for idle jobs until cancelled (a task of the lifecycle)."""
        if self.idle_ttl_s <= 0:
            return
        while True:
            await asyncio.sleep(min(CHECK_S, max(0.2, self.idle_ttl_s / 4)))
            for job in self.idle_jobs():
                try:
                    await self.release(job)
                except OSError as e:  # a file that would not go: tried again next time
                    log.warning("could not release the staging slots of job %s: %s", job, e)

    async def release(self, job: str) -> bool:
        """Release a job's slots if NVMe holds every snapshot in them; return whether they went."""
        loop = asyncio.get_running_loop()
        held = [s for s in self.pool.slots() if s.job == job]
        if not await loop.run_in_executor(self.thread, self._all_durable, held):
            return False
        if job not in self.idle_jobs():
            return False  # saved again meanwhile
        dropped = self.pool.drop_job(job)
        size = sum(s.size_bytes for s in dropped)
        await loop.run_in_executor(self.thread, _unlink, dropped)
        self.released_bytes += size
        log.info("released %d staging slots (%d bytes) of job %s, idle for %.0f s", len(dropped), size, job,
                 self.idle_ttl_s)  # fmt: skip
        return True

    async def remove(self, job: str, dry_run: bool) -> list[Slot]:
        """Give back every slot of a job now (`gc --all`), durable or not; refuse while one is in use."""
        held = [s for s in self.pool.slots() if s.job == job]
        if any(s.state in BUSY_STATES for s in held):
            raise InvalidArgument(f"job {job} is still saving on this node: stop it, or wait for its last flush")
        if dry_run:
            return held
        dropped = self.pool.drop_job(job)
        await asyncio.get_running_loop().run_in_executor(self.thread, _unlink, dropped)
        if dropped:  # a caller may ask again and again: nothing removed, nothing to say
            log.info("removed %d staging slots of job %s (gc --all)", len(dropped), job)
        return dropped

    def _all_durable(self, held: list[Slot]) -> bool:
        return all(s.shard is None or (s.meta is not None and self.nvme.holds(s.meta)) for s in held)


def _unlink(slots: list[Slot]) -> None:
    """Remove the slots' files, and the job's staging directory once empty (a worker thread)."""
    for s in slots:
        for path in (s.path, s.meta_path, s.pending_path, s.layout_path):
            path.unlink(missing_ok=True)
    for directory in {s.path.parent for s in slots}:
        with contextlib.suppress(OSError):  # not empty: another rank's slot appeared meanwhile
            directory.rmdir()

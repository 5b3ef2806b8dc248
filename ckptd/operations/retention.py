"""Retention: which steps each tier drops (past the newest N complete ones, abandoned partial ones), and the runner.

plan_removals is the rule, a pure function. RetentionRunner applies it tier by tier;
every component that holds a step implements BusySteps, and the runner asks them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from ckpt.errors import CheckpointError

from ckptd.config import Config
from ckptd.replication.peering import Peering
from ckptd.save.uploading import Uploader
from ckptd.tiers.base import DurableTier
from ckptd.tiers.object.tier import ObjectTier

log = logging.getLogger(__name__)

RETAINED_TIERS = ("nvme", "peer", "object")  # the tiers [retention] applies to


def plan_removals(all_steps: list[int], complete_steps: list[int], keep: int, busy: set[int]) -> list[tuple[int, str]]:
    """Return (step, reason) for each step to remove from a tier, oldest first.

    keep is the number of newest complete steps to keep (0 keeps all). An
    incomplete step older than the newest complete one can no longer complete
    unless a shard of it is still being written. A busy step is never removed
    (being written, read by a load, or not yet on a slower tier), nor is the
    newest complete step.
    """
    complete = sorted(complete_steps)
    removals: dict[int, str] = {}
    if keep > 0:
        for step in complete[:-keep]:
            if step not in busy:
                removals[step] = f"older than the newest {keep} complete steps"
    if complete:
        newest = complete[-1]
        for step in all_steps:
            if step < newest and step not in complete and step not in busy:
                removals[step] = "incomplete, and older than the newest complete step"
        removals.pop(newest, None)
    return sorted(removals.items())


class BusySteps(Protocol):
    """Anything that holds steps retention must not remove: being flushed, sealed, received, fetched, read, sent."""

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the (job, step) this component holds now. Called on the event loop."""
        ...


@dataclass(frozen=True)
class Removal:
    """One step that gc removes (or would remove) from a tier, and why."""

    tier: str
    job: str
    step: int
    reason: str


class RetentionRunner:
    """Apply [retention] to each tier: what the config no longer keeps goes, busy steps stay.

    Called on the event loop: after a step is sealed (NVMe and the replica store),
    after a step is committed in the store (object), from reconciliation, and from
    `ckptd gc`. One pass at a time. Listing and removing run on the cleanup thread
    (lowest CPU priority) or, for the store, on the object threads.
    """

    def __init__(
        self,
        config: Config,
        durable_tiers: list[DurableTier],
        object_tier: ObjectTier | None,
        peering: Peering,
        holders: list[BusySteps],
        object_threads: ThreadPoolExecutor,
        cleanup_thread: ThreadPoolExecutor,
        uploader: Uploader | None = None,
    ) -> None:
        """object_threads: queries and removals in the object store; cleanup_thread: one thread, started with
        lowest_priority as its initializer, for local removals."""
        self.config = config
        self.durable_tiers = durable_tiers
        self.object_tier = object_tier
        self.peering = peering
        self.holders = holders
        self.uploader = uploader  # its steps not yet committed in the store stay there too
        self._object_threads = object_threads
        self._lock = asyncio.Lock()  # one pass at a time: two would race to remove the same step
        self.cleanup_thread = cleanup_thread
        self._tasks: set[asyncio.Task[None]] = set()

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return every step some holder keeps (asked now, after any await)."""
        return set().union(*(h.busy_steps() for h in self.holders))

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
        async with self._lock:
            removals = await self._collect_local(dry_run, job, keep_newest, tiers)
            if "object" in tiers and self.object_tier is not None:
                busy = self.busy_steps() | (self.uploader.unsettled_steps() if self.uploader else set())
                removals += await self._on_object_threads(
                    self._collect_object, dry_run, job, keep_newest, busy, unfinished_uploads
                )
            return removals

    async def collect_quietly(self, job: str, tiers: tuple[str, ...], keep_newest: bool = True) -> None:
        """Run a pass of its own accord; a failure is logged (the next pass tries again)."""
        try:
            await self.collect(dry_run=False, job=job, tiers=tiers, keep_newest=keep_newest, unfinished_uploads=False)
        except (CheckpointError, OSError) as e:
            log.warning("retention for %s on %s failed: %s", job or "every job", ", ".join(tiers), e)

    def collect_soon(self, job: str, tiers: tuple[str, ...]) -> None:
        """Start a pass of its own accord from a plain callback on the event loop."""
        task = asyncio.get_running_loop().create_task(self.collect_quietly(job, tiers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _collect_local(self, dry_run: bool, job: str, keep_newest: bool, tiers: tuple[str, ...]) -> list[Removal]:
        loop = asyncio.get_running_loop()
        removals: list[Removal] = []
        for tier in [t for t in self.durable_tiers if t.name in tiers]:
            keep = getattr(self.config.retention, tier.name) if keep_newest else 0
            if not dry_run:
                await loop.run_in_executor(self.cleanup_thread, tier.retry_removals)
            for j in [job] if job else await loop.run_in_executor(self.cleanup_thread, tier.jobs):
                # A step that looks abandoned here may be complete in the cluster (its commit
                # notice missed while this node was down): adopt it rather than remove it.
                await self.peering.adopt_missed_commits(tier, j)
                steps = await loop.run_in_executor(self.cleanup_thread, _steps_of, tier, j)
                busy = self.busy_steps()  # now, after the awaits above
                all_steps, complete, damaged = steps
                plan = plan_removals(all_steps, complete, keep, {s for bj, s in busy if bj == j} | damaged)
                for step, reason in plan:
                    if not dry_run and (j, step) in self.busy_steps():
                        continue  # taken meanwhile, while an earlier step was being removed (a load pointed at it)
                    removals.append(Removal(tier.name, j, step, reason))
                    if not dry_run:
                        await loop.run_in_executor(self.cleanup_thread, tier.remove_step, j, step)
                        log.info("removed %s step %d from %s: %s", j, step, tier.name, reason)
        return removals

    def _collect_object(
        self, dry_run: bool, job: str, keep_newest: bool, busy: set[tuple[str, int]], unfinished_uploads: bool
    ) -> list[Removal]:
        """Apply [retention] object to the object store (on an object thread: every call is a request)."""
        tier = self.object_tier
        assert tier is not None
        removals = []
        keep = self.config.retention.object if keep_newest else 0
        for j in [job] if job else tier.jobs():
            complete = tier.complete_steps(j)
            plan = plan_removals(
                all_steps=tier.all_steps(j, scan=unfinished_uploads),  # gc: what crashes left under the hash prefixes
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

    async def remove_job(self, job: str, dry_run: bool, tiers: tuple[str, ...]) -> list[Removal]:
        """Remove every step of a finished job from the named tiers of this node (`ckptd gc --job J --all`)."""
        reason = "the job is removed (gc --all)"
        loop = asyncio.get_running_loop()
        removals: list[Removal] = []
        async with self._lock:
            for tier in [t for t in self.durable_tiers if t.name in tiers]:
                for step in await loop.run_in_executor(self.cleanup_thread, tier.all_steps, job):
                    removals.append(Removal(tier.name, job, step, reason))
                    if not dry_run:
                        await loop.run_in_executor(self.cleanup_thread, tier.remove_step, job, step)
            if "object" in tiers and self.object_tier is not None:
                store = self.object_tier
                steps = await self._on_object_threads(store.all_steps, job, True)  # the hash prefixes listed now
                for step in steps:
                    removals.append(Removal(store.name, job, step, reason))
                    if not dry_run:
                        await self._on_object_threads(store.remove_step, job, step)
        if removals and not dry_run:
            log.info("removed job %s from %s: %d steps", job, ", ".join(tiers), len(removals))
        return removals

    def removal_failures(self) -> int:
        """Return how many step removals failed on this node's disks since start (each is retried)."""
        return sum(t.removal_failures for t in self.durable_tiers)

    async def drain(self) -> None:
        """Let passes under way finish."""
        while self._tasks:  # a pass may start another as it ends
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _on_object_threads(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._object_threads, fn, *args)


def _steps_of(tier: DurableTier, job: str) -> tuple[list[int], list[int], set[int]]:
    """Return (every step, complete steps, damaged steps) of a job on a tier (reads the disk)."""
    return tier.all_steps(job), tier.complete_steps(job), set(tier.damaged_steps(job))


def lowest_priority() -> None:
    """Run the calling thread at the lowest CPU priority (the cleanup thread's initializer).

    Removing old steps is never urgent: unlinking gigabytes (with discard, seconds of
    kernel time) yields to training and to flushes.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux

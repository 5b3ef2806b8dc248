"""Retention: which steps each tier drops (past the newest N complete ones, abandoned partial ones), and the runner.

plan_removals is the rule, a pure function. RetentionRunner applies it tier by tier;
every component that holds a step implements BusySteps, and the runner asks them all.
Retention decides what goes; the save path removes it (SavePath.release, under the lock
that seals): no step leaves a tier's catalog any other way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ckpt_core.errors import CheckpointError, NotFound
from ckpt_core.history import History, Line

from ckptd.config import Config
from ckptd.errors import RemovalRefused, StepChanged
from ckptd.keyed import SharedLocks
from ckptd.operations.job_retention import JobRetention
from ckptd.save.save_path import LOCAL_TIERS
from ckptd.save.uploading import Uploader
from ckptd.tiers.base import DurableTier, Listed, StepCatalog, WrittenTier
from ckptd.tiers.slot_files import Slot

log = logging.getLogger(__name__)

RETAINED_TIERS = ("nvme", "peer", "object")  # the tiers [retention] applies to
STEPS_NAMED = 10  # a NotFound names at most this many of the job's steps (as a load's does)

Occasion = Literal["sealed", "uploaded", "started", "caught up", "gc"]


@dataclass(frozen=True)
class Pass:
    """What a retention pass does on one occasion (see PASSES)."""

    tiers: tuple[str, ...]
    keep_newest: bool = True  # False: only incomplete steps that can no longer complete go
    unfinished_uploads: bool = False  # the store's crash leftovers too (never unasked: another node may own them)
    quiet: bool = False  # a failure is logged (the next pass tries again), not raised


# Every pass retention runs, by what starts it: RetentionRunner.retain is the one entry point.
PASSES: dict[Occasion, Pass] = {
    "sealed": Pass(LOCAL_TIERS),  # a step sealed here (SavePath.after_flush; its failure goes to the rank waiting)
    "uploaded": Pass(("object",), quiet=True),  # a step committed in the store (SavePath.upload_changed)
    "started": Pass(LOCAL_TIERS, keep_newest=False, quiet=True),  # start-up, before any save (Node.start)
    "caught up": Pass(LOCAL_TIERS),  # after each round of catching up with the peers: adopted commits (Node)
    "gc": Pass(RETAINED_TIERS, unfinished_uploads=True),  # `ckptd gc` (the Collect RPC)
}


def plan_removals(
    all_steps: Iterable[int],
    lines: Mapping[int, Line],
    keep: int,
    busy: Collection[int],
    keep_every: int = 0,
    pinned: Collection[int] = (),
) -> list[tuple[int, str]]:
    """Return (step, reason) for each step to remove from a tier, in the order to remove them.

    lines: the line of each complete step on the tier (ckpt_core.history). The job's line
    orders them: first the superseded steps (off the line), oldest first; then the steps
    of the line older than its newest `keep` (0 keeps every complete step, superseded
    ones too), except those that are multiples of keep_every (0: none); then the
    incomplete steps older than the head (the newest step of the line), which can no
    longer complete unless a shard of them is still being written. Never removed: the
    head, a busy step (being written, read by a load, or not yet on a slower tier), a
    pinned one (`ckptd pin`). Steps saved before lines existed are all on the first
    line: for them this is the newest `keep` by number, as before lines.
    """
    history = History.of(lines)
    spared = set(busy) | set(pinned)
    removals: list[tuple[int, str]] = []
    if history.head is None:
        return removals
    if keep > 0:
        removals += [
            (step, f"superseded: off the job's line (its head is step {history.head})")
            for step in history.superseded
            if step not in spared
        ]
        multiples = {s for s in history.in_line if keep_every and s % keep_every == 0}
        removals += [
            (step, f"older than the newest {keep} complete steps")  # of the line; as worded before lines
            for step in history.in_line[:-keep]
            if step not in spared and step not in multiples
        ]
    removals += [
        (step, "incomplete, and older than the newest complete step")
        for step in sorted(all_steps)
        if step < history.head and step not in lines and step not in spared
    ]
    return [(step, reason) for step, reason in removals if step != history.head]


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

    Called on the event loop, through retain() (PASSES names each occasion): after a step is
    sealed (NVMe and the replica store), after a step is committed in the store (object), at
    start-up, after each round of reconciliation, and from `ckptd gc`. One pass at a time on
    this node's tiers, and one on the store: a pass on the store (a listing of a long history
    there, after a restart) never holds up NVMe's, nor reconciliation's. `ckptd rm`, `gc --all`
    and pins hold off both. Listing runs on the cleanup thread (lowest CPU priority) or, for the
    store, on the object threads; each removal is the save path's (release).
    """

    def __init__(
        self,
        config: Config,
        durable_tiers: list[DurableTier],
        object_tier: WrittenTier | None,
        adopt_missed_commits: Callable[[DurableTier, str], Awaitable[None]],
        release: Callable[[StepCatalog, str, int, Listed | None], Awaitable[None]],
        release_slots: Callable[[str, int, bool], Awaitable[list[Slot]]],
        holders: list[BusySteps],
        object_threads: ThreadPoolExecutor,
        cleanup_thread: ThreadPoolExecutor,
        job_retention: JobRetention,
        steps_in_use: SharedLocks[tuple[str, int]],
        uploader: Uploader | None = None,
    ) -> None:
        """object_threads: queries in the object store; cleanup_thread: one thread, started with lowest_priority
        as its initializer, for local listings and the removals that failed before (retry_removals, of steps
        unlisted already); job_retention: each job's settings and pins; steps_in_use: held shared by a load's
        locate (Locator) and alone here around each removal, so that a step a load is taking up stays.

        The save path's, which alone seals, adopts and removes (awaited on the event loop):
        adopt_missed_commits(tier, job) before each job's pass on a local tier; release(tier, job, step, listed)
        removes a step from a tier (SavePath.release); release_slots(job, step, dry_run) drops a step's staging
        slots (`ckptd rm`)."""
        self.config = config
        self.job_retention = job_retention
        self.durable_tiers = durable_tiers
        self.object_tier = object_tier
        self._adopt_missed_commits = adopt_missed_commits
        self._release = release
        self._release_slots = release_slots
        self.holders = holders
        self.uploader = uploader  # its steps not yet committed in the store stay there too
        self._object_threads = object_threads
        # One pass at a time on each: two would race to remove the same step.
        self._local_lock = asyncio.Lock()
        self._object_lock = asyncio.Lock()
        self.cleanup_thread = cleanup_thread
        self._tasks: set[asyncio.Task[list[Removal]]] = set()
        self._steps_in_use = steps_in_use

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return every step some holder keeps (asked now, after any await)."""
        return set().union(*(h.busy_steps() for h in self.holders))

    async def retain(self, occasion: Occasion, job: str = "", dry_run: bool = False) -> list[Removal]:
        """Run the pass of an occasion (PASSES) for a job, or every job: the one entry point of retention.

        Remove what the config says not to keep; with dry_run (`ckptd gc --dry-run`) only report
        it. A quiet occasion's failure is logged, and the pass returns what it removed: nothing.
        """
        how = PASSES[occasion]
        try:
            return await self._collect(dry_run, job, how)
        except (CheckpointError, OSError) as e:
            if not how.quiet:
                raise
            log.warning("retention for %s on %s failed: %s", job or "every job", ", ".join(how.tiers), e)
            return []

    def retain_soon(self, occasion: Occasion, job: str) -> None:
        """Start retain() from a plain callback on the event loop; drain() waits for it."""
        task = asyncio.get_running_loop().create_task(self.retain(occasion, job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _collect(self, dry_run: bool, job: str, how: Pass) -> list[Removal]:
        """Apply retention on the tiers of a pass, this node's first, then the store's."""
        async with self._local_lock:
            removals = await self._collect_local(dry_run, job, how.keep_newest, how.tiers)
        if "object" in how.tiers and self.object_tier is not None:
            async with self._object_lock:
                busy = self.busy_steps() | (self.uploader.unsettled_steps() if self.uploader else set())
                removals += await self._collect_object(dry_run, job, how.keep_newest, busy, how.unfinished_uploads)
        return removals

    @contextlib.asynccontextmanager
    async def _every_pass_held_off(self) -> AsyncIterator[None]:
        """Hold both locks, local first (collect takes one at a time: no deadlock)."""
        async with self._local_lock, self._object_lock:
            yield

    async def _collect_local(self, dry_run: bool, job: str, keep_newest: bool, tiers: tuple[str, ...]) -> list[Removal]:
        loop = asyncio.get_running_loop()
        removals: list[Removal] = []
        for tier in [t for t in self.durable_tiers if t.name in tiers]:
            if not dry_run:
                await loop.run_in_executor(self.cleanup_thread, tier.retry_removals)
            for j in [job] if job else await loop.run_in_executor(self.cleanup_thread, tier.jobs):
                # A step that looks abandoned here may be complete in the cluster (its commit
                # notice missed while this node was down): adopt it rather than remove it.
                await self._adopt_missed_commits(tier, j)  # asks the save path
                steps = await loop.run_in_executor(self.cleanup_thread, _steps_of, tier, j)
                busy = self.busy_steps()  # now, after the awaits above
                policy = self.job_retention.effective(j)  # pins change only under this pass's lock
                all_steps, lines, damaged = steps
                plan = plan_removals(
                    all_steps,
                    lines,
                    policy.keep[tier.name] if keep_newest else 0,
                    {s for bj, s in busy if bj == j} | damaged,
                    policy.keep_every,
                    policy.pinned,
                )
                for step, reason in plan:
                    if dry_run:
                        removals.append(Removal(tier.name, j, step, reason))
                    elif await self._release_unused(tier, j, step, Listed(lines.get(step))):
                        removals.append(Removal(tier.name, j, step, reason))
                        log.info("removed %s step %d from %s: %s", j, step, tier.name, reason)
        return removals

    async def _release_unused(self, tier: StepCatalog, job: str, step: int, listed: Listed | None) -> bool:
        """Remove a planned step from a tier unless a role took it up since the plan; say whether it went.

        Alone on the step against loads' locates (steps_in_use): one under way keeps the step (it
        may be fetching a copy onto NVMe, its lease not taken yet), and one that begins meanwhile
        waits for the removal, then finds the step gone and fetches it afresh. Never waits on a
        load: a retention pass is not held up by a slow fetch. Without that, a load could be
        pointed at a copy just before the removal planned earlier took it away. listed: what the
        pass's listing showed of the step; the tier removes it only if it is still so (a rollback's
        line may have begun saving the same step number again: its new shard must not go with it);
        None (`ckptd rm`): whatever the step holds.
        """
        async with self._steps_in_use.alone_if_free((job, step)) as free:
            if not free or (job, step) in self.busy_steps():
                return False  # taken meanwhile (a load locating it, a lease, a fetch, a write)
            try:
                await self._release(tier, job, step, listed)
            except StepChanged as e:
                log.info("%s", e)
                return False
            return True

    async def _collect_object(
        self, dry_run: bool, job: str, keep_newest: bool, busy: set[tuple[str, int]], unfinished_uploads: bool
    ) -> list[Removal]:
        """Apply [retention] object to the object store (its requests on the object threads)."""
        tier = self.object_tier
        assert tier is not None
        removals = []
        for j in [job] if job else await self._on_object_threads(tier.jobs):
            plan, crashed = await self._on_object_threads(
                self._plan_object, tier, j, keep_newest, busy, unfinished_uploads
            )
            for step, reason, listed in plan:
                if dry_run:
                    removals.append(Removal(tier.name, j, step, reason))
                elif await self._release_unused(tier, j, step, listed):
                    removals.append(Removal(tier.name, j, step, reason))
                    log.info("removed %s step %d from object: %s", j, step, reason)
            for step in crashed:
                removals.append(Removal(tier.name, j, step, "unfinished multipart uploads of a crashed upload"))
                if not dry_run:
                    count = await self._on_object_threads(tier.abort_unfinished, j, step)
                    log.info("aborted %d unfinished upload(s) of %s step %d in the object store", count, j, step)
        return removals

    def _plan_object(
        self, tier: WrittenTier, job: str, keep_newest: bool, busy: set[tuple[str, int]], unfinished_uploads: bool
    ) -> tuple[list[tuple[int, str, Listed]], list[int]]:
        """Return (the steps to remove from the store with why and as listed, the steps whose crashed uploads to
        abort) of a job.

        On an object thread: every call is a request.
        """
        policy = self.job_retention.effective(job)  # read only here; changed on the event loop, under the pass's lock
        lines = tier.complete_lines(job)
        plan = plan_removals(
            all_steps=tier.all_steps(job, afresh=unfinished_uploads),  # gc: what crashes left under the hash prefixes
            lines=lines,
            keep=policy.keep["object"] if keep_newest else 0,
            busy={s for bj, s in busy if bj == job} | set(tier.damaged_steps(job)),
            keep_every=policy.keep_every,
            pinned=policy.pinned,
        )
        listed = [
            (step, reason, Listed(lines.get(step))) for step, reason in plan if unfinished_uploads or step in lines
        ]
        if not unfinished_uploads:
            return listed, []
        # Uploads a crash left unfinished, of steps no upload of this node will resume:
        # their parts cost storage and no listing shows them.
        newest = max(tier.complete_steps(job), default=-1)
        planned = {step for step, _ in plan}
        crashed = [
            step
            for step in tier.unfinished_steps(job)
            if step <= newest and (job, step) not in busy and step not in planned
        ]
        return listed, crashed

    async def remove_job(self, job: str, dry_run: bool, tiers: tuple[str, ...]) -> list[Removal]:
        """Remove every step of a finished job from the named tiers of this node (`ckptd gc --job J --all`)."""
        reason = "the job is removed (gc --all)"
        loop = asyncio.get_running_loop()
        removals: list[Removal] = []
        async with self._every_pass_held_off():
            for tier in [t for t in self.durable_tiers if t.name in tiers]:
                for step in await loop.run_in_executor(self.cleanup_thread, tier.all_steps, job):
                    removals.append(Removal(tier.name, job, step, reason))
                    if not dry_run:
                        await self._release(tier, job, step, None)
            if "object" in tiers and self.object_tier is not None:
                store = self.object_tier
                steps = await self._on_object_threads(store.all_steps, job, True)  # the hash prefixes listed now
                for step in steps:
                    removals.append(Removal(store.name, job, step, reason))
                    if not dry_run:
                        await self._release(store, job, step, None)
        if removals and not dry_run:
            log.info("removed job %s from %s: %d steps", job, ", ".join(tiers), len(removals))
        return removals

    async def remove_one(
        self, job: str, step: int, force: bool, dry_run: bool, object_too: bool = False
    ) -> list[Removal]:
        """Remove one step from every tier of this node that has any of it (`ckptd rm`): its durable copies, then its
        settled staging slots; from the object store, which every node shares, only with object_too (`--tier object`).

        Refused (RemovalRefused) while a role is busy with the step, for the job's head (the
        newest step of its line on this node) and for a pinned step, unless force (never a
        busy one); NotFound names the job's steps here when no tier has it. The pin of a
        removed step goes too. One pass at a time: under the lock of every pass.
        """
        async with self._every_pass_held_off():
            held = await self._holding(job, in_store=object_too)
            steps = {s for on_tier, _ in held.values() for s in on_tier}
            if step not in steps:
                store = "" if object_too or self.object_tier is None else " (the object store not asked: --tier object)"
                raise _not_here(job, step, steps, f"on no tier of this node{store}")
            if (job, step) in self.busy_steps():
                raise RemovalRefused(
                    f"{job} step {step} is in use on this node (being written, replicated or uploaded, or "
                    "pointed at by a load in the last 10 minutes): try again later"
                )
            lines = {s: line for _, tier_lines in held.values() for s, line in tier_lines.items()}
            head = History.of(lines).head
            pinned = step in self.job_retention.pinned(job)
            if step == head and not force:
                raise RemovalRefused(
                    f"{job} step {step} is the job's head (the newest step of its line): the job's next load of "
                    f"its latest step would go back to an older one; pass --force to remove it anyway"
                )
            if pinned and not force:
                raise RemovalRefused(
                    f"{job} step {step} is pinned: unpin it first (ckptd unpin --job {job} --step {step}), "
                    "or pass --force"
                )
            reason = "removed by ckptd rm" + (" --force (the job's head)" if step == head else "")
            removals: list[Removal] = []
            tiers: list[WrittenTier] = [*self.durable_tiers]
            if object_too and self.object_tier is not None:
                tiers.append(self.object_tier)
            for tier in [t for t in tiers if step in held[t.name][0]]:
                if not dry_run and not await self._release_unused(tier, job, step, None):
                    raise RemovalRefused(f"{job} step {step} was taken up by a load meanwhile: try again later")
                removals.append(Removal(tier.name, job, step, reason))
                if not dry_run:
                    log.info("removed %s step %d from %s: %s", job, step, tier.name, reason)
            if pinned and not dry_run:
                await self.job_retention.set_pin(job, step, False)
            slots = await self._release_slots(job, step, dry_run)
            return removals + [Removal("memory", job, step, f"rank {s.rank}'s staging slot") for s in slots]

    async def pin(self, job: str, step: int, pinned: bool) -> list[int]:
        """Pin a step complete on some tier of this node (else NotFound), or unpin one; return the job's pins.

        Under the lock of every pass: a pass under way ends before the pin counts, and none
        removes the step after this returns.
        """
        async with self._every_pass_held_off():
            if pinned:
                held = await self._holding(job, in_store=False)  # this node's disks first: the store may be away
                complete = {s for _, lines in held.values() for s in lines}
                if step not in complete and self.object_tier is not None:
                    complete |= set(await self._on_object_threads(self.object_tier.complete_lines, job))
                if step not in complete:
                    raise _not_here(job, step, complete, "not complete on any tier of this node", "complete ")
            return sorted(await self.job_retention.set_pin(job, step, pinned))

    async def _holding(self, job: str, in_store: bool = True) -> dict[str, tuple[list[int], dict[int, Line]]]:
        """Return, by tier of this node, (every step of the job there, the line of each complete one).

        in_store: the object store too, if one is configured (a store that does not answer raises CheckpointError).
        """
        loop = asyncio.get_running_loop()
        held = {}
        for tier in self.durable_tiers:
            every, lines, _ = await loop.run_in_executor(self.cleanup_thread, _steps_of, tier, job)
            held[tier.name] = (every, lines)
        if in_store and self.object_tier is not None:
            store = self.object_tier

            def listed() -> tuple[list[int], dict[int, Line]]:
                return store.all_steps(job), store.complete_lines(job)

            held[store.name] = await self._on_object_threads(listed)
        return held

    def removal_failures(self) -> int:
        """Return how many step removals failed on this node's disks since start (each is retried)."""
        return sum(t.removal_failures for t in self.durable_tiers)

    async def drain(self) -> None:
        """Let passes under way finish."""
        while self._tasks:  # a pass may start another as it ends
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _on_object_threads(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._object_threads, fn, *args)


def _not_here(job: str, step: int, steps: Collection[int], why: str, kind: str = "") -> NotFound:
    """Return the NotFound of `ckptd rm` and `ckptd pin` for a step this node lacks, naming the job's steps here."""
    if not steps:
        return NotFound(f"{job} step {step} is {why}: job {job} has no {kind}step here")
    newest = sorted(steps, reverse=True)[:STEPS_NAMED]
    count = f"all {len(steps)}" if len(steps) <= STEPS_NAMED else f"the newest {STEPS_NAMED} of {len(steps)}"
    named = ", ".join(map(str, newest))
    return NotFound(f"{job} step {step} is {why}; job {job}'s {kind}steps here, newest first ({count}): {named}")


def _steps_of(tier: DurableTier, job: str) -> tuple[list[int], dict[int, Line], set[int]]:
    """Return (every step, the line of each complete step, damaged steps) of a job on a tier (reads the disk)."""
    return tier.all_steps(job), tier.complete_lines(job), set(tier.damaged_steps(job))


def lowest_priority() -> None:
    """Run the calling thread at the lowest CPU priority (the cleanup thread's initializer).

    Removing old steps is never urgent: unlinking gigabytes (with discard, seconds of
    kernel time) yields to training and to flushes.
    """
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only, on Linux

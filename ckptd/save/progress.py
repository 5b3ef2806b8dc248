"""Where each shard stands on each tier, and the waiters who asked: one verdict per tier.

The flusher, the replication and the uploader report here as shards move (the flusher
also what it passed over: PassedOver); WaitShard reads the verdicts, and `ckptd status`
and /metrics the newest complete step of each job on each tier (NewestSteps). Everything
runs on the event loop and touches no disk: what was durable before this daemon started
is looked up once per wait, on a lookup thread (Executors.locate: never behind Commit's work).
Every table is bounded (the oldest entries go first).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

from ckpt_core.format import validate_tier
from ckpt_core.shard_key import ShardKey

from ckptd.replication.sending import FAILURES_REPORTED, Replication
from ckptd.save.passed_over import PassedOver
from ckptd.save.staging import SlotPool
from ckptd.save.uploading import FAILURES_REPORTED as UPLOAD_FAILURES_REPORTED
from ckptd.save.uploading import Uploader
from ckptd.tiers.base import ShardReader
from ckptd.tiers.slot_files import UNFLUSHED

log = logging.getLogger(__name__)

REMEMBERED_SHARDS = 1 << 16  # shards known to have reached a tier, for waiters that come after retention
RECENT_ERRORS = 20
MAX_JOBS_REPORTED = 1024  # jobs whose newest complete steps are reported (those completing most recently)

Verdict = Callable[[], "tuple[bool, str] | None"]  # (done, error), or None: not yet


@dataclass(frozen=True)
class ShardWait:
    """What WaitShard answers: done, or why the shard cannot reach the tier (passed_over: saves outran the disk)."""

    done: bool
    error: str = ""
    passed_over: bool = False


@dataclass(frozen=True)
class Completion:
    """A job's newest step complete on a tier, and when it became complete there (unix seconds)."""

    step: int
    unix_s: float
    generation: int = 0  # of the step's line (ckpt_core.history): a rollback's new line is newer whatever its numbers


class NewestSteps:
    """Remember, per job and tier, the newest step that became complete there and when.

    completed() is called on the event loop as steps complete, and from the worker thread
    that seeds it at start-up (hence the lock); forget() when a job is removed from the
    node; by_job() is read by `ckptd status` and /metrics. At most MAX_JOBS_REPORTED jobs
    are kept: the job that completed a step longest ago goes first.
    """

    def __init__(self) -> None:
        self._jobs: OrderedDict[str, dict[str, Completion]] = OrderedDict()
        self._lock = threading.Lock()

    def completed(self, job: str, tier: str, step: int, unix_s: float, generation: int = 0) -> None:
        """Note that a step became complete on a tier; an older step than the one known changes nothing.

        Older is by the job's history: a lower line generation, or the same one and a lower step.
        """
        with self._lock:
            tiers = self._jobs.setdefault(job, {})
            known = tiers.get(tier)
            if known is not None and (known.generation, known.step) >= (generation, step):
                return
            tiers[tier] = Completion(step, unix_s, generation)
            self._jobs.move_to_end(job)
            while len(self._jobs) > MAX_JOBS_REPORTED:
                self._jobs.popitem(last=False)

    def forget(self, job: str, tiers: tuple[str, ...]) -> None:
        """Stop reporting a job on tiers it was removed from (`ckptd gc --job J --all`)."""
        with self._lock:
            held = self._jobs.get(job, {})
            for tier in tiers:
                held.pop(tier, None)
            if not held:
                self._jobs.pop(job, None)

    def by_job(self) -> dict[str, dict[str, Completion]]:
        """Return job -> tier -> its newest complete step (a copy)."""
        with self._lock:
            return {job: dict(tiers) for job, tiers in self._jobs.items()}


class ShardProgress:
    """Keep, per shard, which tiers it reached and why it failed; wake the waiters when that changes.

    Order of calls for one copy of a shard: copy_committed() when its save commits;
    sealing_started() once it is durable on NVMe and its step may be sealed;
    sealing_done() after the seal was tried (the NVMe verdict turns true);
    failed() on any error. reached() records the other tiers. changed() after each.
    step_completed() when a step is sealed on NVMe or committed in the object store;
    reached() itself notes a step complete in memory (every rank's copy committed on this
    node) and on the peer tier (every shard of it committed on this node has its replicas).
    """

    def __init__(
        self,
        pool: SlotPool,
        nvme: ShardReader,
        replication: Replication | None,
        uploader: Uploader | None,
        node: str,
        threads: Executor,
    ) -> None:
        """replication, uploader: None where the tier is not configured; node: this node's name, for messages.

        threads: where a wait looks on NVMe for a shard made durable before this daemon started (Executors.locate:
        a lookup like a load's, never queued behind the Commit work on Executors.save).
        """
        self.pool = pool
        self._threads = threads
        self.nvme = nvme
        self.replication = replication
        self.uploader = uploader
        self.node = node
        self._condition = asyncio.Condition()
        self._failures: OrderedDict[ShardKey, str] = OrderedDict()
        self._reached: OrderedDict[tuple[ShardKey, str], None] = OrderedDict()
        self._sealing: set[ShardKey] = set()  # flushed, and the step not yet sealed (if it can be)
        self.errors: deque[dict[str, Any]] = deque(maxlen=RECENT_ERRORS)
        self.newest = NewestSteps()
        self.passed_over = PassedOver(REMEMBERED_SHARDS, MAX_JOBS_REPORTED)
        self._committed_ranks: OrderedDict[tuple[str, int, int], set[int]] = OrderedDict()  # ranks saved here
        self._generations: OrderedDict[tuple[str, int], int] = OrderedDict()  # (job, step) -> its line's generation
        self._wakers: set[asyncio.Task[None]] = set()

    # -- reports ------------------------------------------------------------------

    def passed_over_by(self, key: ShardKey, newer_step: int) -> None:
        """Remember that a save of newer_step took the slot of key's snapshot before it was flushed."""
        self.passed_over.passed_over(key, newer_step)

    def newest_by_job(self) -> dict[str, dict[str, Completion]]:
        """Return job -> tier -> its newest complete step (for `ckptd status` and /metrics)."""
        return self.newest.by_job()

    def passed_over_by_job(self) -> dict[str, dict[str, int]]:
        """Return job -> how many of its shards were passed over, by tier (for `ckptd status` and /metrics)."""
        return self.passed_over.by_job()

    def forget_job(self, job: str, tiers: tuple[str, ...]) -> None:
        """Stop reporting a job's newest steps on tiers it was removed from (`ckptd gc --job J --all`)."""
        self.newest.forget(job, tiers)

    def copy_committed(self, key: ShardKey, generation: int = 0) -> None:
        """Forget what an earlier copy of the shard reached: the new copy has reached only memory.

        generation is that of the step's line (ckpt_core.history), for the newest steps `status` reports.
        """
        self._generations[(key.job, key.step)] = generation
        self._generations.move_to_end((key.job, key.step))
        _bound(self._generations)
        self._failures.pop(key, None)
        self._reached.pop((key, "nvme"), None)
        self._reached.pop((key, "peer"), None)
        self._sealing.discard(key)  # an earlier copy's seal, still queued, must not count for this one
        self.passed_over.forget(key)
        ranks = self._committed_ranks.setdefault((key.job, key.step, key.world_size), set())
        ranks.add(key.rank)
        self._committed_ranks.move_to_end((key.job, key.step, key.world_size))
        _bound(self._committed_ranks)
        self.reached(key, "memory")

    def sealing_started(self, key: ShardKey) -> None:
        """Say the shard is durable on NVMe, and its step about to be sealed if it can be."""
        self._sealing.add(key)

    def sealing_done(self, key: ShardKey) -> None:
        """Say the seal was tried: the shard counts as on NVMe from now on."""
        if key in self._sealing:  # whatever happened: waiters must hear, retention must not keep off
            self._sealing.discard(key)
            self.reached(key, "nvme")

    def reached(self, key: ShardKey, tier: str) -> None:
        """Remember that the shard reached a tier (kept after retention removes it there); note a step made whole."""
        self._reached[(key, tier)] = None
        _bound(self._reached)
        saved_here = self._committed_ranks.get((key.job, key.step, key.world_size), {key.rank})
        if tier == "memory":
            whole = len(saved_here) == key.world_size  # the memory tier lists a step only with every rank
        else:  # a restarted daemon knows only the shards it handles since: those must have their replicas
            whole = tier == "peer" and all((replace(key, rank=r), tier) in self._reached for r in saved_here)
        if whole:
            self.step_completed(tier, key.job, key.step)

    def failed(self, key: ShardKey, tier: str, message: str) -> None:
        """Record why the shard failed on a tier: its waiters hear it, `status` lists it."""
        log.error("%s", message)
        self._failures[key] = message
        self._failures.move_to_end(key)
        _bound(self._failures)
        self.errors.append({"time_unix_s": time.time(), "tier": tier, "shard": str(key), "error": message})

    def step_failed(self, job: str, step: int, world_size: int, tier: str, message: str) -> None:
        """Record that a step can never be complete: every rank saved here hears why, not that it is on the tier."""
        log.error("%s", message)
        for rank in self._committed_ranks.get((job, step, world_size), set()):
            key = ShardKey(job, step, rank, world_size)
            self._reached.pop((key, tier), None)
            self._failures[key] = message
            self._failures.move_to_end(key)
            self.errors.append({"time_unix_s": time.time(), "tier": tier, "shard": str(key), "error": message})
        _bound(self._failures)

    def step_completed(
        self, tier: str, job: str, step: int, unix_s: float | None = None, generation: int | None = None
    ) -> None:
        """Note that a job's step became complete on a tier, now or at unix_s (for `status` and /metrics).

        generation: of the step's line, where the caller has its record; else as its save said (copy_committed).
        """
        gen = self._generations.get((job, step), 0) if generation is None else generation
        self.newest.completed(job, tier, step, time.time() if unix_s is None else unix_s, gen)

    async def changed(self) -> None:
        """Wake every waiter to look again."""
        async with self._condition:
            self._condition.notify_all()

    def changed_soon(self) -> None:
        """Wake every waiter from a plain callback on the event loop."""
        task = asyncio.get_running_loop().create_task(self.changed())
        self._wakers.add(task)
        task.add_done_callback(self._wakers.discard)

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps being sealed: retention keeps off them (BusySteps)."""
        return {(k.job, k.step) for k in self._sealing}

    # -- waiting ------------------------------------------------------------------

    async def wait(self, key: ShardKey, tier: str, timeout_s: float, object_step: Any) -> ShardWait:
        """Return whether a shard reached a tier, or why it cannot, waiting up to timeout_s for it.

        A shard passed over on NVMe (a newer save replaced it before its flush) cannot reach
        nvme, peer nor object: the answer says so at once; memory answers as for any save.

        object_step(job, step) is awaited for whether the step is complete in the store ([step], [] or None), when
        an upload may have finished before this daemon started.
        """
        validate_tier(tier)
        if (tier == "object" and self.uploader is None) or (tier == "peer" and self.replication is None):
            # A poll (SaveHandle.done) asks whether, and the answer is no; a wait would never end, so it is refused.
            return ShardWait(False, "" if timeout_s == 0 else f"tier {tier} is not configured on node {self.node}")
        if tier == "object":
            verdict = await self._upload_verdict(key, object_step)
        elif tier == "peer":
            verdict = self._replica_verdict(key)
        else:
            on_disk = tier == "nvme" and await asyncio.get_running_loop().run_in_executor(
                self._threads, self.nvme.has_shard, key.job, key.step, key.rank
            )

            def verdict() -> tuple[bool, str] | None:
                return (True, "") if self._reached_tier(key, tier, on_disk) else None

        deadline = time.monotonic() + timeout_s
        async with self._condition:
            while True:
                passed_over = self.passed_over.why(key) if tier != "memory" else None
                if passed_over is not None:
                    return ShardWait(False, passed_over, passed_over=True)
                answer = verdict()
                if answer is not None:
                    return ShardWait(*answer)
                if key in self._failures:
                    return ShardWait(False, self._failures[key])
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return ShardWait(False)
                try:
                    await asyncio.wait_for(self._condition.wait(), remaining)
                except TimeoutError:
                    return ShardWait(False)

    def _reached_tier(self, key: ShardKey, tier: str, on_disk_before: bool) -> bool:
        if (key, tier) in self._reached:
            return True
        if tier == "memory":
            return any(s.shard == key and s.state != "writing" for s in self.pool.slots())
        if (
            key in self._failures
            or key in self._sealing
            or any(s.shard == key and s.state in UNFLUSHED for s in self.pool.slots())
        ):
            return False  # the copy being flushed is the one asked about, not an older one on disk
        return on_disk_before  # durable before this daemon started, or before this copy was tracked

    def _replica_verdict(self, key: ShardKey) -> Verdict:
        replication = self.replication
        assert replication is not None  # wait() answered already where the tier is not configured
        # Read before any await: a replica failing so far was just retried (SavePath.wait_shard), and the
        # waiter hears how that fresh attempt goes.
        attempts_before = replication.state(key)[3]

        def verdict() -> tuple[bool, str] | None:
            done, error, failures, attempts = replication.state(key)
            if done or (key, "peer") in self._reached:
                return True, ""
            if attempts <= attempts_before:
                return None
            unreachable = replication.unreachable(key)  # no peer answers: said after one fresh attempt, not three
            if unreachable or failures >= FAILURES_REPORTED:
                return False, unreachable or error
            return None

        return verdict

    async def _upload_verdict(self, key: ShardKey, object_step: Any) -> Verdict:
        uploader = self.uploader
        assert uploader is not None
        if not uploader.wanted(key.step):
            error = f"{key.job} step {key.step} is not uploaded: [object] every = {uploader.every}"
            return lambda: (False, error)
        before = uploader.state(key)
        attempts_before = before.attempts if before is not None else 0
        if before is None and key.step in (await object_step(key.job, key.step) or []):
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


def _bound(table: OrderedDict[Any, Any]) -> None:
    while len(table) > REMEMBERED_SHARDS:
        table.popitem(last=False)

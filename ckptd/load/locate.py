"""The load path, in order: locate a rank's shard, fetch what this node lacks, verify it, serve where it lies.

1. locate: the tiers of this node fastest first (memory, NVMe, the replica store), then the
   peers (the cluster's complete steps), then the object store;
2. fetch: a shard no tier of this node holds is copied onto NVMe first, every chunk checked
   (from the peers by ClusterSteps.fetch, from the store here); refetch (the client found this
   node's copies bad) does so over them;
3. verify and serve: the answer is where the bytes lie, fastest first (ShardSource); the
   client reads them itself and checks every chunk again (ckpt_core.shard_io).

Called on the event loop by the Locate, List and GetShard RPCs. Whatever reads the
disk or the store runs on worker threads: this node's tiers on the locate threads,
the store's questions about one step and its fetches on the object threads, listings
of a job's steps there on the listing threads, bounded in time (a hung store never
holds up a load). A shard that no tier of this node holds is fetched onto NVMe first, verified;
refetch (the client found this node's copies bad) does so over them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, counted, digest, validate_tier
from ckpt_core.history import History, Line, generation
from ckpt_core.shard_io import ShardSource

from ckptd.config import Config
from ckptd.keyed import KeyCounts, KeyedLocks, SharedLocks
from ckptd.load.cluster_steps import ClusterSteps
from ckptd.load.fetch import fetch_shard
from ckptd.storage.object_store import shown_url
from ckptd.tiers.base import DurableTier, Tier, has_committed_shard
from ckptd.tiers.catalog import StepInfo, head_of, list_steps, merge_steps, with_superseded

log = logging.getLogger(__name__)
Answer = TypeVar("Answer")

OBJECT_QUERY_TIMEOUT_S = 5.0
# A store asked for a step no other tier has (or has good), or for a job's steps where no other tier knows any,
# is the load's last resort: waiting longer beats failing (DESIGN, guarantee 7; OPERATIONS runbook h).
OBJECT_LAST_RESORT_S = 120.0
STILL_WAITING_EVERY_S = 10.0  # a wait on the store that long or longer says so in the log at this pace
LOAD_LEASE_S = 600.0  # how long retention keeps off a step a load was pointed at
STEPS_NAMED = 10  # a load of a step that is not complete names at most this many of the job's complete steps


class Locator:
    """Point loads at the fastest good copy of a shard, fetching it onto this node when none is here."""

    def __init__(
        self,
        config: Config,
        tiers: list[Tier],
        nvme: DurableTier,
        replica_store: DurableTier,
        cluster: ClusterSteps,
        with_peers: bool,
        object_tier: Tier | None,
        verification_failed: Callable[[str], None],
        threads: ThreadPoolExecutor,
        object_threads: ThreadPoolExecutor,
        listing_threads: ThreadPoolExecutor,
        fetch_threads: ThreadPoolExecutor,
        pinned: Callable[[str], Collection[int]],
        steps_in_use: SharedLocks[tuple[str, int]],
    ) -> None:
        """with_peers: a peer tier is on (wherever a cluster view is), read through cluster; object_tier: the store's
        (None: off; str() of it names the store in messages).

        threads: lookups on this node's tiers; object_threads: object-store queries of one step (never behind a
        fetch); fetch_threads: whole shards fetched from the store (ClusterSteps fetches the peers' there too);
        listing_threads: listings of a job's steps in the store, which take long with a long history (and go
        on after a caller stopped waiting): on threads of their own, a load's one question is never behind them.
        pinned(job): the job's pinned steps (JobRetention.pinned, on the event loop), marked in listings.
        steps_in_use: held shared on a step from the moment locate knows it until it answers, so that no
        removal planned before runs meanwhile (RetentionRunner removes a step only while no one holds it).
        """
        self.config = config
        self.tiers = tiers
        self.nvme = nvme
        self.replica_store = replica_store
        self.cluster = cluster
        self.with_peers = with_peers
        self.object_tier = object_tier
        self.verification_failed = verification_failed
        self.threads = threads
        self.object_threads = object_threads
        self.listing_threads = listing_threads
        self.fetch_threads = fetch_threads
        self._pinned = pinned
        self._steps_in_use = steps_in_use
        self._fetch_locks: KeyedLocks[tuple[str, int, int]] = KeyedLocks()  # one fetch of a shard at a time
        self._fetching_from_object: KeyCounts[tuple[str, int]] = KeyCounts()  # ranks of a step may be fetched at once
        self._being_read: dict[tuple[str, int], float] = {}  # steps a client was pointed at, until when

    async def on_locate_threads(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on a locate thread (this node's tiers)."""
        return await asyncio.get_running_loop().run_in_executor(self.threads, fn, *args)

    async def known_steps(self, job: str, step: int | None, tier: str = "auto", refetch: bool = False) -> KnownSteps:
        """Return the job's complete steps a load of step (None: the head) finds on tier: this node's, then beyond.

        The peers are asked when this node lacks the step (for the head, the cluster view
        alone answers), the object store when neither has it (for the head, it is listed),
        and for a refetch with no peers to fetch from (with peers, locate asks the store once
        they fail: a hung store does not hold up a good copy on a peer).
        """
        tiers = self.tiers_for(tier)
        from_peers = tier in ("", "auto", "peer") and self.with_peers
        store = self.object_tier if tier in ("", "auto", "object") else None
        records: dict[int, CommitRecord] = await self.on_locate_threads(_complete_records, tiers, job)
        lines = {s: r.line for s, r in records.items()}
        if from_peers and (step is None or step not in lines):
            for r in await self.cluster.complete_records(job, newest=step is None):
                lines.setdefault(r.step, r.line)
        known = KnownSteps(lines, set(), False)
        if store is not None and (step is None or step not in lines or (refetch and not from_peers)):
            if step is None:  # the job's newest step: a last resort where no other tier knows any
                wait_s = OBJECT_LAST_RESORT_S if not lines else OBJECT_QUERY_TIMEOUT_S
                listed = await self.ask_object_store(
                    store.complete_records, job, listing=True, timeout_s=wait_s, about=f"{job}'s steps"
                )
                for in_store, record in (listed or {}).items():
                    lines.setdefault(in_store, record.line)
                known = KnownSteps(lines, set(listed or {}), listed is None)
            else:  # no copy on this node or its peers, or a bad one here: the store is the last resort
                answer = await self.object_step(job, step, OBJECT_LAST_RESORT_S)
                known = KnownSteps(lines, set(answer or []), answer is None)
        return known

    def next_line(self, job: str, record: CommitRecord, known: KnownSteps) -> Line:
        """Return the line a rank's saves continue after it loads record's step: the head's, or a rollback's new one."""
        lines = dict(known.lines)
        for r in self.cluster.committed(job):
            lines.setdefault(r.step, r.line)
        lines[record.step] = record.line
        return History.of(lines).line_after_load(record.step, record.line)

    async def locate(self, job: str, step: int | None, rank: int, tier: str = "auto", refetch: bool = False) -> Located:
        """Return where a rank's shard of a complete step (None: the job's head) lies, fastest first."""
        from_object = tier in ("", "auto", "object") and self.object_tier is not None
        known = await self.known_steps(job, step, tier, refetch)
        steps, store_silent = known.steps, known.store_silent
        if step is None and known.lines:
            step = History.of(known.lines).head
        if step is None or step not in steps:
            what = f"job {job} has no complete step" if step is None else f"{job} step {step} is not complete"
            if store_silent:
                raise CheckpointError(
                    f"{what} on this node or its peers, and the object store ({shown_url(self.config.object.url)}) "
                    "did not answer: it may hold it; try again"
                )
            raise await self.not_complete(job, step, tier, steps, from_object)
        async with self._steps_in_use.shared((job, step)):
            return await self._locate_step(job, step, rank, tier, refetch, known)

    async def _locate_step(
        self, job: str, step: int, rank: int, tier: str, refetch: bool, known: KnownSteps
    ) -> Located:
        """locate()'s second half, once the step is known complete somewhere: find or fetch the shard here.

        From here on retention keeps off the step (the lease, then the client's reads): a copy
        fetched below is older than the newest steps, and would otherwise go between its fetch and
        the client's read. A removal planned before passes the step over (steps_in_use).
        """
        tiers = self.tiers_for(tier)
        from_peers = tier in ("", "auto", "peer") and self.with_peers
        from_object = tier in ("", "auto", "object") and self.object_tier is not None
        object_steps = known.object_steps
        self.lease_for_reading(job, step)
        record = await self.on_locate_threads(self.commit_record_here, job, step)
        if record is not None and rank >= record.world_size:
            saved_by = counted(record.world_size, "rank")
            raise NotFound(
                f"{job} step {step} has no rank {rank}: it was saved by {saved_by} (world_size "
                f"{record.world_size}). To reshard it onto more ranks, load it with load(step={step}, into=state), "
                "where state holds this rank's tensors (DTensors for the sharded ones) to fill in place"
            )
        if refetch:
            self.verification_failed("nvme")  # the client found this node's copies bad
        if refetch and not (from_peers or from_object):
            raise CorruptCheckpoint(f"{job} step {step} rank {rank}: no other tier to fetch a good copy from")
        fresh = refetch or self.superseded_here(job, record)  # fetch over this node's copies
        sources = [] if fresh else await self.on_locate_threads(self.local_sources, tiers, job, step, rank, record)
        fetched_to = ShardSource(
            tier if tier in ("peer", "object") else "nvme",
            "dir",
            self.nvme.shard_source(job, step, rank).path,
            job,
            step,
        )
        if not sources and from_peers and (refetch or step not in object_steps):
            try:
                await self.cluster.fetch(job, step, rank, replace=fresh)
                sources = [fetched_to]
            except CheckpointError as e:
                if not from_object:
                    raise
                log.warning("%s; trying the object store", e)
                answer = await self.object_step(job, step, OBJECT_LAST_RESORT_S)
                if answer is None or step not in answer:
                    raise  # the peers' error says more than "not found": the step does exist
                object_steps = set(answer)
        if not sources and step in object_steps:
            await self._fetch_from_object(job, step, rank, again=tier == "object" or refetch, replace=refetch)
            sources = [fetched_to]
        record = await self.on_locate_threads(self.commit_record_here, job, step)
        if record is None or not sources:
            world_size = record.world_size if record else 0
            raise NotFound(f"{job} step {step} has no rank {rank} {_on_tier(tier)} (world_size {world_size})")
        self.lease_for_reading(job, step)  # again: the lease runs from the answer
        return Located(step, record.world_size, sources, self.next_line(job, record, known))

    async def not_complete(self, job: str, step: int | None, tier: str, steps: set[int], from_object: bool) -> NotFound:
        """Return the NotFound for a step that is not complete on tier, naming the job's newest complete steps there.

        steps: the job's complete steps that the load found on tier. The object store
        was asked for the one step (its history is never listed for a load): on this
        error path alone it is listed, bounded in time like every query of it.
        """
        where = _on_tier(tier)
        if step is None:
            return NotFound(f"job {job} has no complete step {where}")
        unlisted = ""
        if from_object:
            listed = await self.object_steps(job)
            if listed is None:
                unlisted = f" (the object store, {shown_url(self.config.object.url)}, did not list its own in time)"
            steps = steps | set(listed or [])
        if not steps:
            return NotFound(
                f"{job} step {step} is not complete {where}: job {job} has no complete step there{unlisted}"
            )
        newest = sorted(steps, reverse=True)[:STEPS_NAMED]
        count = f"all {len(steps)}" if len(steps) <= STEPS_NAMED else f"the newest {STEPS_NAMED} of {len(steps)}"
        return NotFound(
            f"{job} step {step} is not complete {where}; job {job}'s complete steps there, newest first "
            f"({count}): {', '.join(map(str, newest))}{unlisted}"
        )

    def superseded_here(self, job: str, record: CommitRecord | None) -> bool:
        """Say whether this node's copy of a step (its record) is of an older line than the cluster's record of it.

        A node away while a rollback's new line saved the step number again holds the old line's
        copy until the new line's replica reaches it: a load fetches the new one instead.
        """
        if record is None:
            return False
        return any(
            r.step == record.step and generation(r.line) > generation(record.line) for r in self.cluster.committed(job)
        )

    def tiers_for(self, tier: str) -> list[Tier]:
        """Return this node's tiers that a load naming tier may read."""
        if tier in ("", "auto"):
            return self.tiers
        return [t for t in self.tiers if t.name == validate_tier(tier)]

    def commit_record_here(self, job: str, step: int) -> CommitRecord | None:
        """Return the step's commit record from this node's tiers, or None."""
        for t in self.tiers:
            if step in t.complete_steps(job):
                try:
                    return t.commit_record(job, step)
                except NotFound:  # dropped since (memory's retention, on another thread): the next tier may hold it
                    continue
        return None

    @staticmethod
    def local_sources(
        tiers: list[Tier], job: str, step: int, rank: int, record: CommitRecord | None
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
            try:
                sources.append(t.shard_source(job, step, rank))
            except NotFound:  # dropped since has_shard (memory's retention, on another thread): not a source
                continue
        return sources

    def lease_for_reading(self, job: str, step: int) -> None:
        """Keep retention off a step a client is about to read, for LOAD_LEASE_S."""
        now = time.monotonic()
        for key in [k for k, until in self._being_read.items() if until <= now]:
            del self._being_read[key]
        self._being_read[(job, step)] = now + LOAD_LEASE_S

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps being read by a client or fetched from the store: retention keeps off them (BusySteps)."""
        now = time.monotonic()
        return {step for step, until in self._being_read.items() if until > now} | self._fetching_from_object.keys()

    # -- the object store ------------------------------------------------------------

    async def on_object_threads(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn(*args) on an object-store thread."""
        return await asyncio.get_running_loop().run_in_executor(self.object_threads, fn, *args)

    async def ask_object_store(
        self,
        fn: Callable[..., Answer],
        *args: Any,
        timeout_s: float = OBJECT_QUERY_TIMEOUT_S,
        listing: bool = False,
        about: str = "",
    ) -> Answer | None:
        """Return fn(*args) from an object-store thread, or None if the store fails (logged) or does not answer
        within timeout_s: a store that is down must not hide the other tiers.

        listing: fn lists a job's steps (on the listing threads). A wait of STILL_WAITING_EVERY_S or more
        (a last resort) logs how long it has waited, every STILL_WAITING_EVERY_S, naming what it asked about.
        """
        threads = self.listing_threads if listing else self.object_threads
        answer = asyncio.get_running_loop().run_in_executor(threads, fn, *args)
        started = time.monotonic()
        try:
            while True:
                left_s = timeout_s - (time.monotonic() - started)
                if left_s <= 0:
                    answer.cancel()  # not yet started: it never will; under way: it ends unheard
                    log.warning("the object store did not answer within %.0f s: going on without it", timeout_s)
                    return None
                done, _ = await asyncio.wait({answer}, timeout=min(left_s, STILL_WAITING_EVERY_S))
                if done:
                    return answer.result()
                log.info(
                    "still waiting for the object store's answer about %s: %.0f s of at most %.0f s",
                    *(about or "a job's steps", time.monotonic() - started, timeout_s),
                )
        except CheckpointError as e:
            log.warning("%s", e)
            return None

    async def object_steps(self, job: str) -> list[int] | None:
        """Return the job's steps complete in the store, or None if it is off or did not say in time."""
        if self.object_tier is None:
            return None
        return await self.ask_object_store(self.object_tier.complete_steps, job, listing=True)

    async def object_step(self, job: str, step: int, timeout_s: float = OBJECT_QUERY_TIMEOUT_S) -> list[int] | None:
        """Return [step] if that step is complete in the store, else [], or None if it is off or did not say in time.

        One read of the step's commit record: a job's whole history in the store is never listed for it.
        timeout_s: longer where the store is the last place the step may be (OBJECT_LAST_RESORT_S).
        """
        tier = self.object_tier
        if tier is None:
            return None
        return await self.ask_object_store(
            lambda: [step] if tier.is_complete(job, step) else [], timeout_s=timeout_s, about=f"{job} step {step}"
        )

    async def _fetch_from_object(self, job: str, step: int, rank: int, again: bool, replace: bool = False) -> None:
        """Copy a rank's shard of a step complete in the object store onto this node's NVMe, verified.

        again: read and check the store's copy even if NVMe holds the shard (a load that named tier "object").
        """
        async with self._fetch_locks.hold((job, step, rank)):
            if not again and await self.on_locate_threads(has_committed_shard, self.nvme, job, step, rank):
                return  # another load fetched it meanwhile
            with self._fetching_from_object.counting((job, step)):
                try:
                    await asyncio.get_running_loop().run_in_executor(
                        self.fetch_threads, self._copy_from_object, job, step, rank, replace
                    )
                except CorruptCheckpoint:
                    self.verification_failed("object")
                    raise

    def _copy_from_object(self, job: str, step: int, rank: int, replace: bool) -> None:
        assert self.object_tier is not None
        log.info("fetching rank %d shard of %s step %d from %s", rank, job, step, self.object_tier)
        started = time.monotonic()
        meta = fetch_shard(self.object_tier, self.nvme, job, step, rank, replace)
        where = f"{self.object_tier}/{job}/{step}"
        elapsed_s = time.monotonic() - started
        log.info(
            "fetched rank %d shard of %s step %d from %s (%d bytes, verified, %.2f s)",
            *(rank, job, step, where, meta.data_size_bytes, elapsed_s),
        )

    # -- listings and peers' requests ---------------------------------------------------

    async def list_steps(self, job: str = "", newest: bool = False) -> list[StepInfo]:
        """Return every complete step on any tier, by job and step (with peers, as the cluster sees it), pins marked.

        newest (with a job): only its newest step, which the cluster view answers without
        asking every peer (Checkpointer.latest_step, on every rank at a restart).
        """
        local = await self.on_locate_threads(list_steps, self.tiers, job)
        steps = await self.cluster.list_steps(local, job, newest)
        if newest:  # this node's sealed steps count too, whether or not the view has heard of them
            steps = merge_steps(steps, [i for i in local if set(i.tiers) - {"memory"}])
        if self.object_tier is not None:
            in_store = await self.ask_object_store(list_steps, [self.object_tier], job, listing=True)
            steps = merge_steps(steps, in_store or [])
        if newest:
            head = head_of(steps)
            steps = [head] if head is not None else []
        else:
            steps = with_superseded(steps)
        return [dataclasses.replace(s, pinned=s.step in self._pinned(s.job)) for s in steps]

    async def shard_for_peer(self, job: str, step: int, rank: int, tier: str) -> tuple[ShardMeta, bytes, Path]:
        """Return (record, its bytes, data file) of a shard of a complete step that a peer asks for."""

        def find() -> tuple[ShardMeta, bytes, Path]:
            for t in (self.nvme, self.replica_store):
                if tier in ("", t.name) and step in t.complete_steps(job) and t.has_shard(job, step, rank):
                    source = t.shard_source(job, step, rank)
                    raw = source.meta_path(rank).read_bytes()
                    return ShardMeta.from_bytes(raw, str(source.meta_path(rank))), raw, source.data_path(rank)
            node = self.config.node.name
            raise NotFound(f"node {node} holds no rank {rank} shard of {job} step {step} on tier {tier or 'any'}")

        result: tuple[ShardMeta, bytes, Path] = await self.on_locate_threads(find)
        return result


@dataclass(frozen=True)
class KnownSteps:
    """The complete steps of a job that a load found: their lines, and what the object store said."""

    lines: dict[int, Line]  # each step whose commit record was read, with its line
    object_steps: set[int]  # the steps the store holds (listed, or the one asked for)
    store_silent: bool  # the store was asked and did not answer in time: "not found" cannot be told

    @property
    def steps(self) -> set[int]:
        return set(self.lines) | self.object_steps


@dataclass(frozen=True)
class Located:
    """Where a rank's shard of a complete step lies, fastest first; and the line a save after the load continues."""

    step: int
    world_size: int
    sources: list[ShardSource]
    next_line: Line


def _complete_records(tiers: list[Tier], job: str) -> dict[int, CommitRecord]:
    records: dict[int, CommitRecord] = {}
    for t in tiers:
        for step, record in t.complete_records(job).items():
            records.setdefault(step, record)
    return records


def _on_tier(tier: str) -> str:
    """Return where a load looked, for its NotFound: "on tier nvme", or "on any tier" for "auto"."""
    return "on any tier" if tier in ("", "auto") else f"on tier {tier}"

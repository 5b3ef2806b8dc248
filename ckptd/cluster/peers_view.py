"""The built-in cluster view ([cluster] backend = "peers"): a coordinator per job, a fan-out tree, anti-entropy.

Per step, each node sends one Report (what it holds of the step) to the job's
coordinator, the live node that rendezvous hashing of the job name picks; the
coordinator seals the step when every rank is held somewhere and announces the commit
down a tree of fan-out FANOUT (each node passes it on to at most FANOUT others). So a
node's messages per step do not grow with the cluster (the coordinator takes one
report per node). Nothing is polled: every [cluster] anti_entropy_s, each node compares
digests of the commits it knows with one random peer, and takes the records it lacks.
A coordinator that dies is replaced by the next node in rendezvous order: reports not
answered by a commit are sent again to whoever is coordinator now (docs/INTERNALS.md,
"The cluster view", has the message counts).

The transport is ckptd.cluster.cluster_link (calls out) and ckptd.rpc.cluster_server
(calls in, on_* below). Everything runs on the event loop, but a large commit record's
serialization (on the record threads given at construction, Executors.records).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Any

from ckpt_core.errors import CheckpointError
from ckpt_core.format import CommitRecord
from ckpt_core.history import generation

from ckptd.cluster.cluster_link import ClusterLinks, PeerSlow
from ckptd.cluster.collector import Collector
from ckptd.cluster.peer_membership import Membership
from ckptd.cluster.placement import Holding, StepHoldings
from ckptd.cluster.view import ClusterView, coordinator_of, fan_out
from ckptd.errors import PeerBusy

log = logging.getLogger(__name__)

FANOUT = 8
RETRY_S = 1.0  # a report that failed is sent again (to the next coordinator) this soon
# A report taken but not answered by a commit is sent again (a coordinator that restarted lost it) after
# RESEND_FACTOR times what the job's commits took once its reports were taken (the longest lately: halved
# at each step, raised to any longer), at least RESEND_S, then twice as long: a coordinator waiting on
# slow ranks, or slow itself, is not sent every report again.
RESEND_S = 2.0
RESEND_FACTOR = 2.0
RESEND_MAX_S = 60.0
UNREACHABLE_S = 3.0  # a peer whose call failed is passed over as coordinator this long
# A coordinator whose reports time out is slow, not gone (passing it over would split the step's
# reports between two coordinators): it is passed over only after this many in a row (hung).
SLOW_REPORTS_TOLERATED = 3
PENDING_STEPS_KEPT = 64  # reports awaiting their commit, per job: the newest (older ones were abandoned)


class PeersView(ClusterView):
    """The cluster view kept by the daemons themselves, over their peer port."""

    backend = "peers"

    def __init__(
        self,
        node: str,
        membership: Membership,
        links: ClusterLinks,
        kept_records: int,
        anti_entropy_s: float,
        record_threads: Executor,
        fanout: int = FANOUT,
        serves: bool = True,
        resend_s: float = RESEND_S,
    ) -> None:
        """serves: this node answers the cluster calls (it has a peer port); if not, it never coordinates.

        record_threads: where a commit record is serialized for its announcement (Executors.records).
        """
        super().__init__(node, membership, kept_records)
        self._record_threads = record_threads
        self.serves = serves
        self.resend_s = resend_s
        self.links = links
        self.counters = links.counters  # sent and received, by kind: one table for status and benchmarks
        self.anti_entropy_s = anti_entropy_s
        self.fanout = fanout
        # what the records this node seals are signed with, and those peers send checked with
        self.commit_keys = links.commit_keys
        self.collector = Collector(self.commit_keys)
        self._pending: dict[tuple[str, int], tuple[Holding, ...]] = {}  # reports not yet answered by a commit
        # (job, step) -> (the coordinator that took the report, when it first did, when it is due again, times sent)
        self._sent: dict[tuple[str, int], tuple[str, float, float, int]] = {}
        self._commit_wait: dict[str, float] = {}  # job -> seconds from a report taken to its commit, lately
        self._unreachable: dict[str, float] = {}  # peer -> until when it is passed over
        self._slow: dict[str, int] = {}  # coordinator -> reports to it timed out in a row
        self._alive_seen: frozenset[str] = frozenset()  # the live nodes when the reports were last weighed
        self._live: list[str] = []  # live(), as last worked out from _live_of and _unreachable
        self._live_set: frozenset[str] = frozenset()
        self._live_of: frozenset[str] | None = None  # the membership it was worked out from
        self._live_until = 0.0  # when a passed-over peer's time is up
        self._coordinators: dict[str, str] = {}  # job -> coordinator, for the live nodes of now
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.last_error = ""

    # -- who is who --------------------------------------------------------------------------

    def live(self) -> list[str]:
        """Return the nodes taken to be up: this one and the members not passed over lately, sorted.

        Worked out again only when the membership or a passed-over peer changed: at 1,000
        nodes it is the one piece of work that grows with the cluster, and every report asks.
        """
        now = time.monotonic()
        peers = self.membership.peers()
        if peers is not self._live_of or now >= self._live_until:
            self._unreachable = {p: until for p, until in self._unreachable.items() if until > now}
            me = {self.node} if self.serves else set()
            self._live = sorted(me | (peers - self._unreachable.keys()))
            self._live_set = frozenset(self._live)
            self._live_of = peers
            self._live_until = min(self._unreachable.values(), default=math.inf)
            self._coordinators.clear()
        return self._live

    def coordinator(self, job: str) -> str:
        """Return the node that collects a job's reports now."""
        live = self.live()
        if job not in self._coordinators:
            self._coordinators[job] = coordinator_of(job, live)
        return self._coordinators[job]

    def _everyone_else(self) -> list[str]:
        """Return the members an announcement goes to: all of them, those passed over too (a call costs little)."""
        return sorted(self.membership.peers() - {self.node})

    def _failed(self, peer: str, error: CheckpointError) -> None:
        if self._unreachable.get(peer, 0.0) <= time.monotonic():
            log.info("cluster view: %s; passing it over for %.0f s", error, UNREACHABLE_S)
        self._unreachable[peer] = time.monotonic() + UNREACHABLE_S
        self._live_of = None  # worked out again at the next question
        self.last_error = str(error)

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- this node's side ------------------------------------------------------------------------

    async def start(self) -> None:
        """Learn the commits one live peer knows (a node that restarts catches up at once)."""
        await self._exchange_digests()

    def report(self, job: str, step: int, shards: Sequence[Holding]) -> None:
        held = self.labelled(shards)
        taken_by = self._sent.get((job, step), ("", 0.0, 0.0, 0))[0]
        if self._pending.get((job, step)) == held and taken_by == self.coordinator(job):
            return  # said already, to whoever is coordinator now
        self._pending[(job, step)] = held
        self._sent.pop((job, step), None)
        for old in sorted(s for j, s in self._pending if j == job)[:-PENDING_STEPS_KEPT]:
            self._settled(job, old)
        self._wake.set()

    def announce(self, record: CommitRecord) -> None:
        self._settled(record.job, record.step)
        if self.commits.add(record):
            self._spawn(self._spread(record, self._everyone_else()))

    def _settled(self, job: str, step: int) -> None:
        self._pending.pop((job, step), None)
        self._sent.pop((job, step), None)

    async def learned(self, record: CommitRecord, again: bool = False) -> bool:
        sent = self._sent.get((record.job, record.step))
        if sent is not None:  # the report was taken: the coordinator knows the holdings
            waited = time.monotonic() - sent[1]
            self._commit_wait[record.job] = max(waited, self._commit_wait.get(record.job, 0.0) / 2)
            self._settled(record.job, record.step)
        return await super().learned(record, again)

    async def run_forever(self) -> None:
        """Deliver reports as they come (and again when due); compare digests every anti_entropy_s."""
        # Spread over the period, each node at its own times: nodes that started together (a
        # cluster's restart) would otherwise all exchange digests in the same instant, every period.
        next_exchange = time.monotonic() + random.uniform(0.0, self.anti_entropy_s)
        while True:
            timeout = max(0.0, min(RETRY_S, next_exchange - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            try:
                await self._deliver()
                await self._seal_again()
                if self.anti_entropy_s and time.monotonic() >= next_exchange:
                    next_exchange = time.monotonic() + self.anti_entropy_s * random.uniform(0.5, 1.5)
                    await self._exchange_digests()
            except Exception:  # the loop must outlive any one bad round
                log.exception("cluster view: a round failed")

    async def _deliver(self) -> None:
        """Send each coordinator, in one Report, the pending reports it has not taken (or took long ago)."""
        now = time.monotonic()
        batches: dict[str, list[StepHoldings]] = {}
        for (job, step), held in self._pending.items():
            coordinator = self.coordinator(job)
            taken_by, _, due, _ = self._sent.get((job, step), ("", 0.0, 0.0, 0))
            if taken_by == coordinator and now < due:
                continue
            batches.setdefault(coordinator, []).append(StepHoldings(self.node, job, step, None, held))
        for coordinator, steps in batches.items():
            self._spawn(self._report_to(coordinator, steps))

    async def _seal_again(self) -> None:
        """When the live nodes changed, weigh the reports again: a report set aside may count now."""
        self.live()
        alive = self._live_set
        if alive is self._alive_seen:
            return
        self._alive_seen = alive
        for job in self.collector.jobs():
            for record in self.collector.seal_again(job, alive):
                if await self.learned(record):
                    self._spawn(self._spread(record, self._everyone_else()))

    async def _report_to(self, coordinator: str, steps: list[StepHoldings]) -> None:
        try:
            if coordinator == self.node:
                records = await self.on_report(self.node, steps)
            else:
                records = await self.links.report(coordinator, self.node, steps)
        except PeerBusy:
            return  # the same coordinator, when the report is due again
        except PeerSlow as e:
            self._slow[coordinator] = self._slow.get(coordinator, 0) + 1
            if self._slow[coordinator] >= SLOW_REPORTS_TOLERATED:
                del self._slow[coordinator]
                self._failed(coordinator, e)
                self._wake.set()
                return
            records = []  # it may well have taken them: due again as if it had
        except CheckpointError as e:
            self._failed(coordinator, e)
            self._wake.set()  # to the next coordinator, at once
            return
        else:
            self._slow.pop(coordinator, None)
        now = time.monotonic()
        for s in steps:
            if self.commits.get(s.job, s.step) is not None:
                self._settled(s.job, s.step)  # taken, and committed: nothing more to say
            elif (s.job, s.step) in self._pending:
                taken_by, taken_at, _, times = self._sent.get((s.job, s.step), ("", now, 0.0, 0))
                times, taken_at = (times + 1, taken_at) if taken_by == coordinator else (0, now)
                wait = max(self.resend_s, RESEND_FACTOR * self._commit_wait.get(s.job, 0.0)) * 2**times
                self._sent[(s.job, s.step)] = (coordinator, taken_at, now + min(wait, RESEND_MAX_S), times)
        for record in records:
            await self.learned(record)

    async def _exchange_digests(self) -> None:
        others = [n for n in self.live() if n != self.node]
        if not others:
            return
        peer = random.choice(others)
        digests = {j: (self.commits.digest(j), self.commits.steps(j)) for j in self.commits.jobs()}
        try:
            records = await self.links.digest(peer, digests)
        except CheckpointError as e:  # not held against the peer: reports and announcements find out soon enough
            log.debug("cluster view: %s", e)
            return
        for record in records:
            await self.learned(record)

    async def _spread(self, record: CommitRecord, nodes: list[str], raw: bytes = b"") -> None:
        """Announce a commit to nodes through a fan-out tree; take over the part of a node that does not answer."""
        # a record of 8,000 ranks is 280 kB of JSON
        raw = raw or await asyncio.get_running_loop().run_in_executor(self._record_threads, record.to_bytes)

        async def tell(head: str, relay: list[str]) -> None:
            try:
                await self.links.announce(head, raw, relay)
            except CheckpointError as e:
                self._failed(head, e)
                await self._spread(record, relay, raw)

        await asyncio.gather(*(tell(head, relay) for head, relay in fan_out(nodes, self.fanout)))

    async def holders(self, job: str, step: int, rank: int) -> list[Holding]:
        coordinator = self.coordinator(job)
        if coordinator == self.node:
            return await self.on_holders(job, step, rank)
        try:
            return await self.links.holders(coordinator, job, step, rank)
        except CheckpointError as e:
            self._failed(coordinator, e)
            return []

    # -- the calls of other nodes (ckptd.rpc.cluster_server) ---------------------------------

    async def on_report(self, node: str, steps: list[StepHoldings]) -> list[CommitRecord]:
        """Collect a node's reports; seal and announce each step that became complete; return what is known."""
        known = []
        self.live()
        alive = self._live_set if node in self._live_set else self._live_set | {node}
        for s in steps:
            # Collected after the commit too: holders() answers from what was reported (replicas come later).
            record = self.commits.get(s.job, s.step)
            sealed = self.collector.add(node, s.job, s.step, s.shards, alive, seal=record is None)
            if record is None and sealed is not None:
                record = sealed
                if await self.learned(record):
                    self._spawn(self._spread(record, self._everyone_else()))
            if record is not None:
                known.append(record)
        return known

    async def on_announce(self, record: CommitRecord, relay: list[str], raw: bytes) -> None:
        """Pass an announced commit on (its bytes as they came, without holding up the caller), then adopt it."""
        if relay:
            self._spawn(self._spread(record, [n for n in relay if n != self.node], raw))
        await self.learned(record)

    async def on_digest(self, digests: dict[str, tuple[str, list[int]]]) -> list[CommitRecord]:
        """Return, for each job whose digest differs from the caller's, the records of the steps it lacks.

        And those of a rollback's lines (generation > 0): the caller may hold the step number on the old line.
        """
        lacking = []
        for job in self.commits.jobs():
            digest, steps = digests.get(job, ("", []))
            if digest != self.commits.digest(job):
                held = set(steps)
                lacking += [r for r in self.commits.records(job) if r.step not in held or generation(r.line) > 0]
        return lacking

    async def on_holders(self, job: str, step: int, rank: int) -> list[Holding]:
        self.live()
        alive = self._live_set
        return [h for h in self.collector.holders(job, step, rank) if h.node in alive]

    async def forget_job(self, job: str) -> None:
        self.commits.forget(job)
        self.collector.forget(job)
        self._commit_wait.pop(job, None)
        for j, step in [k for k in self._pending if k[0] == job]:
            self._settled(j, step)

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "node": self.node,
            "connected": True,  # nothing to connect to: the peers are the view
            "members": len(self.live()),
            "pending_reports": len(self._pending),
            "unreachable": sorted(p for p, until in self._unreachable.items() if until > time.monotonic()),
            "last_error": self.last_error,
            "counters": dict(self.counters),
        }

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.links.close()

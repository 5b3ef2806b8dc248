"""The cluster view: which steps are committed, who holds which shard, who is alive — one interface, two backends.

Peering (ckptd.replication.peering) and ClusterSteps (ckptd.load.cluster_steps) use it; the
composition root (ckptd.node) builds and starts it. Order of calls, all on the event loop:
  1. Node builds the view with open_view() and calls watch(SavePath.commit_learned) once;
  2. Node awaits start() once at start-up, after it seeded() it with the commit
     records this node's disks hold, then runs run_forever() as a task until drain;
  3. Peering calls report(job, step, shards) whenever what this node holds durably of a step
     changed and the step is not committed yet (a flush ended, a replica arrived, a
     reconciliation found it), and announce(record) when it sealed a step from its own shards;
  4. the view awaits on_commit(record) once for every step it learns is committed, wherever
     it was sealed (possibly again after a restart: adopting a record is idempotent);
  5. commit_record(), newest_complete() and status() answer from memory; holders() may ask;
  6. forget_job(job) when `ckptd gc --job J --all` removed a job from this node;
  7. close() at drain, after run_forever was cancelled.

report() and announce() never wait on the network: they queue, and the view delivers with
retries, so that training and NVMe flushes go on while the backend is away. The membership
(`view.membership`) is the backend's own: Peering follows it for its links and replicas.

Backends: PeersView (built in, ckptd.cluster.peers_view) and EtcdView (ckptd.cluster.etcd_view).
Every backend passes tests/ckptd/test_cluster_conformance.py.
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import xxhash
from ckpt_core.format import CommitRecord
from ckpt_core.history import History, generation

from ckptd.cluster.peer_membership import Membership
from ckptd.cluster.placement import Holding

log = logging.getLogger(__name__)

OnCommit = Callable[[CommitRecord], Awaitable[None]]
KEPT_RECORDS_MIN = 8  # commit records kept in memory per job, at least (more with larger [retention])


class ClusterView(ABC):
    """Learn and spread the cluster's commits, and collect shard reports where a step is sealed."""

    backend = ""

    def __init__(self, node: str, membership: Membership, kept_records: int) -> None:
        """node: this node's peer address (its name in the view); kept_records: commit records kept per job."""
        self._node = node
        self.membership = membership
        self.commits = CommitBook(max(kept_records, KEPT_RECORDS_MIN))
        self._on_commit: OnCommit | None = None

    @property
    def node(self) -> str:
        """Return this node's name in the view: its peer address as the others know it."""
        return self.membership.own_address() or self._node

    def labelled(self, shards: Sequence[Holding]) -> tuple[Holding, ...]:
        """Return holdings named by this node's name in the view (a disk names them by [node] listen)."""
        node = self.node
        return tuple(h if h.node == node else dataclasses.replace(h, node=node) for h in shards)

    def watch(self, on_commit: OnCommit) -> None:
        """Have on_commit(record) awaited for every step learned committed (one subscriber)."""
        self._on_commit = on_commit

    def seeded(self, records: Iterable[CommitRecord]) -> None:
        """Know these commits already (this node's disks hold them): they are not handed to on_commit."""
        for record in records:
            self.commits.add(record)

    async def learned(self, record: CommitRecord, again: bool = False) -> bool:
        """Take a commit from the backend: hand it to on_commit if it is new; return whether it was handed.

        A record that contradicts a known one of the same step is logged and dropped: the
        first stays (as a node's disk keeps the first record it adopted), unless it is of a
        newer line (a rollback saved the step number again: the old line's is superseded).
        again: hand a known one to on_commit again too (Peering, which found this node's copy unsealed).
        """
        known = self.commits.get(record.job, record.step)
        if known is not None and generation(record.line) > generation(known.line):
            self.commits.add(record)
        elif known is not None:
            if known != record:
                log.warning("%s step %d: ignored a second, different commit record", record.job, record.step)
                return False
            if not again:
                return False
        elif not self.commits.add(record):
            return False  # older than every kept step of its job: long superseded
        if self._on_commit is not None:
            await self._on_commit(record)
        return True

    def commit_record(self, job: str, step: int) -> CommitRecord | None:
        """Return the commit record of a step, if the view knows it committed."""
        return self.commits.get(job, step)

    def newest_complete(self, job: str) -> int | None:
        """Return the head of a job known committed in the cluster: the newest step of its newest line."""
        return self.commits.newest(job)

    def committed(self, job: str) -> list[CommitRecord]:
        """Return the commit records of the job's steps known committed in the cluster (those kept)."""
        return self.commits.records(job)

    @abstractmethod
    async def start(self) -> None:
        """Join the cluster: publish this node, and learn the commits and members there are now."""

    @abstractmethod
    async def run_forever(self) -> None:
        """Deliver queued reports, follow commits and members, until cancelled."""

    @abstractmethod
    def report(self, job: str, step: int, shards: Sequence[Holding]) -> None:
        """Say what this node holds durably of an uncommitted step now (all of it; replaces the last report)."""

    @abstractmethod
    def announce(self, record: CommitRecord) -> None:
        """Spread a commit this node sealed from its own shards."""

    @abstractmethod
    async def holders(self, job: str, step: int, rank: int) -> list[Holding]:
        """Return the live nodes' holdings of a rank's shard of a step, as reported (empty: not known)."""

    @abstractmethod
    async def forget_job(self, job: str) -> None:
        """Drop what the view keeps of a job removed from the cluster (`ckptd gc --job J --all`)."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """Describe the view for `ckptd status`: backend, connected, pending reports, counters."""

    @abstractmethod
    async def close(self) -> None:
        """Leave the cluster and release connections."""


class CommitBook:
    """The commit records known, per job, the newest `kept` steps of each; a digest of them per job."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._jobs: dict[str, OrderedDict[int, CommitRecord]] = {}
        self._digests: dict[str, str] = {}  # job -> digest(job), until the job's records change

    def add(self, record: CommitRecord) -> bool:
        """Keep a record; False when it is older than every kept step of a full job (then it is dropped)."""
        steps = self._jobs.setdefault(record.job, OrderedDict())
        if len(steps) >= self.kept and record.step < next(iter(steps)):
            return False
        self._digests.pop(record.job, None)
        newest = next(reversed(steps), None)
        steps[record.step] = record
        if newest is not None and record.step < newest:  # came late: keep the steps in order
            self._jobs[record.job] = steps = OrderedDict(sorted(steps.items()))
        while len(steps) > self.kept:
            steps.popitem(last=False)
        return True

    def get(self, job: str, step: int) -> CommitRecord | None:
        steps = self._jobs.get(job)
        return steps.get(step) if steps is not None else None

    def newest(self, job: str) -> int | None:
        """Return the job's head (ckpt_core.history): its newest line's newest step."""
        steps = self._jobs.get(job)
        return History.of({s: r.line for s, r in steps.items()}).head if steps else None

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def steps(self, job: str) -> list[int]:
        return list(self._jobs.get(job, {}))

    def records(self, job: str) -> list[CommitRecord]:
        return list(self._jobs.get(job, {}).values())

    def digest(self, job: str) -> str:
        """Return xxh3-64 hex over the kept steps and their records: equal books, equal digests."""
        if job in self._digests:
            return self._digests[job]
        h = xxhash.xxh3_64()
        for step, record in self._jobs.get(job, {}).items():
            h.update(b"%d:%d:%s;" % (step, record.size_bytes, ",".join(record.shard_meta_xxh3_128).encode()))
        self._digests[job] = h.hexdigest()
        return self._digests[job]

    def forget(self, job: str) -> None:
        self._jobs.pop(job, None)
        self._digests.pop(job, None)


def coordinator_of(job: str, nodes: Iterable[str]) -> str:
    """Return the node that collects a job's reports: rendezvous hashing, so only its own jobs move when it goes."""
    return max(nodes, key=lambda n: xxhash.xxh3_64_intdigest(f"{job}\0{n}".encode()))


def fan_out(nodes: Sequence[str], fanout: int) -> list[tuple[str, list[str]]]:
    """Split nodes into at most `fanout` groups: (the head the sender calls, the rest the head passes on to).

    Applied again by every head to its own rest, this spreads a message over a tree of
    depth log_fanout(len(nodes)), each node sending at most `fanout` messages.
    """
    size = -(-len(nodes) // fanout) if nodes else 0
    return [(nodes[i], list(nodes[i + 1 : i + size])) for i in range(0, len(nodes), size)] if size else []

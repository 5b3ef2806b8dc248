"""Read complete steps from other nodes: their NVMe shards and the replicas they keep.

The read side of the peer tier, over PeerLinks: the daemon fetches a rank's shard
through it when this node lacks it (a wiped disk, a lost node's ranks), and
`ckptd restore --from peer` reads through it with no daemon. The write side is
ckptd.replication.sending (sending) and ckptd.replication.receiving (the replica store).
Calls block: make them from worker threads. An inventory of every peer asks them at once, on the
pool given at construction (Executors.inventories).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from concurrent.futures import Executor

from ckpt_core.byte_range import WHOLE, ByteRequest
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, digest
from ckpt_core.shard_io import ShardSource

from ckptd.cluster.peer_link import IsSelf, PeerLink
from ckptd.cluster.placement import Holding, StepHoldings, holders
from ckptd.errors import PeerError
from ckptd.pool_map import pool_map
from ckptd.tiers.base import Tier

log = logging.getLogger(__name__)

VIEW_TTL_S = 1.0
INVENTORY_TIMEOUT_S = 3.0
INVENTORY_THREADS = 64  # peers asked at once by one call: a thread each, not one per peer of a thousand
RETIRED_LINK_CLOSE_S = 60.0  # a link to a peer that left is closed this long after: calls under way end first


class PeerTier(Tier):
    """List and read the steps other nodes hold, whichever of their tiers holds each shard.

    The daemon's Peering changes the links with update() as peers join and leave, and calls
    close_retired() now and then; every other call may come from any worker thread meanwhile.
    """

    name = "peer"

    def __init__(self, links: list[PeerLink], threads: Executor) -> None:
        """threads: where every peer is asked at once, INVENTORY_THREADS by each call (Executors.inventories)."""
        self.links = links
        self._threads = threads
        self._views: dict[str, tuple[float, list[StepHoldings]]] = {}
        self.unreachable: dict[str, str] = {}  # peer address -> why its last inventory failed
        self.answered: set[str] = set()  # the peers that answered an inventory at least once
        self._retired: list[tuple[float, PeerLink]] = []  # (when, link) of peers that left: see close_retired
        self._lock = threading.Lock()  # inventories are asked from several threads at once

    def update(self, added: list[PeerLink], removed: Collection[str]) -> None:
        """Take new peers' links, and retire those of peers that left (their calls under way may finish)."""
        now = time.monotonic()
        with self._lock:
            self._retired += [(now, link) for link in self.links if link.address in removed]
            self.links = [link for link in self.links if link.address not in removed] + added
            for address in removed:
                self.unreachable.pop(address, None)
            self._views.clear()

    def among(self, addresses: Collection[str]) -> PeerTier:
        """Return this tier over only the peers in addresses (the same links: close this one, never that)."""
        with self._lock:
            return PeerTier([link for link in self.links if link.address in addresses], self._threads)

    def close_retired(self) -> None:
        """Close the links retired long enough ago that no call can still be using them."""
        due = time.monotonic() - RETIRED_LINK_CLOSE_S
        with self._lock:
            closing = [link for at, link in self._retired if at <= due]
            self._retired = [(at, link) for at, link in self._retired if at > due]
        for link in closing:
            link.close()

    def inventories(self, job: str = "") -> list[StepHoldings]:
        """Return what every reachable peer holds of a job (or of every job); a peer that fails is left out."""
        cached = self._views.get(job)
        if cached is not None and time.monotonic() - cached[0] < VIEW_TTL_S:
            return cached[1]
        found = self.ask(job)
        with self._lock:
            self._views[job] = (time.monotonic(), found)
        return found

    def ask(
        self,
        job: str = "",
        step: int = -1,
        timeout_s: float = INVENTORY_TIMEOUT_S,
        only: Collection[str] | None = None,
        wait_for_ready: bool = False,
    ) -> list[StepHoldings]:
        """Ask every peer (or those in only) now, no cache, what it holds of a job's step, or of every step.

        wait_for_ready: a peer whose connection failed last is given until timeout_s to connect (PeerLink.inventory).
        """
        links = [link for link in self.links if only is None or link.address in only]

        def ask_one(link: PeerLink) -> list[StepHoldings]:
            return self._inventory(link, job, step, timeout_s, wait_for_ready)

        answers = pool_map(self._threads, ask_one, links, INVENTORY_THREADS)
        return [s for answer in answers for s in answer]

    def _inventory(
        self, link: PeerLink, job: str, step: int, timeout_s: float, wait_for_ready: bool = False
    ) -> list[StepHoldings]:
        try:
            steps = link.inventory(job, step, timeout_s=timeout_s, wait_for_ready=wait_for_ready)
        except IsSelf as e:
            with self._lock:
                if link in self.links:
                    log.info("%s: leaving it out", e)
                    self.links = [x for x in self.links if x is not link]
            return []
        except CheckpointError as e:
            with self._lock:
                if link in self.links:  # a peer that left meanwhile is no longer reported on
                    if link.address not in self.unreachable:
                        log.warning("%s", e)
                    self.unreachable[link.address] = str(e)
            return []
        with self._lock:
            self.unreachable.pop(link.address, None)
            self.answered.add(link.address)
        return steps

    def connecting(self) -> list[str]:
        """Return the peers not asked yet to the end: neither answered nor failed (a node starting up)."""
        with self._lock:
            return sorted({link.address for link in self.links} - self.answered - set(self.unreachable))

    def forget(self) -> None:
        """Drop the cached inventories: the next question asks the peers again."""
        with self._lock:
            self._views.clear()

    def reachable(self) -> set[str]:
        """Return the peers whose last inventory answered."""
        with self._lock:
            return {link.address for link in self.links} - set(self.unreachable)

    def _records(self, job: str) -> dict[int, CommitRecord]:
        return {s.step: s.record for s in self.inventories(job) if s.job == job and s.record is not None}

    def shards(self, job: str, step: int) -> list[Holding]:
        """Return every holding of a step's shards on the peers."""
        return [h for s in self.inventories(job) if (s.job, s.step) == (job, step) for h in s.shards]

    def jobs(self) -> list[str]:
        return sorted({s.job for s in self.inventories() if s.record is not None})

    def complete_steps(self, job: str) -> list[int]:
        """Return the steps complete in the cluster whose every rank some reachable peer holds."""
        records = self._records(job)
        complete = []
        for step, record in sorted(records.items()):
            shards = self.shards(job, step)
            if all(holders(record, shards, rank) for rank in range(record.world_size)):
                complete.append(step)
        return complete

    def commit_record(self, job: str, step: int) -> CommitRecord:
        record = self._records(job).get(step)
        if record is None:
            raise NotFound(f"{job} step {step} is not complete on any reachable peer")
        return record

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        record = self._records(job).get(step)
        return record is not None and rank < record.world_size and bool(holders(record, self.shards(job, step), rank))

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        raise NotFound(f"rank {rank} shard of {job} step {step} lives on other nodes: read it with read_into")

    def _holders(self, job: str, step: int, rank: int) -> list[PeerLink]:
        record = self.commit_record(job, step)
        if rank >= record.world_size:
            raise NotFound(f"{job} step {step} has no rank {rank} (world_size {record.world_size})")
        nodes = {h.node for h in holders(record, self.shards(job, step), rank)}
        found = [link for link in self.links if link.address in nodes]
        if not found:
            raise NotFound(f"no reachable peer holds rank {rank} shard of {job} step {step}")
        return found

    def read_meta(self, job: str, step: int, rank: int) -> ShardMeta:
        """Return the shard record from the first peer whose copy matches the step's commit record."""
        want = self.commit_record(job, step).shard_meta_xxh3_128[rank]
        errors = []
        for link in self._holders(job, step, rank):
            try:
                meta = link.fetch_meta(job, step, rank)
            except CheckpointError as e:
                errors.append(str(e))
                continue
            if digest(meta.to_bytes()) == want:
                return meta
            errors.append(f"peer {link.address} holds a record that does not match the step's commit record")
        raise CorruptCheckpoint(f"no good copy of rank {rank} shard record of {job} step {step}: " + "; ".join(errors))

    def read_into(self, meta: ShardMeta, buffer: memoryview, wanted: ByteRequest = WHOLE) -> None:
        """Fill buffer from the first peer whose copy checks; a bad or missing copy is skipped for the next.

        wanted as in ShardReader.read_into.
        """
        errors = []
        for link in self._holders(meta.job, meta.step, meta.rank):
            try:
                link.connect()
                link.fetch_into(meta, buffer, wanted)
                return
            except (CheckpointError, PeerError) as e:
                log.warning("%s; trying the next copy", e)
                errors.append(str(e))
        raise CorruptCheckpoint(
            f"no good copy of rank {meta.rank} shard of {meta.job} step {meta.step} on the peers: " + "; ".join(errors)
        )

    def close(self) -> None:
        """Close every link, retired ones included."""
        for link in [*self.links, *(link for _, link in self._retired)]:
            link.close()

"""Read complete steps from other nodes: their NVMe shards and the replicas they keep.

The read side of the peer tier, over the links and inventories of a PeerInventory
(ckptd.cluster.peer_inventory): the daemon fetches a rank's shard through it when this node
lacks it (a wiped disk, a lost node's ranks), and `ckptd restore --from peer` reads through it
with no daemon. The write side is ckptd.replication.sending (sending) and
ckptd.replication.receiving (the replica store). Calls block: make them from worker threads.
"""

from __future__ import annotations

import logging

from ckpt_core.byte_range import WHOLE, ByteRequest
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, digest
from ckpt_core.shard_io import ShardSource

from ckptd.cluster.peer_inventory import PeerInventory
from ckptd.cluster.peer_link import PeerLink
from ckptd.cluster.placement import holders
from ckptd.errors import PeerError
from ckptd.tiers.base import Tier

log = logging.getLogger(__name__)


class PeerTier(Tier):
    """List and read the steps other nodes hold, whichever of their tiers holds each shard, over a PeerInventory.

    Any worker thread may call it; the inventory's links change meanwhile (Peering).
    """

    name = "peer"

    def __init__(self, peers: PeerInventory) -> None:
        """peers: the links to the peers, and what each holds (the whole cluster's, or only some peers')."""
        self.peers = peers

    def _records(self, job: str) -> dict[int, CommitRecord]:
        return {s.step: s.record for s in self.peers.inventories(job) if s.job == job and s.record is not None}

    def jobs(self) -> list[str]:
        return sorted({s.job for s in self.peers.inventories() if s.record is not None})

    def complete_steps(self, job: str) -> list[int]:
        """Return the steps complete in the cluster whose every rank some reachable peer holds."""
        records = self._records(job)
        complete = []
        for step, record in sorted(records.items()):
            shards = self.peers.shards(job, step)
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
        return (
            record is not None
            and rank < record.world_size
            and bool(holders(record, self.peers.shards(job, step), rank))
        )

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        raise NotFound(f"rank {rank} shard of {job} step {step} lives on other nodes: read it with read_into")

    def _holders(self, job: str, step: int, rank: int) -> list[PeerLink]:
        record = self.commit_record(job, step)
        if rank >= record.world_size:
            raise NotFound(f"{job} step {step} has no rank {rank} (world_size {record.world_size})")
        nodes = {h.node for h in holders(record, self.peers.shards(job, step), rank)}
        found = [link for link in self.peers.links if link.address in nodes]
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

"""Reason about steps across nodes: which shards each node holds, when a step is complete, where replicas go.

Pure functions over small frozen records, so every rule here is tested without a
daemon. A node's holdings come from its own tiers or, for other nodes, from
their Inventory answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash
from ckpt.format import CommitRecord


@dataclass(frozen=True)
class Holding:
    """One shard record that one node holds durably, on its NVMe ("nvme") or as a replica ("peer")."""

    node: str
    tier: str
    job: str
    step: int
    rank: int
    world_size: int
    data_size_bytes: int
    meta_digest: str  # xxh3-128 of the sealed shard record, as a commit record lists it
    run_id: str


@dataclass(frozen=True)
class StepHoldings:
    """What one node holds of one step: its shards and, once the step is complete there, its commit record."""

    node: str
    job: str
    step: int
    record: CommitRecord | None
    shards: tuple[Holding, ...]


def seal_record(
    job: str,
    step: int,
    shards: Iterable[Holding],
    run_id: str | None = None,
    world_size: int | None = None,
    tiers: tuple[str, ...] = ("nvme", "peer"),
) -> CommitRecord | None:
    """Return the commit record of a step whose every rank is durable on some node, else None.

    A replica counts as much as the NVMe copy it was made from: it is checked, fsynced
    and renamed into place the same way. So a step whose rank lives on only as a replica
    (its node died before the step was sealed) is still sealed by the survivors.

    Only shards of one run count: run_id names it, or (None) every shard must agree.
    Two different records of one rank (saved twice and not yet replaced) also mean
    not yet. The record is the same whichever node computes it.
    """
    nvme = [h for h in shards if h.tier in tiers and (h.job, h.step) == (job, step)]
    if run_id is not None:
        nvme = [h for h in nvme if h.run_id == run_id]
    if not nvme or len({h.run_id for h in nvme}) != 1 or len({h.world_size for h in nvme}) != 1:
        return None
    size = nvme[0].world_size
    if world_size is not None and size != world_size:
        return None
    by_rank: dict[int, set[tuple[str, int]]] = defaultdict(set)
    for h in nvme:
        by_rank[h.rank].add((h.meta_digest, h.data_size_bytes))
    if sorted(by_rank) != list(range(size)) or any(len(v) != 1 for v in by_rank.values()):
        return None
    ranks = [next(iter(by_rank[r])) for r in range(size)]
    return CommitRecord(job, step, size, tuple(d for d, _ in ranks), sum(n for _, n in ranks))


def holders(record: CommitRecord, shards: Iterable[Holding], rank: int, tier: str = "") -> list[Holding]:
    """Return the holdings of a rank's shard that match the step's record (on one tier, or any)."""
    want = record.shard_meta_xxh3_128[rank]
    return [
        h
        for h in shards
        if (h.job, h.step, h.rank) == (record.job, record.step, rank)
        and h.meta_digest == want
        and (not tier or h.tier == tier)
    ]


def complete_on(record: CommitRecord, shards: list[Holding], replicas: int) -> list[str]:
    """Return the cluster tiers ("nvme", "peer") on which every rank of a complete step is held.

    "peer" needs each rank on `replicas` nodes' replica stores; with replicas 0 the tier is off.
    """
    tiers = []
    ranks = range(record.world_size)
    if all(holders(record, shards, r, "nvme") for r in ranks):
        tiers.append("nvme")
    if replicas > 0 and all(len({h.node for h in holders(record, shards, r, "peer")}) >= replicas for r in ranks):
        tiers.append("peer")
    return tiers


def placement(job: str, rank: int, peers: Iterable[str], replicas: int) -> list[str]:
    """Return the peers that keep the replicas of a rank's shard, best first.

    Rendezvous hashing: each (job, rank) ranks the peers by a hash of the pair, so the
    copies spread over the peers, and a change to the peer list moves only the shards
    whose chosen peers changed.
    """
    ranked = sorted(peers, key=lambda p: xxhash.xxh3_64_intdigest(f"{job}\0{rank}\0{p}".encode()), reverse=True)
    return ranked[:replicas]

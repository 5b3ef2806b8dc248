"""Reason about steps across nodes: which shards each node holds, when a step is complete, where replicas go.

Pure functions over small frozen records, so every rule here is tested without a
daemon. A node's holdings come from its own tiers or, for other nodes, from
their Inventory answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import xxhash
from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.format import CommitRecord
from ckpt_core.history import line_from_text

from ckptd.errors import MixedLines


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
    line: str = ""  # the shard record's line as canonical JSON text (ckpt_core.history.line_text); "" the first line
    saved_at: str = ""  # the shard record's saved_at


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
    commit_keys: CommitKeys = UNSIGNED,
) -> CommitRecord | None:
    """Return the commit record of a step whose every rank is durable on some node, else None.

    A replica counts as much as the NVMe copy it was made from: it is checked, fsynced
    and renamed into place the same way. So a step whose rank lives on only as a replica
    (its node died before the step was sealed) is still sealed by the survivors.

    Only shards of one run count: run_id names it, or (None) every shard must agree.
    Two different records of one rank (saved twice and not yet replaced) also mean
    not yet. The record is the same whichever node computes it: its time is its ranks'
    latest saved_at. Ranks whose shard records name different lines (some loaded an older
    step before saving, some not) raise MixedLines: such a step is never complete.
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
    lines = {h.line for h in nvme}
    if len(lines) != 1:
        raise MixedLines(job, step, sorted(lines))
    ranks = [next(iter(by_rank[r])) for r in range(size)]
    line = line_from_text(lines.pop(), f"{job} step {step}'s shard records")
    saved_at = max(h.saved_at for h in nvme)
    return commit_keys.sign(
        CommitRecord(job, step, size, tuple(d for d, _ in ranks), sum(n for _, n in ranks), line, saved_at)
    )


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


def loadable_steps(held: Iterable[StepHoldings], replicas: int) -> list[tuple[CommitRecord, list[str]]]:
    """Return the steps complete in the cluster, by job and step, each with the tiers that hold it whole.

    held: every node's holdings. A step is listed while it can be loaded: after losing a
    node, every rank may still have a copy on some tier although no tier has them all
    (its tiers are then none until the replicas catch up).
    """
    records: dict[tuple[str, int], CommitRecord] = {}
    shards: dict[tuple[str, int], list[Holding]] = defaultdict(list)
    for s in held:
        if s.record is not None:
            records[(s.job, s.step)] = s.record
        shards[(s.job, s.step)].extend(s.shards)
    found = []
    for key, record in sorted(records.items()):
        tiers = complete_on(record, shards[key], replicas)
        if tiers or all(holders(record, shards[key], r) for r in range(record.world_size)):
            found.append((record, tiers))
    return found


def placement(job: str, rank: int, peers: Iterable[str], replicas: int) -> list[str]:
    """Return the peers that keep the replicas of a rank's shard, best first.

    Rendezvous hashing: each (job, rank) ranks the peers by a hash of the pair, so the
    copies spread over the peers. Removing a peer moves only the shards it kept; adding
    one moves its share to it from every other peer (replication hashes over seats
    instead, so that a node that replaces another takes only the old one's share).
    """
    ranked = sorted(peers, key=lambda p: xxhash.xxh3_64_intdigest(f"{job}\0{rank}\0{p}".encode()), reverse=True)
    return ranked[:replicas]


Seats = Mapping[str, str | None]  # seat -> the peer address that holds it (None: left vacant)


def seated_placement(job: str, rank: int, seats: Seats, replicas: int) -> list[str]:
    """Return the peers that keep a rank's replicas: rendezvous hashing over the seats, then who holds each.

    A vacant seat is passed over, so its shards go to their next seat until a newcomer takes it.
    """
    ranked = (seats[s] for s in placement(job, rank, seats, len(seats)))
    return [p for p in ranked if p is not None][:replicas]


def reseat(seats: Seats, peers: Iterable[str]) -> dict[str, str | None]:
    """Return the seats after the peers changed: a peer keeps its seat, a newcomer takes one a peer left.

    Hashing over seats rather than addresses is what makes replacing a node (one address
    out, another in, at once or later) move only the replicas the old node kept: the new
    one takes its seat and with it exactly its share, and no shard changes between two
    nodes that stayed. A newcomer first takes back a vacant seat named after its own
    address, then the vacant seats in order, and only then founds a seat of its own (named
    after its address), so seats never outnumber the most peers ever present at once.
    """
    present = set(peers)
    new = {seat: (holder if holder in present else None) for seat, holder in seats.items()}
    newcomers = sorted(present - {h for h in new.values() if h is not None})
    for address in [a for a in newcomers if new.get(a, "") is None]:
        new[address] = address
        newcomers.remove(address)
    vacant = sorted(s for s, h in new.items() if h is None)
    for seat, address in zip(vacant, newcomers, strict=False):
        new[seat] = address
    for address in newcomers[len(vacant) :]:
        seat, n = address, 1
        while seat in new:  # its own name is held by the node that took its seat while it was away
            seat, n = f"{address}#{n}", n + 1
        new[seat] = address
    return new

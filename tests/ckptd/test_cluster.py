"""The cluster rules: when a step spread over nodes is complete, on which tiers, and where replicas go."""

from __future__ import annotations

from collections import Counter

from ckptd.tiers.cluster import Holding, complete_on, placement, seal_record


def held(node: str, rank: int, tier: str = "nvme", world_size: int = 4, run_id: str = "r1", meta: str = "") -> Holding:
    return Holding(node, tier, "j", 7, rank, world_size, 100 + rank, meta or f"m{rank}", run_id)


def test_a_step_seals_once_every_rank_is_on_some_nodes_nvme():
    shards = [held("a", 0), held("a", 1), held("b", 2)]
    assert seal_record("j", 7, shards) is None
    record = seal_record("j", 7, [*shards, held("b", 3)])
    assert record is not None
    assert record.shard_meta_xxh3_128 == ("m0", "m1", "m2", "m3")
    assert record.size_bytes == 100 + 101 + 102 + 103
    # Every node computes the same record, whatever order it hears the shards in.
    assert seal_record("j", 7, [held("b", 3), held("b", 2), held("a", 1), held("a", 0)]) == record


def test_a_rank_that_lives_on_only_as_a_replica_still_seals_the_step():
    # Node c held ranks 2 and 3 and died before the step was sealed; b has their replicas.
    shards = [held("a", 0), held("a", 1), held("b", 2, tier="peer"), held("b", 3, tier="peer")]
    assert seal_record("j", 7, shards) == seal_record("j", 7, [held("a", r) for r in range(4)])
    assert seal_record("j", 7, shards[:3]) is None


def test_shards_of_two_runs_or_two_copies_never_seal_together():
    mixed_runs = [held("a", 0), held("a", 1), held("b", 2), held("b", 3, run_id="r2")]
    assert seal_record("j", 7, mixed_runs) is None
    assert seal_record("j", 7, mixed_runs, run_id="r1") is None  # r1 lacks rank 3
    assert seal_record("j", 7, [*mixed_runs, held("c", 3)], run_id="r1") is not None
    two_copies = [held("a", 0), held("a", 1), held("b", 2), held("b", 3), held("c", 3, meta="other")]
    assert seal_record("j", 7, two_copies) is None
    assert seal_record("j", 7, [held("a", r, world_size=2) for r in range(2)] + [held("b", 2)]) is None


def test_complete_on_counts_nvme_and_replicas_per_rank():
    record = seal_record("j", 7, [held("a", r) for r in range(4)])
    assert record is not None
    nvme = [held("a", r) for r in range(4)]
    replicas = [held("b", 0, "peer"), held("b", 1, "peer"), held("c", 2, "peer"), held("c", 3, "peer")]
    assert complete_on(record, nvme, replicas=1) == ["nvme"]
    assert complete_on(record, nvme + replicas, replicas=1) == ["nvme", "peer"]
    assert complete_on(record, nvme + replicas, replicas=2) == ["nvme"]
    assert complete_on(record, replicas, replicas=1) == ["peer"]
    assert complete_on(record, nvme + replicas, replicas=0) == ["nvme"]
    stale = [held("b", r, "peer", meta="stale") for r in range(4)]
    assert complete_on(record, stale, replicas=1) == [], "copies that are not the committed ones never count"


def test_placement_is_stable_spread_and_never_repeats_a_peer():
    peers = [f"10.0.0.{i}:7070" for i in range(8)]
    chosen = {rank: placement("job", rank, peers, 2) for rank in range(800)}
    assert all(len(set(c)) == 2 for c in chosen.values())
    assert chosen == {rank: placement("job", rank, list(reversed(peers)), 2) for rank in range(800)}
    load = Counter(p for c in chosen.values() for p in c)
    assert min(load.values()) > 0.6 * (1600 / 8), load  # spread over every peer
    # Removing one peer moves only the copies it held.
    fewer = [p for p in peers if p != peers[3]]
    moved = sum(1 for rank, c in chosen.items() if peers[3] not in c and placement("job", rank, fewer, 2) != c)
    assert moved == 0
    assert placement("job", 0, peers[:1], 3) == peers[:1]

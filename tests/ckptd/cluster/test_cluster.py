"""The cluster rules: when a step spread over nodes is complete, on which tiers, and where replicas go."""

from __future__ import annotations

from collections import Counter

from ckptd.cluster.placement import Holding, complete_on, placement, reseat, seal_record, seated_placement


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


def test_replacing_a_node_moves_only_the_replicas_it_kept():
    peers = [f"10.0.0.{i}:7070" for i in range(8)]
    old, new = peers[3], "10.0.0.99:7070"
    stayed = [p for p in peers if p != old]
    pairs = [(f"job-{j}", rank) for j in range(10) for rank in range(1000)]
    seats = reseat({}, peers)
    replaced = reseat(seats, [*stayed, new])
    for replicas in (1, 2):
        before = {p: seated_placement(*p, seats, replicas) for p in pairs}
        after = {p: seated_placement(*p, replaced, replicas) for p in pairs}
        moved = {p for p in pairs if after[p] != before[p]}
        assert moved == {p for p in pairs if old in before[p]}, "exactly the old node's replicas move"
        assert abs(len(moved) / len(pairs) - replicas / len(peers)) < 0.02, "its share of them"
        # Each moved to the new node, in the old one's place: none between two nodes that stayed.
        assert all(after[p] == [new if n == old else n for n in before[p]] for p in moved)
    # Seen in two rounds (the old node gone first, the new one later) the seats end the same. In between,
    # the old node's shards go each to its next choice among the nodes that stayed.
    gap = reseat(seats, stayed)
    assert reseat(gap, [*stayed, new]) == replaced
    assert all(seated_placement(*p, gap, 1) == placement(*p, stayed, 1) for p in pairs[:1000])
    # Hashing over the addresses alone, the new node would take its share from every node.
    plain_moved = sum(1 for p in pairs if placement(*p, peers, 1) != placement(*p, [*stayed, new], 1))
    assert plain_moved > 1.7 * len(pairs) / len(peers)


def test_seats_go_back_to_their_nodes_and_never_outnumber_the_peers_seen_at_once():
    a, b, c, d = "a:1", "b:1", "c:1", "d:1"
    seats = reseat({}, [a, b, c])
    assert seats == {a: a, b: b, c: c}
    assert reseat(seats, [a, b]) == {a: a, b: b, c: None}  # c's seat waits for a newcomer
    assert reseat(reseat(seats, [a, b]), [a, b, c]) == seats  # c came back: its own seat
    taken = reseat(reseat(seats, [a, b]), [a, b, d])
    assert taken == {a: a, b: b, c: d}
    assert reseat(taken, [a, b, c, d]) == {a: a, b: b, c: d, "c:1#1": c}  # c again, its seat held by d
    assert len(reseat(reseat(taken, [a]), [a, b, c])) == 3

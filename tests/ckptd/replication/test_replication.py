"""Where replicas go as peers join and leave: the replicas a lost peer kept are owed again, the others stay."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpt_core.errors import CheckpointError
from ckpt_core.format import CHUNK_SIZE_BYTES, ShardMeta, digest
from ckpt_core.shard_key import ShardKey

from ckptd.cluster.peer_link import PeerUnreachable
from ckptd.cluster.placement import Holding
from ckptd.replication.sending import Replication

THREADS = ThreadPoolExecutor(4)  # the senders and streams of every Replication here (none sends)

WORLD_SIZE = 64


class Link:
    """What Replication reads of a PeerLink without sending anything."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.ranges_sent = {"data_channel": 0, "grpc_stream": 0}


def _meta(key: ShardKey) -> ShardMeta:
    return ShardMeta(key.job, key.step, key.rank, key.world_size, 4096, CHUNK_SIZE_BYTES, (), "{}")


def _held_where_placed(replication: Replication, keys: list[ShardKey]) -> list[Holding]:
    """Return holdings saying that each shard's replica is on the peer placement chose for it."""
    return [
        Holding(
            replication.targets(k.job, k.rank)[0], "peer", k.job, k.step, k.rank, k.world_size, 4096,
            digest(_meta(k).to_bytes()), "",
        )
        for k in keys
    ]  # fmt: skip


def _pending(replication: Replication) -> dict[str, int]:
    return {address: p["pending_replicas"] for address, p in replication.peers_status().items()}


def test_a_replaced_peer_hands_its_replicas_to_the_new_one_and_a_peer_that_joins_moves_none_in_place():
    links = [Link(f"10.0.0.{i}:7070") for i in range(1, 5)]
    replication = Replication(links, 1, lambda key, done: None, THREADS, THREADS)
    keys = [ShardKey("j", 1, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    for k in keys:
        replication.track(k, _meta(k), [])
    placed = {k: replication.targets(k.job, k.rank)[0] for k in keys}
    replication.confirm(_held_where_placed(replication, keys), {link.address for link in links}, time.monotonic())
    assert all(replication.state(k)[0] for k in keys), "every replica in place"

    old, new = links[1], Link("10.0.0.9:7070")
    replication.update([new], [old.address])
    owed = {k for k in keys if placed[k] == old.address}
    assert owed and {k for k in keys if not replication.state(k)[0]} == owed
    assert _pending(replication) == {**{link.address: 0 for link in links if link is not old}, new.address: len(owed)}
    assert all(replication.targets(k.job, k.rank) == [new.address] for k in owed), "the new peer took its place"

    joined = Link("10.0.0.10:7070")  # a peer more: replicas in place stay where they are, owed ones may go to it
    replication.update([joined], [])
    assert {k for k in keys if not replication.state(k)[0]} == owed
    pending = _pending(replication)
    assert pending[new.address] + pending[joined.address] == len(owed)
    assert all(pending[link.address] == 0 for link in links if link is not old)
    # The next copies spread over all five, the newest taking its share.
    spread = Counter(replication.targets("j", rank)[0] for rank in range(1000))
    assert set(spread) == {link.address for link in links if link is not old} | {new.address, joined.address}
    asyncio.run(replication.drain())


def test_shards_saved_with_no_peer_known_wait_for_the_first_one():
    replication = Replication([], 1, lambda key, done: None, THREADS, THREADS)
    key = ShardKey("j", 1, 0, 1)
    replication.track(key, _meta(key), [])
    assert replication.state(key)[0] is False and replication.pending() == [key]
    first = Link("10.0.0.2:7070")
    replication.update([first], [])
    assert _pending(replication) == {first.address: 1}
    asyncio.run(replication.drain())


def test_a_replica_in_place_is_kept_where_placement_would_now_choose_another_peer():
    # As after a restart once a node was replaced: the copies lie where the seats of the last run put them.
    links = [Link(f"10.0.0.{i}:7070") for i in range(1, 5)]
    replication = Replication(links, 1, lambda key, done: None, THREADS, THREADS)
    keys = [ShardKey("j", 1, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    for k in keys:
        replication.track(k, _meta(k), [])
    elsewhere = {k: next(a.address for a in links if a.address not in replication.targets(k.job, k.rank)) for k in keys}
    held = [
        Holding(elsewhere[k], "peer", k.job, k.step, k.rank, k.world_size, 4096, digest(_meta(k).to_bytes()), "")
        for k in keys
    ]
    replication.confirm(held, {link.address for link in links}, time.monotonic())
    assert all(replication.state(k)[0] for k in keys), "nothing is sent again"
    assert set(_pending(replication).values()) == {0}
    asyncio.run(replication.drain())


class SendingLink(Link):
    """A peer that takes every replica, or (down) refuses each at once, or (silent) never answers, as a cut link."""

    def __init__(self, address: str, down: bool = False, silent: bool = False) -> None:
        super().__init__(address)
        self.down = down
        self.silent = silent
        self.held: list[ShardKey] = []

    def put_shard(self, meta: ShardMeta, path: object, streams: object, record: object = None) -> None:
        if self.silent:
            raise PeerUnreachable(f"peer {self.address}: not reachable within 3 s")
        if self.down:
            raise CheckpointError(f"peer {self.address}: refused")
        self.held.append(ShardKey(meta.job, meta.step, meta.rank, meta.world_size))


async def _attempted(replication: Replication, key: ShardKey, attempts: int) -> None:
    """Wait until a shard's attempts reach a number (the fake links answer at once)."""
    deadline = time.monotonic() + 5.0
    while replication.state(key)[3] < attempts:
        assert time.monotonic() < deadline, f"{key} was not tried {attempts} times"
        await asyncio.sleep(0.01)


def test_a_peer_silent_through_a_cut_is_sent_its_replicas_as_soon_as_it_answers_again():
    cut = SendingLink("10.0.0.1:7070", silent=True)
    replication = Replication([cut], 1, lambda key, done: None, THREADS, THREADS)
    key = ShardKey("j", 1, 0, 1)

    async def body() -> None:
        replication.send(key, _meta(key), [Path("/nonexistent/rank.data")])
        await _attempted(replication, key, 1)
        assert replication.peers_status()[cut.address]["retry_in_s"] > 0  # backing off
        cut.silent = False  # the link heals; the next round's inventory answers
        replication.confirm([], {cut.address}, time.monotonic())
        assert replication.peers_status()[cut.address]["retry_in_s"] == 0
        replication.retry_due(lambda k: None)
        await _attempted(replication, key, 2)
        await replication.drain()

    asyncio.run(body())
    assert cut.held == [key] and replication.state(key)[0]


def test_a_shard_whose_every_peer_is_silent_since_it_was_saved_is_said_to_have_nowhere_to_go():
    b, c = SendingLink("10.0.0.2:7070", silent=True), SendingLink("10.0.0.3:7070", silent=True)
    replication = Replication([b, c], 1, lambda key, done: None, THREADS, THREADS, failover_s=0.01)
    key, later = ShardKey("j", 1, 0, 1), ShardKey("j", 2, 0, 1)

    async def body() -> None:
        replication.send(key, _meta(key), [Path("/nonexistent/rank.data")])
        assert replication.unreachable(key) == "", "nothing tried yet"
        await _attempted(replication, key, 2)  # its placed peer, then the stand-in failover_s gives it
        assert replication.unreachable(key) == "", "two requests unanswered: not yet FAILURES_REPORTED"
        replication.retry_now(key)  # as a waiter has it done
        await _attempted(replication, key, 4)
        said = replication.unreachable(key)
        assert b.address in said and c.address in said, said
        replication.track(later, _meta(later), [])  # saved after: the link may have healed, it is tried first
        assert replication.unreachable(later) == ""
        await replication.drain()

    asyncio.run(body())


def test_a_shard_waiting_out_a_dead_peers_back_off_gets_its_stand_in_after_failover_s_without_a_round():
    # As in the fault campaign: a shard sent to its placed peer as that peer died waits out the back-off; no new
    # save comes and the round that calls retry_due is late. It must still be on a live node within the bound.
    dead, alive = SendingLink("10.0.0.1:7070", down=True), SendingLink("10.0.0.2:7070")
    replication = Replication([dead, alive], 1, lambda key, done: None, THREADS, THREADS, failover_s=0.3)
    keys = [ShardKey("j", 1, rank, WORLD_SIZE) for rank in range(WORLD_SIZE)]
    key = next(k for k in keys if replication.targets(k.job, k.rank) == [dead.address])

    async def body() -> float:
        started = time.monotonic()
        replication.send(key, _meta(key), [Path("/nonexistent/rank.data")])  # the fake links read no file
        while key not in alive.held and time.monotonic() - started < 5.0:
            await asyncio.sleep(0.02)
        await replication.drain()
        return time.monotonic() - started

    took = asyncio.run(body())
    assert alive.held == [key], "the stand-in was never sent the shard"
    assert replication.state(key)[0] and took < 5.0
    assert replication.peers_status()[alive.address]["stood_in_for"] == 1

"""PeerInventory: the links to the peers and what each holds; the peer tier reads and lists over it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from ckpt_core.format import CommitRecord

from ckptd.cluster import peer_inventory
from ckptd.cluster.peer_inventory import PeerInventory
from ckptd.cluster.placement import Holding, StepHoldings
from ckptd.tiers.peer import PeerTier

RECORD = CommitRecord("job", 3, 1, ("d0",), 10)


class Link:
    """A peer that answers its inventory from memory, counting the questions."""

    def __init__(self, address: str, holds: bool) -> None:
        self.address = address
        shard = Holding(address, "nvme", "job", 3, 0, 1, 10, "d0", "")
        self.held = [StepHoldings(address, "job", 3, RECORD, (shard,))] if holds else []
        self.asked = 0
        self.closed = False

    def inventory(self, job: str, step: int, timeout_s: float, wait_for_ready: bool = False) -> list[StepHoldings]:
        self.asked += 1
        return self.held

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def threads():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def test_the_peer_tier_over_some_peers_asks_only_those(threads):
    a, b = Link("a:1", holds=False), Link("b:1", holds=True)
    peers = PeerInventory([a, b], threads)  # type: ignore[list-item]
    named = PeerTier(peers.among({"b:1"}))
    assert named.complete_steps("job") == [3] and named.commit_record("job", 3) == RECORD
    assert (a.asked, b.asked) == (0, 1)
    assert PeerTier(peers).has_shard("job", 3, 0) and a.asked == 1
    assert peers.reachable() == {"a:1", "b:1"} and peers.connecting() == []


def test_a_peer_that_left_is_closed_only_once_its_calls_may_have_ended(threads, monkeypatch):
    a, b = Link("a:1", holds=True), Link("b:1", holds=True)
    peers = PeerInventory([a], threads)  # type: ignore[list-item]
    peers.update([b], {"a:1"})  # type: ignore[list-item]
    peers.close_retired()
    assert [link.address for link in peers.links] == ["b:1"] and not a.closed
    monkeypatch.setattr(peer_inventory, "RETIRED_LINK_CLOSE_S", 0.0)
    peers.close_retired()
    assert a.closed and not b.closed

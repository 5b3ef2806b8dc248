"""Membership from [peer] addresses: names resolved again and again, failures keeping the last set."""

from __future__ import annotations

import asyncio
import logging
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptd.cluster.peer_membership import ResolvedPeers
from ckptd.config import load_config

SERVICE = "ckptd-peers.test:7070"
ME = "10.0.0.1:7070"
RESOLVE_THREADS = ThreadPoolExecutor(1, thread_name_prefix="resolve")  # Executors.resolve, for every test here


class Dns:
    """A lookup that answers from a table, and fails for an entry whose answer is an error."""

    def __init__(self, table: dict[str, list[str] | OSError]) -> None:
        self.table = table
        self.asked = 0

    def __call__(self, entry: str) -> list[str]:
        self.asked += 1
        answer = self.table[entry]
        if isinstance(answer, OSError):
            raise answer
        return answer


def _config(addresses: list[str], interval_s: int = 1):
    quoted = ", ".join(f'"{a}"' for a in addresses)
    return load_config(
        env={
            "CKPTD_NODE__LISTEN": f'"{ME}"',
            "CKPTD_PEER__ADDRESSES": f"[{quoted}]",
            "CKPTD_PEER__INSECURE": "true",
            "CKPTD_PEER__RESOLVE_INTERVAL_S": str(interval_s),
        }
    )


def _ips(*last: int) -> list[str]:
    return [f"10.0.0.{i}:7070" for i in last]


def _temporary_failure() -> OSError:
    return socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")


def _watched(membership: ResolvedPeers) -> list[tuple[set[str], set[str]]]:
    changes: list[tuple[set[str], set[str]]] = []

    async def on_change(added: frozenset[str], removed: frozenset[str]) -> None:
        changes.append((set(added), set(removed)))

    membership.watch(on_change)
    return changes


def test_a_name_stands_for_every_address_it_resolves_to_and_each_lookup_follows_it(caplog):
    dns = Dns({SERVICE: _ips(1, 2, 3, 4), "10.0.0.9:7070": _ips(9), ME: [ME]})
    membership = ResolvedPeers(_config([SERVICE, "10.0.0.9:7070"]), RESOLVE_THREADS, dns)
    changes = _watched(membership)

    async def scenario() -> None:
        await membership.refresh()
        assert membership.peers() == set(_ips(2, 3, 4, 9)), "every address but this node's own"
        assert changes == [(set(_ips(2, 3, 4, 9)), set())]
        dns.table[SERVICE] = _ips(1, 2, 3, 5)  # node 4 replaced by node 5
        await membership.refresh()
        assert changes[-1] == ({"10.0.0.5:7070"}, {"10.0.0.4:7070"})
        await membership.refresh()  # nothing changed: nothing reported
        assert len(changes) == 2
        # A failed lookup keeps the addresses the name last resolved to, and says so once per streak.
        dns.table[SERVICE] = _temporary_failure()
        with caplog.at_level(logging.INFO, logger="ckptd.cluster.peer_membership"):
            for _ in range(3):
                await membership.refresh()
            assert membership.peers() == set(_ips(2, 3, 5, 9)) and len(changes) == 2
            assert "Temporary failure" in membership.status()["failing"][SERVICE]
            dns.table[SERVICE] = _ips(1, 2, 3)
            await membership.refresh()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and SERVICE in warnings[0].getMessage(), caplog.text
        assert "resolves again" in caplog.text
        assert changes[-1] == (set(), {"10.0.0.5:7070"})
        assert membership.status()["failing"] == {}
        assert membership.status()["peers"] == _ips(2, 3, 9)

    asyncio.run(scenario())
    membership.close()


def test_a_name_that_resolves_to_nothing_at_first_leaves_the_node_alone_until_peers_appear():
    dns = Dns({SERVICE: _temporary_failure(), ME: [ME]})
    membership = ResolvedPeers(_config([SERVICE]), RESOLVE_THREADS, dns)
    changes = _watched(membership)

    async def scenario() -> None:
        await membership.refresh()
        assert membership.peers() == set() and changes == []
        dns.table[SERVICE] = _ips(1)  # only this node so far
        await membership.refresh()
        assert membership.peers() == set() and changes == []
        dns.table[SERVICE] = _ips(1, 2)
        await membership.refresh()
        assert changes == [({"10.0.0.2:7070"}, set())]

    asyncio.run(scenario())
    membership.close()


def test_a_change_that_failed_to_apply_is_offered_again():
    dns = Dns({SERVICE: _ips(1, 2), ME: [ME]})
    membership = ResolvedPeers(_config([SERVICE]), RESOLVE_THREADS, dns)
    offered: list[frozenset[str]] = []

    async def on_change(added: frozenset[str], removed: frozenset[str]) -> None:
        offered.append(added)
        if len(offered) == 1:
            raise OSError("could not open the link")

    membership.watch(on_change)

    async def scenario() -> None:
        with pytest.raises(OSError):
            await membership.refresh()
        assert membership.peers() == set()
        await membership.refresh()
        assert offered == [{"10.0.0.2:7070"}] * 2 and membership.peers() == {"10.0.0.2:7070"}

    asyncio.run(scenario())
    membership.close()


def test_an_interval_of_0_resolves_once_at_start():
    dns = Dns({SERVICE: _ips(1, 2), ME: [ME]})
    membership = ResolvedPeers(_config([SERVICE], interval_s=0), RESOLVE_THREADS, dns)

    async def scenario() -> None:
        await membership.refresh()
        asked = dns.asked
        await asyncio.wait_for(membership.run_forever(), timeout=5)  # returns at once: nothing to follow
        assert dns.asked == asked

    asyncio.run(scenario())
    membership.close()


def test_a_name_with_both_families_stands_for_the_addresses_of_this_nodes_family_and_literals_for_themselves():
    both = [*_ips(1, 2, 3), "[fd00::1]:7070", "[fd00::2]:7070", "[fd00::3]:7070"]  # three dual-stack nodes
    dns = Dns({SERVICE: both, "[fd00::9]:7070": ["[fd00::9]:7070"], ME: [ME]})
    membership = ResolvedPeers(_config([SERVICE, "[fd00::9]:7070"]), RESOLVE_THREADS, dns)
    asyncio.run(membership.refresh())
    assert membership.peers() == {*_ips(2, 3), "[fd00::9]:7070"}
    membership.close()

"""Membership from etcd: every live daemon keeps a key under <prefix>nodes/ on a lease it renews.

EtcdView builds it and shares its EtcdClient; Node drives it like any Membership
(refresh() once at start, run_forever() as a task, close() at drain), all on the event
loop. A daemon that stops renewing its lease ([cluster] lease_ttl_s) leaves the set when
the lease expires; one that stops cleanly revokes it at once. While etcd cannot be
reached, the set last seen is kept (peers do not vanish because etcd did).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ckptd.cluster.etcd_client import EtcdClient, EtcdCompacted, EtcdError
from ckptd.cluster.peer_membership import Membership

log = logging.getLogger(__name__)

RETRY_S = 1.0


class EtcdMembership(Membership):
    """The peers are the other keys under <prefix>nodes/; each key's name is a node's peer address."""

    def __init__(self, client: EtcdClient, prefix: bytes, node: str) -> None:
        super().__init__()
        self.client = client
        self.nodes_prefix = prefix + b"nodes/"
        self.node = node
        self._revision = 0  # the revision the published set reflects; the watch resumes after it
        self.failing = ""  # why etcd could not be read lately; "" while it answers

    def _address(self, key: bytes) -> str:
        return key[len(self.nodes_prefix) :].decode(errors="replace")

    async def refresh(self) -> None:
        """Read the node keys now and publish the set (etcd away: keep the last one, say why)."""
        try:
            entries, self._revision = await self.client.get_prefix(self.nodes_prefix, keys_only=True)
        except EtcdError as e:
            self._failed(e)
            return
        self.failing = ""
        await self._publish(frozenset(self._address(e.key) for e in entries) - {self.node})

    def _failed(self, error: EtcdError) -> None:
        if not self.failing:
            log.warning("cluster membership: etcd cannot be read (%s); keeping the last set of peers", error)
        self.failing = str(error)

    async def run_forever(self) -> None:
        """Follow the node keys with a watch; read them whole again after a break or a compaction."""
        while True:
            try:
                peers = set(self.peers())
                async for event in self.client.watch_prefix(self.nodes_prefix, self._revision + 1):
                    address = self._address(event.key)
                    if address != self.node:
                        (peers.add if event.kind == "put" else peers.discard)(address)
                    self._revision = event.mod_revision
                    await self._publish(frozenset(peers))
            except EtcdCompacted:
                await self.refresh()
                continue
            except EtcdError as e:
                self._failed(e)
            except Exception:  # a change that failed is offered again by the refresh below
                log.exception("following the cluster membership in etcd failed")
            await asyncio.sleep(RETRY_S)  # etcd is away: a pace for trying again, not a wait for anything
            await self.refresh()

    def status(self) -> dict[str, Any]:
        return {"source": "etcd", "peers": sorted(self._peers), "failing": self.failing}

    def close(self) -> None:
        """Nothing of its own: EtcdView closes the client."""

"""Who the peers are and what each holds: the links to the other nodes, and their inventories.

Peering changes the links with update() as the membership says peers joined and left, and
calls close_retired() now and then; it asks the peers afresh (ask) in a round of catching up
and for `status` (reachable, connecting, unreachable). ClusterSteps asks what the cluster holds
(inventories, kept VIEW_TTL_S; forget drops them); the peer tier (tiers.peer) reads through the
same links, built on this inventory by the composition root. Calls block: make them from worker
threads; an inventory of every peer asks them at once, on the pool given at construction
(Executors.inventories).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from concurrent.futures import Executor

from ckpt_core.errors import CheckpointError

from ckptd.cluster.peer_link import IsSelf, PeerLink
from ckptd.cluster.placement import Holding, StepHoldings
from ckptd.pool_map import pool_map

log = logging.getLogger(__name__)

VIEW_TTL_S = 1.0
INVENTORY_TIMEOUT_S = 3.0
INVENTORY_THREADS = 64  # peers asked at once by one call: a thread each, not one per peer of a thousand
RETIRED_LINK_CLOSE_S = 60.0  # a link to a peer that left is closed this long after: calls under way end first


class PeerInventory:
    """Hold a link to each peer and answer what the peers hold, whichever of their tiers holds each shard.

    update() and close_retired() come from Peering; every other call may come from any worker
    thread meanwhile.
    """

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

    def among(self, addresses: Collection[str]) -> PeerInventory:
        """Return an inventory of only the peers in addresses (the same links: close this one, never that)."""
        with self._lock:
            return PeerInventory([link for link in self.links if link.address in addresses], self._threads)

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

    def shards(self, job: str, step: int) -> list[Holding]:
        """Return every holding of a step's shards on the peers."""
        return [h for s in self.inventories(job) if (s.job, s.step) == (job, step) for h in s.shards]

    def close(self) -> None:
        """Close every link, retired ones included."""
        for link in [*self.links, *(link for _, link in self._retired)]:
            link.close()

"""Know which other nodes' daemons make up the cluster, and tell Peering when that changes.

The one place the peer set comes from: Peering creates and closes its links, and
Replication chooses where replicas go, from what a Membership says. Peers are named
by "ip:port", the address the others dial and the node's name in the cluster view.
ResolvedPeers derives the set from [peer] addresses, looking its names up again
every [peer] resolve_interval_s, so that a DNS name (a Kubernetes headless service)
stands for every daemon it resolves to.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any

from ckptd.addresses import dialled_names, endpoints, peer_endpoints
from ckptd.config import Config

log = logging.getLogger(__name__)

OnChange = Callable[[frozenset[str], frozenset[str]], Awaitable[None]]  # (added, removed)


class Membership(ABC):
    """Keep the set of other nodes' peer addresses current, and report each change.

    Order of calls, all on the event loop: Peering calls watch(on_change) once, when it
    is built; Node awaits refresh() once at start (before the first flush resumes),
    runs run_forever() as a task until drain, then calls close(). Each change is awaited
    as on_change(added, removed) inside refresh(), one change at a time; the set that
    peers() returns moves only once on_change returned, so a change that failed is
    offered again by the next refresh. peers() and status() answer from memory.
    """

    def __init__(self) -> None:
        self._peers: frozenset[str] = frozenset()
        self._on_change: OnChange | None = None

    def watch(self, on_change: OnChange) -> None:
        """Have on_change(added, removed) awaited after every change of the set (one subscriber)."""
        self._on_change = on_change

    def peers(self) -> frozenset[str]:
        """Return the other nodes' addresses as last published."""
        return self._peers

    def tls_name(self, address: str) -> str:
        """Return the name a peer's certificate must carry, where it is not its address's host ("": the host)."""
        return ""

    def own_address(self) -> str:
        """Return this node's address as the other nodes name it ("": as [node] listen writes it)."""
        return ""

    async def _publish(self, peers: frozenset[str]) -> None:
        added, removed = peers - self._peers, self._peers - peers
        if not added and not removed:
            return
        if self._on_change is not None:
            await self._on_change(added, removed)
        self._peers = peers

    @abstractmethod
    async def refresh(self) -> None:
        """Look at the cluster now, and publish the set if it changed."""

    @abstractmethod
    async def run_forever(self) -> None:
        """Refresh whenever the source may have changed, until cancelled."""

    @abstractmethod
    def status(self) -> dict[str, Any]:
        """Describe the membership for `ckptd status`."""

    @abstractmethod
    def close(self) -> None:
        """Release what the membership holds (after run_forever was cancelled)."""


class ResolvedPeers(Membership):
    """The peers [peer] addresses names: the addresses each entry's host resolves to, less this node's own.

    A DNS answer carries no port: every address an entry resolves to takes the entry's
    port (addresses.peer_endpoints says which addresses count). An entry whose lookup fails
    keeps the addresses it last resolved to (none, the first time: the node runs alone
    until peers appear); the failure is logged once per streak and shown in status()
    until a lookup answers again. Lookups block, on a thread of their own, so that a slow
    DNS server holds up nothing else.
    """

    def __init__(self, config: Config, threads: Executor, lookup: Callable[[str], list[str]] = endpoints) -> None:
        """threads: the resolving thread, one lookup at a time (Executors.resolve).

        lookup(host_port) returns the "ip:port" endpoints of an entry or raises OSError (addresses.endpoints).
        """
        super().__init__()
        self.addresses = tuple(dict.fromkeys(config.peer.addresses))
        self.listen = config.node.listen
        self.interval_s = config.peer.resolve_interval_s
        self._lookup = lookup
        self._known: dict[str, list[str]] = {}  # entry (or listen) -> its endpoints when it last resolved
        self._failing: dict[str, str] = {}  # entry -> why its lookups fail, while they do
        self._names: dict[str, str] = {}  # endpoint -> the name in addresses it was found by (dialled_names)
        self._resolved_unix_s = 0.0
        self._threads = threads

    def _look_up_all(self) -> dict[str, list[str] | OSError]:
        answers: dict[str, list[str] | OSError] = {}
        for entry in (*self.addresses, self.listen):
            if entry:
                try:
                    answers[entry] = self._lookup(entry)
                except OSError as e:
                    answers[entry] = e
        return answers

    async def refresh(self) -> None:
        """Look every entry up again (on the resolving thread); publish the peers if they changed."""
        answers = await asyncio.get_running_loop().run_in_executor(self._threads, self._look_up_all)
        for entry, answer in answers.items():
            if isinstance(answer, OSError):
                if entry not in self._failing:
                    log.warning(
                        "cannot resolve %s (%s); keeping the addresses it last resolved to: %s",
                        entry, answer, ", ".join(self._known.get(entry, [])) or "none",
                    )  # fmt: skip
                self._failing[entry] = str(answer)
            else:
                if self._failing.pop(entry, None) is not None:
                    log.info("%s resolves again: %s", entry, ", ".join(answer))
                self._known[entry] = answer
        self._resolved_unix_s = time.time()
        self._names = dialled_names(self.addresses, self._known)
        await self._publish(peer_endpoints(self.addresses, self.listen, self._known))

    async def run_forever(self) -> None:
        """Refresh every [peer] resolve_interval_s; with 0, never again after start."""
        if self.interval_s == 0:
            return
        while True:
            await asyncio.sleep(self.interval_s)  # a period, not a wait for anything
            try:
                await self.refresh()
            except Exception:  # the next round tries again: membership must outlive one bad change
                log.exception("following the peers named in [peer] addresses failed")

    def tls_name(self, address: str) -> str:
        return self._names.get(address, "")

    def own_address(self) -> str:
        """Return the first address [node] listen resolved to: how the peers' lookups name this node."""
        return min(self._known.get(self.listen, []), default="")

    def status(self) -> dict[str, Any]:
        return {
            "addresses": list(self.addresses),
            "peers": sorted(self._peers),
            "resolve_interval_s": self.interval_s,
            "resolved_unix_s": round(self._resolved_unix_s, 3),
            "failing": dict(self._failing),  # entry -> why it does not resolve now (its last addresses are kept)
        }

    def close(self) -> None:
        """Nothing of its own: the resolving thread is Executors.resolve's, given up with the others."""

"""This node's part in the cluster: find what seals steps across nodes, keep replicas flowing, catch up with the peers.

Built by the composition root and called on the event loop by SavePath, which alone seals and
adopts (it writes the commit records; Peering only finds them: record_to_seal after a shard is
durable here, told_before for a commit a peer tells, look_around → record_found → resume_replicas
for a round of catching up, SavePath.catch_up). What loads need of the cluster is
load/cluster_steps.py's. Blocking work runs on the peer threads. Nodes are known by their
peer address ("ip:port", as [node] listen names this one). Which steps are committed across
nodes, and which nodes are peers, the cluster view says (ckptd.cluster.view): Peering reports
to it what this node holds of steps it cannot seal alone, and follows its membership
(membership_changed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_core.errors import CheckpointError
from ckpt_core.format import CommitRecord, ShardMeta
from ckpt_core.shard_key import ShardKey

from ckptd.cluster.peer_inventory import PeerInventory
from ckptd.cluster.peer_link import PeerLink
from ckptd.cluster.placement import Holding, StepHoldings, seal_record
from ckptd.cluster.view import ClusterView
from ckptd.config import Config
from ckptd.errors import StepAlreadyComplete
from ckptd.replication.sending import FAILURES_REPORTED, Replication
from ckptd.tiers.base import DurableTier

log = logging.getLogger(__name__)

PROBE_STEP = 2**62 - 1  # a step no job has: asking a peer about it only tells whether the peer answers
SLOW_ROUND_S = 10.0  # a round of reconcile that takes longer is logged with where its time went
PROBE_TIMEOUT_S = 2.0  # beyond gRPC's reconnect back-off (peer_link.grpc_options: at most 1 s)
ANNOUNCED_STEPS = 4096  # the steps "complete across the cluster" was logged for, remembered to log it once


@dataclass(frozen=True)
class CatchUp:
    """What a round of catching up found (Peering.look_around), for SavePath.catch_up and resume_replicas.

    asked: the peers asked (None: every one), at asked_at (time.monotonic()); remote, local: what they
    and this node hold; records: the commit records known of the steps (a peer's in a full round, or this
    node's other tier's); remote_shards, mine: the shards the peers (in a full round) and this node hold, by
    step; unsealed: the steps this node holds unsealed; took: where the round's time went, in seconds.
    """

    asked: set[str] | None
    asked_at: float
    remote: list[StepHoldings]
    local: list[StepHoldings]
    records: dict[tuple[str, int], CommitRecord]
    remote_shards: dict[tuple[str, int], list[Holding]]
    mine: dict[tuple[str, int], list[Holding]]
    unsealed: set[tuple[str, int]]
    took: dict[str, float]


class Peering:
    """Coordinate this node's NVMe tier and replica store with the other nodes."""

    def __init__(
        self,
        config: Config,
        view: ClusterView | None,
        nvme: DurableTier,
        replica_store: DurableTier,
        peers: PeerInventory | None,
        replication: Replication | None,
        instance: str,
        threads: ThreadPoolExecutor,
        keep_of: Callable[[str, str], int] | None = None,
    ) -> None:
        """peers: the links to the peers and what they hold, wherever a cluster view is (peers may come later);
        replication: where [peer] replicas > 0.

        instance: this daemon's run (calls that carry it have come back to it). threads: the
        peer threads, for short tier work. keep_of(job, tier): the newest steps retention keeps
        of a job on a tier (JobRetention's, on the event loop); default [retention]'s.
        """
        self.config = config
        self._keep_of = keep_of or (lambda job, tier: int(getattr(config.retention, tier)))
        self.nvme = nvme
        self.replica_store = replica_store
        self.node = config.node.listen or config.node.name
        self._threads = threads
        self._inventories_answered = 0
        self.instance = instance
        # Their links follow the membership.
        self.view = view
        self.membership = view.membership if view is not None else None
        self.peers = peers
        self.replication = replication
        if self.membership is not None:
            self.membership.watch(self.membership_changed)
        # NVMe's complete steps by job, as the last reconciliation listed them (on a thread), for what replicas
        # still owed keep off retention (judged on the event loop); a round old at most, it only keeps more.
        self._nvme_complete: dict[str, list[int]] = {}
        # The same, with the steps the cluster view knows committed: the newest of these are what the peers keep.
        self._cluster_complete: dict[str, list[int]] = {}
        self._announced: OrderedDict[tuple[str, int], None] = OrderedDict()  # see note_complete

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)

    async def membership_changed(self, added: frozenset[str], removed: frozenset[str]) -> None:
        """Open links to the peers that joined, retire those of the peers that left, and place replicas again."""
        assert self.peers is not None
        known = {link.address for link in self.peers.links}
        new = sorted(added - known)  # a change offered again after a failure: its links may be there
        names = {a: self.membership.tls_name(a) for a in new} if self.membership is not None else {}
        links = await self._run(
            lambda: [
                PeerLink(a, self.config.peer, self.instance, names.get(a, ""), self.config.commit_keys) for a in new
            ]
        )
        self.peers.update(links, removed)
        if self.replication is not None:
            self.replication.update(links, removed)
        log.info("peers joined: %s; left: %s", ", ".join(sorted(added)) or "none", ", ".join(sorted(removed)) or "none")

    @property
    def replicas(self) -> int:
        """Return how many other nodes hold a copy of each shard: at most one per peer known now."""
        return min(self.config.peer.replicas, len(self.peers.links)) if self.peers is not None else 0

    # -- what this node holds -----------------------------------------------------

    async def holdings(self, job: str, step: int | None) -> list[StepHoldings]:
        """Return what this node holds of a job's step (or of everything): a peer's Inventory (on the peer threads)."""
        self._inventories_answered += 1
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.local_holdings, job, step)

    def local_holdings(self, job: str = "", step: int | None = None) -> list[StepHoldings]:
        """Return what this node's NVMe tier and replica store hold of a job's step (or of everything)."""
        found = []
        for tier in (self.nvme, self.replica_store):
            for j in [job] if job else tier.jobs():
                for s in [step] if step is not None else tier.all_steps(j):
                    shards = tuple(tier.holdings(j, s, self.node))
                    record = tier.checked_commit(j, s)
                    if shards or record is not None:
                        found.append(StepHoldings(self.node, j, s, record, shards))
        return found

    # -- sealing steps across nodes ---------------------------------------------------

    async def _local_shards(self, job: str, step: int) -> list[Holding]:
        shards: list[Holding] = await self._run(self.nvme.holdings, job, step, self.node)
        return shards + await self._run(self.replica_store.holdings, job, step, self.node)

    async def record_to_seal(self, job: str, step: int, run_id: str | None) -> tuple[CommitRecord | None, bool]:
        """Return the record a step that just got a durable shard here is sealed with, and whether it is sealed here.

        Sealed here: this node holds every rank (of run_id's shards, where given), and the record is
        made now (raises MixedLines where the shards are of different lines). Otherwise the record
        is the one the cluster view knows committed, and what this node holds of the step is
        reported to the view, committed or not (replicas count for holders()); (None, False): not yet,
        the step is sealed here when its commit comes back (SavePath.adopt_commit). SavePath.seal
        calls it under its seal lock, and adopts what it returns.
        """
        shards = await self._local_shards(job, step)
        record = seal_record(job, step, shards, run_id, commit_keys=self.config.commit_keys)
        if record is not None:
            return record, True
        if self.view is not None:
            record = self.view.commit_record(job, step)
            self.view.report(job, step, shards)
        return record, False

    async def told_before(self, record: CommitRecord) -> bool:
        """Say whether this node holds a step a peer tells of complete already, with this very record.

        Raises StepAlreadyComplete where it holds the step complete with another record, which stays
        (SavePath.adopt_commit adopts the record otherwise). A peer may tell a step again (or lie
        about it): nothing changes, nothing is logged.
        """
        held = await self._run(self._commits_held, record.job, record.step)
        if any(r != record for r in held):
            raise StepAlreadyComplete(
                f"{record.job} step {record.step} is complete on node {self.node} with another commit record; kept"
            )
        return bool(held)

    def _commits_held(self, job: str, step: int) -> list[CommitRecord]:
        return [r for t in (self.nvme, self.replica_store) if (r := t.checked_commit(job, step)) is not None]

    # -- replication -------------------------------------------------------------------------

    def replicate(self, key: ShardKey, meta: ShardMeta, slot_path: Path | None) -> None:
        """Start replicating a shard from its staging slot (while it holds the snapshot), else from NVMe."""
        if self.replication is None:
            return
        on_disk = self.nvme.shard_source(key.job, key.step, key.rank).data_path(key.rank)
        self.replication.send(key, meta, [p for p in (slot_path, on_disk) if p is not None])

    def retry_failing_replicas(self, key: ShardKey) -> None:
        """Try a shard's missing replicas at once if they have been failing, or no peer answers (SavePath.wait_shard:
        a waiter asks, and hears how a fresh attempt goes)."""
        if self.replication is not None and (
            self.replication.state(key)[2] >= FAILURES_REPORTED or self.replication.unreachable(key)
        ):
            self.replication.retry_now(key)

    def forget_replicas(self, key: ShardKey) -> None:
        """Stop following the replicas of a shard's earlier copy (it was saved again)."""
        if self.replication is not None:
            self.replication.untrack(key)

    async def look_around(self, full: bool) -> CatchUp | None:
        """Ask the peers what they hold and list this node's holdings: the start of a round of catching up.

        full (at start-up: recovery): ask every peer's inventory, so that the commits they hold are
        adopted and steps sealed from their shards too. Otherwise only the peers this node's
        replicas go to are asked, to confirm those replicas: the work of a round does not grow with
        the cluster. None: no peer tier. SavePath.catch_up then seals what it found (record_found),
        and resume_replicas follows the replicas.
        """
        if self.peers is None:
            return None
        self.peers.forget()
        await self._run(self.peers.close_retired)
        asked = None if full else self.replication.target_peers() if self.replication is not None else set()
        asked_at = time.monotonic()
        peers = self.peers
        remote: list[StepHoldings] = await self._run(lambda: peers.ask(only=asked))
        local: list[StepHoldings] = await self._run(self.local_holdings, "", None)
        took = {"asking the peers and listing this node": time.monotonic() - asked_at}
        records = {(s.job, s.step): s.record for s in remote if s.record is not None and full}
        remote_shards: dict[tuple[str, int], list[Holding]] = defaultdict(list)
        for s in remote if full else []:
            remote_shards[(s.job, s.step)].extend(s.shards)
        mine: dict[tuple[str, int], list[Holding]] = defaultdict(list)  # both tiers of this node, by step
        for s in local:
            mine[(s.job, s.step)].extend(s.shards)
            if s.record is not None:
                records.setdefault((s.job, s.step), s.record)  # sealed in one tier here: seal the other too
        unsealed = {(s.job, s.step) for s in local if s.record is None}
        return CatchUp(asked, asked_at, remote, local, records, remote_shards, mine, unsealed, took)

    def record_found(self, found: CatchUp, job: str, step: int) -> tuple[CommitRecord | None, bool]:
        """Return the record an unsealed step of a round is sealed with, and whether it is sealed here first.

        The record a peer or this node's other tier holds, or the cluster view's; else one made from
        the shards this node (and, in a full round, the peers) hold (raises MixedLines where they are of
        different lines). (None, False): not complete yet, and what this node holds is reported to the
        view. SavePath.catch_up calls it under its seal lock, for each step not flushing.
        """
        record = found.records.get((job, step)) or (self.view.commit_record(job, step) if self.view else None)
        if record is not None:
            return record, False
        held = [*found.mine[(job, step)], *found.remote_shards[(job, step)]]
        record = seal_record(job, step, held, commit_keys=self.config.commit_keys)
        if record is None and self.view is not None:
            self.view.report(job, step, found.mine[(job, step)])
        return record, record is not None

    async def resume_replicas(self, found: CatchUp) -> None:
        """End a round of catching up: follow this node's shards, confirm their replicas, retry those due.

        Logs a round slower than SLOW_ROUND_S with where its time went (found.took).
        """
        took, asked, asked_at = found.took, found.asked, found.asked_at
        if self.replication is not None and self.peers is not None:
            self._nvme_complete = await self._run(lambda: {j: self.nvme.complete_steps(j) for j in self.nvme.jobs()})
            self._cluster_complete = {j: self._complete_in_cluster(j, s) for j, s in self._nvme_complete.items()}
            await self._run(self._track_local_shards, found.local)
            reachable = self.peers.reachable() if asked is None else self.peers.reachable() & asked
            on_disk = await self._run(self._steps_on_disk, self.replication.tracked())
            # A step directory goes only with retention (a shard still being flushed has one already).
            self.replication.forget(lambda k: on_disk.get((k.job, k.step), (True, None))[0] and self._kept(k))
            self.replication.confirm([h for s in found.remote for h in s.shards], reachable, asked_at)
            self.replication.retry_due(lambda k: on_disk.get((k.job, k.step), (True, None))[1])
        if time.monotonic() - asked_at > SLOW_ROUND_S:
            took["the replicas"] = time.monotonic() - asked_at - sum(took.values())
            log.warning(
                "a round of catching up with the peers took %.1f s (%s)",
                *(time.monotonic() - asked_at, ", ".join(f"{what} {s:.1f} s" for what, s in took.items())),
            )

    def _steps_on_disk(self, keys: list[ShardKey]) -> dict[tuple[str, int], tuple[bool, CommitRecord | None]]:
        """Return, for the steps of keys, whether each has a directory on NVMe and its commit record (a thread)."""
        steps = {(k.job, k.step) for k in keys}
        on_disk = {j: set(self.nvme.all_steps(j)) for j in {j for j, _ in steps}}
        return {(j, s): (s in on_disk[j], self.nvme.checked_commit(j, s)) for j, s in steps}

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps whose replicas are still owed within [retention]: retention keeps off them (BusySteps)."""
        return self.replicating_steps()

    def replicating_steps(self) -> set[tuple[str, int]]:
        """Return the steps whose replicas are still on their way, among those the peers keep of the job (keep_of).

        With [retention] peer > 0 that is the bound: a step of the job's newest `peer` steps stays on NVMe
        until its replicas exist (a stand-in's count), however far NVMe's own keep has passed it. With
        peer = 0 (the peers keep every step), at most twice the job's NVMe keep: a peer that stays down
        must not fill the disk.
        """
        if self.replication is None:
            return set()

        def within(key: ShardKey) -> bool:
            if self._keep_of(key.job, "peer") > 0:
                return True  # _kept bounds it by the peers' keep
            limit = 2 * self._keep_of(key.job, "nvme")
            complete = self._nvme_complete.get(key.job)
            if complete is None:  # not listed yet: kept until the next reconciliation says
                return True
            return limit == 0 or key.step in complete[-limit:] or key.step > max(complete, default=-1)

        return {(k.job, k.step) for k in self.replication.pending() if self._kept(k) and within(k)}

    def _complete_in_cluster(self, job: str, on_nvme: list[int]) -> list[int]:
        """Return a job's complete steps on NVMe here and known committed to the cluster view, oldest first."""
        known = {r.step for r in self.view.committed(job)} if self.view is not None else set()
        return sorted(known.union(on_nvme))

    def _kept(self, key: ShardKey) -> bool:
        """Say whether the peers keep a shard's step under the job's peer keep (else it is not sent again).

        The peers keep the job's newest steps, counted among the steps complete in the cluster, not
        on this NVMe alone: an older step a load fetched back onto NVMe is not sent again, for the
        peer's retention would drop it at once, and this node send it again, round after round.
        """
        keep = self._keep_of(key.job, "peer")
        complete = self._cluster_complete.get(key.job)
        if complete is None:  # not listed yet: kept until the next reconciliation says
            return True
        return keep == 0 or key.step in complete[-keep:] or key.step > max(complete, default=-1)

    def _track_local_shards(self, local: list[StepHoldings]) -> None:
        assert self.replication is not None
        for s in local:
            for h in s.shards:
                if h.tier != "nvme":
                    continue
                key = ShardKey(h.job, h.step, h.rank, h.world_size)
                if self.replication.tracks(key, h.meta_digest) or not self._kept(key):
                    continue
                source = self.nvme.shard_source(h.job, h.step, h.rank)
                path = source.meta_path(h.rank)
                try:
                    meta = ShardMeta.from_bytes(path.read_bytes(), str(path))
                except (CheckpointError, OSError):
                    continue  # removed or replaced since it was listed
                self.replication.track(key, meta, [source.data_path(h.rank)])

    def note_complete(self, job: str, step: int) -> None:
        """Log that a step is complete across the cluster, once per step (a seal, a commit learned, a catch-up)."""
        if (job, step) in self._announced:
            return
        self._announced[(job, step)] = None
        while len(self._announced) > ANNOUNCED_STEPS:
            self._announced.popitem(last=False)
        log.info("%s step %d is complete across the cluster", job, step)

    async def recheck_unreachable(self) -> None:
        """Ask the peers last found unreachable again, briefly, so that `status` does not lag a node that came up.

        Called by StatusReport.document before it describes the peers: a question about a step no
        job has (PROBE_STEP) answers at once, and an answer clears the peer's unreachable mark.
        """
        if self.peers is None or not self.peers.unreachable:
            return
        unreachable = set(self.peers.unreachable)
        await self._run(self.peers.ask, "", PROBE_STEP, PROBE_TIMEOUT_S, unreachable, True)

    def status(self) -> dict[str, Any]:
        """Describe the peer tier for `ckptd status`."""
        common = {
            "enabled": self.peers is not None,
            "inventories_answered": self._inventories_answered,  # peers' Inventory calls (start-ups, ls, loads)
            "listen": self.config.node.listen,
            "instance": self.instance,  # this daemon's run: peer calls that carry it are refused as its own
        }
        if self.peers is None or self.membership is None:
            return common
        return {
            **common,
            "membership": self.membership.status(),  # [peer] addresses, what they resolve to, lookups failing
            "replicas": self.replicas,
            "tls": bool(self.config.peer.cert),
            "unreachable": dict(self.peers.unreachable),
            "connecting": self.peers.connecting(),  # no answer nor failure yet: "connecting", not "unreachable"
            "peers": self.replication.peers_status() if self.replication else {},
            # shards short of a copy (and for how long), shards whose copy a stand-in keeps (replication.sending)
            "under_replicated": self.replication.under_replicated() if self.replication else {},
            "counters": dict(self.replication.counters) if self.replication else {},
            "last_transfer": dict(self.replication.last_transfer) if self.replication else {},
        }

    async def drain(self) -> None:
        """Finish transfers under way and close the links."""
        if self.replication is not None:
            await self.replication.drain()
        if self.peers is not None:
            self.peers.close()

"""Send each shard this node wrote to the peers that keep its replicas, until each has it.

Driven from the event loop: SavePath calls send() (through Peering.replicate) once a shard is hashed,
Peering calls update() when peers join or leave (ckptd.cluster.peer_membership) and,
every few seconds, confirm() and retry_due() with what the peers hold, which also
resumes the replication a restarted daemon left undone. A timer (_fail_over) gives
stand-ins to the shards of a peer that has failed for failover_s. Bytes move on worker
threads, never holding a staging slot or a flush: a slow or dead peer delays only
its own copies (two at a time). A peer that fails is retried with exponential
back-off and jitter.

Failover: a peer placed to keep a shard's replica that has failed for `[peer] failover_s`
has a stand-in, the next node in the shard's placement order that is not failing: the
replica goes there too, and counts in its place. Every shard placed on it gets its stand-in
failover_s after the peer's first failure, also those waiting out its back-off (not at the
next round of retry_due, which may come late: a round asks peers that do not answer). The
placed peer is still retried; once it holds the replica, the stand-in's copy is retired
(RetireReplica). So every shard has its `replicas` copies on live nodes within about
failover_s, and the placement stays rendezvous-stable: a node's return moves back only what
it held.

A peer that does not answer at all (PeerUnreachable: a cut link, as keepalive finds within
seconds, or a dead host) fails like a dead one. When a round's inventory (confirm) hears it
again, its back-off is dropped and its replicas go in that round; while no peer answers,
unreachable() says so to a waiter.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_core.errors import CheckpointError, CorruptCheckpoint
from ckpt_core.format import CommitRecord, ShardMeta, digest
from ckpt_core.shard_key import ShardKey

from ckptd.cluster.peer_link import IsSelf, PeerLink, PeerUnreachable
from ckptd.cluster.placement import Holding, reseat, seated_placement
from ckptd.errors import LocalCopyGone, PeerBusy

log = logging.getLogger(__name__)

SHARDS_IN_FLIGHT = 2  # per peer
MAX_SENDERS = 16  # shards being sent at once, to every peer (Executors.replicate)
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
FAILURES_REPORTED = 3  # consecutive failures after which a waiter hears of them


@dataclass
class _Peer:
    link: PeerLink
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(SHARDS_IN_FLIGHT))
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""
    failing_since: float | None = None  # time.monotonic() of the first of its failures in a row
    failed_at: float = 0.0  # time.monotonic() of the last of them
    unanswered: bool = False  # its last request got no answer at all (PeerUnreachable), nor any since: cut off, or down


@dataclass
class _Shard:
    key: ShardKey
    meta: ShardMeta
    sources: list[Path]  # read in order: a staging slot (while it still holds the snapshot), then NVMe
    targets: list[str]  # the peers placed to keep its replicas
    done: dict[str, float] = field(default_factory=dict)  # peer -> when it was known to hold this copy
    sending: set[str] = field(default_factory=set)
    stand_ins: dict[str, str] = field(default_factory=dict)  # a placed peer that keeps failing -> who stands in
    failures: int = 0  # consecutive
    attempts: int = 0  # finished, successful or not
    error: str = ""
    meta_digest: str = ""
    since: float | None = field(default_factory=time.monotonic)  # since when it is short of a copy (status)
    tracked_at: float = field(default_factory=time.monotonic)  # failures before it say nothing of it (unreachable)

    def __post_init__(self) -> None:
        self.meta_digest = digest(self.meta.to_bytes())

    def covered(self, target: str) -> bool:
        """Say whether a placed peer's copy is in, there or on its stand-in."""
        return target in self.done or self.stand_ins.get(target, "") in self.done

    @property
    def replicated(self) -> bool:
        """Say whether every placed peer holds it, or its stand-in does (none placed: no peer is known yet)."""
        return bool(self.targets) and all(self.covered(t) for t in self.targets)

    def receivers(self) -> list[str]:
        """Return every peer this shard is sent to: the placed ones, then the stand-ins."""
        return [*self.targets, *self.stand_ins.values()]


class Replication:
    """Keep `replicas` copies of every shard this node wrote on the peers chosen for it."""

    def __init__(
        self,
        links: list[PeerLink],
        replicas: int,
        on_change: Callable[[ShardKey, bool], None],
        senders: ThreadPoolExecutor,
        streams: ThreadPoolExecutor,
        failover_s: float = 10.0,
    ) -> None:
        """on_change(key, replicated) is called on the event loop after every attempt for a shard.

        replicas: copies wanted per shard; fewer while fewer peers are known. senders: a thread
        per shard being sent (blocked on its peer); streams: the shards' byte ranges, several each.
        failover_s: how long a placed peer fails before a stand-in keeps its copies ([peer] failover_s).
        """
        self.failover_s = failover_s
        self._peers = {link.address: _Peer(link) for link in links}
        self._seats = reseat({}, self._peers)  # placement's view of the peers: see cluster.reseat
        self.replicas = replicas
        self._on_change = on_change
        self._shards: dict[ShardKey, _Shard] = {}
        # Two shards per peer at a time (_Peer.slots): a slow or dead peer ties up its own senders, not the others'.
        self._senders = senders
        self._streams = streams
        self._tasks: set[asyncio.Task[None]] = set()
        self._fail_overs: dict[str, asyncio.TimerHandle] = {}  # failing peer -> the timer of its failover
        self._unanswered_in_a_row = 0  # requests to any peer that got no answer, since the last that did
        self.counters = {"replicas_sent": 0, "replica_bytes_sent": 0, "replica_failures": 0, "replicas_busy": 0}
        self.last_transfer: dict[str, float] = {}

    def targets(self, job: str, rank: int) -> list[str]:
        """Return the peers that keep a rank's replicas."""
        return seated_placement(job, rank, self._seats, self.replicas)

    def update(self, added: list[PeerLink], removed: Collection[str]) -> None:
        """Follow the peers that joined (their links) and left: choose every shard's targets again.

        A shard keeps the targets still here that hold its replica (or are being sent it); the
        others are chosen again. So the replicas a peer that left kept go to the peers now
        chosen in its place (at the next retry_due), and a shard that waited for any peer at
        all gets one; a replica in place never moves because another node joined.
        """
        for address in removed:
            self._peers.pop(address, None)
        for link in added:
            self._peers.setdefault(link.address, _Peer(link))
        self._seats = reseat(self._seats, self._peers)
        for shard in self._shards.values():
            for address in removed:
                shard.done.pop(address, None)  # should it come back, what it holds is asked again
            kept = [t for t in shard.targets if t in self._peers and (t in shard.done or t in shard.sending)]
            ranked = seated_placement(shard.key.job, shard.key.rank, self._seats, len(self._seats))
            shard.targets = (kept + [p for p in ranked if p not in kept])[: self.replicas]
            # A stand-in whose placed peer left, or who left itself, stands in no more (placement chose again).
            shard.stand_ins = {t: s for t, s in shard.stand_ins.items() if t in shard.targets and s in self._peers}

    def track(self, key: ShardKey, meta: ShardMeta, sources: list[Path]) -> _Shard:
        """Keep a shard's replicas in view (a newer copy of the same shard replaces an older one)."""
        shard = self._shards.get(key)
        if shard is None or shard.meta != meta:
            shard = self._shards[key] = _Shard(key, meta, sources, self.targets(key.job, key.rank))
        return shard

    def untrack(self, key: ShardKey) -> None:
        """Stop following a shard (a newer copy will be tracked when it is hashed)."""
        self._shards.pop(key, None)

    def tracks(self, key: ShardKey, meta_digest: str) -> bool:
        """Say whether this copy of a shard is already in view."""
        shard = self._shards.get(key)
        return shard is not None and shard.meta_digest == meta_digest

    def send(self, key: ShardKey, meta: ShardMeta, sources: list[Path], record: CommitRecord | None = None) -> None:
        """Start sending a shard's replicas now."""
        self._kick(self.track(key, meta, sources), record)

    def confirm(self, held: list[Holding], reachable: set[str], asked_at: float) -> None:
        """Bring the count of replicas in line with what the reachable peers said they hold at asked_at.

        After a restart this finds what was sent before; a peer that lost its disk
        gets its replicas again. A copy in place counts wherever placement would put it
        now (it was placed before a restart, or before the peers changed): it is kept
        rather than sent again elsewhere.
        """
        by_key = {(h.node, h.job, h.step, h.rank): h.meta_digest for h in held if h.tier == "peer"}
        peers = reachable & self._peers.keys()
        for address in peers:
            peer = self._peers[address]
            if peer.unanswered and peer.failed_at < asked_at:
                # Silent until it answered now: the link healed (or the peer came back). Its replicas go at
                # once, not after a back-off that grew through the cut.
                log.info("peer %s answers again: retrying the replicas it is owed now", address)
                peer.unanswered, peer.retry_at, self._unanswered_in_a_row = False, 0.0, 0
        for shard in self._shards.values():
            where = (shard.key.job, shard.key.step, shard.key.rank)
            holding = sorted(p for p in peers if by_key.get((p, *where)) == shard.meta_digest)
            if not shard.replicated and set(holding) - set(shard.targets):
                kept = [t for t in shard.targets if t in shard.done or t in shard.sending]
                shard.targets = list(dict.fromkeys([*kept, *holding, *shard.targets]))[: self.replicas]
            for target in reachable.intersection(shard.receivers()):
                if by_key.get((target, shard.key.job, shard.key.step, shard.key.rank)) == shard.meta_digest:
                    shard.done.setdefault(target, asked_at)
                elif shard.done.get(target, asked_at) < asked_at:  # sent before it answered, yet not there
                    log.warning("peer %s no longer holds the replica of %s: sending it again", target, shard.key)
                    del shard.done[target]
                    shard.since = shard.since or time.monotonic()

    def target_peers(self) -> set[str]:
        """Return the peers that keep (or are to keep) a replica of some shard followed here, stand-ins too."""
        return {t for shard in self._shards.values() for t in shard.receivers()}

    def tracked(self) -> list[ShardKey]:
        """Return every shard being followed."""
        return list(self._shards)

    def pending(self) -> list[ShardKey]:
        """Return the shards whose replicas are not all in yet."""
        return [k for k, shard in self._shards.items() if not shard.replicated]

    def forget(self, keep: Callable[[ShardKey], bool]) -> None:
        """Stop tracking shards that are gone from this node (removed by retention)."""
        for key in [k for k, shard in self._shards.items() if not shard.sending and not keep(k)]:
            del self._shards[key]

    def retry_due(self, record_of: Callable[[ShardKey], CommitRecord | None]) -> None:
        """Retry every unfinished shard whose peers are out of back-off."""
        for shard in sorted(self._shards.values(), key=lambda s: -s.key.step):  # newest first
            self._kick(shard, record_of(shard.key))

    def state(self, key: ShardKey) -> tuple[bool, str, int, int]:
        """Return (has every replica, the last error, consecutive failures, attempts finished) for a shard."""
        shard = self._shards.get(key)
        if shard is None:
            return False, "", 0, 0
        return shard.replicated, shard.error, shard.failures, shard.attempts

    def unreachable(self, key: ShardKey) -> str:
        """Return why a shard's missing copies can go nowhere now, "" where some peer may still take them.

        Nowhere: FAILURES_REPORTED requests in a row, to any peers, got no answer at all (PeerUnreachable:
        no connection, a connection keepalive found dead, a deadline), and every peer that does not hold
        its copy left one unanswered since the shard was saved, as when this node is cut off from them.
        The placed peers are tried first, the others once failover_s gives them a stand-in's part. A
        shard saved after the peers were last heard failing is tried before anything is said of it: the
        link may have healed. ShardProgress tells a waiter after a fresh attempt (which
        Peering.retry_failing_replicas makes).
        """
        shard = self._shards.get(key)
        if shard is None or shard.replicated:
            return ""
        others = [a for a in self._peers if a not in shard.done]
        if (
            self._unanswered_in_a_row < FAILURES_REPORTED
            or not others
            or not all(self._peers[a].unanswered and self._peers[a].failed_at >= shard.tracked_at for a in others)
        ):
            return ""
        now = time.monotonic()
        silent = ", ".join(f"{a} (for {now - (self._peers[a].failing_since or now):.0f} s)" for a in sorted(others))
        last = max(others, key=lambda a: self._peers[a].failed_at)
        return (
            f"replication of {key}: no peer that could keep its copy answers (is this node cut off from them?): "
            f"{silent}; the last said: {self._peers[last].last_error}"
        )

    def retry_now(self, key: ShardKey) -> None:
        """Try a shard's missing replicas at once, whatever the back-off says (someone is waiting for them)."""
        shard = self._shards.get(key)
        if shard is not None:
            self._kick(shard, None, now=True)

    def under_replicated(self) -> dict[str, float]:
        """Describe the shards short of a copy for `ckptd status` and /metrics.

        shards: followed here and not replicated (no copy on a placed peer nor its stand-in);
        oldest_s: for how long the oldest of them has been short; on_stand_in: shards whose
        copy is kept by a stand-in while its placed peer fails.
        """
        now = time.monotonic()
        short = [s for s in self._shards.values() if s.targets and not s.replicated]
        return {
            "shards": len(short),
            "oldest_s": round(max((now - (s.since or now) for s in short), default=0.0), 3),
            "on_stand_in": sum(1 for s in self._shards.values() if any(v in s.done for v in s.stand_ins.values())),
        }

    def peers_status(self) -> dict[str, dict[str, object]]:
        """Describe each peer for `ckptd status`."""
        now = time.monotonic()
        return {
            address: {
                "consecutive_failures": p.failures,
                "retry_in_s": round(max(0.0, p.retry_at - now), 3),
                "last_error": p.last_error,
                "pending_replicas": sum(
                    1 for s in self._shards.values() if address in s.targets and not s.covered(address)
                ),
                "stood_in_for": sum(1 for s in self._shards.values() if address in s.stand_ins.values()),
                "ranges_sent": dict(p.link.ranges_sent),  # by data channel, or by gRPC stream (PutShard)
            }
            for address, p in self._peers.items()
        }

    def _kick(self, shard: _Shard, record: CommitRecord | None, now: bool = False) -> None:
        at = time.monotonic()
        self._stand_in(shard, at)
        for target in shard.receivers():
            if target in shard.done or target in shard.sending or (self._peers[target].retry_at > at and not now):
                continue
            shard.sending.add(target)
            task = asyncio.get_running_loop().create_task(self._send_one(shard, target, self._peers[target], record))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _stand_in(self, shard: _Shard, at: float) -> None:
        """Give each placed peer of the shard that has failed for failover_s a stand-in: the next healthy node in
        the shard's placement order that keeps none of its copies. One that stood in for a peer that is well
        again and holds the copy is retired (its copy dropped there)."""
        for target in shard.targets:
            peer = self._peers.get(target)
            stand_in = shard.stand_ins.get(target)
            if stand_in is not None and target in shard.done:
                del shard.stand_ins[target]
                if stand_in in shard.done and stand_in not in shard.targets:
                    del shard.done[stand_in]
                    self._retire(shard, stand_in)
                continue
            failing_s = at - peer.failing_since if peer is not None and peer.failing_since is not None else -1.0
            if stand_in is not None or target in shard.done or failing_s < self.failover_s:
                continue
            ranked = seated_placement(shard.key.job, shard.key.rank, self._seats, len(self._seats))
            taken = set(shard.receivers())
            healthy = [p for p in ranked if p not in taken and self._peers[p].failing_since is None]
            if healthy:
                shard.stand_ins[target] = healthy[0]
                log.warning(
                    "peer %s has failed for %.0f s: %s stands in for it to keep the replica of %s",
                    *(target, failing_s, healthy[0], shard.key),
                )

    def _fail_over_later(self, target: str, since: float) -> None:
        """Call _fail_over(target, since) once the peer has failed for failover_s since its first failure."""
        delay = max(0.0, since + self.failover_s - time.monotonic())
        self._fail_overs[target] = asyncio.get_running_loop().call_later(delay, self._fail_over, target, since)

    def _fail_over(self, target: str, since: float) -> None:
        """Give every shard placed on a peer still failing since `since` its stand-in, and send it there (a timer)."""
        self._fail_overs.pop(target, None)
        peer = self._peers.get(target)
        if peer is None or peer.failing_since != since:
            return  # it left, or it answered since
        if time.monotonic() - since < self.failover_s:  # the loop's clock ran a little ahead
            self._fail_over_later(target, since)
            return
        for shard in sorted(self._shards.values(), key=lambda s: -s.key.step):  # newest first
            if target in shard.targets and not shard.covered(target):
                self._kick(shard, None)

    def _retire(self, shard: _Shard, stand_in: str) -> None:
        """Drop a stand-in's copy of a shard, now that the placed peer holds it (a task; a failure is logged)."""

        async def retire() -> None:
            link = self._peers[stand_in].link if stand_in in self._peers else None
            if link is None:
                return
            try:
                await asyncio.get_running_loop().run_in_executor(self._senders, link.retire_replica, shard.meta)
                log.info("retired the copy of %s that %s kept while its placed peer failed", shard.key, stand_in)
            except (CheckpointError, OSError) as e:
                log.warning("retiring the copy of %s on %s failed (its retention drops it): %s", shard.key, stand_in, e)

        task = asyncio.get_running_loop().create_task(retire())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_one(self, shard: _Shard, target: str, peer: _Peer, record: CommitRecord | None) -> None:
        try:
            async with peer.slots:
                if target in shard.receivers():  # else chosen again while it waited: the peers changed
                    await self._attempt(shard, target, peer, record)
        finally:
            shard.sending.discard(target)

    async def _attempt(self, shard: _Shard, target: str, peer: _Peer, record: CommitRecord | None) -> None:
        started = time.monotonic()
        try:
            await asyncio.get_running_loop().run_in_executor(self._senders, self._put, shard, peer.link, record)
        except IsSelf as e:
            log.info("%s: no replicas go there", e)
            self._drop_peer(target)
        except PeerBusy as e:  # up, and receiving as many replicas as it takes: again after a pause, no failure
            peer.retry_at = time.monotonic() + BACKOFF_MIN_S * random.uniform(0.5, 1.0)
            peer.last_error = f"replication of {shard.key} to peer {target} waits: {e}"
            self.counters["replicas_busy"] += 1
            self._unanswered_in_a_row = 0
            log.info("%s; retrying in %.1f s", peer.last_error, peer.retry_at - time.monotonic())
        except LocalCopyGone as e:  # retention removed it, or a newer save replaced it: nothing to send
            log.info("%s; not replicating it", e)
            if self._shards.get(shard.key) is shard:
                del self._shards[shard.key]
        except Exception as e:  # whatever broke, the shard is retried and a waiter hears why
            if not isinstance(e, (CheckpointError, OSError)):
                log.exception("replication of %s to peer %s failed unexpectedly", shard.key, target)
            message = f"replication of {shard.key} to peer {target} failed: {e}"
            peer.failures += 1
            if peer.failing_since is None:
                peer.failing_since = started
                self._fail_over_later(target, started)
            peer.unanswered, peer.failed_at = isinstance(e, PeerUnreachable), time.monotonic()
            self._unanswered_in_a_row = self._unanswered_in_a_row + 1 if peer.unanswered else 0
            shard.failures += 1
            peer.last_error = shard.error = message
            backoff = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (peer.failures - 1))
            peer.retry_at = time.monotonic() + backoff * random.uniform(0.5, 1.0)
            self.counters["replica_failures"] += 1
            log.warning("%s; retrying in %.1f s", message, peer.retry_at - time.monotonic())
        else:
            shard.done[target] = time.monotonic()
            shard.failures, shard.error = 0, ""
            peer.failures, peer.retry_at, peer.failing_since, peer.unanswered = 0, 0.0, None, False
            self._unanswered_in_a_row = 0
            elapsed = time.monotonic() - started
            self.last_transfer = {"bytes": shard.meta.data_size_bytes, "seconds": round(elapsed, 6)}
            self.counters["replicas_sent"] += 1
            self.counters["replica_bytes_sent"] += shard.meta.data_size_bytes
            log.info("replicated %s to peer %s in %.3f s", shard.key, target, elapsed)
        finally:
            shard.attempts += 1
            if shard.replicated:
                shard.since = None
            # Only the copy still followed counts: an earlier copy's late success must not.
            self._on_change(shard.key, self._shards.get(shard.key) is shard and shard.replicated)
            if target in shard.targets and target in shard.done and target in shard.stand_ins:
                self._kick(shard, record)  # the placed peer is back: its stand-in's copy is retired

    def _drop_peer(self, address: str) -> None:
        """Stop sending to a peer for good, and choose again the peers of the shards it was to keep."""
        self.update([], [address])

    def _put(self, shard: _Shard, link: PeerLink, record: CommitRecord | None) -> None:
        errors = []
        for path in shard.sources:
            try:
                link.put_shard(shard.meta, path, self._streams, record)
                return
            except (CorruptCheckpoint, FileNotFoundError) as e:  # this copy changed or went: try the next one
                errors.append(str(e))
        raise LocalCopyGone(f"no readable local copy of {shard.key} is left: " + "; ".join(errors))

    async def drain(self) -> None:
        """Cancel the failover timers; wait for the transfers under way (their threads are the composition root's)."""
        for timer in self._fail_overs.values():
            timer.cancel()
        self._fail_overs.clear()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

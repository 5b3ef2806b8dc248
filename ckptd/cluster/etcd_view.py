"""The etcd cluster view ([cluster] backend = "etcd"): leases for membership, watches for commits.

Keys, under [cluster] prefix P (docs/INTERNALS.md, "The cluster view"):
  P nodes/<node>                    a live node, on its lease (EtcdMembership)
  P jobs/<job>                      a job exists: tells coordinators which jobs there are
  P held/<job>/<step>/<node>        what a node holds durably of a step (JSON), until retention
  P commits/<job>/<step>            the step's commit record, created once
Steps are written as 20 digits, so keys sort as steps do. Per step a node puts one
key and receives one watch event; the job's coordinator (rendezvous hashing over the
live nodes, as in the built-in view) watches its jobs' held/ keys, creates the commit
key when every rank is in, and deletes the keys of steps older than the records kept,
so that nothing grows without bound. A coordinator that dies is replaced by the next
node in rendezvous order, which reads the held/ keys afresh: no commit is lost.

While etcd is away, report() and announce() queue and are delivered when it is back;
training and NVMe flushes never wait on etcd. Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ckpt_core.errors import CorruptCheckpoint, InvalidArgument
from ckpt_core.format import CommitRecord, validate_job

from ckptd.cluster.collector import Collector
from ckptd.cluster.etcd_client import EtcdClient, EtcdCompacted, EtcdError
from ckptd.cluster.etcd_membership import EtcdMembership
from ckptd.cluster.placement import Holding
from ckptd.cluster.view import ClusterView, coordinator_of
from ckptd.config import Config

log = logging.getLogger(__name__)

RETRY_S = 1.0
DELIVERED_KEPT = 1024  # the reports last put, remembered so that the same one is not put again


def _step_key(step: int) -> bytes:
    return b"%020d" % step


def _holdings_json(shards: Sequence[Holding]) -> bytes:
    fields = ("tier", "rank", "world_size", "data_size_bytes", "meta_digest", "run_id", "line", "saved_at")
    return json.dumps([{f: getattr(h, f) for f in fields} for h in shards], separators=(",", ":")).encode()


def _holdings(node: str, job: str, step: int, raw: bytes) -> tuple[Holding, ...]:
    try:
        return tuple(Holding(node, job=job, step=step, **h) for h in json.loads(raw))
    except (ValueError, TypeError) as e:
        log.warning("%s step %d: ignored a bad report of node %s in etcd: %s", job, step, node, e)
        return ()


class EtcdView(ClusterView):
    """The cluster view kept in etcd."""

    backend = "etcd"

    def __init__(self, config: Config, kept_records: int) -> None:
        k = config.cluster
        self.client = EtcdClient(k.endpoints, cert=k.cert, key=k.key, ca=k.ca)
        self.prefix = k.prefix.encode()
        self.lease_ttl_s = k.lease_ttl_s
        node = config.node.listen
        super().__init__(node, EtcdMembership(self.client, self.prefix, node), kept_records)
        self.commit_keys = config.commit_keys
        self.collector = Collector(self.commit_keys)
        self._pending: dict[tuple[str, int], tuple[Holding, ...]] = {}  # reports not yet in etcd
        self._announcing: dict[tuple[str, int], CommitRecord] = {}  # commits sealed here, not yet in etcd
        self._delivered: OrderedDict[tuple[str, int], tuple[Holding, ...]] = OrderedDict()  # last put, by step
        self._jobs_known: set[str] = set()  # jobs whose P jobs/<job> key this node knows exists
        self._coordinating: dict[str, asyncio.Task[None]] = {}  # job -> the task following its held/ keys
        self._lease = 0
        self._alive_seen: frozenset[str] = frozenset()  # the nodes alive when the reports were last weighed
        self._alive_of: frozenset[str] | None = None  # the membership _alive_now was worked out from
        self._alive_now: frozenset[str] = frozenset()
        self._coordinated_for: tuple[frozenset[str], frozenset[str]] | None = None  # what _mine was worked out for
        self._mine: set[str] = set()  # the jobs this node coordinates
        self._wake = asyncio.Event()
        self.connected = False
        self.last_error = ""

    def _key(self, *parts: str | bytes) -> bytes:
        return self.prefix + b"/".join(p.encode() if isinstance(p, str) else p for p in parts)

    def _failed(self, what: str, error: EtcdError) -> None:
        if self.connected or not self.last_error:
            log.warning("cluster view: etcd is unreachable (%s: %s); commits wait, saves go on", what, error)
        self.connected = False
        self.last_error = f"{what}: {error}"

    def _answered(self) -> None:
        if not self.connected and self.last_error:
            log.info("cluster view: etcd answers again")
        self.connected = True

    # -- this node's side ---------------------------------------------------------------------

    async def start(self) -> None:
        """Register this node on a lease and read the commits there are (etcd away: run_forever retries)."""
        with contextlib.suppress(EtcdError):
            await self._register()
            await self._load_commits()

    async def _register(self) -> None:
        try:
            self._lease = await self.client.grant_lease(self.lease_ttl_s)
            await self.client.put(self._key("nodes", self.node), b"{}", lease=self._lease)
        except EtcdError as e:
            self._lease = 0
            self._failed("registering this node", e)
            raise
        self._answered()

    async def _load_commits(self) -> int:
        entries, revision = await self.client.get_prefix(self._key("commits", ""))
        for entry in entries:
            await self._take_commit(entry.value)
        return revision

    async def _take_commit(self, raw: bytes) -> None:
        try:
            record = CommitRecord.from_bytes(raw, "a commit record in etcd", self.commit_keys)
        except CorruptCheckpoint as e:
            log.warning("cluster view: %s", e)
            return
        await self.learned(record)

    def report(self, job: str, step: int, shards: Sequence[Holding]) -> None:
        held = self.labelled(shards)
        if self._delivered.get((job, step)) != held:
            self._pending[(job, step)] = held
            self._wake.set()

    def announce(self, record: CommitRecord) -> None:
        self._pending.pop((record.job, record.step), None)
        if self.commits.add(record):
            self._announcing[(record.job, record.step)] = record
            self._wake.set()

    async def run_forever(self) -> None:
        """Keep the lease, follow the commits, coordinate this node's jobs and deliver what is queued."""
        await asyncio.gather(self._keep_lease(), self._follow_commits(), self._follow_jobs(), self._deliver_forever())

    async def _keep_lease(self) -> None:
        while True:
            try:
                if self._lease == 0 or await self.client.keep_alive_once(self._lease) <= 0:
                    await self._register()  # the lease expired while etcd was away: this node joins again
                self._answered()
            except EtcdError as e:
                self._failed("renewing this node's lease", e)
            await asyncio.sleep(self.lease_ttl_s / 3 if self.connected else RETRY_S)  # a renewal period

    async def _follow_commits(self) -> None:
        revision = 0
        while True:
            try:
                if revision == 0:
                    revision = await self._load_commits()
                async for event in self.client.watch_prefix(self._key("commits", ""), revision + 1):
                    revision = event.mod_revision
                    if event.kind == "put":
                        await self._take_commit(event.value)
            except EtcdCompacted:
                revision = 0  # read them whole again
                continue
            except EtcdError as e:
                self._failed("following commits", e)
            await asyncio.sleep(RETRY_S)  # etcd is away: a pace for trying again

    async def _deliver_forever(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RETRY_S)
            self._wake.clear()
            try:
                await self._deliver()
                self._answered()
            except EtcdError as e:
                self._failed("reporting shards", e)
            self._coordinate_jobs()
            alive = self._alive()
            if alive is not self._alive_seen:  # reports set aside for a node not known yet may count now
                self._alive_seen = alive
                try:
                    await self._seal_again(alive)
                except EtcdError as e:
                    self._failed("sealing steps", e)

    async def _seal_again(self, alive: frozenset[str]) -> None:
        for job in list(self._coordinating):
            for record in self.collector.seal_again(job, alive):
                if self.commits.get(record.job, record.step) is None:
                    await self._commit(record)

    async def _deliver(self) -> None:
        for (job, step), record in list(self._announcing.items()):
            await self._commit(record)
            self._announcing.pop((job, step), None)
        for (job, step), held in list(self._pending.items()):
            if job not in self._jobs_known:
                await self.client.create(self._key("jobs", job), b"")
                self._jobs_known.add(job)
            await self.client.put(self._key("held", job, _step_key(step), self.node), _holdings_json(held))
            self._delivered[(job, step)] = held
            while len(self._delivered) > DELIVERED_KEPT:
                self._delivered.popitem(last=False)
            if self._pending.get((job, step)) == held:
                del self._pending[(job, step)]

    async def _commit(self, record: CommitRecord) -> None:
        """Create the step's commit key (once: a second creation finds it), then drop what retention lets go."""
        await self.client.create(self._key("commits", record.job, _step_key(record.step)), record.to_bytes())
        await self.learned(record)
        kept = [r.step for r in self.commits.records(record.job)]
        if len(kept) < self.commits.kept:
            return
        oldest = min(kept)
        entries, _ = await self.client.get_prefix(self._key("commits", record.job, ""), keys_only=True)
        for entry in entries:
            if int(entry.key.rsplit(b"/", 1)[1]) < oldest:
                await self.client.delete(entry.key)
        for step in self.collector.steps(record.job):
            if step < oldest:
                await self.client.delete_prefix(self._key("held", record.job, _step_key(step), ""))
                self.collector.drop(record.job, step)

    # -- coordinating ---------------------------------------------------------------------------

    async def _follow_jobs(self) -> None:
        """Know the jobs there are (P jobs/), to coordinate those rendezvous hashing gives this node."""
        while True:
            try:
                entries, revision = await self.client.get_prefix(self._key("jobs", ""), keys_only=True)
                self._jobs_known |= {e.key.rsplit(b"/", 1)[1].decode() for e in entries}
                self._coordinate_jobs()
                async for event in self.client.watch_prefix(self._key("jobs", ""), revision + 1):
                    job = event.key.rsplit(b"/", 1)[1].decode()
                    (self._jobs_known.add if event.kind == "put" else self._jobs_known.discard)(job)
                    self._coordinate_jobs()
            except EtcdError as e:  # a compaction included: read the jobs whole again
                self._failed("following jobs", e)
            await asyncio.sleep(RETRY_S)  # etcd is away: a pace for trying again

    def _alive(self) -> frozenset[str]:
        """Return the nodes with a live lease, this one included (worked out again when the membership changed)."""
        peers = self.membership.peers()
        if peers is not self._alive_of:
            self._alive_of, self._alive_now = peers, peers | {self.node}
        return self._alive_now

    def _coordinate_jobs(self) -> None:
        """Start following the held/ keys of the jobs this node now coordinates; stop for those it no longer does."""
        alive = self._alive()
        jobs = frozenset(self._jobs_known)
        if (alive, jobs) != self._coordinated_for:
            self._coordinated_for = (alive, jobs)
            self._mine = {j for j in self._jobs_known if coordinator_of(j, alive) == self.node}
        mine = self._mine
        for job in set(self._coordinating) - mine:
            self._coordinating.pop(job).cancel()
        for job in mine - set(self._coordinating):
            self._coordinating[job] = asyncio.get_running_loop().create_task(self._coordinate(job))

    async def _coordinate(self, job: str) -> None:
        """Read a job's held/ keys, then follow them: seal each step once every rank is held by a live node."""
        try:
            validate_job(job)
        except InvalidArgument as e:  # a key another program wrote under the prefix: not a job of ours
            log.warning("cluster view: ignoring %r under %sjobs/ in etcd: %s", job, self.prefix.decode(), e)
            return
        prefix = self._key("held", job, "")
        while True:
            try:
                self.collector.forget(job)
                entries, revision = await self.client.get_prefix(prefix)
                for entry in entries:
                    await self._collect(job, entry.key[len(prefix) :], entry.value)
                async for event in self.client.watch_prefix(prefix, revision + 1):
                    if event.kind == "put":
                        await self._collect(job, event.key[len(prefix) :], event.value)
            except EtcdError as e:  # a compaction included: read them whole again
                self._failed(f"coordinating job {job}", e)
            await asyncio.sleep(RETRY_S)  # etcd is away: a pace for trying again

    async def _collect(self, job: str, rest: bytes, value: bytes) -> None:
        step_text, _, node = rest.decode(errors="replace").partition("/")
        if not step_text.isdigit() or not node:
            return
        step = int(step_text)
        if self.commits.get(job, step) is not None:
            return
        record = self.collector.add(node, job, step, _holdings(node, job, step, value), self._alive())
        if record is not None:
            try:
                await self._commit(record)
            except EtcdError:
                self._announcing[(job, step)] = record  # delivered when etcd is back
                raise

    async def holders(self, job: str, step: int, rank: int) -> list[Holding]:
        prefix = self._key("held", job, _step_key(step), "")
        try:
            entries, _ = await self.client.get_prefix(prefix)
        except EtcdError as e:
            self._failed("asking holders", e)
            return []
        alive = self._alive()
        found = []
        for entry in entries:
            node = entry.key[len(prefix) :].decode(errors="replace")
            if node in alive:
                found += [h for h in _holdings(node, job, step, entry.value) if h.rank == rank]
        return found

    async def forget_job(self, job: str) -> None:
        """Delete the job's keys in etcd (its steps are gone from this node; the others' go the same way)."""
        self.commits.forget(job)
        self.collector.forget(job)
        self._jobs_known.discard(job)
        for key in [k for k in self._pending if k[0] == job]:
            del self._pending[key]
        try:
            for part in ("held", "commits"):
                await self.client.delete_prefix(self._key(part, job, ""))
            await self.client.delete(self._key("jobs", job))
        except EtcdError as e:
            self._failed(f"removing job {job}", e)

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "node": self.node,
            "endpoints": list(self.client.endpoints),
            "connected": self.connected,
            "last_error": self.last_error,
            "members": len(self.membership.peers()) + 1,
            "pending_reports": len(self._pending) + len(self._announcing),
            "coordinating": sorted(self._coordinating),
            "counters": dict(self.client.counters),
        }

    async def close(self) -> None:
        """Stop coordinating, revoke this node's lease (it leaves the membership at once), close the client."""
        for task in self._coordinating.values():
            task.cancel()
        await asyncio.gather(*self._coordinating.values(), return_exceptions=True)
        if self._lease:
            with contextlib.suppress(EtcdError, TimeoutError):
                await asyncio.wait_for(self.client.revoke(self._lease), 2.0)
        await self.client.close()

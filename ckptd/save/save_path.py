"""The save, in order, in one place: reserve → copy → commit → flush → seal → replicate → upload → retain → release.

One SavePath per daemon, on the event loop; the composition root (node.py) builds it with
the roles it orders, and hands it to the servicers, which call it for the RPCs of a save
(Reserve, Commit, WaitShard) and the peers' (a replica's arrival, CommitStep). It is the one
writer of this node's catalogs: a step becomes complete on a tier (seal, adopt) and leaves
it (release) only here; the load path's fetched copies are the one other writer. For each
save of a rank:

1. reserve_for()  Reserve's one call: the client's retention first, then (unless the rank only
               prepares its slots) line_for() places the save on the job's line (docs/DESIGN.md, "A job's
               history"): a step older than the head is refused unless the rank rolled back.
               Then SlotPool finds a slot (waits under "block", skipped under "skip"); a save that
               replaces its rank's snapshot not yet flushed passes that step over;
2. (the copy)  the client copies the tensors into the slot: nothing runs here;
3. commit()    the slot's markers are written on the save threads, ShardProgress hears of
               the copy, and the job's flush rounds start if they do not run;
4. flush       each round (Flusher.begin_round) pins one step's slots; Flusher.write writes each
               to NVMe. As soon as its checksums are known:
5. replicate   Replication sends it to its peers, from the slot, beside the NVMe write;
6. upload      once durable on NVMe: the Uploader queues it for the object store ([object] every);
7. seal        after each shard, not awaited by the round: the step is sealed (its commit record)
               if every rank is in, here or on the peers (Peering.record_to_seal finds its record),
               under the seal lock; SavePath alone writes it to the tiers (_adopt_here);
8. retain      once sealed: retention runs for the job on NVMe and the replica store (RetentionRunner.retain);
9. release     what retention, `ckptd rm` or `gc --all` decided goes leaves its tier here (release), under
               the seal lock on this node's disks: never while the step is being sealed or adopted.

The same seal (7) follows a replica's arrival (replica_arrived), a commit the cluster
learned (adopt_commit), a round of catching up with the peers (catch_up, the reconciliation
loop), and retention's look for commits this node missed (adopt_missed_commits), all under the
seal lock, as is the adoption of a replica sender's record. A waiter on
"peer" asks here too (wait_shard): replicas failing so far are tried again. At start-up,
resume() takes over the slots an earlier run left, before any RPC is served, and flushes
them by rounds too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from ckpt_core.errors import CheckpointError, InvalidArgument, NotFound
from ckpt_core.format import CommitRecord, ShardMeta
from ckpt_core.history import Line, generation
from ckpt_core.shard_key import ShardKey

from ckptd import metrics
from ckptd.cluster.view import ClusterView
from ckptd.errors import MixedLines
from ckptd.replication.peering import Peering
from ckptd.save.flush import Flusher
from ckptd.save.job_heads import JobHeads, newer
from ckptd.save.progress import REMEMBERED_SHARDS, ShardProgress, ShardWait
from ckptd.save.staging import SlotPool, Snapshot
from ckptd.save.uploading import Uploader
from ckptd.tiers.base import DurableTier, Listed, StepCatalog
from ckptd.tiers.slot_files import Slot

log = logging.getLogger(__name__)

LOCAL_TIERS = ("nvme", "peer")  # the tiers retention runs on after a seal here


class Retention(Protocol):
    """What the save asks of retention (operations.retention.RetentionRunner, above it), on the event loop.

    Its one entry point, retain(): "sealed" after a step is sealed here (awaited); and its form for
    plain callbacks, retain_soon(): "uploaded" once a step is committed in the object store (the Uploader's).
    """

    async def retain(self, occasion: Literal["sealed"], job: str = "", dry_run: bool = False) -> Sequence[object]: ...

    def retain_soon(self, occasion: Literal["uploaded"], job: str) -> None: ...


@dataclass(frozen=True)
class ReserveAnswer:
    """What a Reserve comes to (reserve_for): the slot to copy into, or why there is none.

    slot: the rank's slot, None where the save is skipped (reason says why) or, for a rank
    preparing its slots, where none is free; spare: the slot its next save will get, if one is
    allocated; reservation: the token its Commit carries (0 when only preparing); line: the line
    of the job's history the save belongs to (None when only preparing: no save was placed).
    """

    slot: Slot | None
    spare: Slot | None
    skipped: bool = False
    reason: str = ""
    blocked_s: float = 0.0
    reservation: int = 0
    line: Line | None = None


class SavePath:
    """Order the roles of a save, from the slot reserved to the step retained."""

    def __init__(
        self,
        pool: SlotPool,
        flusher: Flusher,
        nvme: DurableTier,
        replica_store: DurableTier,
        durable_tiers: list[DurableTier],
        peering: Peering,
        uploader: Uploader | None,
        progress: ShardProgress,
        retention: Retention,
        view: ClusterView | None,
        save_threads: ThreadPoolExecutor,
        peer_threads: ThreadPoolExecutor,
        removal_threads: ThreadPoolExecutor,
        object_threads: ThreadPoolExecutor,
        client_retention: Callable[[str, int | None, int | None], Awaitable[None]],
        object_step: Callable[[str, int], Awaitable[list[int] | None]],
    ) -> None:
        """save_threads: Reserve's and Commit's disk work, never behind a flush; peer_threads: short tier lookups;
        removal_threads: the cleanup thread (lowest CPU priority), where steps leave this node's disks;
        object_threads: requests to the object store (a step removed there).

        object_step(job, step): whether a step is complete in the store (Locator.object_step), for a waiter on "object".

        client_retention(job, keep, keep_every): take the retention a job's client asks for on
        Reserve (JobRetention.client_asked, above the save path), before the save is placed.
        """
        self.pool = pool
        self.flusher = flusher
        self.nvme = nvme
        self.replica_store = replica_store
        self.durable_tiers = durable_tiers
        self.peering = peering
        self.uploader = uploader
        self.progress = progress
        self.retention = retention
        self.view = view
        self._save_threads = save_threads
        self._peer_threads = peer_threads
        self._removal_threads = removal_threads
        self._object_threads = object_threads
        self._client_retention = client_retention
        self._object_step = object_step
        # One seal at a time on this node; catch_up, the adoptions and every removal from this node's disks take it too.
        self._seal_lock = asyncio.Lock()
        self._rounds: dict[str, asyncio.Task[None]] = {}  # job -> its rounds, while a snapshot of it waits
        self.heads = JobHeads(self._tiers_records)  # told of every seal, adoption and removal below
        self._latest_run: OrderedDict[tuple[str, int], str] = OrderedDict()  # the run that committed a step last
        self.tasks: set[asyncio.Task[None]] = set()
        self.counters = {"saves": 0, "skipped": 0, "bytes_saved": 0, "replica_bytes_received": 0}
        self.save_seconds = metrics.Histogram(
            "ckptd_save_duration_seconds",
            "From a rank's slot reserved to its snapshot committed (the copy: what the daemon sees of a save's stall)",
            metrics.SAVE_BUCKETS_S,
        )

    # -- 1. reserve -------------------------------------------------------------------

    async def reserve_for(
        self,
        key: ShardKey,
        size_bytes: int,
        asked: Line | None,
        after: int,
        retention: tuple[int | None, int | None] | None = None,
        prepare: bool = False,
    ) -> ReserveAnswer:
        """Answer a rank's Reserve: take its client's retention, then prepare its slots or place and reserve the save.

        retention: (keep, keep_every) its client asks for, None where it asks nothing. prepare: allocate
        the rank's slots ahead of its first save (no reservation: the client maps and pins them), and
        answer its free slots. Otherwise line_for() places the save (asked and after as there),
        reserve() finds its slot, and the answer names the slot its next save will get.
        """
        if retention is not None:
            await self._client_retention(key.job, *retention)
        if prepare:
            free = await self.pool.prepare(key.job, key.rank, size_bytes)
            return ReserveAnswer(free[0] if free else None, free[1] if len(free) > 1 else None)
        line = await self.line_for(key, asked, after)
        slot, blocked_s, reason = await self.reserve(key, size_bytes, line)
        if slot is None:
            return ReserveAnswer(None, None, skipped=True, reason=reason, line=line)
        spare = self.pool.spare(key.job, key.rank)
        return ReserveAnswer(slot, spare, False, reason, blocked_s, slot.reservation, line)

    async def line_for(self, key: ShardKey, asked: Line | None, after: int) -> Line:
        """Return the line of the job's history a save belongs to, or refuse it (InvalidArgument); before reserve().

        Refused: a step older than the job's head, or than the step the rank loaded or saved last.

        asked is the line the rank continues (Checkpointer: after a load, or its last save),
        after the step it loaded or saved last; None: the rank has neither, and the save
        continues the job's head. The head is the newest step of the newest line this node
        knows (its durable tiers, the cluster view's commits).
        """
        record = await asyncio.get_running_loop().run_in_executor(self._save_threads, self._head_of, key.job)
        head = record.step if record is not None else None
        head_line = record.line if record is not None else ()
        # The head itself, or the step last saved, saved again: reserve() skips it if complete, else (a rank
        # that never got its shard in) it is saved again.
        if asked is None and record is not None and key.step < record.step:
            saved = f", saved {record.committed_at}" if record.committed_at else ""
            raise _not_newer(key, f"step {head}, the job's newest complete step{saved}")
        if asked is None:
            return head_line
        if key.step < after:
            raise _not_newer(key, f"step {after}, which this rank loaded or saved last")
        if head is not None and generation(asked) < generation(head_line):
            raise InvalidArgument(
                f"{key.job} step {key.step} continues a line of the job that a later rollback superseded (the job's "
                f"newest step is {head}, of a newer line): load the step to continue from first"
            )
        return asked

    def _head_of(self, job: str) -> CommitRecord | None:
        """Return the record of the job's head here (kept by JobHeads) or in the cluster (a save thread)."""
        head = self.heads.head(job)
        for record in self.view.committed(job) if self.view is not None else []:
            head = newer(head, record)
        return head

    def _tiers_records(self, job: str) -> dict[int, CommitRecord]:
        """Return the records of the job's steps complete on this node's durable tiers (JobHeads' listing)."""
        records: dict[int, CommitRecord] = {}
        for tier in self.durable_tiers:
            records.update(tier.complete_records(job))
        return records

    async def reserve(self, key: ShardKey, size_bytes: int, line: Line = ()) -> tuple[Slot | None, float, str]:
        """Find staging room for a shard (see SlotPool.reserve); return (slot or None, seconds blocked, why).

        line is the one line_for() gave: a step complete here on an older line is saved again (it is superseded).
        """
        # A skipped save is the caller's to report, and the servicer's to log (at a pace a caller cannot flood).
        if await self.is_complete(key.job, key.step, line):  # before any slot is claimed for a save that will not be
            self.counters["skipped"] += 1
            return None, 0.0, f"{key.job} step {key.step} is already complete; a complete step is never rewritten"
        reserved = await self.pool.reserve(key.job, key.rank, size_bytes)
        if reserved.slot is None:
            self.counters["skipped"] += 1
            return None, 0.0, f"{reserved.reason} (staging.policy = skip)"
        if reserved.blocked_s > 0.5:
            log.warning("%s waited %.1f s for staging room: %s", key, reserved.blocked_s, reserved.reason)
        self.flusher.reserved(key)
        if reserved.replaced is not None and reserved.replaced.step != key.step:  # the same step: saved again
            self.progress.passed_over_by(reserved.replaced, key.step)
            await self.progress.changed()
        return reserved.slot, reserved.blocked_s, reserved.reason

    async def is_complete(self, job: str, step: int, line: Line = ()) -> bool:
        """Say whether a durable tier holds the step complete, on line or a newer one.

        One complete in memory alone may be saved again; so may one of an older line (a rollback's
        new line saves the step number again: the tier retires the superseded step when the new
        shard comes, LocalDirTier.open_shard).
        """
        return await asyncio.get_running_loop().run_in_executor(self._save_threads, self._complete, job, step, line)

    def _complete(self, job: str, step: int, line: Line = ()) -> bool:
        for tier in self.durable_tiers:
            try:
                if generation(tier.commit_record(job, step).line) >= generation(line):
                    return True
            except NotFound:
                continue
        return False

    # -- 3. commit --------------------------------------------------------------------

    async def commit(self, snapshot: Snapshot) -> None:
        """Take over a filled slot and queue its flush; return once its markers are written."""
        key = snapshot.key
        if len(snapshot.run_id) > 256:
            raise InvalidArgument(f"{key}: run_id is longer than 256 characters")
        slot = self.pool.take(snapshot)
        # Once taken, the slot is committed and flushed even if the client goes away meanwhile.
        await asyncio.shield(self._spawn(self._take_over(slot, snapshot)))

    async def _take_over(self, slot: Slot, snapshot: Snapshot) -> None:
        key = snapshot.key
        try:
            # Off the event loop: the slot's layout, megabytes, is read and written beside it.
            loop = asyncio.get_running_loop()
            layout_json = await loop.run_in_executor(self._save_threads, self._write_markers, slot, snapshot)
        except BaseException:
            self.pool.abandon(slot)
            raise
        self.pool.committed(slot, snapshot, layout_json)
        copy_s = await self.flusher.copied(key)
        if copy_s is not None:
            self.save_seconds.observe(copy_s)
        self._note_run(key, snapshot.run_id)
        self.progress.copy_committed(key, generation(snapshot.line))
        self.peering.forget_replicas(key)  # of an earlier copy of the shard: this one replaces it
        if self.uploader is not None:
            self.uploader.forget(key)
        self.counters["saves"] += 1
        self.counters["bytes_saved"] += snapshot.data_size_bytes
        self.flush_soon(key.job)

    def _write_markers(self, slot: Slot, snapshot: Snapshot) -> str:
        """Refuse a snapshot of a step complete meanwhile, else mark the slot committed (one hop: a save thread)."""
        key = snapshot.key
        if self._complete(key.job, key.step, snapshot.line):
            raise InvalidArgument(f"{key.job} step {key.step} is already complete; a complete step is never rewritten")
        return self.pool.write_markers(slot, snapshot)

    def _note_run(self, key: ShardKey, run_id: str) -> None:
        """Remember the run that committed a step last (bounded, oldest first): seals take its shards only."""
        self._latest_run.pop((key.job, key.step), None)  # re-insert: the table stays ordered by commit
        self._latest_run[(key.job, key.step)] = run_id
        while len(self._latest_run) > REMEMBERED_SHARDS:
            self._latest_run.popitem(last=False)

    async def wait_shard(self, key: ShardKey, tier: str, timeout_s: float) -> ShardWait:
        """Return whether a shard reached a tier, or why it cannot, waiting up to timeout_s (ShardProgress.wait).

        A waiter on "peer" for replicas failing so far has them tried again at once: it hears how a
        fresh attempt goes. The retry only queues its sends: ShardProgress.wait reads the attempts made
        so far before its first await, and counts that attempt as a new one.
        """
        if tier == "peer":
            self.peering.retry_failing_replicas(key)
        return await self.progress.wait(key, tier, timeout_s, self._object_step)

    # -- 4. flush, 5. replicate, 6. upload -----------------------------------------------

    def flush_soon(self, job: str) -> None:
        """Start the job's flush rounds unless they run: they go on while a snapshot of the job waits for its flush."""
        if job in self._rounds:
            return  # the running rounds look again after their current one
        self._rounds[job] = self._spawn(self._rounds_of(job))

    async def _rounds_of(self, job: str) -> None:
        """Flush the job round after round until no snapshot of it waits (a task per job, see flush_soon)."""
        try:
            while True:
                await self.flusher.until_ranks_agree(job)
                begun = self.flusher.begin_round(job)
                if begun is None:
                    return  # and, before any await, out of _rounds: the next commit starts them again
                chosen, passed_over = begun
                for key in passed_over:
                    self.progress.passed_over_by(key, chosen.step)
                await self.pool.changed()  # the slots passed over are free: saves waiting for one may go on
                await self.progress.changed()  # their waiters hear they were passed over
                await asyncio.gather(*(self._flush(slot) for slot in chosen.flushed))
        finally:
            self._rounds.pop(job, None)

    async def _flush(self, slot: Slot) -> None:
        """Write one pinned slot to NVMe, replicating it once hashed and uploading it once durable; then seal."""
        key = slot.shard
        assert key is not None
        resumed = slot.meta  # a flush resumed after a restart: no new checksums come; read before the slot settles
        try:
            if not await self.flusher.write(slot, lambda meta: self.peering.replicate(key, meta, slot.path)):
                return  # another snapshot is in the slot now
            if not self.flusher.others_unflushed(slot):
                self.progress.sealing_started(key)
            if resumed is not None:
                self.peering.replicate(key, resumed, slot.path)
            if self.uploader is not None:
                self.uploader.upload(key)
        except Exception as e:  # a flush must never fail silently, whatever broke
            if not isinstance(e, (CheckpointError, OSError)):
                log.exception("flush of %s failed unexpectedly", key)
            self.progress.failed(key, "nvme", str(e))
        # Not awaited by the round: the job's next round need not wait for the seal and retention.
        self._spawn(self.after_flush(key))

    # -- 7. seal, 8. retain ------------------------------------------------------------------

    async def after_flush(self, key: ShardKey) -> None:
        """Seal the shard's step if it can be, tell the waiters, then apply retention to the job."""
        record = None
        mixed = None
        try:
            record = await self.seal(key.job, key.step)
        except MixedLines as e:
            mixed = e
        except (CheckpointError, OSError) as e:
            self.progress.failed(key, "nvme", f"commit of {key.job} step {key.step} failed: {e}")
        finally:
            self.progress.sealing_done(key)
        if mixed is not None:  # no rank of it may count as saved
            self.progress.step_failed(key.job, key.step, key.world_size, "nvme", str(mixed))
        await self.progress.changed()  # waiters first: retention below may take a while
        if record is None:
            return
        self.progress.step_completed("nvme", key.job, key.step, generation=generation(record.line))
        log.info("%s step %d is complete on nvme (%d bytes)", key.job, key.step, record.size_bytes)
        try:
            await self.retention.retain("sealed", key.job)
        except (CheckpointError, OSError) as e:
            self.progress.failed(key, "nvme", f"retention for {key.job} failed: {e}")

    async def seal(self, job: str, step: int) -> CommitRecord | None:
        """Seal a step that just got a durable shard here (flushed or received), if it can be now.

        One seal at a time (two ranks finishing together must not both write the record),
        and none while another shard of the step is still on its way: a re-saved shard
        replaces the old one before the step is sealed. Where other nodes hold ranks of the
        step, it is reported to the cluster view instead, and sealed when its commit comes.
        """
        if self.flusher.flushing(job, step):
            return None  # sealed when the last of its flushes ends
        async with self._seal_lock:
            if self.flusher.flushing(job, step):
                return None
            # Sealed from the latest run that committed the step: a late flush of an
            # earlier run never counts beside the newer run's shards.
            record, sealed_here = await self.peering.record_to_seal(job, step, self._latest_run.get((job, step)))
            if record is None or not await self._adopt_here(record):
                return None
            if sealed_here and self.view is not None:
                self.view.announce(record)
            return record

    async def replica_arrived(self, meta: ShardMeta, told: CommitRecord | None) -> None:
        """Adopt the commit record a replica's sender gave, count the replica, then seal its step if it was the last
        rank missing (the peer servicer's, once the receiver made the replica durable).

        Before the sender hears that its replica is in: once every rank has waited for
        "peer", losing any one node can no longer lose the step. told (the sender's record of a
        step complete already) is adopted on the replica store at once, under the seal lock as every
        adoption (an I/O error adopting it goes back to the sender; a seal's is logged).
        """
        if told is not None and (told.job, told.step) == (meta.job, meta.step):
            async with self._seal_lock:
                loop = asyncio.get_running_loop()
                if await loop.run_in_executor(self._peer_threads, self.replica_store.adopt_commit, told):
                    self.heads.sealed(told)
        self.counters["replica_bytes_received"] += meta.data_size_bytes  # a record not adopted: uncounted
        try:
            record = await self.seal(meta.job, meta.step)
        except (CheckpointError, OSError) as e:
            log.warning("sealing %s step %d after a replica arrived failed: %s", meta.job, meta.step, e)
            return
        if record is not None:
            self.peering.note_complete(meta.job, meta.step)
            await self._note_nvme_complete(record)

    async def commit_learned(self, record: CommitRecord) -> None:
        """The view's on_commit: adopt_commit, its refusals logged (the view goes on following commits)."""
        try:
            await self.adopt_commit(record)
        except (CheckpointError, OSError) as e:
            log.warning("%s step %d: the cluster's commit was not adopted here: %s", record.job, record.step, e)

    async def adopt_commit(self, record: CommitRecord) -> None:
        """Seal a step the cluster found complete, where this node holds part of it (the view, a peer's CommitStep).

        As a seal: under the seal lock, and not while a shard of the step is still flushing
        (that flush seals the step when it ends, with the record the view now knows).
        Raises StepAlreadyComplete where this node holds the step with another record.
        """
        try:
            async with self._seal_lock:
                if self.flusher.flushing(record.job, record.step):
                    if self.view is not None:
                        self.view.seeded([record])
                    return
                told_before = await self.peering.told_before(record)  # or refused: held with another record
                adopted = await self._adopt_here(record) and not told_before
            if adopted:
                self.peering.note_complete(record.job, record.step)
                await self._note_nvme_complete(record)
        finally:
            await self.progress.changed()

    async def catch_up(self, full: bool) -> None:
        """Catch up with the peers: seal what this node's shards or the cluster's commits complete, resume replicas.

        The reconciliation loop's round (node.py). Peering asks the peers and lists this node
        (look_around: every peer when full, at start-up), then, as any seal, under the seal lock
        and never while a shard of the step flushes, each unsealed step is sealed with the record
        Peering finds for it (record_found); last, Peering follows the replicas (resume_replicas).
        """
        found = await self.peering.look_around(full)
        if found is None:
            return
        waited_at = time.monotonic()
        async with self._seal_lock:
            found.took["waiting for the seal lock"] = time.monotonic() - waited_at
            for job, step in sorted(found.unsealed):
                if self.flusher.flushing(job, step):
                    continue
                try:
                    record, sealed_here = self.peering.record_found(found, job, step)
                except MixedLines as e:
                    log.debug("%s", e)  # the flush that wrote its last shard reported it to the rank waiting on it
                    continue
                if record is not None and await self._adopt_here(record):
                    self.peering.note_complete(job, step)
                    if sealed_here and self.view is not None:
                        self.view.announce(record)
                    elif self.view is not None:
                        self.view.seeded([record])  # a peer's record: the view answers latest_step from it
            found.took["sealing"] = time.monotonic() - waited_at - found.took["waiting for the seal lock"]
        await self.peering.resume_replicas(found)

    async def adopt_missed_commits(self, tier: DurableTier, job: str) -> None:
        """Seal this node's incomplete steps of a job on a tier that the cluster view knows complete (retention).

        RetentionRunner asks before it plans a pass: a step that looks abandoned here may be complete
        in the cluster (its commit notice missed while this node was down). Under the seal lock, as
        every adoption, and not while a shard of the step flushes (that flush seals it when it ends).
        """
        if self.view is None:
            return
        loop = asyncio.get_running_loop()
        async with self._seal_lock:
            for step in await loop.run_in_executor(self._peer_threads, _incomplete_steps, tier, job):
                record = self.view.commit_record(job, step)
                if record is None or self.flusher.flushing(job, step):
                    continue
                if await loop.run_in_executor(self._peer_threads, tier.adopt_commit, record):
                    self.heads.sealed(record)
                    log.info("%s step %d on tier %s: adopted the commit record a peer holds", job, step, tier.name)

    async def _adopt_here(self, record: CommitRecord) -> bool:
        """Seal a step complete in the cluster on every durable tier here that holds part of it; say whether any did.

        The one place the save path writes a commit record to a tier's catalog (the flush, a
        replica's arrival, a commit learned, a round of catching up), under the seal lock.
        """
        loop = asyncio.get_running_loop()
        adopted = [await loop.run_in_executor(self._peer_threads, t.adopt_commit, record) for t in self.durable_tiers]
        if any(adopted):
            self.heads.sealed(record)
        return any(adopted)

    async def _note_nvme_complete(self, record: CommitRecord) -> None:
        """Tell `status` and /metrics that a step sealed here is complete on this node's NVMe, if its shards are."""
        held = await asyncio.get_running_loop().run_in_executor(
            self._peer_threads, self.nvme.checked_commit, record.job, record.step
        )
        if held is not None:
            self.progress.step_completed("nvme", record.job, record.step, generation=generation(record.line))

    # -- 9. release: what retention, `ckptd rm` and `gc --all` decided goes ----------------------

    async def release(self, tier: StepCatalog, job: str, step: int, listed: Listed | None) -> None:
        """Remove a step from a tier: the one way a step leaves a tier's catalog (RetentionRunner decides which).

        From this node's disks under the seal lock, on the cleanup thread (lowest CPU priority): a step
        is never removed while it is being sealed or adopted. From the object store on the object
        threads, outside the seal lock: no seal writes there (the Uploader commits its steps, and
        holds them busy until it has). listed: as StepCatalog.remove_step (StepChanged: it stays).
        """
        loop = asyncio.get_running_loop()
        if not isinstance(tier, DurableTier):  # the object store: its catalog is not this node's disk
            await loop.run_in_executor(self._object_threads, tier.remove_step, job, step, listed)
            return
        async with self._seal_lock:
            try:
                await loop.run_in_executor(self._removal_threads, tier.remove_step, job, step, listed)
            finally:
                self.heads.released(job, step)

    async def release_slots(self, job: str, step: int, dry_run: bool) -> list[Slot]:
        """Drop a step's settled staging slots (`ckptd rm`); return them, or with dry_run those it would drop."""
        slots = self.pool.drop_step(job, step, dry_run)  # no await before: nothing took them meanwhile
        if slots and not dry_run:
            await self.pool.changed()
        return slots

    # -- what the replicas and uploads report (registered by the composition root) -----------------

    def replication_changed(self, key: ShardKey, replicated: bool) -> None:
        """Replication's on_change: a shard's replicas reached their peers, or an attempt failed."""
        if replicated:
            self.progress.reached(key, "peer")  # stays known after the shard is no longer tracked
        self.progress.changed_soon()

    def upload_changed(self, key: ShardKey, committed: bool) -> None:
        """The Uploader's on_change: a shard's upload, or its step's commit in the store, moved on."""
        state = self.uploader.state(key) if self.uploader is not None else None
        if state is not None and state.committed:  # its step's commit record is in the store
            self.progress.step_completed("object", key.job, key.step)
        self.progress.changed_soon()
        if committed:  # a new step in the store: [retention] object may now remove an older one
            self.retention.retain_soon("uploaded", key.job)

    # -- recovery and drain ------------------------------------------------------------------

    async def resume(self) -> None:
        """Take over the slots an earlier run left: flush what is not on NVMe yet, seal what a crash left whole.

        What is not on NVMe is flushed by rounds, as any save: of each rank, the snapshot of
        the step its job's round picks (the newest, or one [nvme] flush_every keeps); older
        ones are passed over, their markers removed, so recovery never writes a step it would
        pass over. The checks run on the save threads: resumed flushes take the flush threads meanwhile.
        """
        loop = asyncio.get_running_loop()
        held = await loop.run_in_executor(self._save_threads, self.pool.recover)
        for slot in sorted(held, key=lambda s: s.committed_seq):
            assert slot.shard is not None
            self._note_run(slot.shard, slot.run_id)
        for slot in sorted(held, key=lambda s: s.shard.step if s.shard else 0):
            key = slot.shard
            assert key is not None
            if await loop.run_in_executor(self._save_threads, self._flushed_already, slot, key):
                await self.pool.settle(slot)
        newest: dict[tuple[str, int], Slot] = {}  # of each rank, the snapshot its rounds will flush
        for slot in sorted((s for s in held if s.state == "pending"), key=lambda s: s.committed_seq):
            newest[(slot.job, slot.rank)] = slot
        for slot in newest.values():
            log.info("resuming flush of %s", slot.shard)
        for job in sorted({job for job, _ in newest}):
            self.flush_soon(job)
        # A crash between the last shard's rename and the commit record leaves a
        # step with every shard in place: commit it now.
        for job, step, world_size in await loop.run_in_executor(self._save_threads, self._interrupted_commits):
            await self.after_flush(ShardKey(job, step, 0, world_size))

    def _flushed_already(self, slot: Slot, key: ShardKey) -> bool:
        # Complete, or older than the newest complete step (removed by retention, or never
        # to complete), or this very copy already on disk: nothing left to flush. A copy
        # not even checksummed is flushed again (a rewrite of an incomplete step is harmless).
        complete = self.nvme.complete_steps(key.job)
        return key.step <= max(complete, default=-1) or (slot.meta is not None and self.nvme.holds(slot.meta))

    def _interrupted_commits(self) -> list[tuple[str, int, int]]:
        found = []
        for job in self.nvme.jobs():
            complete = set(self.nvme.complete_steps(job))
            for step in self.nvme.all_steps(job):
                held = [] if step in complete else self.nvme.holdings(job, step)
                world_size = held[0].world_size if held else None
                if world_size:
                    found.append((job, step, world_size))
        return found

    async def drain(self) -> None:
        """Wait for every queued flush, seal and retention pass of a save."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


def _incomplete_steps(tier: DurableTier, job: str) -> list[int]:
    complete = set(tier.complete_steps(job))
    return [s for s in tier.all_steps(job) if s not in complete]


def _not_newer(key: ShardKey, than: str) -> InvalidArgument:
    """Return the refusal of a save whose step does not grow the job's line, naming the ways forward."""
    return InvalidArgument(
        f"{key.job} step {key.step} is older than {than}: a job's steps grow along its line, and a save "
        "below it would be older than the job's newest. For a new run, use a new job name or remove the old "
        f"run's steps first (ckptd gc --job {key.job} --all); to go back on purpose (a rollback), load the step to "
        "continue from (Checkpointer.load(step=N)) and save steps after N: they start a new line, and the old "
        "line's steps after N become superseded"
    )

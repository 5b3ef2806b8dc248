"""Upload each shard of every `every`-th step from NVMe to the object tier, then commit the step there.

Driven from the event loop: Node calls start() once (which resumes the
uploads that the disk says are pending); SavePath calls upload() after each shard is
durable on NVMe and forget() when a shard is saved again; ShardProgress state() for
waiters; Node drain() at shutdown. Bytes move on the upload threads (Executors.upload): a slow or failing store never
holds a staging slot, a flush or training. Each shard goes the one way into a tier,
upload_file: the NVMe file is read in the store's part-sized ranges and pushed
through the tier's open_shard -> write -> seal (abandon on any failure). Failures
retry with exponential back-off and jitter, forever, and are reported after a few
in a row.

Which node writes a step's commit record: the node that uploaded rank 0's shard,
once the step is complete in the cluster (its commit record is on this node's NVMe)
and every rank's shard in the store matches that record. The write is create-only
where the store allows it, so even two writers could never commit different records.
The other nodes watch the store until the record is there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_core.byte_range import ByteRange
from ckpt_core.errors import CheckpointError, CorruptCheckpoint, NotFound
from ckpt_core.format import CommitRecord, ShardMeta, chunk_ranges
from ckpt_core.shard_key import ShardKey

from ckptd import metrics
from ckptd.config import Config
from ckptd.errors import AlreadyHeld, CommitConflict, LocalCopyGone
from ckptd.keyed import KeyedLocks
from ckptd.tiers.base import DurableTier, WrittenTier
from ckptd.tiers.object.layout import part_bytes

log = logging.getLogger(__name__)

UPLOAD_THREADS = 2  # shards uploaded at once; each sends several parts at a time
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
COMMIT_POLL_MIN_S = 0.2
COMMIT_POLL_MAX_S = 5.0
COMMIT_WATCH_LIMIT_S = 3600.0  # how long a node waits for the other nodes' uploads of a step
FAILURES_REPORTED = 3  # consecutive failures after which a waiter hears of them
REMEMBERED = 1 << 16


@dataclass
class UploadState:
    """Where one shard stands on the object tier."""

    uploaded: bool = False
    committed: bool = False  # its step's commit record is in the store
    failures: int = 0  # consecutive
    attempts: int = 0  # finished, successful or not
    error: str = ""
    gave_up: bool = False  # the error is final: the step will never be complete in the store


class Uploader:
    """Keep the object tier one step behind NVMe at most: upload, commit, retry."""

    def __init__(
        self,
        config: Config,
        nvme: DurableTier,
        tier: WrittenTier,
        on_change: Callable[[ShardKey, bool], None],
        threads: ThreadPoolExecutor,
    ) -> None:
        """tier: the object store's (str() of it names the store in messages); on_change(key, committed) is called
        on the event loop whenever a shard's state changes."""
        self.config = config
        self.nvme = nvme
        self.tier = tier
        self.io = threads  # UPLOAD_THREADS uploads and the commit checks (Executors.upload)
        self._on_change = on_change
        self._states: dict[ShardKey, UploadState] = {}
        self._locks: KeyedLocks[tuple[str, int, int]] = KeyedLocks()
        self._uploading: set[ShardKey] = set()
        self._watching: dict[tuple[str, int], set[ShardKey]] = {}  # steps waiting for their commit record
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(UPLOAD_THREADS)
        self.counters = {"uploaded_shards": 0, "uploaded_bytes": 0, "commits_written": 0, "upload_failures": 0}
        self.upload_seconds = metrics.Histogram(
            "ckptd_upload_duration_seconds", "Uploading one shard to the object store (a successful attempt)"
        )
        self.verification_failures = 0  # NVMe copies found bad while read for upload
        self.last_error = ""

    @property
    def every(self) -> int:
        """Return which steps go to the object tier: every this many ([object] every)."""
        return self.config.object.every

    def wanted(self, step: int) -> bool:
        """Say whether a step goes to the object tier ([object] every)."""
        return step % self.config.object.every == 0

    # -- scheduling ----------------------------------------------------------------

    def start(self) -> None:
        """Resume in the background what earlier runs left: shards on NVMe not yet in the store."""
        self._spawn(self._resume())

    async def _resume(self) -> None:
        loop = asyncio.get_running_loop()
        delay = BACKOFF_MIN_S
        while True:
            try:
                pending = await loop.run_in_executor(self.io, self._pending_on_disk)
                break
            except (CheckpointError, OSError) as e:
                self._failed(f"listing the object store to resume uploads failed: {e}")
                await asyncio.sleep(_jittered(delay))  # back-off before trying the store again
                delay = min(delay * 2, BACKOFF_MAX_S)
        for key in pending:
            if key not in self._states:
                log.info("resuming upload of %s", key)
                self.upload(key)

    def _pending_on_disk(self) -> list[ShardKey]:
        pending = []
        keep = self.config.retention.object
        for job in self.nvme.jobs():
            in_store = self.tier.complete_steps(job)
            # Older than the steps [retention] object keeps: removed from the store on purpose, or soon to be.
            floor = in_store[-keep] if keep and len(in_store) >= keep else -1
            for step in self.nvme.all_steps(job):
                if step not in in_store and step > floor and self.wanted(step):
                    pending += [ShardKey(job, step, h.rank, h.world_size) for h in self.nvme.holdings(job, step)]
        return pending

    def upload(self, key: ShardKey) -> None:
        """Start uploading a shard that is durable on NVMe (a step [object] every leaves out is ignored)."""
        if not self.wanted(key.step):
            return
        # A store slower than the saves: an older step of the job none of whose shards has
        # begun its upload here is skipped, whole, for the newer one. A step under way goes
        # on, so some step always completes, and at most two per job wait on NVMe.
        begun = {(k.job, k.step) for k, s in self._states.items() if s.attempts or s.uploaded or k in self._uploading}
        for older, state in self._states.items():
            skipped = older.job == key.job and older.step < key.step and (older.job, older.step) not in begun
            if skipped and not (state.uploaded or state.gave_up):
                state.error = f"{older} was not uploaded: step {key.step} came before any shard of its step began"
                state.gave_up = True
                log.warning("%s", state.error)
                self._on_change(older, False)
        self._states[key] = UploadState()
        if len(self._states) > REMEMBERED:
            del self._states[next(iter(self._states))]
        self._spawn(self._upload(key, self._states[key]))

    def forget(self, key: ShardKey) -> None:
        """Drop what is known of a shard's earlier copy (it was saved again)."""
        self._states.pop(key, None)

    def state(self, key: ShardKey) -> UploadState | None:
        """Return where a shard stands, or None if no upload of it is known."""
        return self._states.get(key)

    def busy_steps(self) -> set[tuple[str, int]]:
        """Return the steps NVMe retention keeps off: their shards are still on their way to the store.

        Bounded while the store is slow or down: a newer step skips older ones not begun
        (see upload). Once uploaded, a shard no longer needs its NVMe copy.
        """
        waiting = {(k.job, k.step) for k, s in self._states.items() if not (s.uploaded or s.gave_up)}
        return waiting | {(k.job, k.step) for k in self._uploading}

    def unsettled_steps(self) -> set[tuple[str, int]]:
        """Return the steps this node is still uploading or committing (object retention keeps off them)."""
        steps = {(k.job, k.step) for k, s in self._states.items() if not (s.committed or s.gave_up)}
        return steps | set(self._watching)

    def pending(self) -> int:
        """Return how many shards are on their way to the store."""
        return sum(1 for s in self._states.values() if not (s.uploaded or s.gave_up))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- uploading ------------------------------------------------------------------

    async def _upload(self, key: ShardKey, state: UploadState) -> None:
        loop = asyncio.get_running_loop()
        delay = BACKOFF_MIN_S
        # One copy of a shard at a time: a re-save waits for the copy before it.
        async with self._locks.hold((key.job, key.step, key.rank)):
            while self._states.get(key) is state and not state.gave_up:
                async with self._slots:
                    if state.gave_up:  # superseded while it waited for a slot
                        return
                    self._uploading.add(key)
                    try:
                        meta = await loop.run_in_executor(self.io, self._upload_shard, key)
                        error, gone = "", False
                    except (LocalCopyGone, CommitConflict) as e:
                        meta, error, gone = None, str(e), True
                    except CorruptCheckpoint as e:  # the NVMe copy failed its checks: no retry can help
                        self.verification_failures += 1
                        meta, error, gone = None, f"{e}; not uploaded", True
                    except (CheckpointError, OSError) as e:
                        meta, error, gone = None, f"upload of {key} to {self.tier} failed: {e}", False
                    except Exception as e:  # the loop must outlive any one bad attempt
                        log.exception("upload of %s failed unexpectedly", key)
                        meta, error, gone = None, f"upload of {key} failed unexpectedly: {e!r}", False
                    finally:
                        self._uploading.discard(key)
                state.attempts += 1
                if not error:
                    state.uploaded, state.failures, state.error = True, 0, ""
                    if meta is not None:
                        self.counters["uploaded_shards"] += 1
                        self.counters["uploaded_bytes"] += meta.data_size_bytes
                    self._on_change(key, False)
                    break
                if gone:
                    log.warning("%s: not uploaded", error)
                    state.error, state.gave_up = error, True
                    self._on_change(key, False)
                    return
                state.failures += 1
                state.error = error
                self.counters["upload_failures"] += 1
                self._failed(error)
                self._on_change(key, False)
                await asyncio.sleep(_jittered(delay))  # back-off before the next attempt
                delay = min(delay * 2, BACKOFF_MAX_S)
        if self._states.get(key) is state:
            self._watch(key)

    def _upload_shard(self, key: ShardKey) -> ShardMeta | None:
        """Upload the shard from NVMe unless the store holds it already; return its record if it was sent."""
        source = self.nvme.shard_source(key.job, key.step, key.rank)
        path = source.meta_path(key.rank)
        try:
            meta = ShardMeta.from_bytes(path.read_bytes(), str(path))
        except FileNotFoundError:
            raise LocalCopyGone(f"{key} is no longer on NVMe (removed by retention or saved again)") from None
        if self.tier.holds(meta):
            return None
        started = time.monotonic()
        if not upload_file(self.tier, meta, source.data_path(key.rank)):
            return None  # the step is complete in the store with this very shard
        self.upload_seconds.observe(time.monotonic() - started)
        log.info(
            "uploaded %s to %s (%d bytes, %.2f s)",
            key,
            f"{self.tier}/{key.job}/{key.step}",
            meta.data_size_bytes,
            time.monotonic() - started,
        )
        return meta

    # -- committing -------------------------------------------------------------------

    def _watch(self, key: ShardKey) -> None:
        """Follow the step of an uploaded shard until its commit record is in the store (and write it, for rank 0)."""
        step = (key.job, key.step)
        if step in self._watching:
            self._watching[step].add(key)
            return
        self._watching[step] = {key}
        self._spawn(self._watch_step(*step))

    async def _watch_step(self, job: str, step: int) -> None:
        loop = asyncio.get_running_loop()
        delay = COMMIT_POLL_MIN_S
        record: list[CommitRecord] = []  # once read from NVMe: the step may leave NVMe before it commits
        since = time.monotonic()
        try:
            while True:
                keys = self._watching[(job, step)]
                writer = any(k.rank == 0 for k in keys)
                try:
                    verdict = await loop.run_in_executor(self.io, self._check_commit, job, step, writer, record, since)
                except (CheckpointError, OSError) as e:
                    self._failed(f"committing {job} step {step} on {self.tier} failed: {e}")
                    verdict = "waiting"
                if verdict != "waiting":
                    break
                await asyncio.sleep(_jittered(delay))  # a period: other nodes' uploads give no signal here
                delay = min(delay * 2, COMMIT_POLL_MAX_S)
        finally:
            keys = self._watching.pop((job, step))
        for i, key in enumerate(sorted(keys, key=lambda k: k.rank)):
            state = self._states.get(key)
            if state is not None and verdict == "committed":
                state.committed = True
            elif state is not None:
                state.error = f"{job} step {step} will never be complete on tier object: {verdict}"
                state.gave_up = True
                log.warning("%s", state.error)
            # One retention pass per new step in the store, by the node that committed it.
            self._on_change(key, verdict == "committed" and i == 0 and key.rank == 0)

    def _check_commit(self, job: str, step: int, writer: bool, record: list[CommitRecord], since: float) -> str:
        """Return "committed", "waiting", or why the step will never be committed in the store.

        Only the writer needs the step's commit record, read once from NVMe and kept:
        the step may leave NVMe (retention) before the other nodes' uploads are in.
        """
        try:
            self.tier.commit_record(job, step)
            return "committed"
        except NotFound:
            pass
        if writer:  # first: a step whose every shard is in commits, even after a newer one did
            if not record and (sealed := self.nvme.checked_commit(job, step)) is not None:
                record.append(sealed)
            if record:
                try:
                    if self.tier.adopt_commit(record[0]):
                        self.counters["commits_written"] += 1
                        return "committed"
                except CommitConflict as e:
                    return str(e)
            elif step not in self.nvme.all_steps(job):
                return "it left NVMe (retention) before it was complete in the cluster"
        newer = [s for s in self.tier.complete_steps(job) if s > step]
        if newer and self.tier.is_complete(job, step):  # its commit read afresh: a listing may lag a commit
            return "committed"
        if newer:
            return f"a newer step ({newer[-1]}) is complete there first"
        if time.monotonic() - since > COMMIT_WATCH_LIMIT_S:
            return f"its commit record did not appear in the store within {COMMIT_WATCH_LIMIT_S:.0f} s"
        return "waiting"

    # -- reporting --------------------------------------------------------------------

    def _failed(self, message: str) -> None:
        if message != self.last_error:
            log.error("%s", message)
        self.last_error = message

    def status(self) -> dict[str, Any]:
        """Return the object tier's part of `ckptd status`."""
        failing = {str(k): s.error for k, s in self._states.items() if s.failures and not (s.uploaded or s.gave_up)}
        return {
            "enabled": True,
            "url": str(self.tier),
            "every": self.config.object.every,
            "compression": self.config.object.compression,
            "pending_uploads": self.pending(),
            "uploading": len(self._uploading),
            "waiting_for_commit": len(self._watching),
            "failing": dict(list(failing.items())[:20]),
            "last_error": self.last_error,
            **self.counters,
        }

    async def drain(self) -> None:
        """Stop retrying and watching; let attempts already on a thread finish."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)


def upload_file(tier: WrittenTier, meta: ShardMeta, data_path: Path) -> bool:
    """Upload a shard from its local data file through tier.open_shard, every chunk checked on the way.

    Called on an uploader thread (tests and benchmarks call it on theirs). The file is read in
    order, in ranges of the store's part size, with a sequential read-ahead hint: each range
    goes to ShardWrite.write while the parts before it are still in flight. Any failure
    abandons the copy. Return False where the store's commit record lists this very shard
    already (AlreadyHeld): nothing was sent.
    """
    try:
        shard = tier.open_shard(meta, transfer=str(data_path))
    except AlreadyHeld:
        return False
    try:
        fd = os.open(data_path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != meta.data_size_bytes:
                raise CorruptCheckpoint(f"{shard.what}: the local copy {data_path} has the wrong size")
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            for offset, length in chunk_ranges(meta.data_size_bytes, part_bytes(meta)):
                block = os.pread(fd, length, offset)
                if len(block) != length:
                    raise CorruptCheckpoint(
                        f"{shard.what}: the local copy {data_path} ended at byte {offset + len(block)}"
                    )
                shard.write(ByteRange(offset, length), memoryview(block))
        finally:
            os.close(fd)
        shard.seal()
    except BaseException:
        shard.abandon()
        raise
    return True


def _jittered(delay_s: float) -> float:
    return delay_s * random.uniform(0.5, 1.0)

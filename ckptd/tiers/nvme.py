"""Keep checkpoints in a local directory tree: the NVMe tier (also what the replica store and restore target use).

Every shard enters through open_shard, one LocalShardWrite per copy: the step directory
is made ready and the rank's older record dropped (under the step's lock), its bytes go
to a temporary file in large aligned direct-I/O writes, range by range, each chunk
checked or hashed first; seal fsyncs the file and renames it in, its record last
(storage.commit_protocol). The NVMe flush, fetch and restore write a whole shard from
memory through ShardSink.write_shard (its blocks on this tier's writer threads); the
replica receiver writes the ranges a peer sends. The step's commit record is written
last, once every rank's shard is in. Layout: <root>/<job>/<step>/. The records of a
step directory are read through step_records, each parsed once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from pathlib import Path

from ckpt_core.byte_range import ByteRange
from ckpt_core.chunks import check_chunks, chunk_digests
from ckpt_core.commit_keys import UNSIGNED, CommitKeys
from ckpt_core.errors import CorruptCheckpoint, InvalidArgument, NotFound
from ckpt_core.format import (
    COMMIT_NAME,
    DIRECT_IO_ALIGN_BYTES,
    JOB_RE,
    PARTIAL_SUFFIX,
    CommitRecord,
    ShardMeta,
    data_name,
    digest,
    meta_name,
    validate_job,
)
from ckpt_core.history import generation
from ckpt_core.shard_io import ShardSource, read_index

from ckptd.cluster.placement import Holding, seal_record
from ckptd.errors import ShardWriteError, StepAlreadyComplete
from ckptd.storage.commit_protocol import StepDirCommit
from ckptd.storage.durable_write import RangeWriter, fsync_dir
from ckptd.tiers.base import DurableTier, Listed, ShardWrite, shard_on_tier
from ckptd.tiers.step_records import StepRecords, entry_names

log = logging.getLogger(__name__)

DELETING_PREFIX = ".deleting-"


class LocalDirTier(DurableTier):
    """Store steps under a root directory with the atomic commit protocol."""

    def __init__(
        self, root: Path, name: str = "nvme", write_threads: Executor | None = None, commit_keys: CommitKeys = UNSIGNED
    ) -> None:
        """write_threads: where write_shard's blocks are written, several at once (Executors.nvme_writes or
        replica_writes; a restore's own); None writes them on the calling thread (readers, tests).
        commit_keys (Config.commit_keys): sign the records this tier seals, check those it reads."""
        self.root = root
        self.name = name
        self._io = write_threads
        self.commit_keys = commit_keys
        self._records = StepRecords(name, commit_keys)
        self._step_locks: dict[tuple[str, int], threading.Lock] = {}
        self._step_locks_lock = threading.Lock()
        self.removal_failures = 0  # step directories that could not be deleted (see retry_removals)
        self._undeleted: set[Path] = set()  # those still there, retried before every retention pass

    def _step_dir(self, job: str, step: int) -> Path:
        """Return the directory of a job's step."""
        return self.root / validate_job(job) / str(step)

    # -- listing -----------------------------------------------------------

    def jobs(self) -> list[str]:
        """Return the jobs with a directory under the root (other entries, like lost+found, are not jobs)."""
        return sorted(name for name in entry_names(self.root) if JOB_RE.fullmatch(name) and (self.root / name).is_dir())

    def all_steps(self, job: str, afresh: bool = False) -> list[int]:
        """Return every step directory of the job, complete or not, oldest first (listed afresh every time)."""
        return sorted(int(n) for n in entry_names(self.root / job) if n.isdigit())

    def complete_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is in place and checks; a damaged one is logged and left out."""
        return [s for s in self.all_steps(job) if self.checked_commit(job, s) is not None]

    def complete_records(self, job: str) -> dict[int, CommitRecord]:
        """Return each complete step's commit record (each parsed once, then kept while its file stays)."""
        return {s: r for s in self.all_steps(job) if (r := self.checked_commit(job, s)) is not None}

    def checked_commit(self, job: str, step: int) -> CommitRecord | None:
        """Return the step's commit record if it is there and checks, else None (not complete here)."""
        record = self._commit_state(job, step)
        return record if isinstance(record, CommitRecord) else None

    def is_complete(self, job: str, step: int) -> bool:
        """Say whether the step is complete here: one stat of its commit record (parsed once)."""
        return self.checked_commit(job, step) is not None

    def damaged_steps(self, job: str) -> list[int]:
        """Return the steps whose commit record is there but does not check: never removed, only reported."""
        return [s for s in self.all_steps(job) if self._commit_state(job, s) == "damaged"]

    def _commit_state(self, job: str, step: int) -> CommitRecord | str:
        """Return the step's checked commit record, "missing", or "damaged"."""
        return self._records.commit_state(self.root / job / str(step), job, step)

    def _step_lock(self, job: str, step: int) -> threading.Lock:
        with self._step_locks_lock:
            return self._step_locks.setdefault((job, step), threading.Lock())

    def commit_record(self, job: str, step: int) -> CommitRecord:
        """Return a complete step's commit record."""
        record = self.checked_commit(validate_job(job), step)
        if record is None:
            raise NotFound(f"{job} step {step} is not complete on tier {self.name}")
        return record

    def committed_unix_s(self, job: str, step: int) -> float:
        """Return when a complete step's commit record was written (its mtime)."""
        return (self._step_dir(job, step) / COMMIT_NAME).stat().st_mtime

    def shard_source(self, job: str, step: int, rank: int) -> ShardSource:
        """Point at a step directory."""
        return ShardSource(self.name, "dir", str(self._step_dir(job, step)), job, step)

    def has_shard(self, job: str, step: int, rank: int) -> bool:
        """Say whether a rank's shard is fully written (its metadata is renamed last)."""
        return (self._step_dir(job, step) / meta_name(rank)).exists()

    def holds(self, meta: ShardMeta) -> bool:
        """Say whether this exact shard record is installed here."""
        path = self._step_dir(meta.job, meta.step) / meta_name(meta.rank)
        try:
            return path.read_bytes() == meta.to_bytes()
        except OSError:
            return False

    # -- writing -----------------------------------------------------------

    @property
    def write_threads(self) -> Executor | None:
        """Return the tier's writer threads, which write_shard hands its blocks to."""
        return self._io

    def open_shard(self, meta: ShardMeta, transfer: str = "") -> LocalShardWrite:
        """Make the step directory ready for a shard, drop the rank's older copy, and open a temporary file for it.

        Called on a worker thread (the flush's, through write_shard; the receiver's). Refused
        (StepAlreadyComplete) when the step is complete here, unless meta is exactly the record
        the step's commit lists for that rank (a replica, or a shard fetched back). transfer
        names the temporary file, which start-up removes if a crash leaves it.
        """
        what = shard_on_tier(meta, self.name)
        commit = StepDirCommit(self._step_dir(meta.job, meta.step))
        # Each copy owns its temporary file, even two copies of one transfer: abandoning
        # one never removes the file another is writing.
        unique = f"{transfer}-{uuid.uuid4().hex[:8]}" if transfer else ""
        try:
            with self._step_lock(meta.job, meta.step):
                self._check_writable(meta, what)
                commit.begin()
                try:
                    # A shard saved again replaces the old one: drop it first, so a failure
                    # later leaves the step without this rank rather than with stale bytes.
                    (commit.step_dir / meta_name(meta.rank)).unlink(missing_ok=True)
                    # Created under the lock: a failed copy's remove_if_empty never takes the directory from this one.
                    temporary = commit.create_temporary(data_name(meta.rank), unique)
                except OSError:
                    commit.remove_if_empty()
                    raise
            try:
                return LocalShardWrite(self, meta, commit, temporary, what)
            except BaseException:  # a full disk, found by fallocate: the file is gone; so is the directory, if empty
                self._remove_if_empty(meta.job, meta.step)
                raise
        except OSError as e:
            raise ShardWriteError(f"{what}: {e.strerror or e}") from e

    def _remove_if_empty(self, job: str, step: int, wait: bool = True) -> bool:
        """Remove a step's directory if nothing is in it, under the step's lock; return whether it went.

        A failed copy calls it once its temporary file is gone, so that no empty step directory
        is left. wait=False (abandon(), which may run on the event loop) gives up at once when
        the lock is held: whoever holds it is working in the directory.
        """
        lock = self._step_lock(job, step)
        if not lock.acquire(blocking=wait):
            return False
        try:
            step_dir = self._step_dir(job, step)
            removed = StepDirCommit(step_dir).remove_if_empty()
            if removed:
                self._records.forget(step_dir)  # records of shards it once held, dropped since
            return removed
        finally:
            lock.release()

    @contextlib.contextmanager
    def _writable(self, meta: ShardMeta, what: str) -> Iterator[None]:
        """Hold the step's lock, once the shard may still be written there; learn its record once installed."""
        with self._step_lock(meta.job, meta.step):
            self._check_writable(meta, what)
            yield
            self._records.learn(self._step_dir(meta.job, meta.step), meta)

    def _check_writable(self, meta: ShardMeta, what: str) -> None:
        """Refuse a shard of a step complete here, unless listed there; retire the step if meta's line supersedes it.

        Called under the step's lock. A step complete here on a line older than the shard's
        (a rollback's new line saved the same step number again) is superseded: it is
        removed, and the new line's step takes its place.
        """
        record = self.checked_commit(meta.job, meta.step)
        if record is None:
            return
        if generation(record.line) < generation(meta.line):
            log.warning(
                "%s step %d on tier %s: removing the step saved at %s, superseded by a rollback's line that saves "
                "step %d again",
                *(meta.job, meta.step, self.name, record.committed_at or "an unknown time", meta.step),
            )
            self._delete(self._unlist(meta.job, meta.step))
            return
        listed = meta.rank < record.world_size and record.shard_meta_xxh3_128[meta.rank] == digest(meta.to_bytes())
        if not (meta.chunk_xxh3_128 and listed):
            raise StepAlreadyComplete(f"{what}: the step is already complete; a complete step is never rewritten")

    def try_commit(self, job: str, step: int, world_size: int, run_id: str = "") -> CommitRecord | None:
        """Write the step's commit record if every rank's shard is in, all of one run; return it, or None.

        With a run_id, shards of the step written by another run are stale and removed first.
        """
        with self._step_lock(job, step):
            state = self._commit_state(job, step)
            if isinstance(state, CommitRecord):
                return state
            self._drop_other_runs(job, step, run_id)
        held = self.holdings(job, step)
        record = seal_record(job, step, held, run_id or None, world_size, commit_keys=self.commit_keys)
        if record is None:
            odd = next((h for h in held if h.world_size != world_size), None)
            if odd is not None:
                raise ShardWriteError(f"{job} step {step}: rank {odd.rank} was saved with world_size {odd.world_size}")
            return None
        return record if self.adopt_commit(record) else None

    def read_index(self, record: CommitRecord) -> bytes | None:
        """Return the step's sealed index if this tier keeps one that belongs to record."""
        return read_index(self._step_dir(record.job, record.step), record)

    def holdings(self, job: str, step: int, node: str = "") -> list[Holding]:
        """Return the readable shard records of a step on this tier, each parsed once (a damaged one is left out)."""
        return self._records.holdings(self._step_dir(job, step), job, step, node)

    def adopt_commit(self, record: CommitRecord) -> bool:
        """Seal a step with its commit record; return whether the step is complete here with that record.

        Used once the step is complete across the cluster, on every node holding part
        of it. Shards the record does not list (an earlier run's, a stale copy) are
        removed first; the step directory must exist.
        """
        job, step = record.job, record.step
        step_dir = self._step_dir(job, step)
        with self._step_lock(job, step):
            state = self._commit_state(job, step)
            if isinstance(state, CommitRecord):
                if state != record:
                    log.error(
                        "%s step %d on tier %s: kept its commit record over a different one", job, step, self.name
                    )
                return state == record
            if not step_dir.is_dir():
                return False
            kept = 0
            for h in self.holdings(job, step):
                if h.rank < record.world_size and record.shard_meta_xxh3_128[h.rank] == h.meta_digest:
                    kept += 1
                    continue
                why = "dropping rank %d's shard, not the committed one"
                log.warning("%s step %d on tier %s: " + why, job, step, self.name, h.rank)
                (step_dir / meta_name(h.rank)).unlink(missing_ok=True)
                (step_dir / data_name(h.rank)).unlink(missing_ok=True)
            commit = StepDirCommit(step_dir)
            if state == "damaged":
                os.replace(step_dir / COMMIT_NAME, step_dir / f"{COMMIT_NAME}.damaged-{uuid.uuid4().hex[:8]}")
                log.warning("%s step %d on tier %s: moved a damaged commit record aside", job, step, self.name)
            if kept == record.world_size:  # every rank's record is here: so is the step's index
                commit.write_index(record)
            commit.write_commit(record.to_bytes())
        return True

    def _drop_other_runs(self, job: str, step: int, run_id: str) -> None:
        # Shards left by an earlier run of the job that died before this step was whole:
        # each rank saves the step again in this run, and only then is it sealed.
        if not run_id:
            return
        step_dir = self._step_dir(job, step)
        for path in sorted(step_dir.glob("rank-*.meta.json")):
            try:
                stale = ShardMeta.from_bytes(path.read_bytes(), str(path)).run_id != run_id
            except CorruptCheckpoint:
                stale = True
            digits = path.name.removeprefix("rank-").removesuffix(".meta.json")
            if stale and digits.isdigit():
                rank = int(digits)
                log.warning(
                    "%s step %d on tier %s: dropping rank %d's shard of an earlier run", job, step, self.name, rank
                )
                path.unlink(missing_ok=True)
                (step_dir / data_name(rank)).unlink(missing_ok=True)
        fsync_dir(step_dir)

    def remove_step(self, job: str, step: int, listed: Listed | None = None) -> None:
        """Unlist the step (commit record first) and move its directory aside under the step's lock; then delete it.

        Under the lock, no shard is opened or installed in the directory meanwhile (open_shard,
        _writable). With listed (retention's plan), a step that is no longer as listed stays
        (StepChanged): a rollback's line that saved the step number again since (open_shard
        retired the old step) writes into a new directory, which must not go with the old step.
        The deletion (gigabytes, maybe) runs after the lock: a new copy of the step need not wait for it.
        """
        with self._step_lock(job, step):
            step_dir = self._step_dir(job, step)
            if not step_dir.exists():
                raise NotFound(f"{job} step {step} is not on tier {self.name}")
            if listed is not None:
                writing = any(name.endswith(PARTIAL_SUFFIX) for name in entry_names(step_dir))
                listed.check(self.name, job, step, self.checked_commit(job, step), writing)
            doomed = self._unlist(job, step)
            with self._step_locks_lock:
                self._step_locks.pop((job, step), None)
        self._delete(doomed)

    def _unlist(self, job: str, step: int) -> Path:
        """Unlist a step (its commit record first) and move its directory aside; return where (under the step's lock).

        The caller deletes what is returned (_delete); a crash before that leaves it to remove_leftovers.
        """
        step_dir = self._step_dir(job, step)
        doomed = step_dir.parent / f"{DELETING_PREFIX}{step}-{uuid.uuid4().hex[:8]}"  # never an older leftover's name
        (step_dir / COMMIT_NAME).unlink(missing_ok=True)
        self._records.forget(step_dir)
        os.replace(step_dir, doomed)
        fsync_dir(step_dir.parent)
        return doomed

    def _delete(self, doomed: Path) -> bool:
        """Delete an unlisted step's directory; a failure is logged and counted, and retry_removals() tries again."""
        try:
            shutil.rmtree(doomed)
        except FileNotFoundError:
            pass
        except OSError as e:
            if doomed not in self._undeleted:  # counted once per directory, however often retried
                self._undeleted.add(doomed)
                self.removal_failures += 1
                log.error("cannot remove %s from tier %s (it is unlisted; retried later): %s", doomed, self.name, e)
            return False
        self._undeleted.discard(doomed)
        return True

    def retry_removals(self) -> list[str]:
        """Delete what failed removals left (unlisted steps still taking disk); return what was removed."""
        jobs = [self.root / j for j in self.jobs()]
        doomed = [job / n for job in jobs for n in entry_names(job) if n.startswith(DELETING_PREFIX)]
        return [str(d) for d in doomed if self._delete(d)]

    def remove_leftovers(self) -> list[str]:
        """Delete temporary files and half-deleted steps that an interrupted run left; return them."""
        removed = self.retry_removals()
        for job in self.jobs():
            for name in entry_names(self.root / job):
                entry = self.root / job / name
                if name.isdigit():
                    for f in entry_names(entry):
                        if f.endswith(PARTIAL_SUFFIX):
                            (entry / f).unlink(missing_ok=True)
                            removed.append(str(entry / f))
        return removed


class LocalShardWrite(ShardWrite):
    """One copy of one shard on its way into a LocalDirTier: a temporary file, written range by range, then installed.

    LocalDirTier.open_shard makes it; then, as ShardWrite says: write() from any worker
    threads, several at once, ranges in any order; seal() on a worker thread once every
    chunk is in; or abandon() from any thread (the event loop included: it only closes
    and unlinks, and removes the step's directory if that leaves it empty and its lock is
    free). Where meta carries no checksums, those write() computes or is given
    make the record seal returns.
    """

    def __init__(self, tier: LocalDirTier, meta: ShardMeta, commit: StepDirCommit, temporary: Path, what: str) -> None:
        self.meta = meta
        self.temporary = temporary
        self._tier = tier
        self._commit = commit
        self.what = what
        try:
            self._writer = RangeWriter(temporary, size_bytes=meta.data_size_bytes)
        except BaseException:  # a full disk says so here, once the file exists: it goes
            temporary.unlink(missing_ok=True)
            raise
        chunks = -(-meta.data_size_bytes // meta.chunk_size_bytes)
        self._chunk_in = bytearray(chunks)  # 1 where the chunk is written
        self._chunks_missing = chunks
        self._digests = list(meta.chunk_xxh3_128) or [""] * chunks
        self._lock = threading.Lock()  # guards the fields below and the two above
        self._writes_running = 0
        self._state = "open"  # then "sealing" and "sealed" (or "failed"), or "abandoned"

    def write(self, byte_range: ByteRange, data: memoryview, digests: Sequence[str] | None = None) -> None:
        """Check (or hash, or take digests for) the range's chunks, then write them; any worker thread."""
        first, end = self._chunks_of(byte_range, data, digests)
        with self._lock:
            if self._state != "open":
                raise ShardWriteError(f"{self.what}: a write after the copy was {self._state}")
            self._writes_running += 1
        try:
            if digests is None and self.meta.chunk_xxh3_128:
                check_chunks(self.meta, data, byte_range.offset, self.what)
                digests = self.meta.chunk_xxh3_128[first:end]
            elif digests is None:
                digests = chunk_digests(data, self.meta.chunk_size_bytes)
            self._write_aligned(data, byte_range)
            with self._lock:
                self._digests[first:end] = digests
                self._chunks_missing -= (end - first) - sum(self._chunk_in[first:end])
                self._chunk_in[first:end] = b"\1" * (end - first)
        except OSError as e:
            raise ShardWriteError(f"{self.what}: {e.strerror or e}") from e
        finally:
            with self._lock:
                self._writes_running -= 1
                last_out = self._writes_running == 0 and self._state == "abandoned"
            if last_out:  # abandoned while this write ran: the file goes now
                self._discard()

    def _chunks_of(self, byte_range: ByteRange, data: memoryview, digests: Sequence[str] | None) -> tuple[int, int]:
        """Return the chunks [first, end) the range covers, once it, its data and its digests fit the shard."""
        chunk, size = self.meta.chunk_size_bytes, self.meta.data_size_bytes
        offset, end = byte_range.offset, byte_range.end
        fits = 0 <= offset <= end <= size and offset % chunk == 0 and (end % chunk == 0 or end == size)
        if not fits or len(data) != byte_range.length:
            raise InvalidArgument(f"{self.what}: range {byte_range} ({len(data)} bytes) does not fit the shard")
        if digests is not None and len(digests) != -(-byte_range.length // chunk):
            raise InvalidArgument(f"{self.what}: {len(digests)} checksums for range {byte_range}")
        return offset // chunk, -(-end // chunk)

    def _write_aligned(self, data: memoryview, byte_range: ByteRange) -> None:
        # Direct writes need whole 4 KiB blocks: a range that ends mid-block (the shard's
        # end) writes its last bytes from a small aligned copy; finish() cuts the padding.
        whole = byte_range.length - byte_range.length % DIRECT_IO_ALIGN_BYTES
        if whole:
            self._writer.write_range(data[:whole], byte_range.offset, whole)
        if whole < byte_range.length:
            with mmap.mmap(-1, DIRECT_IO_ALIGN_BYTES) as tail, memoryview(tail) as view:
                view[: byte_range.length - whole] = data[whole:]
                self._writer.write_range(view, byte_range.offset + whole, byte_range.length - whole)

    def seal(self, record: ShardMeta | None = None) -> ShardMeta:
        """Fsync the file and install it as the rank's shard, under the step's lock and its last checks."""
        with self._lock:
            if self._state != "open" or self._writes_running:
                raise ShardWriteError(f"{self.what}: sealed while {self._state} or with a write running")
            if self._chunks_missing:
                raise InvalidArgument(f"{self.what}: {self._chunks_missing} chunks never arrived")
            self._state = "sealing"
        meta = record or (
            self.meta
            if self.meta.chunk_xxh3_128
            else dataclasses.replace(self.meta, chunk_xxh3_128=tuple(self._digests))
        )
        if record is not None and (
            record.chunk_xxh3_128 != tuple(self._digests)
            or dataclasses.replace(record, chunk_xxh3_128=self.meta.chunk_xxh3_128) != self.meta
        ):
            with self._lock:
                self._state = "failed"
            raise InvalidArgument(f"{self.what}: the record to seal is not the one its bytes were written for")
        try:
            self._writer.finish(meta.data_size_bytes)
            self._writer.close()
            guard = self._tier._writable(meta, self.what)
            self._commit.install_shard(meta.rank, self.temporary, meta.to_bytes(), guard)
        except BaseException as e:
            with self._lock:
                self._state = "failed"  # abandon() removes what is left
            if isinstance(e, OSError):
                raise ShardWriteError(f"{self.what}: {e.strerror or e}") from e
            raise
        with self._lock:
            self._state = "sealed"
        return meta

    def abandon(self) -> None:
        """Close and unlink the temporary file now, or as the last running write ends; nothing counts.

        A seal still running is left to end: its caller abandons the copy if it fails.
        """
        with self._lock:
            if self._state not in ("open", "failed"):
                return
            self._state = "abandoned"
            running = self._writes_running
        if not running:
            self._discard()

    def _discard(self) -> None:
        self._writer.close()
        self.temporary.unlink(missing_ok=True)
        self._tier._remove_if_empty(self.meta.job, self.meta.step, wait=False)
